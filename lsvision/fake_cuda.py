"""A fake CUDA device on a CPU-only machine: run a model's CUDA branches, forward and backward, without a GPU.

Under `torch._subclasses.fake_tensor.FakeTensorMode`, tensors on `cuda` carry shapes, dtypes and devices only; every
op runs its meta kernel, so the layers take their CUDA branches and the private kernels' signatures are checked. The
autograd engine cannot run backward there (it needs a real device context: "hasPrimaryContext expects a valid device
index"), so `run_backward` walks the graph itself, as the engine would: each node once, in topological order, with its
incoming gradients summed (each reduced to the shape and cast to the dtype the node was recorded with, as the
engine's `validate_outputs` does), and the leaves' gradients accumulated into `.grad`; activation checkpointing
recomputes each segment once in that walk (one `GraphExecGroup`). Autocast on `cuda` refuses to turn on without a
device, so `cuda_autocast` sets its state directly (the dispatcher then casts fake CUDA tensors as it would real
ones), and inside `fake_cuda` `torch.autocast('cuda')` is let turn on, as checkpointing's recomputation needs.
Where a fake device cannot choose as a GPU would, `gpu_attention_kernels` makes it: SDPA as the memory-efficient
kernel, FlexAttention with a backward. Meta kernels do not check a kernel's eligibility rules or
numerics: a real GPU does (tests/test_cuda.py, `make gpu-check`).

Used by the tests (tests/test_cuda_fake.py) and by the CUDA cost counter (`lsvision.measure_cuda`).
"""
import contextlib
import warnings
from collections import Counter
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

__all__ = ['FAKE_CUDA', 'cuda_autocast', 'fake_cuda', 'fake_flex_backward', 'flex_attention_backward',
           'gpu_attention_kernels', 'run_backward']

FAKE_CUDA = torch.device('cuda')


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """A fake-tensor mode in which real (CPU) tensors may enter: `module.to('cuda')` makes fake CUDA copies.

    Inside it `torch.autocast('cuda')` turns on as it would on a GPU (activation checkpointing re-enters it to
    recompute a segment in the autocast state of its forward)."""
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _cuda_autocast_allowed():
        yield mode


@contextlib.contextmanager
def _cuda_autocast_allowed() -> Iterator[None]:
    """`torch.autocast('cuda')` without a device: it asks `amp_definitely_not_available` (and, for bf16,
    `is_bf16_supported`) and disables itself with a warning where there is no GPU."""
    common = torch.cuda.amp.common
    saved = common.amp_definitely_not_available, torch.cuda.is_bf16_supported
    common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *args, **kwargs: True
    try:
        yield
    finally:
        common.amp_definitely_not_available, torch.cuda.is_bf16_supported = saved


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
def run_backward(loss: torch.Tensor, around_node: Optional[Callable[[Any], ContextManager]] = None) -> int:
    """``loss.backward()`` by walking the autograd graph (works on fake CUDA tensors). Returns the nodes run.

    Args:
        loss: A scalar that requires grad.
        around_node: Optional: a context manager entered around each node's backward (given the node).
    """
    root = loss.grad_fn
    assert root is not None, 'the loss does not require grad'
    # one backward for activation checkpointing: outside the engine each saved tensor it unpacks would otherwise
    # recompute its whole segment again
    with torch.utils.checkpoint.GraphExecGroup():
        return _walk_backward(root, torch.ones_like(loss), around_node)


def _walk_backward(root: Any, loss_grad: torch.Tensor, around_node: Optional[Callable[[Any], ContextManager]]) -> int:
    """`run_backward`'s walk from `root` with the loss's gradient `loss_grad`."""
    pending = _graph_order(root)
    inbox: Dict = {root: [loss_grad]}
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
        with around_node(node) if around_node is not None else contextlib.nullcontext():
            results = _call_node(node, grads)
        for grad, (nxt, slot) in results:
            box = inbox.setdefault(nxt, [None] * len(nxt._input_metadata))
            grad = _as_recorded(grad, nxt._input_metadata[slot])
            box[slot] = grad if box[slot] is None else box[slot] + grad
        for nxt, _ in node.next_functions:
            if nxt is not None:
                pending[nxt] -= 1
                if pending[nxt] == 0:
                    ready.append(nxt)
    return done


@torch.library.custom_op('lsvision_fake::flex_attention_backward', mutates_args=())
def flex_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            grad_out: torch.Tensor, buffers: List[torch.Tensor], buffer_grads: List[torch.Tensor]
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """FlexAttention's backward as one operator of the fake device (reads q, k, v, the output and its gradient; writes
    the gradients of q, k, v): the real one traces its joint graph through the autograd engine, which needs a device.
    The tensors its `score_mod` reads that take a gradient (learnable biases) are read too, and their gradients, which
    Inductor accumulates with atomic adds into zeroed buffers (`buffer_grads`), read and written."""
    raise RuntimeError('lsvision_fake::flex_attention_backward runs on the fake CUDA device only')


@flex_attention_backward.register_fake
def _(q, k, v, out, grad_out, buffers, buffer_grads):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), [torch.empty_like(g) for g in buffer_grads]


class _FlexOnFakeCuda(torch.autograd.Function):
    """FlexAttention forward as it is; its backward the fake device's `flex_attention_backward`, with the gradients
    of the score_mod's tensors that need one (`buffers`: the same tensors the score_mod reads)."""

    @staticmethod
    def forward(ctx, run, score_mod, block_mask, scale, q, k, v, *buffers):
        out = run(q, k, v, score_mod, block_mask, scale)
        ctx.save_for_backward(q, k, v, out, *buffers)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *buffers = ctx.saved_tensors
        dq, dk, dv, dbuf = flex_attention_backward(q, k, v, out, grad_out, buffers,
                                                   [torch.zeros_like(b) for b in buffers])
        return (None, None, None, None, dq, dk, dv, *dbuf)


class _EfficientSdpa(TorchFunctionMode):
    """`F.scaled_dot_product_attention` as the memory-efficient kernel (the fake device's SDPA picks the math path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from lsvision.layers import _private_sdpa  # the one guard of the private kernels' schemas
        kwargs = kwargs or {}
        if (func is not F.scaled_dot_product_attention or args[0].device.type != 'cuda'
                or not _private_sdpa.fused_kernels_available('cuda')):
            return func(*args, **kwargs)
        names = ('query', 'key', 'value', 'attn_mask', 'dropout_p', 'is_causal', 'scale', 'enable_gqa')
        call = {**dict(zip(names, args)), **kwargs}
        q, k, v, mask = call['query'], call['key'], call['value'], call.get('attn_mask')
        if torch.is_autocast_enabled('cuda'):  # SDPA is on autocast's lower-precision list: all in its dtype
            q, k, v = (t.to(torch.get_autocast_dtype('cuda')) for t in (q, k, v))
        if k.dtype != q.dtype or v.dtype != q.dtype or call.get('enable_gqa'):  # keep SDPA's own error
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, float('-inf'))
        elif mask is not None and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        return _private_sdpa._op('_scaled_dot_product_efficient_attention')(
            q, k, v, mask, torch.is_grad_enabled() and q.requires_grad, call.get('dropout_p', 0.0),
            call.get('is_causal', False), scale=call.get('scale'))[0]


@contextlib.contextmanager
def fake_flex_backward() -> Iterator[None]:
    """On the fake device, the layers' FlexAttention calls (`span_flex._run_flex`) get a backward where they need one
    (`flex_attention_backward`: FlexAttention's own traces its joint graph, which needs a device). They run eagerly
    (torch.compile does not run on fake tensors), as the fused kernel's meta: eager's warning about materialized
    scores is not said."""
    from lsvision.layers import span_flex
    run = span_flex._run_flex

    def run_flex(q, k, v, score_mod, block_mask, scale):
        buffers = [t for t in span_flex.score_mod_tensors(score_mod) if t.requires_grad]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *buffers)):
            return _FlexOnFakeCuda.apply(run, score_mod, block_mask, scale, q, k, v, *buffers)
        return run(q, k, v, score_mod, block_mask, scale)

    span_flex._run_flex = run_flex
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', 'flex_attention called without torch.compile')
            yield
    finally:
        span_flex._run_flex = run


@contextlib.contextmanager
def gpu_attention_kernels() -> Iterator[None]:
    """On the fake device, attention runs as the kernels a GPU runs: `F.scaled_dot_product_attention` as the
    memory-efficient kernel (forward and backward: flash launches as many), and the layers' FlexAttention calls
    with a backward (`fake_flex_backward`)."""
    with fake_flex_backward(), _EfficientSdpa():
        yield
