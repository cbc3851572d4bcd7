"""The attention softmax's precision and the additive score of a masked key, one definition for every layer.

Half-precision scores (fp16, bf16: autocast's dtypes) take their softmax in fp32, as timm's and torch's attention
do; fp32 stays fp32 and fp64 stays fp64 (`softmax_dtype`, `softmax_fp32`).

A masked key gets the additive score `mask_value(dtype)`, half the dtype's lowest finite value: beside any key that
is not masked, exp() of it is exactly 0, the same weights as -inf; a row whose keys are all masked (a padded query)
gets uniform weights instead of NaN, so its output stays finite and can be zeroed or dropped downstream (the 1D
layers' padded queries and projection weights rely on this, as the official code does); and a bias or a second
mask can be added to it without overflowing to -inf (the lowest value itself plus a bias of -16 is -inf in fp16).
Two sites keep -inf on purpose, each where a key must weigh 0 even in such a row: a boolean mask under tracing
(`matmul_attention._traced_attention`, SDPA's own semantics) and HSW's shifted-window mask (a padded query, whose keys
are all padded, must still never see across the shift boundary); and a dense reference's keys outside a query's span
(`span_attention_reference`) are no keys of it at all.

Written for lsvision, Apache-2.0.
"""
from typing import Optional

import torch

__all__ = ['mask_value', 'softmax_dtype', 'softmax_fp32']


def mask_value(dtype: torch.dtype) -> float:
    """The additive score of a masked key in `dtype` scores: `torch.finfo(dtype).min / 2`, written out (TorchScript
    has no finfo). exp() of it is 0 beside any unmasked key; a row of only masked keys stays finite (uniform weights);
    a bias or a second mask added to it stays finite."""
    if dtype == torch.float16:
        return -32752.0
    if dtype == torch.bfloat16:
        return -1.6947656946257677e38
    if dtype == torch.float64:
        return -8.988465674311579e307
    if dtype == torch.float32:
        return -1.7014117331926443e38
    raise ValueError(f'attention scores must be floating point (float16, bfloat16, float32, float64), got {dtype}')


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the attention softmax computes in for `dtype` scores: fp32 for fp16 and bf16, else `dtype` (fp64 is
    not truncated)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def softmax_fp32(scores: torch.Tensor, dim: int = -1, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """softmax(scores) over `dim`, computed in `softmax_dtype` and returned in `out_dtype` (default: the scores').

    Args:
        scores: Attention scores (any dtype; half precision is upcast).
        dim: The softmax dimension.
        out_dtype: The weights' dtype; None: the scores' dtype.
    """
    weights = scores.to(softmax_dtype(scores.dtype)).softmax(dim=dim)
    return weights.to(scores.dtype if out_dtype is None else out_dtype)
