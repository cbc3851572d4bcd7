"""FLOPs through fvcore as timm's benchmark.py calls it: ``FlopCountAnalysis(model, input)`` on the eval-mode model,
grad enabled, fvcore's own handles only.

Under torch.jit.trace the layers take their plain path (`lsvision.layers.export.training_paths_enabled`: no custom
autograd Function, which fvcore would see as an opaque ``prim::PythonOp``) and write attention out as torch.matmul
(`lsvision.layers.scaled_dot_product_attention`: fvcore has no SDPA handle). Before, fvcore counted cvt_ls_13 at
4.654 GFLOPs (4.825 under no_grad) against the tool's 4.953.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import TINY_FAMILIES, tiny_model

import timm

from lsvision.flops import FLOP_HANDLES, count_flops
from lsvision.layers import scaled_dot_product_attention

with warnings.catch_warnings():  # fvcore scripts helpers at import time
    warnings.simplefilter('ignore')
    from fvcore.nn import FlopCountAnalysis

IMAGE_SIZE = {'vil_ls_medium': 32}  # the smallest map its windows take; 64 elsewhere


def _fvcore_as_timm(model: torch.nn.Module, size: int) -> FlopCountAnalysis:
    """timm's benchmark.py `profile_fvcore`: eval mode, grad enabled, a ones input, fvcore's default handles."""
    analysis = FlopCountAnalysis(model.eval(), torch.ones(1, 3, size, size))
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def test_cvt_ls_13_fvcore_with_grad_gives_the_tools_count():
    model = timm.create_model('cvt_ls_13')
    assert torch.is_grad_enabled()
    analysis = _fvcore_as_timm(model, 224)
    total = analysis.total()
    assert total / 1e9 == pytest.approx(4.953, rel=0.01)  # spec long_short.md §3.4
    assert total == count_flops(model, warn_unsupported=False).total
    assert not [op for op in analysis.unsupported_ops() if 'PythonOp' in op or 'scaled_dot_product' in op]


# families whose attention is lsvision's own code; the others run timm's Attention / WindowAttention (pvt_v2, Swin,
# ViT), whose SDPA fvcore does not count, as for timm's own models (lsvision.flops' handle counts it)
OWN_ATTENTION = ('cvt_13', 'cvt_ls_13', 'vil_ls_medium', 'pvt_tiny_grc')


@pytest.mark.parametrize('name', sorted(TINY_FAMILIES))
def test_fvcore_counts_the_same_with_and_without_grad(name):
    """Every family: grad on or off, fvcore sees no opaque PythonOp and counts the same; with lsvision's handles it
    gives the tool's count; where the attention is lsvision's own, fvcore's own handles already do."""
    model = tiny_model(name)
    size = IMAGE_SIZE.get(name, 64)
    with_grad = _fvcore_as_timm(model, size)
    total = with_grad.total()
    with torch.no_grad():
        assert _fvcore_as_timm(model, size).total() == total
    assert not [op for op in with_grad.unsupported_ops() if 'PythonOp' in op]
    tool = count_flops(model, input_size=(3, size, size), warn_unsupported=False).total
    assert _fvcore_as_timm(model, size).set_op_handle(**FLOP_HANDLES).total() == tool
    if name in OWN_ATTENTION:
        assert 'aten::scaled_dot_product_attention' not in with_grad.unsupported_ops()
        assert total == tool


@pytest.mark.parametrize('mask_kind', ['none', 'additive', 'bool', 'causal'])
def test_traced_attention_equals_sdpa(mask_kind):
    """The matmul form taken under torch.jit.trace computes what F.scaled_dot_product_attention computes (fp64)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = {'none': None, 'causal': None,
            'additive': torch.randn(1, 3, 5, 5, generator=g, dtype=torch.float64),
            'bool': torch.rand(2, 1, 5, 5, generator=g) > 0.3}[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # no row without a key
    causal = mask_kind == 'causal'

    def attend(q, k, v):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)

    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # the tracer's warnings on Python values
        traced = torch.jit.trace(attend, (q, k, v))
    assert 'scaled_dot_product_attention' not in str(traced.graph)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)
    torch.testing.assert_close(traced(q, k, v), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attend(q, k, v), expected, rtol=0, atol=0)  # eager: SDPA itself


def test_traced_model_keeps_gradients():
    """A model traced with grad (its plain path) gives the outputs and parameter gradients of the eager model, whose
    training path runs the custom autograd Functions."""
    model = tiny_model('cvt_ls_13').double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        traced = torch.jit.trace(model, (x,), check_trace=False)
    assert 'PythonOp' not in str(traced.inlined_graph)
    eager_out = model(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), list(model.parameters()))
    traced_out = traced(x)
    traced_grads = torch.autograd.grad(traced_out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(traced_out, eager_out, rtol=1e-10, atol=1e-10)
    for a, b in zip(traced_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
