"""GRC-Attention (Cached Transformers) for the 1D LRA encoders: full or long-short self-attention with a gated
recurrent cache.

Paper: `Cached Transformers: Improving Transformers with Differentiable Memory Cache` (AAAI 2024,
https://arxiv.org/abs/2312.12742), Table 6: GRC on Long ListOps encoders (Transformer 36.23 -> 37.40).

As in the vision models (`lsvision/models/vit_grc.py`), a block's attention is built as usual and then turned into
its GRC subclass in place (`attach_grc`): it keeps its parameters and their names (an uncached checkpoint loads
with only `attn.grc.*` missing), its forward is the unchanged self-attention (`self_attention_of`, the self branch
o_self: `LongShortAttention1d` or `FullAttention1d`, with its key-padding mask and cls token) followed by the
sequence GRC layer `GatedRecurrentCache1d` (`lsvision/layers/grc.py`): the cache of the real tokens, the memory
branch (full attention over the cache), the per-head mix and a 1D PE. A cls token is a prefix token of the GRC
layer, with a cache slot of its own.

Written for lsvision, Apache-2.0.
"""
from typing import Optional

import torch
import torch.nn as nn

from lsvision.layers import (
    FullAttention1d,
    GatedRecurrentCache1d,
    GrcConfig,
    LongShortAttention1d,
    attach_grc,
    self_attention_of,
)

__all__ = ['FullGrcAttention1d', 'LongShortGrcAttention1d', 'add_grc_1d']


def _grc_forward(attn: nn.Module, o_self: torch.Tensor, x: torch.Tensor, mask: Optional[torch.Tensor],
                 cls_token: Optional[torch.Tensor]) -> torch.Tensor:
    """The GRC layer on the self branch's output: its input is the attention's input, with the cls token in front."""
    if cls_token is not None:
        x = torch.cat([cls_token, x], dim=1)
    return attn.grc(x, o_self, mask)


class LongShortGrcAttention1d(LongShortAttention1d):
    """Bidirectional long-short attention (the self branch, run as is) with a sequence GRC cache under `grc`.

    Made from a built `LongShortAttention1d` by `add_grc_1d`.
    """

    grc: GatedRecurrentCache1d
    self_attention = self_attention_of(LongShortAttention1d)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cls_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Same arguments and output layout as `LongShortAttention1d.forward`."""
        return _grc_forward(self, self.self_attention(x, mask, cls_token), x, mask, cls_token)


class FullGrcAttention1d(FullAttention1d):
    """Full attention (the self branch, run as is) with a sequence GRC cache under `grc`.

    Made from a built `FullAttention1d` by `add_grc_1d`.
    """

    grc: GatedRecurrentCache1d
    self_attention = self_attention_of(FullAttention1d)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cls_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Same arguments and output layout as `FullAttention1d.forward`."""
        return _grc_forward(self, self.self_attention(x, mask, cls_token), x, mask, cls_token)


_GRC_CLASSES = {LongShortAttention1d: LongShortGrcAttention1d, FullAttention1d: FullGrcAttention1d}


def add_grc_1d(attn: nn.Module, seq_len: int, num_prefix_tokens: int = 0,
               config: Optional[GrcConfig] = None) -> nn.Module:
    """Turn a built `LongShortAttention1d` or `FullAttention1d` into its GRC-Attention in place, and return it.

    The GRC layer takes the attention's width, heads, qkv bias and attention dropout (its memory branch); it is
    initialized like the rest of the LRA encoders (PyTorch's defaults, as the official LRA model's layers).

    Args:
        attn: The block's attention.
        seq_len: Sequence slots of the cache, T_m (the model's max length, as in the paper's ListOps setting).
        num_prefix_tokens: 1 for the attention that gets a cls token (the last layer with cls pooling), else 0.
        config: The GRC options (`GrcConfig`; its defaults, r = 0.5 and lam init 0, when None).
    """
    grc_cls = _GRC_CLASSES.get(type(attn))
    if grc_cls is None:
        raise TypeError(f'no sequence GRC attention for {type(attn).__name__}; '
                        f'supported: {", ".join(c.__name__ for c in _GRC_CLASSES)}')
    w = attn.qkv.weight
    grc = GatedRecurrentCache1d(
        attn.qkv.in_features,
        attn.num_heads,
        seq_len,
        num_prefix_tokens=num_prefix_tokens,
        config=config,
        mem_attn_kwargs=dict(qkv_bias=attn.qkv.bias is not None, attn_drop=attn.attn_drop),
        device=w.device,
        dtype=w.dtype,
    )
    return attach_grc(attn, grc_cls, grc)
