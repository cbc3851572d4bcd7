"""The kernels a model dispatches on the fake CUDA device (`lsvision.fake_cuda`, re-exported here for the tests).

`KernelCounter` counts ATen operators by name, `SdpaCalls` the calls of `F.scaled_dot_product_attention`: what the
tests assert about which kernels ran. What they cost is `lsvision.measure_cuda`'s.
"""
from collections import Counter
from typing import Dict, Optional, Set

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lsvision.fake_cuda import FAKE_CUDA, cuda_autocast, fake_cuda, fake_flex_backward, run_backward

__all__ = ['FAKE_CUDA', 'KernelCounter', 'SdpaCalls', 'assert_grads_like_params', 'cuda_autocast', 'fake_cuda',
           'fake_flex_backward', 'run_backward']


class KernelCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched (by name, e.g. '_scaled_dot_product_efficient_attention.default'), with
    the dtypes of their first tensor argument and the devices of their tensor outputs. Enter it inside the fake mode.
    Higher-order operators pass through it too (FlexAttention's `flex_attention`, counted by that name)."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.dtypes: Dict[str, Set[torch.dtype]] = {}
        self.devices: Set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        self.calls[name] += 1
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None:
            self.dtypes.setdefault(name, set()).add(first.dtype)
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out

    def count(self, prefix: str) -> int:
        """Calls of the operators whose name starts with `prefix`."""
        return sum(n for name, n in self.calls.items() if name.startswith(prefix))

    def attention_ops(self) -> Dict[str, int]:
        return {name: n for name, n in sorted(self.calls.items()) if 'attention' in name or 'sdp' in name}


class SdpaCalls(TorchFunctionMode):
    """Records the calls of `F.scaled_dot_product_attention` as (device type, query dtype, with a mask). On a fake CUDA
    device its backend choice falls back to the math path (the choice reads the device's properties), so its calls
    are counted here, where a real GPU would run a flash or memory-efficient kernel."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get('attn_mask', args[3] if len(args) > 3 else None)
            self.calls[(args[0].device.type, args[0].dtype, mask is not None)] += 1
        return func(*args, **kwargs)

    def count(self, device: str = 'cuda', dtype: Optional[torch.dtype] = None, masked: Optional[bool] = None) -> int:
        return sum(n for (dev, dt, m), n in self.calls.items()
                   if dev == device and dtype in (None, dt) and masked in (None, m))


def assert_grads_like_params(module: nn.Module) -> None:
    """Every parameter has a gradient of its own shape, dtype and device."""
    wrong = [f'{name}: {None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype, p.grad.device)} for '
             f'{(tuple(p.shape), p.dtype, p.device)}'
             for name, p in module.named_parameters()
             if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype or p.grad.device != p.device]
    assert not wrong, 'parameters without a matching gradient:\n' + '\n'.join(wrong)
