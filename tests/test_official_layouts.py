"""The authors' layouts of tests/official_layouts.py against the authors' own key lists and checkpoints.

Each layout is written from the lsvision model of the golden data's configuration and compared with what the
authors' code saved: the exact key set, shapes and dtypes (`char_lm_official/keys.json`, `vil_ls_official/*.pth`
and `full_key_shapes.json`, `cvt_official/tiny_cvt.pth`, `char_lm_official_outputs/checkpoint_best*.pt`). Where the
golden folder holds a checkpoint, the authors' file loaded through lsvision's converter and written back through the
layout must give the file again, bit for bit: a converter that swaps two tensors of the same shape (q <-> k,
r_w_bias <-> r_r_bias, the two DualLN norms) fails here, because the layout's tables are the test's own.
PVT v1 has no golden data: its layout is checked against the key list whai362/PVT `classification/pvt.py` builds,
restated below.
"""
import json
from typing import Dict, Sequence, Tuple

import pytest
import torch
from conftest import golden_path
from official_layouts import fairseq, microsoft_cvt, official_char_lm, official_pvt, official_vil

import timm

import lsvision.sequence as seq
from lsvision.models import cvt
from lsvision.sequence.convert import load_official_checkpoint

Layout = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]


def _layout(state: Dict[str, torch.Tensor]) -> Layout:
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def _assert_same_layout(ours: Layout, theirs: Layout) -> None:
    only_ours, only_theirs = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    assert (only_ours, only_theirs) == ([], []), "key sets differ: (in the layout only, in the authors' only)"
    wrong = {k: (ours[k], theirs[k]) for k in theirs if ours[k] != theirs[k]}
    assert not wrong, f"shape or dtype differs (ours, authors'): {wrong}"


def _assert_same_values(ours: Dict[str, torch.Tensor], theirs: Dict[str, torch.Tensor], skip: str = '\0') -> None:
    assert ours.keys() == theirs.keys()
    differ = [k for k in theirs if not k.endswith(skip) and not torch.equal(ours[k], theirs[k])]
    assert not differ, f"the layout written back differs from the authors' file at {differ}"


# ---- char-LM: NVIDIA/transformer-ls autoregressive/ TransformerLSModel ----

CHAR_LM_PRESETS = {'enwik8_small': 'ls_lm_enwik8_small', 'enwik8_large': 'ls_lm_enwik8_large',
                   'text8_small': 'ls_lm_text8_small'}
# golden/char_lm_official_outputs/meta.json `ctor`, in lsvision's argument names
GOLDEN_CHAR_LM = dict(vocab_size=260, dim=48, mlp_hidden=128, num_heads=4, depth=2, mem_len=32, dp_rank=3,
                      segment_size=16, window_size=16, drop=0.0)


@pytest.mark.parametrize('preset', sorted(CHAR_LM_PRESETS))
def test_char_lm_layout_has_the_authors_keys_and_shapes(preset):
    keys = json.loads((golden_path('char_lm_official') / 'keys.json').read_text())[preset]
    with torch.device('meta'):
        model = seq.create_model(CHAR_LM_PRESETS[preset])
    ours = {k: list(v.shape) for k, v in official_char_lm(model).items()}
    assert ours == keys['state_dict']


def test_char_lm_meta_json_is_the_config_written_here():
    ctor = json.loads((golden_path('char_lm_official_outputs') / 'meta.json').read_text())['ctor']
    names = dict(vocab_size='vocab_size', dim='d_model', mlp_hidden='d_inner', num_heads='n_head', depth='n_layer',
                 mem_len='mem_len', dp_rank='chunk_rank', segment_size='chunk_size', window_size='window_len',
                 drop='dropout')
    assert {ours: ctor[theirs] for ours, theirs in names.items()} == GOLDEN_CHAR_LM


@pytest.mark.parametrize('file', ['checkpoint_best.pt', 'checkpoint_best_fp16.pt'])
def test_char_lm_layout_writes_back_the_authors_checkpoint(file):
    """fairseq's checkpoint -> load_official_checkpoint -> official_char_lm: the file's tensors again, bit for bit
    (the fp16 file loads into fp32 and is compared after .half(), as fairseq --fp16 saved it)."""
    path = golden_path('char_lm_official_outputs') / file
    theirs = torch.load(path, weights_only=True)['model']
    model = seq.CharLM(**GOLDEN_CHAR_LM)
    load_official_checkpoint(model, str(path))
    dtype = next(iter(theirs.values())).dtype
    ours = {k: v.to(dtype) for k, v in fairseq(official_char_lm(model))['model'].items()}
    _assert_same_layout(_layout(ours), _layout(theirs))
    _assert_same_values(ours, theirs)


# ---- ViL-LS: NVIDIA/transformer-ls imagenet/ MsViT ----

# golden/vil_ls_official/README.md: the arch strings of the two tiny models, in lsvision's arguments
VIL_TINY = {
    'tiny224': dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 2, 2, 1), num_classes=10),
    'tiny384': dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 1, 1, 1), num_classes=10,
                    img_size=384, window_sizes=(8,) * 4),
}


@pytest.mark.parametrize('name', sorted(VIL_TINY))
def test_vil_layout_has_the_authors_keys_shapes_and_dtypes(name):
    theirs = torch.load(golden_path('vil_ls_official') / f'{name}.pth', weights_only=True)
    ours = official_vil(timm.create_model('vil_ls_medium', device='meta', **VIL_TINY[name]))
    assert ours.keys() == theirs.keys() and ours['arch'] == theirs['arch']
    _assert_same_layout(_layout(ours['net']), _layout(theirs['net']))


@pytest.mark.parametrize('name', ['vil_ls_medium', 'vil_ls_base'])
def test_vil_layout_has_the_authors_keys_and_shapes_at_full_size(name):
    theirs = json.loads((golden_path('vil_ls_official') / 'full_key_shapes.json').read_text())[f'{name}_224']
    ours = official_vil(timm.create_model(name, device='meta'))['net']
    assert {k[len('module.'):]: list(v.shape) for k, v in ours.items()} == theirs


@pytest.mark.parametrize('name', sorted(VIL_TINY))
def test_vil_layout_writes_back_the_authors_checkpoint(name):
    """The authors' tiny checkpoint through timm's documented load, written back: their tensors, bit for bit (the
    int64 index buffers, which lsvision computes instead of loading, by shape only)."""
    path = golden_path('vil_ls_official') / f'{name}.pth'
    theirs = torch.load(path, weights_only=True)['net']
    kwargs = VIL_TINY[name]
    overlay = dict(file=str(path), num_classes=kwargs['num_classes'])
    model = timm.create_model('vil_ls_medium', pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    _assert_same_values(official_vil(model)['net'], theirs, skip='.relative_position_index')


# ---- CvT: microsoft/CvT lib/models/cls_cvt.py ----

TINY_CVT = dict(embed_dims=(16, 32, 48), num_heads=(1, 2, 3), depths=(1, 1, 2), num_classes=10)  # cvt_official


def test_cvt_layout_has_microsofts_keys_shapes_and_dtypes():
    theirs = torch.load(golden_path('cvt_official') / 'tiny_cvt.pth', weights_only=True)
    ours = microsoft_cvt(timm.create_model('cvt_13', device='meta', **TINY_CVT))
    _assert_same_layout(_layout(ours), _layout(theirs))


def test_cvt_layout_writes_back_microsofts_state_dict():
    theirs = torch.load(golden_path('cvt_official') / 'tiny_cvt.pth', weights_only=True)
    model = timm.create_model('cvt_13', **TINY_CVT)
    model.load_state_dict(cvt.checkpoint_filter_fn(dict(theirs), model), strict=True)
    _assert_same_values(microsoft_cvt(model), theirs)


# ---- PVT v1: whai362/PVT classification/pvt.py (no golden data) ----

def whai362_pvt_shapes(embed_dims: Sequence[int], depths: Sequence[int], mlp_ratios: Sequence[int] = (8, 8, 4, 4),
                       sr_ratios: Sequence[int] = (8, 4, 2, 1), img_size: int = 224, patch_size: int = 4,
                       num_classes: int = 1000) -> Dict[str, Tuple[int, ...]]:
    """The state_dict shapes `PyramidVisionTransformer(...)` of whai362/PVT (v1, qkv_bias=True) builds, restated
    from its constructor: per stage `patch_embed{S}` (conv + LN), `pos_embed{S}` (one more token in the last stage,
    the cls token's), `block{S}.{j}` (norm1, attn.q / kv / proj, attn.sr + attn.norm where sr > 1, norm2, mlp.fc1 /
    fc2); then `norm`, `cls_token`, `head`."""
    shapes: Dict[str, Tuple[int, ...]] = {}
    size, cin = img_size, 3
    for s, (dim, depth, ratio, sr) in enumerate(zip(embed_dims, depths, mlp_ratios, sr_ratios), start=1):
        patch = patch_size if s == 1 else 2
        size = size // patch
        shapes.update({f'patch_embed{s}.proj.weight': (dim, cin, patch, patch), f'patch_embed{s}.proj.bias': (dim,),
                       f'patch_embed{s}.norm.weight': (dim,), f'patch_embed{s}.norm.bias': (dim,),
                       f'pos_embed{s}': (1, size * size + (s == len(embed_dims)), dim)})
        hidden = int(dim * ratio)
        for j in range(depth):
            block = {'norm1.weight': (dim,), 'norm1.bias': (dim,), 'attn.q.weight': (dim, dim), 'attn.q.bias': (dim,),
                     'attn.kv.weight': (2 * dim, dim), 'attn.kv.bias': (2 * dim,), 'attn.proj.weight': (dim, dim),
                     'attn.proj.bias': (dim,), 'norm2.weight': (dim,), 'norm2.bias': (dim,),
                     'mlp.fc1.weight': (hidden, dim), 'mlp.fc1.bias': (hidden,), 'mlp.fc2.weight': (dim, hidden),
                     'mlp.fc2.bias': (dim,)}
            if sr > 1:
                block.update({'attn.sr.weight': (dim, dim, sr, sr), 'attn.sr.bias': (dim,),
                              'attn.norm.weight': (dim,), 'attn.norm.bias': (dim,)})
            shapes.update({f'block{s}.{j}.{k}': v for k, v in block.items()})
        cin = dim
    last = embed_dims[-1]
    shapes.update({'norm.weight': (last,), 'norm.bias': (last,), 'cls_token': (1, 1, last),
                   'head.weight': (num_classes, last), 'head.bias': (num_classes,)})
    return shapes


@pytest.mark.parametrize('name,kwargs,theirs', [
    ('pvt_tiny', dict(embed_dims=(16, 32, 32, 64), num_heads=(1, 1, 2, 2), depths=(1, 1, 1, 1)),
     dict(embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1))),
    ('pvt_tiny', {}, dict(embed_dims=(64, 128, 320, 512), depths=(2, 2, 2, 2))),
    ('pvt_small', {}, dict(embed_dims=(64, 128, 320, 512), depths=(3, 4, 6, 3))),
])
def test_pvt_layout_has_whai362s_keys_and_shapes(name, kwargs, theirs):
    ours = official_pvt(timm.create_model(name, device='meta', **kwargs))
    assert {k: tuple(v.shape) for k, v in ours.items()} == whai362_pvt_shapes(**theirs)


def test_layouts_name_an_lsvision_key_they_do_not_know():
    model = timm.create_model('cvt_13', device='meta', **TINY_CVT)
    model.stages[0].blocks[0].attn.register_buffer('extra', torch.zeros(1, device='meta'))
    with pytest.raises(KeyError, match=r"CvT layout: no official name for the lsvision key 'attn\.extra'"):
        microsoft_cvt(model)
