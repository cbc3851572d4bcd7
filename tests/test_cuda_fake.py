"""The CUDA paths on a CPU-only machine: every family and the 1D layers on a fake CUDA device (`fake_cuda`).

Forward in train and eval mode and backward (walked by `run_backward`, as the engine cannot run it on a fake device),
in float32 and under bf16 / fp16 autocast: every parameter gets a gradient of its shape, dtype and device, and the
CUDA kernels ran (the memory-efficient attention and its backward for the long-short spans, the block-diagonal
dynamic projection, SDPA where the CPU would run batched matmuls), so a change that silently routes CUDA to the CPU
path fails here. Shapes, dtypes and the kernels' signatures are checked by their meta kernels; numerics and the real
kernels' eligibility rules need a GPU (tests/test_cuda.py, `make gpu-check`).
"""
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.nn as nn
from _helpers import TINY_TWO_STAGE_FAMILIES
from fake_cuda import (
    FAKE_CUDA,
    KernelCounter,
    SdpaCalls,
    assert_grads_like_params,
    cuda_autocast,
    fake_cuda,
    fake_flex_backward,
    run_backward,
)
from test_span_attention import LAYERS

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import CausalLongShortAttention, GrcMemoryAttention, LongShortAttention1d, LongShortAttention2d

EFFICIENT = '_scaled_dot_product_efficient_attention.default'
EFFICIENT_BACKWARD = '_scaled_dot_product_efficient_attention_backward.default'
CPU_KERNELS = '_scaled_dot_product_flash_attention_for_cpu'
PRECISIONS = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}

# one tiny model per family, in two stages (the fake device's dispatch costs per op run): each family's kinds of
# stage, head dims the efficient kernel's alignment allows
FAMILIES: Dict[str, Dict] = TINY_TWO_STAGE_FAMILIES


def _family_cases():
    for name in FAMILIES:
        for precision in PRECISIONS:
            yield pytest.param(name, precision, id=f'{name}-{precision}')


def _count(model: nn.Module, cls: type) -> int:
    return sum(isinstance(m, cls) for m in model.modules())


def _expect_cuda_kernels(name: str, model: nn.Module, train: bool, ops: KernelCounter, sdpa: SdpaCalls,
                         dtype: torch.dtype) -> None:
    """The CUDA kernels each family runs where its CPU path would run others."""
    assert ops.count(CPU_KERNELS) == 0, ops.attention_ops()
    assert sdpa.count('cpu') == 0, sdpa.calls
    long_short = _count(model, LongShortAttention2d)
    if long_short and (name == 'cvt_ls_13' or not train):
        # span_kernel='auto' on CUDA: the windows as one FlexAttention call per layer, in the compute dtype (CPU: the
        # span path's batched matmuls or flash for cpu)
        assert ops.calls['flex_attention'] == long_short, ops.attention_ops()
        assert ops.dtypes['flex_attention'] == {dtype}, ops.dtypes['flex_attention']
    elif long_short:
        # ViL-LS trains with a gradient for its window bias: the span path, whose spans run as matmuls there
        assert ops.calls['flex_attention'] == 0, ops.attention_ops()
    if name == 'swin_tiny_patch4_window7_224_grc':
        # GRC's window memory attention (a bias) through SDPA (CPU: batched matmuls for small windows)
        assert sdpa.count('cuda', dtype, masked=True) == _count(model, GrcMemoryAttention), sdpa.calls
    elif name != 'cvt_ls_13' and not long_short:
        assert sdpa.count('cuda', dtype) > 0, sdpa.calls


def _run(module: nn.Module, make_input: Callable[[], tuple], train: bool, dtype: Optional[torch.dtype]
         ) -> (KernelCounter, SdpaCalls):
    """One forward (train: and backward through the graph walk) on the fake CUDA device; the counters of both."""
    module.train(train)
    with KernelCounter() as ops, SdpaCalls() as sdpa, torch.set_grad_enabled(train), cuda_autocast(dtype), \
            fake_flex_backward(), torch.compiler.set_stance('force_eager'):
        out = module(*make_input())
        assert out.device.type == 'cuda' and out.dtype == (dtype or torch.float32), (out.device, out.dtype)
        if train:
            run_backward(out.float().square().mean())
    return ops, sdpa


@pytest.mark.parametrize('name,precision', list(_family_cases()))
def test_fake_cuda_family_trains_and_evaluates_on_cuda_kernels(name, precision):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, **FAMILIES[name])
    dtype = PRECISIONS[precision]
    size = FAMILIES[name].get('img_size', 64)
    with fake_cuda():
        model = model.to(FAKE_CUDA)
        ops, sdpa = _run(model, lambda: (torch.randn(2, 3, size, size, device=FAKE_CUDA),), True, dtype)
        assert_grads_like_params(model)
        _expect_cuda_kernels(name, model, True, ops, sdpa, dtype or torch.float32)
        ops, sdpa = _run(model, lambda: (torch.randn(2, 3, size, size, device=FAKE_CUDA),), False, dtype)
        _expect_cuda_kernels(name, model, False, ops, sdpa, dtype or torch.float32)


@pytest.mark.parametrize('precision', list(PRECISIONS))
def test_fake_cuda_1d_long_short_trains_and_evaluates_on_cuda_kernels(precision):
    """Segments of 20 queries: training on the memory-efficient kernel, inference through SDPA with the span mask."""
    torch.manual_seed(0)
    attn = LongShortAttention1d(32, 2, 20, 3)
    dtype = PRECISIONS[precision]
    with fake_cuda():
        attn = attn.to(FAKE_CUDA)
        make_input = lambda: (torch.randn(3, 50, 32, device=FAKE_CUDA),  # noqa: E731
                              torch.ones(3, 50, dtype=torch.bool, device=FAKE_CUDA))
        ops, _ = _run(attn, make_input, True, dtype)
        assert_grads_like_params(attn)
        assert ops.count(EFFICIENT) == 1 and ops.count(EFFICIENT_BACKWARD) == 1, ops.attention_ops()
        assert ops.dtypes[EFFICIENT] == {dtype or torch.float32}
        ops, sdpa = _run(attn, make_input, False, dtype)
        assert sdpa.count('cuda', dtype or torch.float32, masked=True) >= 1 and ops.count(CPU_KERNELS) == 0


def test_fake_cuda_causal_long_short_trains():
    torch.manual_seed(0)
    attn = CausalLongShortAttention(32, 2, 8, 4, 2)
    with fake_cuda():
        attn = attn.to(FAKE_CUDA)
        _run(attn, lambda: (torch.randn(2, 32, 32, device=FAKE_CUDA), torch.randn(2, 16, 32, device=FAKE_CUDA)),
             True, None)
        assert_grads_like_params(attn)


def test_fake_cuda_dynamic_projection_runs_block_diagonal():
    """The span path on CUDA (`span_kernel='span'`) runs the dynamic projection's products for all heads at once (one
    matmul each for keys and values, forward), where at this size (r N C = 4 x 40000 x 32, above
    `BLOCK_DIAGONAL_MAX_MACS`) the CPU runs one matmul per head: the same layer on the fake CPU device shows the
    difference."""
    calls = {}
    for device in ('cuda', 'cpu'):
        torch.manual_seed(0)
        attn = LongShortAttention2d(32, 2, 2, 4, span_kernel='span', **LAYERS['conv'])
        with fake_cuda() as mode:
            attn = attn.to(FAKE_CUDA) if device == 'cuda' else attn._apply(mode.from_tensor)
            x = mode.from_tensor(torch.empty(2, 1 + 200 * 200, 32)).to(device).normal_()
            with KernelCounter() as ops:
                attn.train()(x, (200, 200))
            calls[device] = ops.calls['bmm.out']
    assert calls == {'cuda': 2, 'cpu': 4}, calls


@pytest.mark.parametrize('name,precision', [('cvt_ls_13', p) for p in PRECISIONS] + [('vil_ls_medium', 'bf16')])
def test_fake_cuda_flex_kernel_is_the_one_taken(name, precision):
    """With `span_kernel='flex'` every long-short layer runs one FlexAttention call on CUDA, in the compute dtype, and
    neither the span path's kernels nor its masked SDPA, in train and eval mode. Without gradients: FlexAttention
    traces its score_mod's backward through the autograd engine at forward time, which needs a real device (its
    gradients are checked on a GPU, tests/test_cuda.py). `force_eager`: torch.compile does not run on fake tensors."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, span_kernel='flex', **FAMILIES[name])
    dtype = PRECISIONS[precision]
    size = FAMILIES[name].get('img_size', 64)
    long_short = _count(model, LongShortAttention2d)
    with fake_cuda(), torch.compiler.set_stance('force_eager'), torch.no_grad():
        model = model.to(FAKE_CUDA)
        for train in (True, False):
            model.train(train)
            with KernelCounter() as ops, SdpaCalls() as sdpa, cuda_autocast(dtype):
                out = model(torch.randn(2, 3, size, size, device=FAKE_CUDA))
            assert out.device.type == 'cuda' and out.dtype == (dtype or torch.float32), (out.device, out.dtype)
            assert ops.calls['flex_attention'] == long_short, ops.attention_ops()
            assert ops.dtypes['flex_attention'] == {dtype or torch.float32}, ops.dtypes['flex_attention']
            assert ops.count(EFFICIENT) == 0 and ops.count(CPU_KERNELS) == 0, ops.attention_ops()
            if name == 'cvt_ls_13':  # no other attention in the model but the cls token's update (stage 3)
                cls_layers = FAMILIES[name]['depths'][-1]
                assert sdpa.count('cuda', masked=False) == sdpa.count('cuda') == cls_layers, sdpa.calls
