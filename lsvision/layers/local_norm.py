"""LN_L of long-short attention, recomputed in its consumers' backward instead of kept.

The keys and values of a long-short layer (2D, and 1D bidirectional) are LayerNorm-ed (LN_L) before two consumers
read them: the dynamic projection (P @ LN_L(k)) and the window attention. Through autograd, each consumer would keep
the normalized keys and values for its backward (two map-sized tensors per layer), while LN_L itself keeps its input,
the keys and values before the norm, the q, k, v projection's outputs, which are kept anyway, and its statistics.
Instead, LN_L runs once in forward (`local_norm_tokens`, plain autograd) and the consumers
(`long_short.local_norm_projection`, `span_attention.span_attention_local_norm`) take its outputs together with the
keys and values before the norm, and keep only the latter: their backward normalizes again (`local_norm_tokens`, as
in forward) and returns the gradients of LN_L's outputs, whose sum LN_L's own backward takes once.

Written for lsvision, Apache-2.0.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .autocast import autocast_off
from .export import training_paths_enabled

__all__ = ['recompute_local_norm', 'local_norm_tokens']


def recompute_local_norm(projected: torch.Tensor, norm_weight: Optional[torch.Tensor]) -> bool:
    """Whether a long-short layer takes its training path, LN_L applied inside the consumers: gradients are wanted
    (of `projected`, an output of the q, k, v projection, or of LN_L's weight) and the training paths are enabled
    (`training_paths_enabled`: grad on, neither TorchScript nor torch.export / torch.jit.trace running)."""
    return training_paths_enabled() and (
        projected.requires_grad or (norm_weight is not None and norm_weight.requires_grad))


@torch.jit.unused  # training only (TorchScript runs the plain path)
def local_norm_tokens(
        k: torch.Tensor,
        v: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        eps: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """LN_L of keys and values over their channels, in k's dtype with autocast off: the same in the training forward,
    where it runs once for both consumers (plain autograd keeps its input and statistics, not its outputs), and in
    the consumers' backward, which normalizes again.

    Args:
        k, v: Tokens before the norm, (B, *spatial, C), any strides.
        weight, bias: LN_L's affine parameters (C,), or None.
        eps: LN_L's epsilon.

    Returns:
        The normalized keys and values, (B, *spatial, C) tokens each.
    """
    C = k.shape[-1]
    weight, bias = _in_dtype(weight, k.dtype), _in_dtype(bias, k.dtype)
    with autocast_off(k.device.type):
        return F.layer_norm(k, [C], weight, bias, eps), F.layer_norm(v, [C], weight, bias, eps)


def _in_dtype(param: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """LN_L's affine parameter in the tokens' dtype: CUDA's LayerNorm kernels take one dtype (under autocast,
    bfloat16 tokens and float32 parameters are refused); the statistics are computed in float32 either way."""
    return param if param is None or param.dtype == dtype else param.to(dtype)
