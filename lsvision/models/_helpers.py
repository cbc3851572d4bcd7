"""Small pieces shared by the lsvision model families."""
from typing import Any, Dict, Sequence

import torch
import torch.nn as nn

from timm.layers import _assert, register_notrace_function, trunc_normal_

from lsvision.layers import GatedRecurrentCache

__all__ = [
    'check_image_input', 'grc_layer_kwargs', 'init_linear_trunc_normal', 'require_non_grc_keys', 'GrcModelMixin',
    'GRC_CHECKPOINT_ERROR',
]

GRC_CHECKPOINT_ERROR = (
    'gradient checkpointing is not supported with GRC: the recompute in backward would update the cache a second '
    'time and use the new cache (wrong gradients)')


def grc_layer_kwargs(
        ratio: float,
        lam_init: float,
        summary_src: str,
        eval_update: bool,
        interp_mode: str,
        sync_cache: bool,
) -> Dict[str, Any]:
    """The `GatedRecurrentCache` arguments a GRC model takes as its `grc_*` constructor arguments."""
    return dict(ratio=ratio, lam_init=lam_init, summary_src=summary_src, eval_update=eval_update,
                interp_mode=interp_mode, sync_cache=sync_cache)


def require_non_grc_keys(
        state_dict: Dict[str, torch.Tensor],
        model: nn.Module,
        ignore_suffixes: Sequence[str] = (),
) -> Dict[str, torch.Tensor]:
    """Return `state_dict` if it holds every key of `model` except the GRC ones (`.grc.`), else raise a KeyError
    naming the missing keys: a baseline checkpoint loaded with `strict=False` may leave only GRC layers fresh.

    Args:
        state_dict: The filtered checkpoint.
        model: The GRC model it is for.
        ignore_suffixes: Endings of non-persistent keys a checkpoint need not carry (e.g. Swin's index buffers).
    """
    missing = [k for k in model.state_dict()
               if k not in state_dict and '.grc.' not in k and not k.endswith(tuple(ignore_suffixes))]
    if missing:
        raise KeyError(f'checkpoint lacks non-GRC keys of {type(model).__name__}: {missing[:8]}')
    return state_dict


def init_linear_trunc_normal(m: nn.Module) -> None:
    """timm's Linear init (weights trunc normal std .02, biases 0), for `module.apply` on new GRC attention."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class GrcModelMixin:
    """`reset_cache` and a guarded `set_grad_checkpointing` for timm models whose attention carries GRC caches.

    Put it before the timm model class in the bases, so its methods come first.
    """

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise RuntimeError(GRC_CHECKPOINT_ERROR)
        super().set_grad_checkpointing(False)

    @torch.jit.ignore
    def reset_cache(self) -> None:
        """Zero every GRC cache."""
        for m in self.modules():
            if isinstance(m, GatedRecurrentCache):
                m.reset_cache()


@register_notrace_function  # asserts on the input shape: a leaf for torch.fx
def check_image_input(x: torch.Tensor, in_chans: int, min_size: int) -> None:
    """Raise an error that says what was expected when `x` is not an image batch the model can take."""
    _assert(x.ndim == 4, f'expected an image batch (B, {in_chans}, H, W), got a tensor of {x.ndim} dims')
    _assert(
        x.shape[1] == in_chans,
        f'expected {in_chans} input channels, got {x.shape[1]}; create the model with in_chans={x.shape[1]} '
        'to change it',
    )
    _assert(
        x.shape[2] >= min_size and x.shape[3] >= min_size,
        f'input {x.shape[2]}x{x.shape[3]} is smaller than the smallest this model takes ({min_size}x{min_size})',
    )
