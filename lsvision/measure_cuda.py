"""What one step costs a GPU, counted without one: kernels launched, bytes moved and FLOPs on the fake CUDA device.

The step runs on `lsvision.fake_cuda` with attention as a GPU runs it (`gpu_attention_kernels`): forward, the backward
of a training step, and the optimizer apart. Every ATen operator on a CUDA tensor is a kernel, except views, aliases,
allocations and metadata; it reads its tensor arguments and writes its outputs; FLOPs are torch.utils.flop_counter's.
The rules in full, and their calibration against real steps: docs/benchmarks/cuda_counting.md.
"""
import contextlib
import copy
import re
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lsvision.fake_cuda import FAKE_CUDA, cuda_autocast, fake_cuda, gpu_attention_kernels, run_backward
from lsvision.layers.span_flex import score_mod_tensors
from lsvision.reports import markdown_table

__all__ = ['CudaCost', 'add_count_ratios', 'cost_row', 'count_row', 'count_step', 'counts_markdown']

_NO_KERNEL = {'empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided', '_unsafe_view', 'resize_',
              'set_', 'sym_size', 'sym_stride', 'sym_numel', 'sym_storage_offset', 'is_same_size', 'lift_fresh'}
_OVERWRITE = {'copy_', 'fill_', 'zero_', 'normal_', 'uniform_', 'bernoulli_', 'random_'}  # write, never read
_GATHER = {'index_select', 'embedding', 'gather', 'index'}  # read the rows they gather and the indices
_KERNELS = {'flex_attention_backward': 2}  # the Triton template's delta = rowsum(dO * O), then its backward kernel


def _tensors(tree: Any) -> List[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in _tensors(x)]


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CudaCost:
    """Kernels, bytes and FLOPs of one step, by (phase, module, operator); phases forward, backward, optimizer."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[str, str, str], List[int]] = defaultdict(lambda: [0, 0, 0])

    def add(self, phase: str, module: str, op: str, *values: int) -> None:
        """Adds kernels, bytes and FLOPs."""
        self.rows[(phase, module, op)] = [a + b for a, b in zip(self.rows[(phase, module, op)], values)]

    def by(self, key: str, phases: Sequence[str] = ('forward', 'backward')) -> Dict[str, Dict[str, int]]:
        """Totals per 'op', 'module' or 'total' over `phases`, most kernels first."""
        out: Dict[str, Dict[str, int]] = defaultdict(lambda: {'kernels': 0, 'bytes': 0, 'flops': 0})
        for (phase, module, op), values in self.rows.items():
            if phase in phases:
                entry = out[{'op': op, 'module': module, 'total': 'total'}[key]]
                for name, value in zip(('kernels', 'bytes', 'flops'), values):
                    entry[name] += value
        return dict(sorted(out.items(), key=lambda kv: (-kv[1]['kernels'], kv[0])))

    def total(self, phases: Sequence[str] = ('forward', 'backward')) -> Dict[str, int]:
        return self.by('total', phases).get('total', {'kernels': 0, 'bytes': 0, 'flops': 0})


class _Counting(TorchDispatchMode):
    """Charges every kernel on a CUDA tensor to the phase and module `where()` names."""

    supports_higher_order_operators = True

    def __init__(self, cost: CudaCost, where: Callable[[], Tuple[str, str]]):
        super().__init__()
        self.cost, self.where = cost, where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hop = isinstance(func, torch._ops.HigherOrderOperator)
        if not hop and func.namespace == 'aten':  # composite operators (whole under inference_mode): their parts
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if hop:  # FlexAttention's forward: reads q, k, v and the score_mod's tensors; writes the output and its lse
            if func.__name__.startswith('flex_attention'):
                read = _nbytes(args[:3]) + _nbytes(score_mod_tensors(args[3]))
                self.cost.add(*self.where(), func.__name__, 1, read + _nbytes(outputs), 0)
            return out
        name = func.__name__.split('.')[0]
        if (func.namespace == 'prim' or func.is_view or name in _NO_KERNEL
                or not any(t.device.type == 'cuda' for t in inputs + outputs)):
            return out
        written = [a for a, s in zip(list(args) + [kwargs.get(s.name) for s in func._schema.arguments[len(args):]],
                                     func._schema.arguments)
                   if s.alias_info is not None and s.alias_info.is_write and isinstance(a, torch.Tensor)]
        if name in _OVERWRITE or func._overloadname.startswith('out'):
            inputs = [t for t in inputs if not any(t is w for w in written)]
        read = (_nbytes(outputs) + _nbytes([t for t in inputs if not t.is_floating_point()]) if name in _GATHER
                else _nbytes(inputs))
        packet = func._overloadpacket
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0
        self.cost.add(*self.where(), func.__name__, _KERNELS.get(name, 1), read + _nbytes(outputs or written), flops)
        return out


class _Modules(TorchFunctionMode):
    """The module running an operator: forward hooks keep the stack of running modules (indices as '*', so that the
    blocks of a stage add up); each torch function's new autograd nodes are charged to the module that made them,
    which is where their backward kernels go."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.stack: List[str] = []
        self.node_module: Dict[Any, str] = {}
        self.phase, self.backward_module = 'forward', '(loss)'
        self.handles = []
        for name, module in model.named_modules():
            pattern = re.sub(r'\.\d+(?=\.|$)', '.*', name) or '(model)'
            self.handles += [module.register_forward_pre_hook(lambda m, a, p=pattern: self.stack.append(p)),
                             module.register_forward_hook(lambda m, a, o: self._leave(o), always_call=True)]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            self._claim(out)
        return out

    def _leave(self, outputs: Any) -> None:
        self._claim(outputs)
        self.stack.pop()

    def _claim(self, outputs: Any) -> None:
        module, pending = self.stack[-1] if self.stack else '(loss)', [t.grad_fn for t in _tensors(outputs)]
        while pending:
            node = pending.pop()
            if node is not None and node not in self.node_module:
                self.node_module[node] = module
                pending.extend(n for n, _ in node.next_functions)

    def where(self) -> Tuple[str, str]:
        if self.phase == 'forward':
            return 'forward', self.stack[-1] if self.stack else '(loss)'
        return self.phase, self.backward_module

    def node(self, node: Any) -> contextlib.nullcontext:
        """Entered around each backward node: its kernels are charged to the module that made it."""
        self.backward_module = self.node_module.get(node, '(loss)')
        return contextlib.nullcontext()


def _loss(out: Any) -> torch.Tensor:
    """The mean of the output (of a dict's outputs summed), as `lsvision.bench`'s training step."""
    out = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(out, dict):
        return torch.stack([v.float().mean() for v in out.values()]).sum()
    return out.float().mean()


def count_step(model: nn.Module, make_inputs: Callable[[], Sequence[torch.Tensor]], train: bool,
               dtype: Optional[torch.dtype] = torch.bfloat16, optimizer: bool = True) -> CudaCost:
    """The CUDA cost of one training step (forward, backward; torch's foreach AdamW apart) or one inference forward
    (eval mode, `inference_mode`), in the steady state: an uncounted forward first fills the layers' geometry caches.

    Args:
        model: A CPU model; a fake CUDA copy of it runs.
        make_inputs: Builds the inputs (the fake CUDA device is the default device).
        train: A training step, or an inference forward.
        dtype: Autocast dtype (None: float32).
        optimizer: Count the optimizer step (training).
    """
    cost, fake = CudaCost(), copy.deepcopy(model)
    with fake_cuda(), torch.compiler.set_stance('force_eager'), gpu_attention_kernels():
        fake = fake.to(FAKE_CUDA).train(train)
        with torch.device(FAKE_CUDA):
            inputs = list(make_inputs())
        with torch.no_grad(), cuda_autocast(dtype):
            fake(*inputs)
        modules = _Modules(fake)
        try:
            with _Counting(cost, modules.where), modules, torch.inference_mode(not train):
                with cuda_autocast(dtype):
                    loss = _loss(fake(*inputs))
                if train:
                    modules.phase = 'backward'
                    run_backward(loss, around_node=modules.node)
                    if optimizer:
                        modules.phase, modules.backward_module = 'optimizer', '(optimizer)'
                        torch.optim.AdamW([p for p in fake.parameters() if p.grad is not None], foreach=True).step()
        finally:
            for handle in modules.handles:
                handle.remove()
    return cost


def count_row(spec: str, kind: str, size: int, batch_size: int, dtype: Optional[str] = 'bfloat16') -> Dict[str, Any]:
    """One model at one point as a report row (`cost_row`): a vision model (a `lsvision.bench` spec) on square images
    of side `size`, or a sequence model (`lsvision.sequence`, max_len `size`) on token ids below 200."""
    from lsvision import bench, sequence
    seq = sequence.is_model(spec)
    model = sequence.create_model(spec, max_len=size) if seq else bench.create_model(spec)
    shape = (batch_size, size) if seq else (batch_size, model.pretrained_cfg.get('input_size', (3,))[0], size, size)
    make = (lambda: [torch.randint(200, shape)]) if seq else (lambda: [torch.randn(shape)])
    cost = count_step(model, make, kind == 'train', getattr(torch, dtype) if dtype else None)
    return cost_row(spec, f'{kind} {size} b{batch_size} {dtype or "float32"}', cost)


def cost_row(model: str, point: str, cost: CudaCost) -> Dict[str, Any]:
    """The point, the forward + backward totals, the forward's kernels, the optimizer's, per op and per module."""
    return dict(model=model, point=point, **cost.total(), forward_kernels=cost.total(('forward',))['kernels'],
                optimizer=cost.total(('optimizer',)), by_op=cost.by('op'), by_module=cost.by('module'))


def add_count_ratios(rows: List[Dict[str, Any]], baseline: str) -> None:
    """`kernels_ratio`, `bytes_ratio`, `flops_ratio` of each row to the baseline's row at the same point."""
    base = {r['point']: r for r in rows if r['model'] == baseline}
    for row in rows:
        ref = base.get(row['point'])
        if ref is not None and row is not ref:
            row.update({f'{k}_ratio': row[k] / ref[k] if ref[k] else None for k in ('kernels', 'bytes', 'flops')})


def counts_markdown(rows: Sequence[Dict[str, Any]], top: int = 12) -> str:
    """The summary table, then each row's modules and operators that launch the most kernels."""
    def cell(row: Dict[str, Any], key: str, scale: float, fmt: str) -> str:
        ratio = row.get(f'{key}_ratio')
        return f'{row[key] / scale:{fmt}}' + ('' if ratio is None else f' ({ratio:.2f}x)')

    parts = [markdown_table(['point', 'model', 'kernels', 'GB moved', 'TFLOP', 'optimizer kernels'], [
        [r['point'], r['model'], cell(r, 'kernels', 1, '.0f'), cell(r, 'bytes', 1e9, '.1f'),
         cell(r, 'flops', 1e12, '.2f'), str(r['optimizer']['kernels'])] for r in rows], 2)]
    for r in rows:
        for key in ('module', 'op'):
            items = list(r[f'by_{key}'].items())[:top]
            parts += ['', f"{r['model']}, {r['point']}: the {len(items)} {key}s launching most kernels", '',
                      markdown_table([key, 'kernels', 'GB moved', 'GFLOP'], [
                          [f'`{name}`', str(v['kernels']), f"{v['bytes'] / 1e9:.2f}", f"{v['flops'] / 1e9:.1f}"]
                          for name, v in items])]
    return '\n'.join(parts) + '\n'
