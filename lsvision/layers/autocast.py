"""Autocast helpers for the layers' custom autograd Functions, whose backward runs outside autocast: the dtype autocast
computes in, and autocast switched off on a device (both safe under torch.compile).

Written for lsvision, Apache-2.0.
"""
import contextlib
from typing import ContextManager, FrozenSet

import torch

__all__ = ['autocast_dtype', 'autocast_off']


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
