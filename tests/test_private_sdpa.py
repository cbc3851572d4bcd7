"""The guard of the private attention kernels (`lsvision.layers._private_sdpa`): schemas checked once, a mismatch falls
back to the public path with the same numbers and one warning, and the CUDA kernel's eligibility rules."""
import warnings

import pytest
import torch
from _helpers import perturb
from fake_cuda import FAKE_CUDA, KernelCounter, fake_cuda
from test_span_attention import LAYERS

from lsvision.layers import LongShortAttention2d
from lsvision.layers import _private_sdpa as private_sdpa
from lsvision.layers._private_sdpa import (
    EXPECTED_SCHEMAS,
    efficient_attention_problems,
    efficient_bias,
    fused_attention,
    fused_kernels_available,
)

CPU_FLASH = '_scaled_dot_product_flash_attention_for_cpu'


def test_expected_schemas_are_the_installed_torch_s(monkeypatch):
    """The calls were written for this torch's schemas (a torch upgrade that changes one fails here first)."""
    monkeypatch.setattr(private_sdpa, '_schema_ok', {})
    for name, schema in EXPECTED_SCHEMAS.items():
        assert str(getattr(torch.ops.aten, name).default._schema) == schema, name
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert fused_kernels_available('cpu') and fused_kernels_available('cuda')
    assert not fused_kernels_available('mps')


def _train_step(attn: torch.nn.Module, x: torch.Tensor, feat_size):
    """Output and input + parameter gradients of one training forward and backward, and the ops it dispatched."""
    attn.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with KernelCounter() as ops:
        out = attn(x, feat_size)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in attn.parameters()], ops


def test_schema_mismatch_falls_back_to_the_public_path_with_the_same_numbers(monkeypatch):
    """With the CPU flash kernel's expected schema changed (as a torch upgrade would change the installed one), the
    layer trains without the private kernel, on the public path, with the same output and gradients; one warning names
    the op and the torch version, once per process."""
    torch.manual_seed(0)
    feat_size = (9, 11)
    attn = perturb(LongShortAttention2d(32, 2, 4, 3, **LAYERS['conv']), 0.3).double().train()
    x = torch.randn(2, 1 + 9 * 11, 32, dtype=torch.float64)
    monkeypatch.setattr(private_sdpa, '_schema_ok', {})
    private, ops = _train_step(attn, x, feat_size)
    assert ops.count(CPU_FLASH + '.') == 1 and ops.count(CPU_FLASH + '_backward') >= 1, ops.attention_ops()

    monkeypatch.setitem(EXPECTED_SCHEMAS, CPU_FLASH, EXPECTED_SCHEMAS[CPU_FLASH].replace('scale', 'softmax_scale'))
    monkeypatch.setattr(private_sdpa, '_schema_ok', {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        public, ops = _train_step(attn, x, feat_size)
        again, _ = _train_step(attn, x, feat_size)
    assert ops.count(CPU_FLASH) == 0, ops.attention_ops()
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert f'aten.{CPU_FLASH}' in message and torch.__version__ in message, message
    names = ['out', 'x'] + [n for n, _ in attn.named_parameters()]
    for name, a, b, c in zip(names, private, public, again):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f'{name}: {m}')
        torch.testing.assert_close(c, b, rtol=0, atol=0)


def _qkv(dtype=torch.float16, head_dim=16, n=24):
    q = torch.randn(2, 3, 10, head_dim, dtype=dtype)
    k = torch.randn(2, 3, n, head_dim, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_efficient_kernel_rules_accept_what_lsvision_passes():
    q, k, v = _qkv()
    mask = torch.zeros(1, 3, 1, 24, dtype=torch.float16).masked_fill(torch.rand(1, 3, 1, 24) < 0.3, float('-inf'))
    assert efficient_attention_problems(q, k, v, None) == []
    assert efficient_attention_problems(q, k, v, efficient_bias(mask, (2, 3, 10, 24))) == []
    for dtype in (torch.float32, torch.bfloat16):
        assert efficient_attention_problems(*_qkv(dtype), None) == []


@pytest.mark.parametrize('case,expected', [
    ('float64', 'dtype torch.float64'),
    ('head_dim_12', 'head dim 12 is not a multiple of 8'),
    ('strided_last_dim', 'last dim is not contiguous'),
    ('key_head_dim', 'shapes do not fit'),
    ('three_dims', 'must be 4-D'),
    ('bias_dtype', 'bias dtype torch.float32'),
    ('bias_broadcast', 'bias shape (1, 3, 1, 24)'),
    ('bias_unaligned', 'bias strides (720, 240, 24, 1)'),
])
def test_efficient_kernel_rules_name_what_the_kernel_refuses(case, expected):
    q, k, v = _qkv(torch.float64 if case == 'float64' else torch.float16, 12 if case == 'head_dim_12' else 16)
    bias = None
    if case == 'strided_last_dim':
        k = torch.randn(2, 3, 16, 24, dtype=torch.float16).transpose(-1, -2)
    elif case == 'key_head_dim':
        k, v = torch.randn(2, 3, 24, 8, dtype=torch.float16), torch.randn(2, 3, 24, 8, dtype=torch.float16)
    elif case == 'three_dims':
        q = q[0]
    elif case == 'bias_dtype':
        bias = efficient_bias(torch.zeros(2, 3, 10, 24), (2, 3, 10, 24))
    elif case == 'bias_broadcast':
        bias = torch.zeros(1, 3, 1, 24, dtype=torch.float16)
    elif case == 'bias_unaligned':
        bias = torch.zeros(2, 3, 10, 24, dtype=torch.float16)
    problems = efficient_attention_problems(q, k, v, bias)
    assert any(expected in p for p in problems), problems


def test_fake_cuda_fused_attention_refuses_what_the_meta_kernel_would_take():
    """On the fake CUDA device the meta kernel takes a head dim of 12; the real kernel does not, and neither does the
    guard, before the call."""
    with fake_cuda():
        q, k, v = (t.to(FAKE_CUDA) for t in _qkv(torch.float16, 12))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0]
        assert out.shape == q.shape  # the meta kernel's answer
        with pytest.raises(ValueError, match='head dim 12 is not a multiple of 8'):
            fused_attention(q, k, v, None, 0.25)
