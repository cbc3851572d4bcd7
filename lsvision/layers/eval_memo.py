"""What layers need to reuse input-independent terms in inference: folded conv/BatchNorm weights, standardized
weights, the frozen-cache products of GRC. Written once for every layer that caches such terms."""
from typing import Iterable, Optional, Tuple

import torch

__all__ = ['eval_fast_path', 'version_key']


def eval_fast_path(training: bool) -> bool:
    """True in eager inference without autograd: a layer may then use terms it computed on an earlier call.

    Never while tracing, scripting or compiling, so that FLOP counting and exported graphs see the full computation.
    """
    if training or torch.is_grad_enabled() or torch.jit.is_scripting() or torch.jit.is_tracing():
        return False
    return not torch.compiler.is_compiling()


def version_key(tensors: Iterable[torch.Tensor]) -> Optional[Tuple[Tuple[int, int], ...]]:
    """(address, version) of each tensor: it changes on every in-place write (optimizer step, load_state_dict,
    `copy_` under no_grad) and when a tensor is replaced. Writes through `.data` do not bump versions.

    Returns None for inference tensors (made under `torch.inference_mode`), which have no version counter: don't
    cache then.
    """
    try:
        return tuple((t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None
