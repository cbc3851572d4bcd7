"""FLOPs (multiply-adds, fvcore's and the papers' convention) and activations of a forward pass, on fvcore.

fvcore's ``FlopCountAnalysis`` traces the model; handles registered here add what it misses: fused attention
(``aten::scaled_dot_product_attention``, otherwise counted as zero), ``aten::baddbmm``, and ``aten::matmul`` with
batch dims on its right operand. Ops that are free under the multiply-add convention (elementwise, activations,
softmax, pooling, reshapes) are reported in ``uncounted``; any other op without a handle is ``unsupported``.
"""
import logging
import warnings
from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

with warnings.catch_warnings():  # fvcore scripts helpers at import time: a torch.jit deprecation warning
    warnings.filterwarnings('ignore', message='.*torch.jit.*deprecated.*', category=FutureWarning)
    from fvcore.nn import ActivationCountAnalysis, FlopCountAnalysis
    from fvcore.nn.jit_analysis import JitModelAnalysis
    from fvcore.nn.jit_handles import generic_activation_jit, get_shape

__all__ = ['FlopReport', 'UNCOUNTED_OPS', 'count_activations', 'count_flops', 'parameter_count']

_logger = logging.getLogger(__name__)
Handle = Callable[[List[Any], List[Any]], Union[int, float]]
InputSpec = Union[Sequence[int], torch.Tensor, Tuple[torch.Tensor, ...]]


def _shape(value: Any) -> List[int]:
    if get_shape(value) is None:
        raise ValueError('a shape is unknown in the traced graph; cannot count FLOPs')
    return list(get_shape(value))


def _batch(*shapes: Sequence[int]) -> int:
    """The element count of the broadcast batch shape (right-aligned; a smaller size that divides the largest is
    grouped-query attention's shared key/value heads)."""
    ndim = max(len(s) for s in shapes)
    padded = [[1] * (ndim - len(s)) + list(s) for s in shapes]
    sizes = [0 if 0 in dims else max(dims) for dims in zip(*padded)]
    if any(n and n % d for dims, n in zip(zip(*padded), sizes) for d in dims):
        raise ValueError(f'attention batch shapes {[list(s) for s in shapes]} are not broadcastable')
    return prod(sizes)


def sdpa_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """``q @ k^T`` and ``attn @ v``: ``batch * L * S * (E + Ev)``; masks and causality do not reduce the count."""
    q, k, v = (_shape(x) for x in inputs[:3])
    return _batch(q[:-2], k[:-2], v[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])


def baddbmm_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """``b * n * m * p`` for ``batch1`` (b, n, m) and ``batch2`` (b, m, p)."""
    b, n, m = _shape(inputs[1])
    return b * n * m * _shape(inputs[2])[-1]


def matmul_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """``prod(broadcast batch) * n * m * p`` (fvcore's own handle misses batch dims only the right operand has)."""
    a, b = _shape(inputs[0]), _shape(inputs[1])
    if len(a) == 1 or len(b) == 1:  # a matrix-vector product
        return prod(b if len(a) == 1 else a)
    return _batch(a[:-2], b[:-2]) * a[-2] * a[-1] * b[-1]


FLOP_HANDLES: Dict[str, Handle] = {'aten::scaled_dot_product_attention': sdpa_flop_jit,
                                   'aten::baddbmm': baddbmm_flop_jit, 'aten::matmul': matmul_flop_jit}
ACTIVATION_HANDLES: Dict[str, Handle] = {
    'aten::scaled_dot_product_attention': lambda inputs, outputs: prod(_shape(outputs[0])),
    'aten::baddbmm': generic_activation_jit()}
UNCOUNTED_OPS = {'aten::' + op for op in """
    abs add add_ addcmul addcmul_ addcdiv clamp_max clamp_min cos div div_ erf exp fill_ le lerp lerp_ log logical_and
    logical_not logical_or lt masked_fill_ maximum minimum mul mul_ ne neg pow reciprocal rsqrt rsub sign sin sqrt
    square sub sub_ where elu elu_ gelu gelu_ glu hardsigmoid hardsigmoid_ hardswish hardswish_ hardtanh hardtanh_
    leaky_relu leaky_relu_ log_softmax mish mish_ prelu relu6 sigmoid sigmoid_ silu silu_ softmax softplus tanh tanh_
    adaptive_max_pool1d adaptive_max_pool2d amax amin avg_pool1d avg_pool2d cumsum linalg_vector_norm max_pool1d
    max_pool2d mean norm std sum var alias as_strided bernoulli_ clone dropout_ empty_like diagonal expand_as eye
    feature_dropout flip im2col index_select linspace meshgrid movedim new_ones ones_like pad pixel_shuffle
    pixel_unshuffle repeat repeat_interleave reshape_as tile unflatten unfold view_as zero_""".split()}
"""Ops free or intentionally uncounted under the multiply-add convention (reported in ``uncounted``)."""


@dataclass
class FlopReport:
    """FLOPs of one forward pass: ``total`` (multiply-adds), per operator, and the ``unsupported`` (missing from the
    total) and ``uncounted`` (free) ops with their counts."""

    total: int
    by_operator: Dict[str, int] = field(default_factory=dict)
    unsupported: Dict[str, int] = field(default_factory=dict)
    uncounted: Dict[str, int] = field(default_factory=dict)

    @property
    def gflops(self) -> float:
        return self.total / 1e9


def parameter_count(model: nn.Module) -> int:
    """The number of elements of the model's (deduplicated) parameters."""
    return sum(p.numel() for p in model.parameters())


def _inputs(model: nn.Module, input_size: InputSpec) -> Tuple[torch.Tensor, ...]:
    """A tensor or tensors as given, or a random input of batch 1 and ``input_size`` on the model's device and float
    dtype."""
    device = next((p.device for p in model.parameters()), torch.device('cpu'))
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    tensors = (input_size,) if isinstance(input_size, torch.Tensor) else tuple(input_size)
    if tensors and all(isinstance(t, torch.Tensor) for t in tensors):
        return tuple(t.to(device) for t in tensors)
    if not all(isinstance(s, int) and s > 0 for s in input_size):
        raise ValueError(f'input_size must be a shape of positive ints, or tensors, got {input_size!r}')
    x = torch.randn((1, *input_size), generator=torch.Generator().manual_seed(0))
    return (x.to(device=device, dtype=dtype),)


def _run(analysis: JitModelAnalysis, model: nn.Module) -> float:
    """Traces in eval mode under no_grad (each module's mode restored); returns the total."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).total('')
    finally:
        for module, mode in modes:
            module.training = mode


def count_flops(model: nn.Module, input_size: InputSpec = (3, 224, 224),
                extra_handles: Optional[Mapping[str, Optional[Handle]]] = None,
                warn_unsupported: bool = True) -> FlopReport:
    """Counts the FLOPs (multiply-adds) of one forward pass, traced in eval mode under no_grad.

    Args:
        model: A model traceable with ``torch.jit`` at a fixed input shape.
        input_size: The input shape without the batch dim (batch 1), or a tensor (or tuple of tensors) passed as is.
        extra_handles: Handles for this call (op name -> handle, e.g. ``'prim::PythonOp.MyFunction'``); a None
            handle counts the op as zero.
        warn_unsupported: Log a warning listing unsupported ops.
    """
    handles = {**FLOP_HANDLES, **(extra_handles or {})}
    analysis = FlopCountAnalysis(model, _inputs(model, input_size))
    # set_op_handle(op, None) keeps fvcore's own handle for the op: a handle counting zero ignores it
    analysis.set_op_handle(**{op: h or (lambda inputs, outputs: 0) for op, h in handles.items()})
    total = _run(analysis, model)
    unsupported, uncounted = {}, {}
    for op, n in analysis.unsupported_ops('').items():
        (uncounted if op in UNCOUNTED_OPS else unsupported)[op] = n
    if warn_unsupported and unsupported:
        _logger.warning('FLOPs of these unsupported ops are not counted: %s',
                        ', '.join(f'{op} ({n}x)' for op, n in sorted(unsupported.items())))
    by_operator = {op: int(round(n)) for op, n in analysis.by_operator('').most_common()}
    return FlopReport(int(round(total)), by_operator, unsupported, uncounted)


def count_activations(model: nn.Module, input_size: InputSpec = (3, 224, 224)) -> int:
    """Counts the output elements of convolutions, matmuls, linears and attention in one forward pass (fvcore's
    ``ActivationCountAnalysis`` plus fused attention and baddbmm), as :func:`count_flops` traces."""
    analysis = ActivationCountAnalysis(model, _inputs(model, input_size))
    analysis.set_op_handle(**ACTIVATION_HANDLES)
    return int(round(_run(analysis, model)))
