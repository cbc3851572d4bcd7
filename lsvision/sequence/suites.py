"""What the sequence benchmarks compare (``tools/benchmark.py --suite sequence`` and ``--suite hsw``): each long-short
layer or model beside its full-attention counterpart, as data next to the models."""
import functools

from lsvision.layers import CausalLongShortAttention, FullAttention1d, LongShortAttention1d

from ._registry import create_model
from .char_lm import CausalFullAttention, CharLM

D, HEADS, MEM = 256, 4, 128  # the layers' width and heads; the cached tokens of the causal long-short layers
_LM = dict(vocab_size=256, dim=256, depth=2, num_heads=4, mlp_hidden=1024, drop=0.)
SEQUENCE_CONFIGS = {
    'sdpa_full': ('layer', functools.partial(FullAttention1d, D, HEADS), None),
    'ls_bidir_w8_r32': ('layer', functools.partial(LongShortAttention1d, D, HEADS, 8, 32), 'sdpa_full'),
    'sdpa_causal': ('layer', functools.partial(CausalFullAttention, D, HEADS), None),
    'ls_causal_blocked': ('layer', functools.partial(CausalLongShortAttention, D, HEADS, 128, 16, 1), 'sdpa_causal'),
    'ls_causal_official': ('layer', functools.partial(CausalLongShortAttention, D, HEADS, 128, 16, 1,
                                                      query_chunk_size=None, checkpoint_chunks=False), 'sdpa_causal'),
    'lra_ls': ('model', functools.partial(create_model, 'ls_lra_text'), 'lra_full'),
    'lra_full': ('model', functools.partial(create_model, 'full_lra_text'), None),
    'lm_ls_causal': ('model', functools.partial(CharLM, window_size=128, segment_size=16, dp_rank=1, mem_len=128,
                                                cache_mode='official', **_LM), 'lm_sdpa_causal'),
    'lm_sdpa_causal': ('model', functools.partial(CharLM, attn='full', **_LM), None),
}
"""Name -> (kind, build, baseline): layers take (n, D) features (``ls_causal_*`` also MEM cached ones), models n token
ids and ``max_len=n``; a name with sdpa, full or official grows quadratically with n."""
HSW_MODELS = {'HSW': ('hsw_tiny', {}), 'HSW-LS': ('hsw_tiny', {'attn': 'ls'}), 'flat': ('hsw_flat_tiny', {})}
"""Label -> (registered model, kwargs): HSW, HSW-LS and the flat full-attention encoder of as many blocks."""
HSW_TARGETS = {4096: 5., 16384: 15.}  # flat / HSW at least, by tokens
HSW_LS_TARGET = 1.3  # HSW-LS / HSW at most
