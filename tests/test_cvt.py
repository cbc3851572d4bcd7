"""CvT and CvT-LS: registration, exact sizes, FLOPs, training behaviour and input errors."""
import copy
from typing import Optional

import pytest
import torch
from _helpers import TINY_FAMILIES, perturb

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.flops import count_flops

# spec long_short.md §3.4/§3.5/§5: exact parameter counts (BN buffers excluded) and fvcore GFLOPs (1 MAC = 1 FLOP)
PARAMS = {
    'cvt_ls_13': 20_185_464,
    'cvt_ls_17': 23_555_544,
    'cvt_ls_21': 31_930_344,
    'cvt_ls_21s': 30_767_160,
    'cvt_ls_13_384': 20_185_464,
    'cvt_ls_21_384': 31_930_344,
    'cvt_ls_13_448': 20_300_552,
    'cvt_ls_17_448': 23_763_272,
    'cvt_ls_21_448': 32_119_400,
    'cvt_ls_21s_448': 31_011_848,
    'cvt_13': 19_997_480,
    'cvt_21': 31_622_696,
    'cvt_13_384': 19_997_480,
    'cvt_21_384': 31_622_696,
}
GFLOPS = {
    'cvt_ls_13': 4.953,
    'cvt_ls_17': 9.778,
    'cvt_ls_21': 7.888,
    'cvt_ls_21s': 11.212,
    'cvt_ls_21_384': 23.864,
    'cvt_13': 4.585,
    'cvt_21': 7.206,
}
TINY_LS = TINY_FAMILIES['cvt_ls_13']
TINY_CONV = TINY_FAMILIES['cvt_13']


def test_registered_names():
    names = set(timm.list_models(['cvt_*']))
    for size in ('13', '17', '21', '21s'):
        for res in ('', '_384', '_448'):
            assert f'cvt_ls_{size}{res}' in names
    assert {'cvt_13', 'cvt_21', 'cvt_13_384', 'cvt_21_384'} <= names


@pytest.mark.parametrize('name', ['cvt_13_384', 'cvt_21_384'])
def test_384_configs_match_microsoft_evaluation(name):
    cfg = timm.get_pretrained_cfg(name)
    assert cfg.input_size == (3, 384, 384) and cfg.crop_pct == 1.0
    with torch.device('meta'):
        big, base = timm.create_model(name), timm.create_model(name[:-len('_384')])
    assert {k: v.shape for k, v in big.state_dict().items()} == {k: v.shape for k, v in base.state_dict().items()}


@pytest.mark.parametrize('name', sorted(PARAMS))
def test_parameter_count(name):
    model = timm.create_model(name, device='meta')  # no init cost; the full models' forward is tested below
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]


@pytest.mark.parametrize('name', sorted(GFLOPS))
def test_flops_match_spec(name):
    # FLOPs depend on shapes only: an uninitialized model (no init cost)
    model = timm.create_model(name, device='meta').to_empty(device='cpu')
    size = model.pretrained_cfg['input_size']
    gflops = count_flops(model, size).total / 1e9
    assert gflops == pytest.approx(GFLOPS[name], rel=0.02)


def test_window_and_rank_follow_resolution():
    for name, ws, rs in (('cvt_ls_13', (8, 4, 2), (64, 16, 4)), ('cvt_ls_13_384', (12, 6, 3), (64, 16, 4)),
                         ('cvt_ls_13_448', (16, 8, 4), (128, 32, 8))):
        model = timm.create_model(name, device='meta')
        assert tuple(s.blocks[0].attn.window_size for s in model.stages) == ws
        assert tuple(s.blocks[0].attn.dp_rank for s in model.stages) == rs


@pytest.mark.parametrize('name,bf16', [('cvt_ls_13', True), ('cvt_13', False)])
def test_full_model_forward_at_native_size(name, bf16):
    """The full-size model at 224: stage shapes, finite logits; CvT-LS-13 also in pure bf16, which gives the fp32
    logits to 2e-2 of their scale (measured 1.2e-2)."""
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        final, feats = model.forward_intermediates(x)
        logits = model.forward_head(final)
    assert [tuple(f.shape) for f in feats] == [(1, 64, 56, 56), (1, 192, 28, 28), (1, 384, 14, 14)]
    assert logits.shape == (1, 1000) and torch.isfinite(logits).all()
    if bf16:
        _assert_bf16_close_to_fp32(model, x, logits)


@pytest.mark.parametrize('name,kwargs', [('cvt_ls_13', TINY_LS), ('cvt_13', TINY_CONV)])
def test_train_step_with_drop_path(name, kwargs):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.1, **kwargs).train()
    assert any(type(m).__name__ == 'DropPath' for m in model.modules())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 3, 64, 80), torch.tensor([0, 3, 4])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def _assert_bf16_close_to_fp32(model: torch.nn.Module, x: torch.Tensor, ref: Optional[torch.Tensor] = None) -> None:
    """Run `model` in fp32 (unless its fp32 logits `ref` are given), then as a pure bf16 copy: the bf16 logits lie
    within 2e-2 of the largest fp32 logit."""
    with torch.no_grad():
        ref = model(x) if ref is None else ref
        out = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize('name,kwargs', [('cvt_ls_13', TINY_LS), ('cvt_13', TINY_CONV)])
def test_pure_bf16_forward(name, kwargs):
    """A pure bf16 model (no autocast) gives the fp32 logits to 2e-2 of their scale (measured 1.1e-2 CvT-LS,
    6e-3 CvT)."""
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    _assert_bf16_close_to_fp32(model, torch.randn(2, 3, 96, 112))


@pytest.mark.parametrize('size', [(32, 32), (100, 76), (130, 200)])
def test_any_input_size(size):
    model = timm.create_model('cvt_ls_13', **TINY_LS).eval()
    with torch.no_grad():
        out = model.forward_intermediates(torch.randn(1, 3, *size), intermediates_only=True)[-1]
    expected = []
    for s in size:
        for k, st, p in ((7, 4, 2), (3, 2, 1), (3, 2, 1)):  # the conv embeddings
            s = (s + 2 * p - k) // st + 1
        expected.append(s)
    assert tuple(out.shape[-2:]) == tuple(expected)


@pytest.mark.parametrize('name,kwargs', [('cvt_ls_13', TINY_LS), ('cvt_13', TINY_CONV)])
def test_default_head_is_the_normed_cls_token(name, kwargs):
    """The papers' head by default; forward == forward_head(forward_features) for every pooling, also after
    reset_classifier; 'avg' averages the normed patch tokens (the stage-3 map)."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7, **kwargs).eval()
    assert model.global_pool == 'token'
    x = torch.randn(2, 3, 64, 80)
    with torch.no_grad():
        y, prefix = x, None
        for stage in model.stages:
            y, prefix = stage.forward_with_prefix(y)
        cls_logits = model.head(model.norm(prefix[:, 0]))
        avg_logits = model.head(model.norm(y.flatten(2).transpose(1, 2)).mean(1))
        feats = model.forward_features(x)
        assert feats.shape == (2, 1 + 4 * 5, 64)
        torch.testing.assert_close(model(x), cls_logits)
        torch.testing.assert_close(model.forward_head(feats), cls_logits)
        assert not torch.allclose(cls_logits, avg_logits, atol=1e-3)
        head = model.head
        model.reset_classifier(7, 'avg')
        model.head = head
        torch.testing.assert_close(model(x), avg_logits)
        torch.testing.assert_close(model.forward_head(feats), avg_logits)
        model.reset_classifier(0, '')
        torch.testing.assert_close(model(x), feats)
        model.reset_classifier(0, 'token')
        torch.testing.assert_close(model(x), feats[:, 0])
        final, _ = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats)
    avg_model = timm.create_model(name, num_classes=7, global_pool='avg', **kwargs)
    assert avg_model.global_pool == 'avg'
    with pytest.raises(AssertionError, match="pass global_pool='avg'"):
        timm.create_model(name, cls_token_stages=(False, False, False), **kwargs)
    model = timm.create_model(name, global_pool='avg', cls_token_stages=(False, False, False), **kwargs)
    with pytest.raises(AssertionError, match='needs a cls token'):
        model.reset_classifier(3, 'token')


def test_pruned_model_averages_the_tap():
    """Pruned before the cls-token stage, the features are that stage's tokens and the head resets to no pooling."""
    model = timm.create_model('cvt_ls_13', **TINY_LS).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        taps = model.forward_intermediates(x, intermediates_only=True)
        model.prune_intermediate_layers([1])
        feats = model.forward_features(x)
        torch.testing.assert_close(feats, taps[1].flatten(2).transpose(1, 2))
        assert model.global_pool == '' and model.num_prefix_tokens == 0
        model.reset_classifier(0, 'avg')
        torch.testing.assert_close(model(x), feats.mean(1))
        with pytest.raises(AssertionError, match='needs a cls token'):
            model.reset_classifier(0, 'token')


def test_grad_checkpointing_keeps_outputs_and_grads():
    torch.manual_seed(0)
    model = timm.create_model('cvt_ls_13', num_classes=3, **TINY_LS)
    x = torch.randn(2, 3, 64, 64)
    model(x).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_grad_checkpointing(True)
    model(x).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


def test_meta_device_and_factory_kwargs():
    model = timm.create_model('cvt_ls_13', device='meta')
    assert all(p.device.type == 'meta' for p in model.parameters())
    out = model(torch.empty(1, 3, 224, 224, device='meta'))
    assert out.shape == (1, 1000)
    model = timm.create_model('cvt_13', dtype=torch.float64, **TINY_CONV)
    assert all(p.dtype == torch.float64 for p in model.parameters())


def test_model_built_under_inference_mode_runs():
    """A model built and run under inference_mode (inference tensors as parameters) gives a normal one's outputs."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 48)
    with torch.inference_mode():
        model = timm.create_model('cvt_ls_13', embed_dims=(32, 64, 64), num_heads=(1, 2, 2), depths=(1, 1, 1)).eval()
        out = model(x)
    plain = timm.create_model('cvt_ls_13', embed_dims=(32, 64, 64), num_heads=(1, 2, 2), depths=(1, 1, 1)).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(out, plain(x).detach(), rtol=1e-5, atol=1e-5)  # grad enabled: the module path


@pytest.mark.parametrize('batch,num_prefix', [(1, 0), (2, 0), (1, 1), (2, 1)])
def test_sep_conv_training_keeps_only_its_input_and_matches_autograd(batch, num_prefix):
    """CvT-LS's q/k/v convs recompute conv and BatchNorm in backward: same gradients and running statistics as
    autograd through the modules, and nothing map-sized saved but the input, as given: with a prefix token, a view of
    the tokens (no copy of the patch map kept). Batch 1 too: there ATen's BatchNorm backward returns wrong gradients
    for an NCHW input with a channels-last gradient (torch 2.14)."""
    from lsvision.models.cvt import SepConv2d, _map_view
    torch.manual_seed(0)
    conv = SepConv2d(8).double().train()
    perturb(conv, 0.3)
    plain = copy.deepcopy(conv)
    # the layout the layer passes: a channels-last view of the patch tokens (after the prefix tokens)
    tokens = torch.randn(batch, num_prefix + 12 * 13, 8, dtype=torch.float64)
    weight = torch.randn(batch, 12 * 13, 8, dtype=torch.float64)
    saved = []
    ta = tokens.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = conv(_map_view(ta[:, num_prefix:], (12, 13)))
    (out * weight).sum().backward()
    map_sized = [t for t in saved if t.numel() >= batch * 12 * 13 * 8]
    assert map_sized and all(t.untyped_storage().data_ptr() == ta.untyped_storage().data_ptr() for t in map_sized)
    tb = tokens.clone().requires_grad_()
    xb = tb[:, num_prefix:].transpose(1, 2).reshape(batch, 8, 12, 13)
    out = plain.bn(plain.dw(xb)).flatten(2).transpose(1, 2)
    (torch.nn.functional.linear(out, plain.pw.weight.flatten(1), plain.pw.bias) * weight).sum().backward()
    torch.testing.assert_close(ta.grad, tb.grad)
    for (name, a), b in zip(conv.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, name=name: f'{name}: {m}')
    for a, b in zip(conv.bn.buffers(), plain.bn.buffers()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize('batch,num_prefix', [(1, 0), (2, 0), (2, 1)])
def test_projection_conv_training_keeps_only_its_input_and_matches_autograd(batch, num_prefix):
    """CvT-LS's projection-logit conv (weight-standardized depthwise conv, pointwise conv) recomputes the depthwise
    output in backward: same gradients as autograd through StdConv2d, and nothing map-sized saved but the input (with
    a prefix token, a view of the tokens, as the layer passes them)."""
    from lsvision.models.cvt import ConvDynamicProjection
    torch.manual_seed(0)
    proj = ConvDynamicProjection(8, 6).double().train()
    perturb(proj, 0.3)
    H, W = 12, 13
    tokens = torch.randn(batch, num_prefix + H * W, 8, dtype=torch.float64)
    weight = torch.randn(batch, H * W, 6, dtype=torch.float64)
    saved = []
    xa = tokens.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = proj(xa[:, num_prefix:], (H, W))
    (out * weight).sum().backward()
    map_sized = [t for t in saved if t.numel() >= batch * H * W * 8]  # the weights are smaller
    assert map_sized and all(t.untyped_storage().data_ptr() == xa.untyped_storage().data_ptr() for t in map_sized)
    grads = [xa.grad] + [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad(set_to_none=True)
    xb = tokens.clone().requires_grad_()
    feat_map = xb[:, num_prefix:].transpose(1, 2).reshape(batch, 8, H, W)
    plain = torch.nn.functional.linear(proj.dw(feat_map).flatten(2).transpose(1, 2), proj.pw.weight.flatten(1),
                                       proj.pw.bias)  # StdConv2d's own forward under autograd
    (plain * weight).sum().backward()
    for a, b in zip(grads, [xb.grad] + [p.grad for p in proj.parameters()]):
        torch.testing.assert_close(a, b)
