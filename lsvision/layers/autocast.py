"""Autocast helpers for the layers' custom autograd Functions, whose backward runs outside autocast: the dtype autocast
computes in, and autocast switched off on a device (both safe under torch.compile).

Written for lsvision, Apache-2.0.
"""
import contextlib
from typing import ContextManager, FrozenSet, List, Sequence

import torch

__all__ = ['autocast_dtype', 'autocast_off', 'cast_stacked']


def _autocast_devices() -> FrozenSet[str]:
    """The device types autocast knows, read once: torch.compile (dynamo, torch < 2.14) cannot trace
    `torch.amp.is_autocast_available`, so the layers look the answer up in a constant."""
    names = ['cpu', 'cuda', 'xpu', 'mps', 'hpu', 'mtia', 'xla', torch._C._get_privateuse1_backend_name()]
    return frozenset(name for name in names if torch.amp.is_autocast_available(name))


_AUTOCAST_DEVICES = _autocast_devices()


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes in on `t`'s device, or `t`'s own dtype where autocast is off (or unknown)."""
    device = t.device.type
    if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


def autocast_off(device_type: str) -> ContextManager:
    """Autocast disabled on `device_type` (a custom autograd.Function's backward runs outside autocast, so its
    forward does too, in one explicit dtype)."""
    if device_type in _AUTOCAST_DEVICES:
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def cast_stacked(groups: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype) -> List[torch.Tensor]:
    """Each group of same-shaped tensors (a layer's parameters, say) stacked and cast to `dtype`, in two kernels for
    all groups together: one `cat` of every tensor's values, one cast of the result. Each group comes back as a view
    of the cast buffer, (len(group), *shape); autograd returns each tensor's gradient in its own dtype (one cast of
    the buffer's gradient, then views of it).

    The CUDA paths cast a layer's parameters per forward under autocast; cast one by one (and stacked, where one
    kernel serves a group), that is two kernels a group, launches that cost more than the few bytes they move. Where
    nothing needs a cast (every tensor already in `dtype`), each group is stacked as it is (a group of one: the
    tensor itself, unsqueezed).
    """
    for group in groups:
        if not group or any(t.shape != group[0].shape for t in group):
            raise ValueError(f'cast_stacked: each group needs tensors of one shape, got '
                             f'{[tuple(t.shape) for t in group]}')
    tensors = [t for group in groups for t in group]
    if all(t.dtype == dtype for t in tensors):
        return [torch.stack(list(group)) if len(group) > 1 else group[0].unsqueeze(0) for group in groups]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(dtype)
    sizes = [len(group) * group[0].numel() for group in groups]
    return [piece.view((len(group),) + tuple(group[0].shape)) for piece, group in zip(flat.split(sizes), groups)]
