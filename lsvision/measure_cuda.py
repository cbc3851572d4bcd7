"""What one step costs a GPU, counted without one: kernels launched, bytes moved and FLOPs on a fake CUDA device.

The model runs on `lsvision.fake_cuda` (FakeTensorMode: shapes, dtypes and devices, no data), forward and, for a
training step, backward (the graph walked as the autograd engine would) and the optimizer step apart. The rules:

* **Kernels**: every ATen operator dispatched on a CUDA tensor is one kernel, except those that launch none: views
  and aliases (`OpOverload.is_view`), allocations (`empty*`, `new_empty*`), `_unsafe_view`, metadata and
  resizing. Composite operators are counted as the operators they decompose into (as the CUDA runtime launches them).
* **Bytes**: each kernel reads its tensor arguments and writes its outputs, counted by their elements (a strided view
  counts its own elements, not its storage's). An argument a kernel overwrites (`copy_`, `fill_`, `zero_`, the
  `out=` overloads) is written, not read; one it updates in place is both. Indexing kernels (`index_select`,
  `embedding`, `gather`, `index.Tensor`) read the rows they gather, not the whole table.
* **FLOPs**: torch.utils.flop_counter's registry (matmuls, convolutions, attention kernels; 2 per multiply-add).
* **Attention**: `F.scaled_dot_product_attention` is taken as the memory-efficient kernel a GPU runs
  (`_scaled_dot_product_efficient_attention`: one forward kernel, one backward kernel; flash counts the same);
  a boolean mask costs the kernel that turns it into the additive bias. The private kernels count as themselves.
  FlexAttention counts as its generated kernels: one forward kernel (reading q, k, v, writing the output and its
  logsumexp), and two backward kernels (the Triton template's `delta = rowsum(dO * O)` preprocessing and its one
  backward kernel; reading q, k, v, the output and its gradient, writing the gradients of q, k, v). Their FLOPs
  depend on the blocks the BlockMask skips and are not counted (0).
* Per module: each kernel is charged to the innermost module running it; a backward kernel to the module whose
  forward made the autograd node.

Calibrated against real H100 steps in docs/benchmarks/cuda_counts.md.
"""
import contextlib
import copy
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from lsvision.fake_cuda import FAKE_CUDA, cuda_autocast, fake_cuda, run_backward

__all__ = ['CountPoint', 'CudaCost', 'PHASES', 'add_count_ratios', 'cost_row', 'count_row', 'count_step',
           'counts_markdown', 'parse_point']

PHASES = ('forward', 'backward', 'optimizer')
_NO_KERNEL = {'empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided', '_unsafe_view', 'resize_',
              'set_', 'sym_size', 'sym_stride', 'sym_numel', 'sym_storage_offset', 'is_same_size', 'lift_fresh'}
_OVERWRITE = {'copy_', 'fill_', 'zero_', 'normal_', 'uniform_', 'bernoulli_', 'random_'}
_GATHER = {'index_select', 'embedding', 'gather', 'index'}
_FLEX_KERNELS = {'forward': 1, 'backward': 2}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> List[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


@dataclass
class CudaCost:
    """Kernels, bytes and FLOPs of one step, by phase, operator and module (see the module docstring's rules)."""

    # (phase, op, module pattern) -> [kernels, bytes read, bytes written, flops]
    rows: Dict[Tuple[str, str, str], List[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0, 0]))

    def add(self, phase: str, op: str, module: str, kernels: int, read: int, written: int, flops: int) -> None:
        row = self.rows[(phase, op, module)]
        for i, v in enumerate((kernels, read, written, flops)):
            row[i] += v

    def total(self, phases: Sequence[str] = ('forward', 'backward')) -> Dict[str, int]:
        """Kernels, bytes (read + written) and FLOPs summed over `phases`."""
        k = b = f = 0
        for (phase, _, _), (kernels, read, written, flops) in self.rows.items():
            if phase in phases:
                k, b, f = k + kernels, b + read + written, f + flops
        return {'kernels': k, 'bytes': b, 'flops': f}

    def by(self, key: str, phases: Sequence[str] = ('forward', 'backward')) -> Dict[str, Dict[str, int]]:
        """Totals per 'op' or per 'module', largest kernel count first."""
        index = {'op': 1, 'module': 2}[key]
        out: Dict[str, Dict[str, int]] = defaultdict(lambda: {'kernels': 0, 'bytes': 0, 'flops': 0})
        for name, (kernels, read, written, flops) in self.rows.items():
            if name[0] in phases:
                entry = out[name[index]]
                entry['kernels'] += kernels
                entry['bytes'] += read + written
                entry['flops'] += flops
        return dict(sorted(out.items(), key=lambda kv: (-kv[1]['kernels'], kv[0])))


class _Counting(TorchDispatchMode):
    """Charges every kernel-launching operator on a CUDA tensor to the current phase and module."""

    supports_higher_order_operators = True

    def __init__(self, cost: CudaCost, where: Callable[[], Tuple[str, str]]):
        super().__init__()
        self.cost, self.where, self.depth = cost, where, 0  # depth: entered (re-entered to decompose)

    def __enter__(self):
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.HigherOrderOperator) and func.namespace == 'aten':
            # composite operators reach the mode whole under inference_mode: count what they run
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator):
            if func.__name__.startswith('flex_attention'):  # reads q, k, v; writes the output and its logsumexp
                phase, module = self.where()
                self.cost.add(phase, func.__name__, module, _FLEX_KERNELS['forward'],
                              sum(_nbytes(t) for t in args[:3]), sum(_nbytes(t) for t in _tensors(out)), 0)
            return out
        name = func.__name__.split('.')[0]
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        on_cuda = any(t.device.type == 'cuda' for t in inputs + outputs)
        if func.namespace == 'prim' or func.is_view or name in _NO_KERNEL or not on_cuda:
            return out
        written_args = [a for a, s in zip(list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]],
                                          func._schema.arguments)
                        if s.alias_info is not None and s.alias_info.is_write and isinstance(a, torch.Tensor)]
        overwrite = name in _OVERWRITE or func._overloadname.startswith('out')
        read_args = [t for t in inputs if not (overwrite and any(t is w for w in written_args))]
        read = sum(_nbytes(t) for t in read_args)
        if name in _GATHER:  # the gathered rows (the output's elements) and the indices
            read = sum(_nbytes(t) for t in outputs) + sum(_nbytes(t) for t in inputs if not t.is_floating_point())
        written = sum(_nbytes(t) for t in outputs) if outputs else sum(_nbytes(t) for t in written_args)
        flops = 0
        if func._overloadpacket in flop_registry:
            flops = int(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
        phase, module = self.where()
        self.cost.add(phase, func.__name__, module, 1, read, written, flops)
        return out


class _EfficientSdpa(TorchFunctionMode):
    """`F.scaled_dot_product_attention` as the memory-efficient kernel (a fake device's SDPA picks the math path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or args[0].device.type != 'cuda':
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
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, torch.is_grad_enabled() and q.requires_grad, call.get('dropout_p', 0.0),
            call.get('is_causal', False), scale=call.get('scale'))[0]
        return out


class _ModuleTracker:
    """The innermost module running (forward hooks) and the module that made each autograd node (for backward)."""

    def __init__(self, model: nn.Module):
        self.stack: List[str] = []
        self.node_module: Dict[Any, str] = {}
        self.phase, self.backward_module = 'forward', '(loss)'
        self.handles = []
        for name, module in model.named_modules():
            pattern = re.sub(r'\.\d+(?=\.|$)', '.*', name) or '(model)'
            self.handles.append(module.register_forward_pre_hook(lambda m, a, p=pattern: self.stack.append(p)))
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._leave(o), always_call=True))

    def _leave(self, outputs: Any) -> None:
        self.claim(outputs)
        self.stack.pop()

    def claim(self, outputs: Any) -> None:
        """Charge the autograd nodes behind `outputs` that no module has claimed yet to the running module."""
        module = self.stack[-1] if self.stack else '(loss)'
        pending = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None or node in self.node_module:
                continue
            self.node_module[node] = module
            pending.extend(n for n, _ in node.next_functions)

    def where(self) -> Tuple[str, str]:
        if self.phase == 'forward':
            return 'forward', self.stack[-1] if self.stack else '(loss)'
        return self.phase, self.backward_module

    @contextlib.contextmanager
    def running(self, node: Any):
        self.backward_module = self.node_module.get(node, '(loss)')
        yield

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _ClaimEachOp(TorchFunctionMode):
    """Claims each torch function's new autograd nodes for the module running it (finer than the module's outputs)."""

    def __init__(self, tracker: _ModuleTracker):
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            self.tracker.claim(out)
        return out


def _loss(out: Any) -> torch.Tensor:
    """The mean of the output (each output of a dict summed), as `lsvision.bench`'s training step."""
    out = out[0] if isinstance(out, (tuple, list)) else out
    if isinstance(out, dict):
        return torch.stack([v.float().mean() for v in out.values()]).sum()
    return out.float().mean()


class _FlexBackwardKernels(torch.autograd.Function):
    """FlexAttention with its backward counted as the generated kernels (`_FLEX_KERNELS`): on a fake device the real
    backward cannot be built (FlexAttention traces its joint graph through the autograd engine: it needs a device)."""

    @staticmethod
    def forward(run, q, k, v, score_mod, block_mask, scale):
        with torch.no_grad():
            return run(q, k, v, score_mod, block_mask, scale)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_shapes
        flex = torch.ops.higher_order.flex_attention_backward
        counting = _FlexBackwardKernels.counting
        if counting.depth > 0:  # reads q, k, v, the output and its gradient; writes the gradients of q, k, v
            qkv = sum(math.prod(t[0]) * t[1].itemsize for t in (q, k, v))
            counting.cost.add('backward', flex.__name__, counting.where()[1], _FLEX_KERNELS['backward'],
                              qkv + 2 * _nbytes(grad_out), qkv, 0)
        return (None,) + tuple(torch.empty(t[0], dtype=t[1], device=t[2]) for t in (q, k, v)) + (None,) * 3

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.saved_shapes = [(t.shape, t.dtype, t.device) for t in inputs[1:4]]


@contextlib.contextmanager
def _flex_counted(counting: '_Counting') -> Any:
    """Routes the layers' FlexAttention calls (`span_flex._run_flex`) through `_FlexBackwardKernels` when training."""
    from lsvision.layers import span_flex
    run = span_flex._run_flex

    def counted(q, k, v, score_mod, block_mask, scale):
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
            return run(q, k, v, score_mod, block_mask, scale)
        _FlexBackwardKernels.counting = counting
        return _FlexBackwardKernels.apply(run, q, k, v, score_mod, block_mask, scale)

    span_flex._run_flex = counted
    try:
        yield
    finally:
        span_flex._run_flex = run


def _step(fake: nn.Module, inputs: Sequence[torch.Tensor], train: bool, dtype: Optional[torch.dtype],
          tracker: Optional[_ModuleTracker]) -> torch.Tensor:
    """Forward (and backward) of one step; the loss."""
    with torch.enable_grad() if train else torch.inference_mode():
        with cuda_autocast(dtype):
            loss = _loss(fake(*inputs))
        if train:
            if tracker is not None:
                tracker.phase = 'backward'
            run_backward(loss, around_node=tracker.running if tracker is not None else None)
    return loss


def count_step(model: nn.Module, make_inputs: Callable[[], Sequence[torch.Tensor]], train: bool,
               dtype: Optional[torch.dtype] = torch.bfloat16, optimizer: Optional[str] = 'adamw') -> CudaCost:
    """The CUDA cost of one training step (forward, backward, the optimizer apart) or one inference forward, in the
    steady state: an uncounted step first fills the layers' geometry caches (masks, indices), as on a GPU after the
    first step.

    Args:
        model: A CPU model; a fake CUDA copy of it runs (the model itself is not changed).
        make_inputs: Builds the inputs (called with the fake CUDA device as the default device).
        train: A training step (train mode, gradients) or an inference forward (eval mode, `inference_mode`).
        dtype: Autocast dtype on CUDA (None: float32).
        optimizer: 'adamw' (torch's AdamW, foreach as on CUDA) or None for no optimizer step.

    Returns:
        The step's `CudaCost`.
    """
    cost = CudaCost()
    fake = copy.deepcopy(model)
    with fake_cuda(), torch.compiler.set_stance('force_eager'):
        fake = fake.to(FAKE_CUDA).train(train)
        with torch.device(FAKE_CUDA):
            inputs = list(make_inputs())
        tracker = _ModuleTracker(fake)
        counting = _Counting(cost, tracker.where)
        try:
            with _EfficientSdpa(), _flex_counted(counting):
                with torch.no_grad(), cuda_autocast(dtype):  # warm-up: the geometry caches
                    fake(*inputs)
                with counting, _ClaimEachOp(tracker):
                    _step(fake, inputs, train, dtype, tracker)
                    if train and optimizer:
                        tracker.phase, tracker.backward_module = 'optimizer', '(optimizer)'
                        torch.optim.AdamW([p for p in fake.parameters() if p.grad is not None], lr=1e-4,
                                          weight_decay=0.05, foreach=True).step()
        finally:
            tracker.remove()
    return cost


@dataclass(frozen=True)
class CountPoint:
    """One counted point: 'train' or 'inference', input size (image side, or sequence length), batch, dtype."""

    kind: str
    size: int
    batch_size: int
    dtype: Optional[str] = 'bfloat16'

    def label(self) -> str:
        return f'{self.kind} {self.size} b{self.batch_size} {self.dtype or "float32"}'


def parse_point(text: str) -> CountPoint:
    """'train:224:256' (kind:size:batch) or 'inference:1024:8:float32' -> a `CountPoint`."""
    parts = text.split(':')
    if len(parts) not in (3, 4) or parts[0] not in ('train', 'inference') or not all(p.isdigit() for p in parts[1:3]):
        raise ValueError(f"a point is kind:size:batch[:dtype] with kind 'train' or 'inference', e.g. train:224:256 or "
                         f"inference:1024:8:float32; got {text!r}")
    dtype = parts[3] if len(parts) == 4 else 'bfloat16'
    if dtype not in ('bfloat16', 'float16', 'float32'):
        raise ValueError(f'dtype must be bfloat16, float16 or float32, got {dtype!r} in {text!r}')
    return CountPoint(parts[0], int(parts[1]), int(parts[2]), None if dtype == 'float32' else dtype)


def _model_and_inputs(spec: str, point: CountPoint, kwargs: Dict[str, Any]
                      ) -> Tuple[nn.Module, Callable[[], List[torch.Tensor]]]:
    """A vision model (a `lsvision.bench` spec: timm name, '@full', ...) with a square image, or a registered sequence
    model (`lsvision.sequence`, built with max_len = size) with token ids below 200, as the sequence benchmark."""
    from lsvision import sequence
    if sequence.is_model(spec):
        model = sequence.create_model(spec, max_len=point.size, **kwargs)
        return model, lambda: [torch.randint(200, (point.batch_size, point.size))]
    from lsvision.bench import create_model
    model = create_model(spec, **kwargs)
    chans = model.pretrained_cfg.get('input_size', (3,))[0]
    return model, lambda: [torch.randn(point.batch_size, chans, point.size, point.size)]


def count_row(spec: str, point: CountPoint, kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The counts of one model at one point, as a report row (`cost_row`)."""
    model, make_inputs = _model_and_inputs(spec, point, kwargs or {})
    dtype = getattr(torch, point.dtype) if point.dtype else None
    return cost_row(spec, point, count_step(model, make_inputs, point.kind == 'train', dtype), kwargs)


def cost_row(model: str, point: CountPoint, cost: CudaCost, kwargs: Optional[Dict[str, Any]] = None
             ) -> Dict[str, Any]:
    """A report row: the point, the totals of forward + backward, the optimizer's apart, per op and per module."""
    return dict(model=model, model_kwargs=kwargs or {}, point=point.label(), kind=point.kind, size=point.size,
                batch_size=point.batch_size, dtype=point.dtype or 'float32', **cost.total(),
                forward_kernels=cost.total(('forward',))['kernels'],
                optimizer=cost.total(('optimizer',)), by_op=cost.by('op'), by_module=cost.by('module'))


def add_count_ratios(rows: List[Dict[str, Any]], baseline: str) -> None:
    """`kernels_ratio`, `bytes_ratio`, `flops_ratio` of every row to the baseline model's row at the same point."""
    base = {r['point']: r for r in rows if r['model'] == baseline}
    for row in rows:
        ref = base.get(row['point'])
        if ref is not None and row is not ref:
            for key in ('kernels', 'bytes', 'flops'):
                row[f'{key}_ratio'] = row[key] / ref[key] if ref[key] else None


def counts_markdown(rows: Sequence[Dict[str, Any]], top: int = 12) -> str:
    """The summary table, then per row its costliest modules and operators (by kernels)."""
    from lsvision.bench import markdown_table

    def ratio(row: Dict[str, Any], key: str) -> str:
        value = row.get(f'{key}_ratio')
        return '' if value is None else f' ({value:.2f}x)'

    summary = markdown_table(
        ['point', 'model', 'kernels', 'GB moved', 'TFLOP', 'optimizer kernels'],
        [[r['point'], r['model'], f"{r['kernels']}{ratio(r, 'kernels')}", f"{r['bytes'] / 1e9:.1f}{ratio(r, 'bytes')}",
          f"{r['flops'] / 1e12:.2f}{ratio(r, 'flops')}", str(r['optimizer']['kernels'])] for r in rows], 2)
    parts = [summary]
    for r in rows:
        for key, title in (('by_module', 'module'), ('by_op', 'operator')):
            items = list(r[key].items())[:top]
            parts += ['', f"{r['model']}, {r['point']}: the {len(items)} {title}s launching most kernels "
                          '(forward + backward)', '',
                      markdown_table([title, 'kernels', 'GB moved', 'GFLOP'],
                                     [[f'`{name}`', str(v['kernels']), f"{v['bytes'] / 1e9:.2f}",
                                       f"{v['flops'] / 1e9:.1f}"] for name, v in items])]
    return '\n'.join(parts) + '\n'
