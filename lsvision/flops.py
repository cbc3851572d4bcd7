"""FLOP and activation counting for lsvision models.

This wraps fvcore's :class:`~fvcore.nn.FlopCountAnalysis` and :class:`~fvcore.nn.ActivationCountAnalysis` and adds
what fvcore alone misses:

* ``aten::scaled_dot_product_attention`` (fused attention, used by timm and most modern attention layers) has no
  fvcore handle and would otherwise be silently counted as zero. A handle is registered for it here.
* ``aten::baddbmm`` (batched matmul with an added bias) likewise has no fvcore handle.
* A module-level registry (:data:`EXTRA_FLOP_HANDLES`, :func:`register_flop_handle`) lets other lsvision code register
  handles for its own custom ops; every count made through this module applies it.
* Ops that are free or intentionally uncounted under the multiply-add convention (elementwise arithmetic,
  activations, softmax, pooling, ...) do not produce "unsupported operator" warnings. They are reported separately in
  :attr:`FlopReport.uncounted`, while genuinely unknown ops are reported in :attr:`FlopReport.unsupported`.

Counting convention (fvcore's, and what papers report as "FLOPs"): one multiply-add counts as one FLOP.

fvcore works by ``torch.jit`` tracing, so models must be traceable at a fixed input shape.
"""

import logging
import warnings
from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Counter, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn as nn

with warnings.catch_warnings():
    # fvcore scripts a few helpers at import time, which makes recent torch emit a deprecation warning that is
    # irrelevant to users of this module.
    warnings.filterwarnings('ignore', message='.*torch.jit.*deprecated.*', category=FutureWarning)
    from fvcore.nn import ActivationCountAnalysis, FlopCountAnalysis
    from fvcore.nn.jit_analysis import JitModelAnalysis
    from fvcore.nn.jit_handles import generic_activation_jit, get_shape

__all__ = [
    'EXTRA_ACTIVATION_HANDLES',
    'EXTRA_FLOP_HANDLES',
    'UNCOUNTED_OPS',
    'FlopReport',
    'Handle',
    'baddbmm_flop_jit',
    'count_activations',
    'count_flops',
    'parameter_count',
    'register_activation_handle',
    'register_flop_handle',
    'sdpa_activation_jit',
    'sdpa_flop_jit',
    'unregister_flop_handle',
]

_logger = logging.getLogger(__name__)

Handle = Callable[[List[Any], List[Any]], Union[Counter[str], int, float]]
"""An fvcore op handle: ``handle(inputs, outputs)`` with lists of ``torch._C.Value`` -> a count or a Counter."""

InputSpec = Union[Sequence[int], torch.Tensor, Tuple[torch.Tensor, ...]]

SDPA_OP = 'aten::scaled_dot_product_attention'


def _shape(val: Any, what: str) -> List[int]:
    """Returns the complete shape of a jit value, raising a helpful error when the tracer did not record one."""
    shape = get_shape(val)
    if shape is None:
        raise ValueError(f'Shape of {what} is unknown in the traced graph; cannot count FLOPs.')
    return list(shape)


def _broadcast_batch_dims(*shapes: Sequence[int]) -> List[int]:
    """Broadcasts batch shapes the way attention does, allowing grouped-query (GQA) head sharing.

    Shapes are right-aligned as in numpy broadcasting. In each position the result is the largest size, which every
    other size must divide: a size of 1 is ordinary broadcasting, and a smaller divisor is the key/value head count of
    grouped-query attention (each key/value head serves several query heads).

    Args:
        *shapes: Batch shapes (all dims except the last two) of query, key and value.

    Returns:
        The broadcast batch shape.

    Raises:
        ValueError: If the shapes are not broadcastable.
    """
    ndim = max(len(s) for s in shapes)
    padded = [[1] * (ndim - len(s)) + list(s) for s in shapes]
    out = []
    for sizes in zip(*padded):
        size = max(sizes)
        if 0 in sizes:
            size = 0
        elif any(size % s != 0 for s in sizes):
            raise ValueError(f'Attention batch shapes {[list(s) for s in shapes]} are not broadcastable.')
        out.append(size)
    return out


def sdpa_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """Counts FLOPs (multiply-adds) of ``aten::scaled_dot_product_attention``.

    For query ``(..., L, E)``, key ``(..., S, E)`` and value ``(..., S, Ev)`` this is
    ``prod(batch) * L * S * (E + Ev)``: the two matmuls ``q @ k^T`` and ``attn @ v``. The batch shape is the broadcast
    of the query, key and value batch shapes (with grouped-query attention, the query head count). Scaling, masking,
    dropout and softmax are not counted, as fvcore does not count them when attention is written out explicitly. A
    causal or boolean mask does not reduce the count: the dense matmuls are counted, whatever a kernel may skip.

    Args:
        inputs: The jit inputs of the op: query, key, value, attn_mask, dropout_p, is_causal, scale[, enable_gqa].
        outputs: The jit outputs of the op.

    Returns:
        The number of multiply-adds.
    """
    q_shape = _shape(inputs[0], 'SDPA query')
    k_shape = _shape(inputs[1], 'SDPA key')
    v_shape = _shape(inputs[2], 'SDPA value')
    seq_q, dim_qk = q_shape[-2:]
    seq_kv = k_shape[-2]
    dim_v = v_shape[-1]
    batch = _broadcast_batch_dims(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    return int(prod(batch) * seq_q * seq_kv * (dim_qk + dim_v))


def sdpa_activation_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """Counts activations of ``aten::scaled_dot_product_attention``: the number of elements of its output.

    Args:
        inputs: The jit inputs of the op.
        outputs: The jit outputs of the op.

    Returns:
        The number of output elements.
    """
    return int(prod(_shape(outputs[0], 'SDPA output')))


def baddbmm_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """Counts FLOPs (multiply-adds) of ``aten::baddbmm`` (``beta * input + alpha * batch1 @ batch2``).

    Args:
        inputs: The jit inputs of the op: input, batch1, batch2, beta, alpha.
        outputs: The jit outputs of the op.

    Returns:
        ``b * n * m * p`` for ``batch1`` of shape ``(b, n, m)`` and ``batch2`` of shape ``(b, m, p)``.
    """
    b, n, m = _shape(inputs[1], 'baddbmm batch1')
    p = _shape(inputs[2], 'baddbmm batch2')[-1]
    return int(b * n * m * p)


def matmul_flop_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """Counts FLOPs (multiply-adds) of ``aten::matmul`` with numpy broadcasting of the batch dims.

    fvcore's own handle counts ``prod(a.shape) * b.shape[-1]``, which misses the batch dims that only ``b`` has
    (e.g. ``(B, h, r, N) @ (2, B, h, N, d)``). Here the count is ``prod(out batch) * n * m * p``.

    Args:
        inputs: The jit inputs of the op: a, b.
        outputs: The jit outputs of the op.

    Returns:
        The number of multiply-adds.
    """
    a = _shape(inputs[0], 'matmul input')
    b = _shape(inputs[1], 'matmul other')
    if len(b) == 1:  # matrix-vector: (..., n, m) @ (m,)
        return int(prod(a))
    if len(a) == 1:  # vector-matrix: (m,) @ (..., m, p)
        return int(prod(b))
    n, m = a[-2:]
    p = b[-1]
    ndim = max(len(a), len(b)) - 2
    batch_a = [1] * (ndim - len(a) + 2) + a[:-2]
    batch_b = [1] * (ndim - len(b) + 2) + b[:-2]
    return int(prod(max(x, y) for x, y in zip(batch_a, batch_b)) * n * m * p)


EXTRA_FLOP_HANDLES: Dict[str, Handle] = {
    SDPA_OP: sdpa_flop_jit,
    'aten::baddbmm': baddbmm_flop_jit,
    'aten::matmul': matmul_flop_jit,
}
"""FLOP handles applied on top of fvcore's defaults by every count made through this module (op name -> handle).

Entries here override fvcore's own handle for the same op. Prefer :func:`register_flop_handle` to editing this dict.
"""

EXTRA_ACTIVATION_HANDLES: Dict[str, Handle] = {
    SDPA_OP: sdpa_activation_jit,
    'aten::baddbmm': generic_activation_jit(),
}
"""Activation handles applied on top of fvcore's defaults by :func:`count_activations` (op name -> handle)."""

UNCOUNTED_OPS: Set[str] = {
    # elementwise arithmetic and comparisons
    'aten::abs', 'aten::add', 'aten::add_', 'aten::addcmul', 'aten::addcmul_', 'aten::addcdiv', 'aten::clamp_max',
    'aten::clamp_min', 'aten::cos', 'aten::div', 'aten::div_', 'aten::erf', 'aten::exp', 'aten::fill_', 'aten::le',
    'aten::lerp', 'aten::lerp_',
    'aten::log', 'aten::logical_and', 'aten::logical_not', 'aten::logical_or', 'aten::lt', 'aten::masked_fill_',
    'aten::maximum', 'aten::minimum', 'aten::mul', 'aten::mul_', 'aten::ne', 'aten::neg', 'aten::pow',
    'aten::reciprocal', 'aten::rsqrt', 'aten::rsub', 'aten::sign', 'aten::sin', 'aten::sqrt', 'aten::square',
    'aten::sub', 'aten::sub_', 'aten::where',
    # activations and softmax
    'aten::elu', 'aten::elu_', 'aten::gelu', 'aten::gelu_', 'aten::glu', 'aten::hardsigmoid', 'aten::hardsigmoid_',
    'aten::hardswish', 'aten::hardswish_', 'aten::hardtanh', 'aten::hardtanh_', 'aten::leaky_relu',
    'aten::leaky_relu_', 'aten::log_softmax', 'aten::mish', 'aten::mish_', 'aten::prelu', 'aten::relu6',
    'aten::sigmoid', 'aten::sigmoid_', 'aten::silu', 'aten::silu_', 'aten::softmax', 'aten::softplus', 'aten::tanh',
    'aten::tanh_',
    # reductions and pooling (additions/comparisons only)
    'aten::adaptive_max_pool1d', 'aten::adaptive_max_pool2d', 'aten::amax', 'aten::amin', 'aten::avg_pool1d',
    'aten::avg_pool2d', 'aten::cumsum', 'aten::linalg_vector_norm', 'aten::max_pool1d', 'aten::max_pool2d',
    'aten::mean', 'aten::norm', 'aten::std', 'aten::sum', 'aten::var',
    # shape, memory and constant creation
    'aten::alias', 'aten::as_strided', 'aten::bernoulli_', 'aten::clone', 'aten::dropout_', 'aten::empty_like',
    'aten::diagonal', 'aten::expand_as', 'aten::eye', 'aten::feature_dropout', 'aten::flip', 'aten::im2col',
    'aten::index_select', 'aten::linspace',
    'aten::meshgrid', 'aten::movedim', 'aten::new_ones', 'aten::ones_like', 'aten::pad', 'aten::pixel_shuffle',
    'aten::pixel_unshuffle', 'aten::repeat', 'aten::repeat_interleave', 'aten::reshape_as', 'aten::tile',
    'aten::unflatten', 'aten::unfold', 'aten::view_as', 'aten::zero_',
}
"""Ops known to be free or intentionally uncounted under the multiply-add convention.

They raise no "unsupported operator" warning and are reported in :attr:`FlopReport.uncounted` rather than
:attr:`FlopReport.unsupported`. fvcore additionally ignores its own list of zero-cost ops (reshapes, copies, ...),
which are not reported at all.
"""


def register_flop_handle(op_name: str, handle: Handle, overwrite: bool = False) -> Handle:
    """Registers a FLOP handle for a jit op, applied by every :func:`count_flops` call from then on.

    A handle takes the op's jit ``inputs`` and ``outputs`` (lists of ``torch._C.Value``; use
    ``fvcore.nn.jit_handles.get_shape`` to read shapes) and returns the multiply-add count, either as a number
    (reported under the op name without its namespace) or as a ``Counter`` of name -> count.

    Args:
        op_name: The traced op name, e.g. ``'aten::scaled_dot_product_attention'`` or ``'prim::PythonOp.MyFunction'``
            for a custom ``torch.autograd.Function``.
        handle: The FLOP handle.
        overwrite: Whether to replace a handle already registered for ``op_name``.

    Returns:
        The handle.

    Raises:
        ValueError: If a different handle is already registered for ``op_name`` and ``overwrite`` is False.
    """
    existing = EXTRA_FLOP_HANDLES.get(op_name)
    if existing is not None and existing is not handle and not overwrite:
        raise ValueError(f'A FLOP handle is already registered for {op_name!r}; pass overwrite=True to replace it.')
    EXTRA_FLOP_HANDLES[op_name] = handle
    return handle


def unregister_flop_handle(op_name: str) -> Optional[Handle]:
    """Removes the FLOP handle registered for an op.

    Args:
        op_name: The traced op name.

    Returns:
        The removed handle, or None if none was registered.
    """
    return EXTRA_FLOP_HANDLES.pop(op_name, None)


def register_activation_handle(op_name: str, handle: Handle, overwrite: bool = False) -> Handle:
    """Registers an activation handle for a jit op, applied by every :func:`count_activations` call from then on.

    Args:
        op_name: The traced op name.
        handle: The activation handle (same signature as a FLOP handle, counting output elements).
        overwrite: Whether to replace a handle already registered for ``op_name``.

    Returns:
        The handle.

    Raises:
        ValueError: If a different handle is already registered for ``op_name`` and ``overwrite`` is False.
    """
    existing = EXTRA_ACTIVATION_HANDLES.get(op_name)
    if existing is not None and existing is not handle and not overwrite:
        raise ValueError(f'An activation handle is already registered for {op_name!r}; pass overwrite=True.')
    EXTRA_ACTIVATION_HANDLES[op_name] = handle
    return handle


@dataclass
class FlopReport:
    """The result of :func:`count_flops`.

    Attributes:
        total: Total FLOPs, counting one multiply-add as one FLOP.
        by_module: FLOPs per submodule name, down to the requested depth (top-level children by default), in
            ``named_modules`` order. The root module (``''``) is not included; its count is ``total``.
        by_operator: FLOPs per operator (op name without namespace, e.g. ``'linear'``, ``'conv'``,
            ``'scaled_dot_product_attention'``).
        unsupported: Ops without a handle that are not known to be free, with how many times each was encountered.
            Their cost is missing from ``total``.
        uncounted: Ops in :data:`UNCOUNTED_OPS` that were encountered, with counts; intentionally not counted.
    """

    total: int
    by_module: Dict[str, int] = field(default_factory=dict)
    by_operator: Dict[str, int] = field(default_factory=dict)
    unsupported: Dict[str, int] = field(default_factory=dict)
    uncounted: Dict[str, int] = field(default_factory=dict)

    @property
    def gflops(self) -> float:
        """Total FLOPs in billions (GFLOPs, i.e. giga multiply-adds)."""
        return self.total / 1e9


def parameter_count(model: nn.Module) -> int:
    """Counts the parameters of a model.

    Args:
        model: The model.

    Returns:
        The total number of elements of all (deduplicated) parameters.
    """
    return sum(p.numel() for p in model.parameters())


def _device_and_dtype(model: nn.Module) -> Tuple[torch.device, torch.dtype]:
    """Returns the device and floating dtype of a model's first floating parameter or buffer."""
    device = None
    for tensor in list(model.parameters()) + list(model.buffers()):
        if device is None:
            device = tensor.device
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return device or torch.device('cpu'), torch.get_default_dtype()


def _make_inputs(model: nn.Module, input_size: InputSpec, batch_size: int) -> Tuple[torch.Tensor, ...]:
    """Builds the example inputs for tracing ``model``."""
    device, dtype = _device_and_dtype(model)
    if isinstance(input_size, torch.Tensor):
        return (input_size.to(device),)
    if len(input_size) > 0 and all(isinstance(t, torch.Tensor) for t in input_size):
        return tuple(t.to(device) for t in input_size)  # type: ignore[union-attr]
    if not all(isinstance(s, int) and s > 0 for s in input_size):
        raise ValueError(f'input_size must be a shape of positive ints or a tensor, got {input_size!r}.')
    if batch_size < 1:
        raise ValueError(f'batch_size must be positive, got {batch_size}.')
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((batch_size, *input_size), generator=generator, dtype=torch.float32)
    return (x.to(device=device, dtype=dtype),)


def _zero_jit(inputs: List[Any], outputs: List[Any]) -> int:
    """A handle that counts nothing, for ops ignored on request."""
    return 0


def _run_analysis(analysis: JitModelAnalysis, model: nn.Module) -> None:
    """Runs the (cached) trace of an fvcore analysis in eval mode under no_grad, restoring each module's mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            analysis.total('')  # traces the model; fvcore caches the results in the analysis
    finally:
        for module, mode in modes:
            module.training = mode


def count_flops(
        model: nn.Module,
        input_size: InputSpec = (3, 224, 224),
        batch_size: int = 1,
        module_depth: Optional[int] = 1,
        extra_handles: Optional[Mapping[str, Optional[Handle]]] = None,
        warn_unsupported: bool = True,
) -> FlopReport:
    """Counts the FLOPs (multiply-adds) of one forward pass of a model.

    The model is traced in eval mode under ``torch.no_grad`` on a random input on the model's device and dtype; the
    training mode of every submodule is restored afterwards. fvcore's handles are used, plus :data:`EXTRA_FLOP_HANDLES`
    (fused attention and anything registered with :func:`register_flop_handle`), plus ``extra_handles``.

    Args:
        model: The model. It must be traceable with ``torch.jit`` at a fixed input shape.
        input_size: The input shape without the batch dimension, e.g. ``(3, 224, 224)``; or a tensor (or tuple of
            tensors) passed to the model as is (with its batch dimension; ``batch_size`` is then ignored).
        batch_size: Batch size of the generated input.
        module_depth: Depth of the submodules reported in :attr:`FlopReport.by_module`: 1 for top-level children,
            2 for their children as well, and so on; None for all submodules.
        extra_handles: Handles for this call only, overriding all others (op name -> handle); a None handle makes
            the op count as zero (not reported as unsupported), e.g. ``{'aten::batch_norm': None}`` to leave out
            batch norms that fold into convolutions at inference.
        warn_unsupported: Whether to log a warning listing unsupported ops (not those in :data:`UNCOUNTED_OPS`).

    Returns:
        The FLOP report.
    """
    inputs = _make_inputs(model, input_size, batch_size)
    handles = {**EXTRA_FLOP_HANDLES, **(extra_handles or {})}
    analysis = FlopCountAnalysis(model, inputs)
    # fvcore's set_op_handle(op, None) only marks the op as ignored and keeps any handle already set for it (e.g. its
    # default batch_norm handle), so the op would still be counted: ignore ops with a zero handle instead.
    analysis.set_op_handle(**{op: _zero_jit if handle is None else handle for op, handle in handles.items()})
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    _run_analysis(analysis, model)

    unsupported: Dict[str, int] = {}
    uncounted: Dict[str, int] = {}
    for op, n in analysis.unsupported_ops('').items():
        (uncounted if op in UNCOUNTED_OPS else unsupported)[op] = n
    if warn_unsupported and unsupported:
        _logger.warning(
            'FLOPs of these unsupported ops are not counted: %s',
            ', '.join(f'{op} ({n}x)' for op, n in sorted(unsupported.items())),
        )

    by_module = {
        name: int(round(n)) for name, n in analysis.by_module().items()
        if name and (module_depth is None or name.count('.') < module_depth)
    }
    by_operator = {op: int(round(n)) for op, n in analysis.by_operator('').most_common()}
    return FlopReport(
        total=int(round(analysis.total(''))),
        by_module=by_module,
        by_operator=by_operator,
        unsupported=unsupported,
        uncounted=uncounted,
    )


def count_activations(model: nn.Module, input_size: InputSpec = (3, 224, 224), batch_size: int = 1) -> int:
    """Counts the activations (output elements of convolutions, matmuls, linears and attention) of a forward pass.

    Uses fvcore's ``ActivationCountAnalysis`` plus :data:`EXTRA_ACTIVATION_HANDLES`, under the same conditions as
    :func:`count_flops`.

    Args:
        model: The model. It must be traceable with ``torch.jit`` at a fixed input shape.
        input_size: The input shape without the batch dimension, or a tensor (or tuple of tensors) with it.
        batch_size: Batch size of the generated input.

    Returns:
        The number of activations.
    """
    inputs = _make_inputs(model, input_size, batch_size)
    analysis = ActivationCountAnalysis(model, inputs)
    analysis.set_op_handle(**EXTRA_ACTIVATION_HANDLES)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    _run_analysis(analysis, model)
    return int(round(analysis.total('')))
