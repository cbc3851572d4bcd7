"""What the layers that fold their weights for inference (`timm.models.reparameterize_model`) share.

A layer with a `reparameterize()` method computes its input-independent terms once, in place, when
`timm.models.reparameterize_model` (also `timm.utils.reparameterize_model`) walks the model: BatchNorm folded into a
conv, a standardized weight, GRC's frozen-cache terms. The folded tensors replace their sources (the state dict
changes with them), so a folded layer is for inference only, and :func:`refuse_training` makes `train()` say so.

Written for lsvision, Apache-2.0.
"""
import torch.nn as nn

__all__ = ['refuse_training']


def refuse_training(module: nn.Module, mode: bool) -> None:
    """Raise a RuntimeError when `module` (reparameterized for inference) is switched to train mode."""
    if mode:
        raise RuntimeError(
            f'{type(module).__name__} was reparameterized for inference by timm.models.reparameterize_model: its '
            'weights are folded (e.g. BatchNorm into convs, GRC gate terms of the frozen cache), so it cannot train. '
            'Train the model you passed to reparameterize_model (it returns a folded copy and leaves its argument '
            'as it was) and call reparameterize_model again afterwards.')
