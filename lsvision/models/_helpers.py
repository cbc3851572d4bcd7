"""Small pieces shared by the lsvision model families."""
import torch

from timm.layers import _assert, register_notrace_function

__all__ = ['check_image_input']


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
