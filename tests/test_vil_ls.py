"""ViL-LS: official-checkpoint equivalence (golden data), converter, key coverage, sizes, FLOPs and behaviour."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _helpers import TINY_FAMILIES, load_tool

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.flops import count_flops
from lsvision.models.vil_ls import (
    RelPosAttention,
    checkpoint_filter_fn,
    full_rel_pos_index,
    official_key_to_lsvision,
    parse_official_arch,
    resize_rel_pos_table,
)

# spec long_short.md §2/§5: exact official parameter counts, and official fvcore GFLOPs at the native size
PARAMS = {'vil_ls_medium': 39_799_423, 'vil_ls_base': 55_834_363, 'vil_ls_medium_384': 39_947_653}
GFLOPS = {'vil_ls_medium': (224, 8.722), 'vil_ls_base': (224, 13.395), 'vil_ls_medium_384': (384, 28.743)}
# the golden tiny224 layout (8/16/32/64 wide, head dim 8), for behaviour tests
TINY = TINY_FAMILIES['vil_ls_medium']
ATOL = 1e-4  # the golden README's acceptance bound


def _golden(golden_dir: Path, name: str):
    io = torch.load(golden_dir / f'{name}_io.pt', weights_only=True)
    kwargs = dict(parse_official_arch(io['arch']), img_size=io['img_size'], num_classes=10)
    return io, kwargs


def _assert_reproduces(model: nn.Module, io: dict) -> None:
    model.eval()
    with torch.no_grad():
        logits = model(io['input'])
        taps = model.forward_intermediates(io['input'], intermediates_only=True)
        x, prefixes = io['input'], []
        for stage in model.stages:
            x, prefix = stage.forward_with_prefix(x)
            prefixes.append(prefix)
    torch.testing.assert_close(logits, io['logits'], rtol=0, atol=ATOL)
    for i, expected in enumerate(io['features']):
        torch.testing.assert_close(taps[i], expected, rtol=0, atol=ATOL, msg=f'stage {i + 1} features')
    for i, expected in enumerate(io['cls_tokens']):
        torch.testing.assert_close(prefixes[i], expected, rtol=0, atol=ATOL, msg=f'stage {i + 1} cls tokens')
    assert prefixes[3].shape[1] == 0


@pytest.mark.parametrize('name', ['tiny224', 'tiny384'])
def test_official_checkpoint_through_timm_reproduces_official_outputs(golden_dir, name):
    io, kwargs = _golden(golden_dir, name)
    overlay = dict(file=str(golden_dir / f'{name}.pth'), num_classes=10)
    model = timm.create_model('vil_ls_medium', pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    _assert_reproduces(model, io)


def test_converter_writes_safetensors_that_reproduce_official_outputs(golden_dir, tmp_path, capsys):
    tool = load_tool('convert_vil_ls')
    io, kwargs = _golden(golden_dir, 'tiny384')
    out = tmp_path / 'tiny384.safetensors'
    assert tool.main([str(golden_dir / 'tiny384.pth'), str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'dropped 4 relative_position_index buffers' in printed and 'optimizer' in printed
    overlay = dict(file=str(out), num_classes=10)
    model = timm.create_model('vil_ls_medium', pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    _assert_reproduces(model, io)


def test_converter_explains_a_mismatched_checkpoint(golden_dir, tmp_path, capsys):
    tool = load_tool('convert_vil_ls')
    assert tool.main([str(golden_dir / 'tiny224.pth'), str(tmp_path / 'x.safetensors'), '--model', 'vil_ls_base']) == 2
    err = capsys.readouterr().err
    assert 'missing' in err and 'mis-shaped' in err and 'What to do: leave --model out' in err
    assert tool.main([str(golden_dir / 'tiny224_io.pt'), str(tmp_path / 'x.safetensors')]) == 2
    assert 'not an official MsViT state_dict' in capsys.readouterr().err

    # a full-size 224 checkpoint (shapes only) in the w=8 384 model: window tables are carried over, others resized
    shapes = json.loads((golden_dir / 'full_key_shapes.json').read_text())['vil_ls_medium_224']
    net = {'module.' + k: torch.empty(s, device='meta') for k, s in shapes.items()}
    converted = tool.convert({'net': net}, 'vil_ls_medium_384')[0]
    assert converted['stages.0.blocks.0.attn.rel_pos_table'].shape == (375, 3)
    assert converted['stages.2.blocks.0.attn.rel_pos_table'].shape == (47 * 47, 6)
    del net['module.layer3.5.attn.qkv.weight']
    net['module.layer3.5.attn.foo'] = torch.empty(3, device='meta')
    with pytest.raises(tool.ConversionError) as e:
        tool.convert({'net': net})
    assert 'stages.2.blocks.2.attn.qkv.weight' in str(e.value) and 'layer3.5.attn.foo' in str(e.value)


def _printed_snippet(printed: str) -> str:
    """The Python lines the converter prints after 'load it with:'."""
    lines = printed.splitlines()
    start = lines.index('load it with:') + 1
    return '\n'.join(lines[start:start + 2])


def test_converter_load_line_keeps_a_10_class_head(golden_dir, tmp_path, capsys):
    """The printed line carries num_classes in pretrained_cfg_overlay: timm loads the head strictly, no warning."""
    tool = load_tool('convert_vil_ls')
    io, _ = _golden(golden_dir, 'tiny224')
    out = tmp_path / 'tiny224.safetensors'
    assert tool.main([str(golden_dir / 'tiny224.pth'), str(out)]) == 0
    snippet = _printed_snippet(capsys.readouterr().out)
    assert snippet.startswith('import timm, lsvision')
    call = snippet.splitlines()[1][len('model = '):]
    assert f'pretrained_cfg_overlay=dict(file={str(out)!r}, num_classes=10)' in call and 'num_classes=10' in call
    model = eval(call, {'timm': timm})  # the line as printed
    assert model.pretrained_cfg['num_classes'] == 10
    _assert_reproduces(model, io)


def test_converter_snippet_runs_in_a_fresh_interpreter(golden_dir, tmp_path, capsys):
    """The printed snippet, pasted into a new Python (nothing imported before it), loads the converted file: the
    official logits. The file is named relative to the folder the tool ran in, as a user types it."""
    tool = load_tool('convert_vil_ls')
    (tmp_path / 'out').mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert tool.main([str(golden_dir / 'tiny224.pth'), 'out/tiny224.safetensors']) == 0
    snippet = _printed_snippet(capsys.readouterr().out)
    check = (f'\nimport torch\nio = torch.load({str(golden_dir / "tiny224_io.pt")!r}, weights_only=True)\n'
             'with torch.no_grad():\n'
             "    torch.testing.assert_close(model.eval()(io['input']), io['logits'], rtol=0, atol=1e-4)\n"
             "print('reproduced')\n")
    proc = subprocess.run([sys.executable, '-c', snippet + check], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f'the printed snippet failed:\n{snippet}\n{proc.stderr[-3000:]}'
    assert proc.stdout.strip().endswith('reproduced')


def test_converter_refuses_a_head_it_cannot_load(golden_dir):
    tool = load_tool('convert_vil_ls')
    checkpoint = torch.load(golden_dir / 'tiny224.pth', weights_only=True)
    del checkpoint['net']['module.head.bias']
    with pytest.raises(tool.ConversionError, match='classifier head cannot be loaded strictly') as e:
        tool.convert(checkpoint)
    assert 'head.bias' in str(e.value)


def test_last_stage_cls_token_is_refused_by_name(golden_dir):
    """The official head classifies a last-stage cls token; lsvision averages the map: refused, never loaded."""
    tool = load_tool('convert_vil_ls')
    checkpoint = torch.load(golden_dir / 'tiny224.pth', weights_only=True)
    checkpoint['net']['module.layer4.0.cls_token'] = torch.zeros(1, 1, 64)
    with pytest.raises(tool.ConversionError, match="'layer4.0.cls_token'"):
        tool.convert(checkpoint)
    _, kwargs = _golden(golden_dir, 'tiny224')
    model = timm.create_model('vil_ls_medium', **dict(kwargs, num_cls_tokens=(1, 1, 1, 1)))
    with pytest.raises(ValueError, match="'layer4.0.cls_token'.*classifies the normed cls token"):
        checkpoint_filter_fn(checkpoint, model)


def test_filter_names_keys_it_cannot_place(golden_dir):
    _, kwargs = _golden(golden_dir, 'tiny224')
    model = timm.create_model('vil_ls_medium', **kwargs)
    checkpoint = torch.load(golden_dir / 'tiny224.pth', weights_only=True)
    del checkpoint['net']['module.layer2.4.mlp.fc1.bias']
    with pytest.raises(KeyError, match=r'missing.*stages\.1\.blocks\.1\.mlp\.fc1\.bias'):
        checkpoint_filter_fn(checkpoint, model)
    lsvision_layout = dict(model.state_dict(), extra=torch.zeros(1))
    with pytest.raises(KeyError, match='unexpected.*extra'):
        checkpoint_filter_fn(lsvision_layout, model)


@pytest.mark.parametrize('official,name', [('vil_ls_medium_224', 'vil_ls_medium'), ('vil_ls_base_224', 'vil_ls_base')])
def test_full_size_key_coverage(golden_dir, official, name):
    shapes = json.loads((golden_dir / 'full_key_shapes.json').read_text())[official]
    model = timm.create_model(name, device='meta')
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    dropped = [k for k in shapes if official_key_to_lsvision(k) is None]
    assert all(k.endswith('.attn.relative_position_index') for k in dropped)
    assert len(dropped) == sum(len(s.blocks) for s in model.stages)  # one buffer per attention layer
    mapped = [official_key_to_lsvision(k) for k in shapes if k not in dropped]
    assert len(set(mapped)) == len(mapped)  # one to one

    checkpoint = {
        'net': {'module.' + k: torch.empty(s, device='meta') for k, s in shapes.items()},
        'arch': 'msvit', 'epoch': 300, 'best_acc': 83.8, 'optimizer': {'state': {}}, 'scheduler': None,
    }
    converted = checkpoint_filter_fn(checkpoint, model)
    assert {k: tuple(v.shape) for k, v in converted.items()} == expected

    with pytest.raises(ValueError, match='not ViL-LS'):
        checkpoint_filter_fn({'net': {**checkpoint['net'], 'module.layer1.0.pos_embed': torch.zeros(1)}}, model)


def test_layernorm_eps_match_official():
    model = timm.create_model('vil_ls_medium', device='meta')
    dual = 0
    for n, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            is_dual = n.endswith(('attn.norm_local', 'attn.norm_global'))
            dual += is_dual
            assert m.eps == (1e-5 if is_dual else 1e-6), n
    assert dual == 2 * (1 + 4)  # one DualLN pair per long-short layer (stages 1-2)


@pytest.mark.parametrize('name', sorted(PARAMS))
def test_parameter_count_and_flops(name):
    # FLOPs depend on shapes only: skip the (slow) weight init with an uninitialized model
    model = timm.create_model(name, device='meta').to_empty(device='cpu')
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    size, gflops = GFLOPS[name]
    assert count_flops(model, (3, size, size)).total / 1e9 == pytest.approx(gflops, rel=0.01)


def test_full_model_forward():
    model = timm.create_model('vil_ls_medium', device='meta').to_empty(device='cpu').eval()
    for p in model.parameters():  # a quick stand-in for the (slow) trunc-normal init
        nn.init.normal_(p, std=.02)
    with torch.no_grad():
        final, taps = model.forward_intermediates(torch.randn(1, 3, 224, 224))
        logits = model.forward_head(final)
    assert [tuple(t.shape) for t in taps] == [(1, 96, 56, 56), (1, 192, 28, 28), (1, 384, 14, 14), (1, 768, 7, 7)]
    assert final.shape == (1, 768, 7, 7) and logits.shape == (1, 1000) and torch.isfinite(logits).all()
    assert model.feature_info[-1]['reduction'] == 32


def test_variants_follow_resolution():
    for name, w, tables in (('vil_ls_medium', 7, (729, 169)), ('vil_ls_medium_384', 8, (2209, 529))):
        model = timm.create_model(name, device='meta')
        assert [s.blocks[0].attn.window_size for s in model.stages[:2]] == [w, w]
        assert tuple(s.blocks[0].attn.rel_pos_table.shape[0] for s in model.stages[2:]) == tables
        assert model.pretrained_cfg['pool_size'] == (model.img_size[0] // 32,) * 2


@pytest.mark.parametrize('feat_size,g', [((1, 1), 1), ((3, 7), 1), ((6, 6), 0), ((5, 2), 2)])
def test_full_attention_matches_explicit_official_form(feat_size, g):
    """The window-view bias equals table[relative_position_index] (+ g2g/g2l), and forward the explicit softmax."""
    torch.manual_seed(0)
    attn = RelPosAttention(16, 2, feat_size=feat_size, num_prefix_tokens=g).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_()
    n = feat_size[0] * feat_size[1]
    bias = attn.rel_pos_bias(feat_size)
    expected = attn.rel_pos_table[full_rel_pos_index(feat_size, torch.device('cpu')).reshape(-1)]
    assert torch.equal(bias[:, g:, g:], expected.reshape(n, n, 2).permute(2, 0, 1))
    if g:
        assert torch.equal(bias[:, :g, :g], attn.rel_pos_g2g)
        assert torch.equal(bias[:, :g, g:], attn.rel_pos_g2l[0, :, :, None].expand(-1, -1, n))
        assert torch.equal(bias[:, g:, :g], attn.rel_pos_g2l[1, :, None, :].expand(-1, n, -1))
    x = torch.randn(2, g + n, 16)
    with torch.no_grad():
        q, k, v = attn.qkv(x).reshape(2, g + n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + bias
        expected = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, g + n, 16))
        torch.testing.assert_close(attn(x, feat_size), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('size', [(32, 32), (100, 76), (130, 200), (97, 225)])
def test_any_input_size(size):
    model = timm.create_model('vil_ls_medium', **TINY).eval()
    with torch.no_grad():
        feats = model.forward_intermediates(torch.randn(1, 3, *size), intermediates_only=True)
    for f, r in zip(feats, (4, 8, 16, 32)):
        assert tuple(f.shape[-2:]) == (size[0] // r, size[1] // r)


def test_rel_pos_tables_exact_at_native_size_interpolated_elsewhere(golden_dir):
    attn = RelPosAttention(16, 2, feat_size=(14, 14))
    assert resize_rel_pos_table(attn.rel_pos_table, (14, 14), (14, 14)) is attn.rel_pos_table
    assert attn.rel_pos_bias((5, 9)).shape == (2, 1 + 45, 1 + 45)

    # a 224 checkpoint run at 384: interpolating at run time, in set_input_size and in checkpoint_filter_fn agree
    io, kwargs = _golden(golden_dir, 'tiny224')
    checkpoint = torch.load(golden_dir / 'tiny224.pth', weights_only=True)
    x = torch.randn(1, 3, 384, 320)
    native = timm.create_model('vil_ls_medium', **kwargs).eval()
    native.load_state_dict(checkpoint_filter_fn(checkpoint, native))
    with torch.no_grad():
        expected = native(x)
        native.set_input_size(img_size=(384, 320))
        resized = native(x)
    at384 = timm.create_model('vil_ls_medium', **dict(kwargs, img_size=(384, 320))).eval()
    at384.load_state_dict(checkpoint_filter_fn(checkpoint, at384))
    assert at384.stages[2].blocks[0].attn.rel_pos_table.shape == (47 * 39, 4)
    with torch.no_grad():
        loaded = at384(x)
    torch.testing.assert_close(resized, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(loaded, expected, rtol=0, atol=1e-5)

    # set_input_size keeps frozen tables frozen; w=8 windows take the w=7 tables offset by offset
    native.requires_grad_(False)
    native.set_input_size(img_size=224)
    assert not any(p.requires_grad for p in native.parameters())
    w8 = timm.create_model('vil_ls_medium', **dict(kwargs, window_sizes=(8,) * 4))
    w8.load_state_dict(checkpoint_filter_fn(checkpoint, w8))
    assert w8.stages[0].blocks[0].attn.rel_pos_table.shape[0] == 375


def test_train_step_with_drop_path():
    torch.manual_seed(0)
    model = timm.create_model('vil_ls_medium', num_classes=5, drop_path_rate=0.1, **TINY).train()
    rates = [(b.drop_path1, b.drop_path2) for s in model.stages for b in s.blocks]
    assert isinstance(rates[0][0], nn.Identity)  # linspace from 0 over all 6 layers
    assert [round(d1.drop_prob, 6) for d1, _ in rates[1:]] == [0.02, 0.04, 0.06, 0.08, 0.1]
    assert all(d1.drop_prob == d2.drop_prob for d1, d2 in rates[1:])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(3, 3, 80, 112), torch.tensor([0, 3, 4])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.grad.any()}
    assert len(before) > 0.95 * len(list(model.parameters()))  # e.g. the last stage-3 g2g bias only moves cls
    opt.step()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_pure_bf16_forward():
    """A pure bf16 model (no autocast) gives the fp32 logits to 2e-2 of their scale (measured 8.5e-3)."""
    torch.manual_seed(0)
    model = timm.create_model('vil_ls_medium', **TINY).eval()
    x = torch.randn(2, 3, 96, 144)
    with torch.no_grad():
        ref = model(x)
        out = model.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


def test_full_attention_everywhere_switch():
    model = timm.create_model('vil_ls_medium', attn_types=('full',) * 4, **TINY).eval()
    attns = [b.attn for s in model.stages for b in s.blocks]
    assert all(isinstance(a, RelPosAttention) for a in attns)
    assert attns[0].rel_pos_table.shape == (111 * 111, 1) and attns[0].rel_pos_g2g is not None
    with torch.no_grad():
        assert model(torch.randn(1, 3, 96, 64)).shape == (1, 1000)


def test_parse_official_arch():
    arch = 'l1,h2,d16,n1,s1,g1,p4,f7,a0,r8_l2,h2,d16,n1,s0,g1,p2,f7,a0,r4_l3,h2,d16,n1,s1,g0,p2,f7,a0,r8'
    kwargs = parse_official_arch(arch)
    assert kwargs['attn_types'] == ('long_short', 'full', 'full')  # s0 is sticky, as in the official code
    assert kwargs['num_cls_tokens'] == (1, 1, 0) and kwargs['dp_ranks'] == (8, 4, 8)
    with pytest.raises(ValueError, match='absolute position'):
        parse_official_arch(arch.replace('a0', 'a1', 1))
