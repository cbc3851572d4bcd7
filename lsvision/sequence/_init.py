"""The weight init both language models take from their authors' code ('normal', std 0.02)."""
import torch.nn as nn

__all__ = ['init_normal_lm_weights']


def init_normal_lm_weights(m: nn.Module, std: float = 0.02) -> bool:
    """Linear/Embedding weights N(0, std) with zero biases, LayerNorm weights N(1, std) with zero biases.

    Returns:
        Whether ``m`` was one of those kinds (the caller then initializes its own parameters otherwise).
    """
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=std)
        if getattr(m, 'bias', None) is not None:
            nn.init.zeros_(m.bias)
        return True
    if isinstance(m, nn.LayerNorm):
        nn.init.normal_(m.weight, mean=1.0, std=std)
        nn.init.zeros_(m.bias)
        return True
    return False
