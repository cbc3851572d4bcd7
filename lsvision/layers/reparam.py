"""What the layers that fold their weights for inference (`timm.models.reparameterize_model`) share.

A layer with a `reparameterize()` method computes its input-independent terms once, in place, when
`timm.models.reparameterize_model` (also `timm.utils.reparameterize_model`) walks the model: BatchNorm folded into a
conv, a standardized weight, GRC's frozen-cache terms. The folded tensors replace their sources (the state dict
changes with them), so a folded layer is for inference only, and its `train()` says so.

Written for lsvision, Apache-2.0.
"""
import torch.nn as nn

__all__ = ['FoldableModule']


class FoldableModule(nn.Module):
    """Base of the layers with a `reparameterize()` hook: `reparameterized` tells whether the layer is folded, and
    `train()` of a folded layer raises a RuntimeError that says what to do instead."""

    def __init__(self):
        super().__init__()
        self.reparameterized = False

    def _set_reparameterized(self) -> None:
        """Marks the layer folded (the end of its `reparameterize`): inference-only from now on."""
        self.reparameterized = True
        self.training = False

    def train(self, mode: bool = True) -> 'FoldableModule':
        if mode and self.reparameterized:
            raise RuntimeError(
                f'{type(self).__name__} was reparameterized for inference by timm.models.reparameterize_model: its '
                'weights are folded (e.g. BatchNorm into convs, GRC gate terms of the frozen cache), so it cannot '
                'train. Train the model you passed to reparameterize_model (it returns a folded copy and leaves its '
                'argument as it was) and call reparameterize_model again afterwards.')
        return super().train(mode)
