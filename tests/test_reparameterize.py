"""Outputs are a pure function of parameters, buffers and input; inference folding is explicit
(`timm.models.reparameterize_model`): same outputs, scriptable, no more FLOPs, and a folded model refuses to train."""
import copy
import json

import pytest
import torch
import torch.nn.functional as F
from _helpers import TINY_CONFIGS, TINY_TWO_STAGE_FAMILIES, load_tool, model_kwargs_args, tiny_model

import timm
from timm.models import reparameterize_model
from timm.utils import ModelEmaV3

import lsvision  # noqa: F401  (registers the models)
from lsvision.flops import count_flops
from lsvision.layers import GatedRecurrentCache, GrcMemoryAttention, LongShortAttention2d
from lsvision.models.cvt import ConvDynamicProjection, FusedConvProjections, SepConvQkv

SWIN_T = 'swin_tiny_patch4_window7_224_grc'
# a tiny config of every vision model family and of the plain and variant models (name -> kwargs); inputs are 64 x 64
TINY = TINY_CONFIGS
# the models whose layers used to keep eval caches (issue 17): CvT-LS, ViL-LS and every GRC family
STATEFUL_BEFORE = [n for n in TINY if n not in ('cvt_13', 'pvt_tiny')]
# families with nothing to fold (ViL-LS: linear projections, no BatchNorm; CvT and PVT: timm/plain layers)
NOTHING_TO_FOLD = ('cvt_13', 'vil_ls_medium', 'pvt_tiny')


def _randomize_state(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial BatchNorm statistics, GRC caches and mixing weights, so that every folded term matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) * 1.5 + 0.5)
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
            elif isinstance(m, GatedRecurrentCache):
                m.cache.copy_(torch.randn(m.cache.shape, generator=gen))
                m.lam.fill_(2.)  # weight the memory branch
            elif isinstance(m, GrcMemoryAttention) and m.relative_position_bias_table is not None:
                m.relative_position_bias_table.copy_(torch.randn(m.relative_position_bias_table.shape, generator=gen))


def _tiny(name: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    model = tiny_model(name, seed, **{'num_classes': 10, **kwargs}).eval()
    _randomize_state(model, seed)
    return model


def _input(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def _eval_out(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _data_writes(name, model, ema, x):
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.data.mul_(1.5).add_(0.05 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith(('running_var', 'cache')):
                b.data.mul_(2.)


def _load_state_dict(name, model, ema, x):
    model.load_state_dict(_tiny(name, seed=3).state_dict())


def _optimizer_step(name, model, ema, x):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(x).square().sum().backward()  # eval mode, autograd on: the GRC caches stay frozen
    opt.step()
    opt.zero_grad()


def _ema_update(name, model, ema, x):
    ema.update(_tiny(name, seed=4))  # model is ema.module


def _replace_data(name, model, ema, x):
    gen = torch.Generator().manual_seed(5)
    for p in model.parameters():
        p.data = p.data * 0.5 + 0.1 * torch.randn(p.shape, generator=gen)


CHANGES = {
    'data_writes': _data_writes,
    'load_state_dict': _load_state_dict,
    'optimizer_step': _optimizer_step,
    'ema_update': _ema_update,
    'param_data_assignment': _replace_data,
}


@pytest.mark.parametrize('change', list(CHANGES))
@pytest.mark.parametrize('name', STATEFUL_BEFORE)
def test_eval_outputs_follow_every_kind_of_weight_change(name, change):
    # issue 17: before, eval layers kept folded weights keyed on tensor versions, and `.data` writes (which bump no
    # version) left a model serving its old weights. Now each change shows at once, in no_grad and inference_mode.
    x = _input()
    if change == 'ema_update':
        ema = ModelEmaV3(_tiny(name), decay=0.5)
        model = ema.module
    else:
        ema, model = None, _tiny(name)
    with torch.inference_mode():
        before_inference = model(x)
    before = _eval_out(model, x)
    torch.testing.assert_close(before_inference, before, atol=0, rtol=0)
    CHANGES[change](name, model, ema, x)
    after = _eval_out(model, x)
    fresh = _eval_out(copy.deepcopy(model), x)
    torch.testing.assert_close(after, fresh, atol=1e-6, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), fresh, atol=1e-6, rtol=0)
    assert (after - before).abs().max() > 1e-4, 'the change did not change the outputs: the test would prove nothing'


@pytest.mark.parametrize('name', list(TINY))
def test_reparameterized_model_matches_and_scripts(name):
    """The folded model gives the eager outputs with no more FLOPs, leaves the original alone, and both the original
    and the folded model script (a scripting failure fails the test). Two stages a family (scripting's time grows
    with the modules it compiles); the PVT variants in PVT-GRC's two stages."""
    config = TINY_TWO_STAGE_FAMILIES.get(name, TINY_TWO_STAGE_FAMILIES['pvt_tiny_grc'])
    model = _tiny(name, **config)
    folded = reparameterize_model(model)
    size = config.get('img_size', 64)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    expected = _eval_out(model, x)
    torch.testing.assert_close(_eval_out(folded, x), expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(folded.forward_features(x), model.forward_features(x), atol=1e-5, rtol=0)
    reparameterized = [m for m in folded.modules() if getattr(m, 'reparameterized', False)]
    assert bool(reparameterized) == (name not in NOTHING_TO_FOLD)
    assert not any(getattr(m, 'reparameterized', False) for m in model.modules()), 'the original was changed'

    assert count_flops(folded, (3, size, size)).total <= count_flops(model, (3, size, size)).total

    # every family scripts, unfused and folded, with the eager outputs
    torch.testing.assert_close(_eval_out(torch.jit.script(model), x), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(_eval_out(torch.jit.script(folded), x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize('name', ['cvt_ls_13', SWIN_T])
def test_reparameterized_full_size_forward_matches(name):
    torch.manual_seed(0)
    model = timm.create_model(name).eval()
    _randomize_state(model, 0)
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    folded = reparameterize_model(model)
    with torch.no_grad():
        torch.testing.assert_close(folded.forward_features(x), model.forward_features(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(folded(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize('name', ['cvt_ls_13', 'pvt_v2_b0_grc', SWIN_T])
def test_reparameterized_model_refuses_to_train(name):
    model = _tiny(name)
    folded = reparameterize_model(model)
    with pytest.raises(RuntimeError, match='reparameterize_model'):
        folded.train()
    folded.eval()  # eval stays allowed
    model.train()  # the original trains on
    if name == SWIN_T:
        with pytest.raises(RuntimeError, match='reparameterize_model'):
            folded.set_input_size(img_size=96)  # resizes the cache, which the folded gate terms hold
    if name == 'pvt_v2_b0_grc':
        with pytest.raises(RuntimeError, match='reparameterize_model'):
            next(m for m in folded.modules() if isinstance(m, GatedRecurrentCache)).reset_cache()


def test_reparameterized_state_dict_holds_the_folded_tensors():
    model = _tiny('pvt_v2_b0_grc')
    folded = reparameterize_model(model)
    keys = folded.state_dict().keys()
    assert any(k.endswith('grc.gate_bias') for k in keys) and not any('linear_reset' in k for k in keys)
    # a folded copy loads a folded state dict; an unfolded one is refused (the folded terms are missing)
    again = reparameterize_model(_tiny('pvt_v2_b0_grc', seed=7))
    again.load_state_dict(folded.state_dict())
    torch.testing.assert_close(_eval_out(again, _input()), _eval_out(model, _input()), atol=1e-5, rtol=0)
    with pytest.raises(RuntimeError, match='gate_bias'):
        again.load_state_dict(model.state_dict())


def test_reparameterize_is_idempotent():
    model = _tiny('cvt_ls_13')
    folded = reparameterize_model(model)
    twice = reparameterize_model(folded)
    torch.testing.assert_close(_eval_out(twice, _input()), _eval_out(folded, _input()), atol=0, rtol=0)


def test_fused_conv_projections_one_conv_equals_four():
    # the reparameterized CvT-LS layer runs its four depthwise convs as one on small maps and one by one on large
    # ones (`max_fused_positions`): the same outputs
    torch.manual_seed(0)
    attn = LongShortAttention2d(
        16, num_heads=2, window_size=2, dp_rank=2, qkv_layer=SepConvQkv, dp_layer=ConvDynamicProjection).eval()
    _randomize_state(attn, 0)
    x = torch.randn(2, 1 + 5 * 6, 16)
    with torch.no_grad():
        plain = attn(x, (5, 6))
        attn.reparameterize()
        assert attn.qkv is None and isinstance(attn.fused_proj, FusedConvProjections)
        fused = attn(x, (5, 6))
        attn.fused_proj.max_fused_positions = 0
        separate = attn(x, (5, 6))
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=0)
    torch.testing.assert_close(separate, fused, atol=1e-6, rtol=0)


@pytest.mark.parametrize('threads', [1, 2])
def test_window_memory_attention_kernel_follows_the_device_only(threads):
    # on CPU, Swin's window memory attention always runs as batched matmuls (whatever the thread count: rounding
    # must not change with it); the result equals SDPA, the kernel on other devices
    torch.manual_seed(0)
    mem = GrcMemoryAttention(32, 2, cache_hw=(7, 7), window_size=(7, 7)).eval()
    x, cache = torch.randn(3, 49, 32), torch.randn(3, 49, 32)
    q, k, v = (torch.randn(3, 2, 49, 16) for _ in range(3))
    bias = mem._gather_rel_pos_bias(49, q.dtype)
    torch.set_num_threads(threads)  # conftest gives the next test its thread count back
    with torch.no_grad():
        out = mem.attend(q, k, v, bias)
        full = mem(x, cache)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=mem.scale),
                               atol=1e-6, rtol=1e-5)
    folded = copy.deepcopy(mem)
    folded.reparameterize()
    with torch.no_grad():
        torch.testing.assert_close(folded(x, cache), full, atol=1e-6, rtol=0)


def test_patch_reduction_as_matmul_equals_the_conv():
    # the reparameterized PVT memory branch runs its kernel = stride reduction as one matmul on patch-major tokens
    torch.manual_seed(0)
    mem = GrcMemoryAttention(16, 2, cache_hw=(8, 12), sr_ratio=4).eval()
    x, cache = torch.randn(2, 96, 16), torch.randn(2, 96, 16)
    with torch.no_grad():
        plain = mem(x, cache)
        mem.reparameterize()
        assert mem.sr is None and mem.sr_patch_weight is not None
        torch.testing.assert_close(mem(x, cache), plain, atol=1e-6, rtol=0)



def test_validate_tool_reparam_flag(tmp_path):
    # tools/validate.py (and robustness.py, same CLI code) --reparam evaluates the folded model: same metrics, and the
    # results say it was folded
    from eval_fixtures import make_imagenet
    from safetensors.torch import save_file

    validate = load_tool('validate')
    imagenet = make_imagenet(tmp_path / 'imagenet')
    model = _tiny('cvt_ls_13', num_classes=1000)
    ckpt = tmp_path / 'tiny.safetensors'
    save_file(model.state_dict(), str(ckpt))
    kwargs = model_kwargs_args(TINY['cvt_ls_13'])
    results = {}
    for flags in ([], ['--reparam']):  # --threads 1 holds for this test only (conftest restores the count)
        out = tmp_path / ('reparam' if flags else 'plain')
        assert validate.main(['--models', 'cvt_ls_13', '--checkpoint', str(ckpt), '--model-kwargs', *kwargs,
                              '--imagenet', str(imagenet['root']), '--workers', '0', '--threads', '1',
                              '--device', 'cpu', '--no-progress', '--out-dir', str(out), *flags]) == 0
        results[bool(flags)] = json.loads((out / 'results.json').read_text())
    plain, folded = results[False], results[True]
    assert folded['settings']['reparam'] and folded['models'][0]['reparam']
    assert not plain['settings']['reparam'] and 'reparam' not in plain['models'][0]
    for key in ('top1', 'top5', 'count'):
        assert folded['models'][0]['suites']['imagenet'][key] == plain['models'][0]['suites']['imagenet'][key]
