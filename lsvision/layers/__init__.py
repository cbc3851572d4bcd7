"""Attention math shared by the lsvision models. Layers know no model."""
from .grc import (
    GatedRecurrentCache,
    GatedRecurrentCache1d,
    GrcAttention,
    GrcConfig,
    GrcMemoryAttention,
    attach_grc,
    grc_dims,
    self_attention_of,
    wrap_attention_with_grc,
)
from .long_short import (
    SPAN_KERNELS,
    LinearDynamicProjection,
    LinearQkv,
    LongShortAttention2d,
    dynamic_projection,
    projection_weights,
    resize_window_rel_pos_table,
    set_span_kernel,
    window_rel_pos_index,
    window_rel_pos_table_size,
    window_size_of_rel_pos_table,
    window_span,
)
from .long_short_1d import (
    CausalLongShortAttention,
    FullAttention1d,
    LongShortAttention1d,
    sinusoid_frequencies,
    sinusoid_positions,
)
from .matmul_attention import matmul_attention, scaled_dot_product_attention
from .span_attention import span_attention, span_attention_reference
from .span_flex import span_flex_attention
