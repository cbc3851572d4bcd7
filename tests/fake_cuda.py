"""Run models on a fake CUDA device on a CPU-only machine: forward, backward and the kernels they dispatch.

Under `torch._subclasses.fake_tensor.FakeTensorMode`, tensors on `cuda` carry shapes, dtypes and devices only; every
op runs its meta kernel, so the layers take their CUDA branches and the private kernels' signatures are checked. The
autograd engine cannot run backward there (it needs a real device context: "hasPrimaryContext expects a valid device
index"), so `run_backward` walks the graph itself, as the engine would: each node once, in topological order, with its
incoming gradients summed (each reduced to the shape and cast to the dtype the node was recorded with, as the
engine's `validate_outputs` does), and the leaves' gradients accumulated into `.grad`. Autocast on `cuda` refuses to
turn on without a device, so `cuda_autocast` sets its state directly (the dispatcher then casts fake CUDA tensors as
it would real ones). Meta kernels do not check a kernel's eligibility rules or numerics: tests/test_cuda.py does, on
a GPU.
"""
import contextlib
from collections import Counter
from typing import Dict, Iterator, List, Optional, Set, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ['FAKE_CUDA', 'KernelCounter', 'SdpaCalls', 'assert_grads_like_params', 'cuda_autocast', 'fake_cuda',
           'run_backward']

FAKE_CUDA = torch.device('cuda')


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A fake-tensor mode in which real (CPU) tensors may enter: `module.to('cuda')` makes fake CUDA copies."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def cuda_autocast(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Autocast on `cuda` to `dtype` (None: off), set directly: `torch.autocast('cuda')` disables itself where CUDA is
    not available."""
    if dtype is None:
        yield
        return
    enabled, previous = torch.is_autocast_enabled('cuda'), torch.get_autocast_dtype('cuda')
    torch.set_autocast_enabled('cuda', True)
    torch.set_autocast_dtype('cuda', dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled('cuda', enabled)
        torch.set_autocast_dtype('cuda', previous)


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


def _graph_order(root: torch.autograd.graph.Node) -> Dict[torch.autograd.graph.Node, int]:
    """The number of incoming edges of every node reachable from `root`."""
    pending: Counter = Counter()
    seen, stack = {root}, [root]
    while stack:
        for nxt, _ in stack.pop().next_functions:
            if nxt is None:
                continue
            pending[nxt] += 1
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return pending


def _as_recorded(grad: torch.Tensor, meta) -> torch.Tensor:
    """A gradient reduced to the shape and cast to the dtype its node recorded (the engine's validate_outputs)."""
    if list(grad.shape) != list(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


def _call_node(node, grads: List[Optional[torch.Tensor]]) -> List[Tuple[torch.Tensor, Tuple]]:
    """Run one backward node: its (gradient, edge) pairs for the edges that lead somewhere."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        # a custom Function: missing output gradients as zeros; its backward returns one entry per forward argument,
        # of which those that need a gradient are, in order, its edges that lead somewhere
        grads = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                 for g, m in zip(grads, node._input_metadata)]
        out = node.apply(*grads)
        out = [g for g, need in zip(out if isinstance(out, tuple) else (out,), node.needs_input_grad) if need]
        edges = [e for e in node.next_functions if e[0] is not None]
    else:
        out = node(*grads)
        out = list(out) if isinstance(out, tuple) else [out]
        edges = list(node.next_functions)
        out, edges = [g for g, e in zip(out, edges) if e[0] is not None], [e for e in edges if e[0] is not None]
    assert len(out) == len(edges), f'{node.name()}: {len(out)} gradients for {len(edges)} edges'
    return [(g, e) for g, e in zip(out, edges) if g is not None]


@torch.no_grad()
def run_backward(loss: torch.Tensor) -> int:
    """``loss.backward()`` by walking the autograd graph (works on fake CUDA tensors). Returns the nodes run."""
    root = loss.grad_fn
    assert root is not None, 'the loss does not require grad'
    pending = _graph_order(root)
    inbox: Dict = {root: [torch.ones_like(loss)]}
    ready, done = [root], 0
    while ready:
        node = ready.pop()
        done += 1
        grads = inbox.pop(node, [])
        grads += [None] * (len(node._input_metadata) - len(grads))
        if node.name() == 'torch::autograd::AccumulateGrad':
            leaf = node.variable
            if grads[0] is not None:
                leaf.grad = grads[0] if leaf.grad is None else leaf.grad + grads[0]
            continue
        for grad, (nxt, slot) in _call_node(node, grads):
            box = inbox.setdefault(nxt, [None] * len(nxt._input_metadata))
            grad = _as_recorded(grad, nxt._input_metadata[slot])
            box[slot] = grad if box[slot] is None else box[slot] + grad
        for nxt, _ in node.next_functions:
            if nxt is not None:
                pending[nxt] -= 1
                if pending[nxt] == 0:
                    ready.append(nxt)
    return done


def assert_grads_like_params(module: nn.Module) -> None:
    """Every parameter has a gradient of its own shape, dtype and device."""
    wrong = [f'{name}: {None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype, p.grad.device)} for '
             f'{(tuple(p.shape), p.dtype, p.device)}'
             for name, p in module.named_parameters()
             if p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype or p.grad.device != p.device]
    assert not wrong, 'parameters without a matching gradient:\n' + '\n'.join(wrong)
