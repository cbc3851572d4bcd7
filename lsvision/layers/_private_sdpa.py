"""Every call of a private aten attention kernel in lsvision, behind one guard.

The training path of the span attention (`span_attention`) runs on fused kernels that return the log-sum-exp of every
query, which the public `F.scaled_dot_product_attention` does not: CPU's flash kernel and CUDA's memory-efficient one,
forward and backward. Their signatures are private and change between torch releases, so

  * each call passes every argument by keyword (the schema's names);
  * at first use the op's schema (`torch.ops.aten.<op>.default._schema`) is compared with the one this code was
    written for (`EXPECTED_SCHEMAS`, torch 2.14.1); on a mismatch `fused_kernels_available` says no, the layers take
    their public path (`F.scaled_dot_product_attention` forward, the recomputing batched-matmul backward: the same
    results, more time) and one warning names the op and the torch version;
  * the CUDA kernel's eligibility rules, which meta kernels (and so fake-tensor tests) do not check, are written once
    (`efficient_attention_problems`, each with the torch source it comes from) and checked before every call.

Written for lsvision, Apache-2.0.
"""
import warnings
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ['EXPECTED_SCHEMAS', 'fused_kernels_available', 'fused_attention', 'fused_attention_backward',
           'efficient_bias', 'efficient_attention_problems', 'efficient_kernel_takes']

# the schemas the calls below were written for (torch 2.14.1)
EXPECTED_SCHEMAS: Dict[str, str] = {
    '_scaled_dot_product_flash_attention_for_cpu': (
        'aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, '
        'float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) '
        '-> (Tensor output, Tensor logsumexp)'),
    '_scaled_dot_product_flash_attention_for_cpu_backward': (
        'aten::_scaled_dot_product_flash_attention_for_cpu_backward(Tensor grad_out, Tensor query, Tensor key, '
        'Tensor value, Tensor out, Tensor logsumexp, float dropout_p, bool is_causal, *, Tensor? attn_mask=None, '
        'float? scale=None) -> (Tensor grad_query, Tensor grad_key, Tensor grad_value)'),
    '_scaled_dot_product_efficient_attention': (
        'aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, '
        'bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *, float? scale=None) '
        '-> (Tensor output, Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)'),
    '_scaled_dot_product_efficient_attention_backward': (
        'aten::_scaled_dot_product_efficient_attention_backward(Tensor grad_out_, Tensor query, Tensor key, '
        'Tensor value, Tensor attn_bias, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset, '
        'float dropout_p, bool[4] grad_input_mask, bool is_causal=False, *, float? scale=None) '
        '-> (Tensor, Tensor, Tensor, Tensor)'),
}
# the ops each device's fused path needs, forward and backward
_DEVICE_OPS: Dict[str, Tuple[str, str]] = {
    'cpu': ('_scaled_dot_product_flash_attention_for_cpu', '_scaled_dot_product_flash_attention_for_cpu_backward'),
    'cuda': ('_scaled_dot_product_efficient_attention', '_scaled_dot_product_efficient_attention_backward'),
}
_schema_ok: Dict[str, bool] = {}  # op name -> its schema is the expected one (checked once, warned once)


def _op(name: str) -> torch._ops.OpOverload:
    return getattr(torch.ops.aten, name).default


def _schema_matches(name: str) -> bool:
    """Whether the installed torch's schema of aten.`name` is the one the calls were written for (checked and, on a
    mismatch, warned about once per process)."""
    if name not in _schema_ok:
        try:
            found = str(_op(name)._schema)
        except (AttributeError, RuntimeError):  # the op is gone
            found = None
        _schema_ok[name] = found == EXPECTED_SCHEMAS[name]
        if not _schema_ok[name]:
            warnings.warn(
                f'lsvision: torch {torch.__version__} changed the private op aten.{name} (written for '
                f'{EXPECTED_SCHEMAS[name]!r}, found {found!r}); long-short attention trains on the public '
                'F.scaled_dot_product_attention and its recomputing backward instead: the same results, slower. '
                'Update lsvision/layers/_private_sdpa.py for this torch.', RuntimeWarning, stacklevel=3)
    return _schema_ok[name]


def fused_kernels_available(device_type: str) -> bool:
    """Whether the fused kernels of `device_type` ('cpu': flash, 'cuda': memory-efficient) can be called: they exist
    there and their schemas are the expected ones."""
    ops = _DEVICE_OPS.get(device_type)
    return ops is not None and all(_schema_matches(name) for name in ops)


def efficient_bias(mask: Optional[torch.Tensor], shape: Tuple[int, int, int, int]) -> Optional[torch.Tensor]:
    """An additive mask as CUDA's memory-efficient kernel reads it: expanded to the (B', H', M, N) of its queries and
    keys (broadcast dims stay stride-0 views) with every other stride a multiple of 16 elements, as
    `F.scaled_dot_product_attention` pads it (`preprocess_mask`; the key axis is padded in a copy and sliced back)."""
    if mask is None:
        return None
    mask = mask.expand(shape)
    if mask.stride(-1) == 1 and all(st % _BIAS_ALIGNMENT == 0 for st in mask.stride()[:-1]):
        return mask
    n = shape[-1]
    compact = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())]
    padded = mask.new_empty(compact.shape[:-1] + (-(-n // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT,))
    padded[..., :n].copy_(compact)
    return padded[..., :n].expand(shape)


# The memory-efficient kernel's eligibility rules that meta kernels do not check (torch's sources, by file and the
# function or message to grep for: pytorch/pytorch, aten/src/ATen/native/transformers/):
#   dtypes: float16, bfloat16, float32 (cuda/sdp_utils.cpp, `check_tensor_dtype` in can_use_mem_efficient_attention;
#     bfloat16 needs sm80+);
#   head dim: a multiple of the GEMM alignment, 8 for half types on tensor cores and 4 for float32 on sm80+
#     (cuda/sdp_utils.cpp `check_head_dim_size_mem_efficient`, `minimum_gemm_alignment`): lsvision asks 8 of all;
#   q, k, v: 4-D (B', H', M, K), the same K for q and k, the last dim contiguous (cuda/attention.cu
#     `_efficient_attention_forward`: "Embedding per head", CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA);
#   bias: q's dtype, exactly (B', H', M, N) (stride 0 for broadcast dims), last dim contiguous (cuda/attention.cu:
#     "invalid dtype for bias - should match query's dtype", "attn_bias: wrong shape (... dimension)"), batch,
#     head and row strides aligned (cuda/mem_eff_attention/kernel_forward.h and kernel_backward.h, `check_supported`:
#     "attn_bias is not correctly aligned (strideM)"), which `F.scaled_dot_product_attention` ensures by padding the
#     key axis to 16 elements (attention.cpp `preprocess_mask`, mem_eff_alignment = 16): lsvision asks the same 16.
_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEAD_DIM_ALIGNMENT = 8
_BIAS_ALIGNMENT = 16


def efficient_attention_problems(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor]
                                 ) -> List[str]:
    """What keeps CUDA's memory-efficient kernel from taking these inputs (see the rules above); empty: eligible."""
    problems = []
    if q.dtype not in _EFFICIENT_DTYPES:
        problems.append(f'dtype {q.dtype}: the kernel takes float16, bfloat16, float32')
    if not (q.dtype == k.dtype == v.dtype):
        problems.append(f'q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}')
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return problems + [f'q, k, v must be 4-D (B, H, L, K), got {q.dim()}, {k.dim()}, {v.dim()} dims']
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        problems.append(f'shapes do not fit: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}')
    for name, t in (('q', q), ('v', v)):
        if t.shape[-1] % _HEAD_DIM_ALIGNMENT:
            problems.append(f'{name} head dim {t.shape[-1]} is not a multiple of {_HEAD_DIM_ALIGNMENT}')
    for name, t in (('q', q), ('k', k), ('v', v)):
        if t.stride(-1) != 1:
            problems.append(f'{name} last dim is not contiguous (stride {t.stride(-1)})')
    if bias is not None:
        expected = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if bias.dtype != q.dtype:
            problems.append(f'bias dtype {bias.dtype} is not the dtype of q, {q.dtype}')
        if tuple(bias.shape) != expected:
            problems.append(f'bias shape {tuple(bias.shape)} is not (B, H, M, N) = {expected}')
        elif bias.stride(-1) != 1 or any(st % _BIAS_ALIGNMENT for st in bias.stride()[:-1]):
            problems.append(f'bias strides {bias.stride()}: the last must be 1 and the others multiples of '
                            f'{_BIAS_ALIGNMENT} (`efficient_bias` lays a mask out so)')
    return problems


def efficient_kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether CUDA's memory-efficient kernel takes queries of this dtype and head dim (the layouts lsvision makes
    fit, or `fused_attention` says why not)."""
    return dtype in _EFFICIENT_DTYPES and head_dim % _HEAD_DIM_ALIGNMENT == 0


def _check_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    problems = efficient_attention_problems(q, k, v, bias)
    if problems:
        raise ValueError('CUDA memory-efficient attention cannot take these inputs: ' + '; '.join(problems))


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The fused attention kernel over blocks of queries (B', H', M, d) and their keys (B', H', N, d), any strides
    with the last one 1: the output (B', H', M, d) and the log-sum-exp of every query's scores, (B', H', M'), M' >= M
    (CUDA pads it to a multiple of 32). CPU runs the flash kernel, CUDA the memory-efficient one (its bias and
    log-sum-exp, which the flash kernel lacks). Call only where `fused_kernels_available(q.device.type)`."""
    if q.device.type == 'cpu':
        out, lse = _op('_scaled_dot_product_flash_attention_for_cpu')(
            query=q, key=k, value=v, dropout_p=0., is_causal=False, attn_mask=mask, scale=scale)
        return out, lse
    bias = efficient_bias(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    _check_efficient(q, k, v, bias)
    out, lse = _op('_scaled_dot_product_efficient_attention')(
        query=q, key=k, value=v, attn_bias=bias, compute_log_sumexp=True, dropout_p=0., is_causal=False,
        scale=scale)[:2]
    return out, lse


def fused_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, scale: float
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of `fused_attention`, given its output and log-sum-exp (in the kernel's layout): gradients of q,
    k and v."""
    if q.device.type == 'cpu':
        grad_q, grad_k, grad_v = _op('_scaled_dot_product_flash_attention_for_cpu_backward')(
            grad_out=grad_out, query=q, key=k, value=v, out=out, logsumexp=lse, dropout_p=0., is_causal=False,
            attn_mask=mask, scale=scale)
        return grad_q, grad_k, grad_v
    # the kernel reads the output with the row stride of its forward's layout, (B', M, H', d) in memory, whatever
    # `out`'s strides (it takes those of the batch and head axes only)
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    bias = efficient_bias(mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    _check_efficient(q, k, v, bias)
    no_rng = torch.empty((), dtype=torch.long)  # the dropout RNG's seed and offset: read only with dropout
    grad_q, grad_k, grad_v, _ = _op('_scaled_dot_product_efficient_attention_backward')(
        grad_out_=grad_out, query=q, key=k, value=v, attn_bias=bias, out=out, logsumexp=lse, philox_seed=no_rng,
        philox_offset=no_rng, dropout_p=0., grad_input_mask=[True, True, True, False], is_causal=False, scale=scale)
    return grad_q, grad_k, grad_v
