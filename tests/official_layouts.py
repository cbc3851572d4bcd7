"""The authors' checkpoint layouts, written from lsvision models with the test's own name tables (test helpers).

Each function takes an lsvision model and returns what the authors' code saves for the same weights, so that a test
can load it back through lsvision's documented calls and compare. The names come from literal tables below, one per
family, written from the authors' key lists (tests/golden/*: `char_lm_official/keys.json`,
`vil_ls_official/*.pth`, `cvt_official/tiny_cvt.pth`) and, for PVT v1, from whai362/PVT `classification/pvt.py`.
Nothing here imports lsvision's converters or key maps: a slip in a converter's table (q <-> k, r_w_bias <->
r_r_bias) makes the round trip through these layouts fail instead of cancelling out. tests/test_official_layouts.py
checks every layout against the authors' keys, shapes and (where the golden data has them) values.

An lsvision key the tables do not know is a KeyError naming it: a renamed lsvision module cannot slip through.
"""
import re
from typing import Dict, Mapping, Tuple

import torch
import torch.nn as nn

StateDict = Dict[str, torch.Tensor]
FAIRSEQ_PREFIX = 'decoder.model.'  # fairseq's TransformerLS LM -> TransformerLSDecoder -> .model

# ---- the name tables: lsvision module (or parameter) -> the authors' name ----

# NVIDIA/transformer-ls autoregressive/model_lib/model.py TransformerLSModel, one layer `layers.{i}` (keys.json)
CHAR_LM_LAYER = {
    'norm1': 'norm1', 'norm2': 'norm2', 'mlp.fc1': 'ff.fc1', 'mlp.fc2': 'ff.fc2',
    'attn.q': 'attn.proj_query', 'attn.k': 'attn.proj_key', 'attn.v': 'attn.proj_val', 'attn.proj': 'attn.proj_out',
    'attn.dynamic_proj': 'attn.dconv_1', 'attn.r_net': 'attn.r_net', 'attn.r_net_chunk': 'attn.r_net_chunk',
    'attn.norm_local': 'attn.dual_ln_win', 'attn.norm_global': 'attn.dual_ln_dproj',
    # Transformer-XL's u (added to the query for the content term) and v (for the position term)
    'attn.content_bias': 'attn.r_w_bias', 'attn.pos_bias': 'attn.r_r_bias',
}
# their shapes in the authors' model: u (1, h, 1, 1, d), v (1, h, 1, d); lsvision keeps (h, d)
CHAR_LM_BIAS_SHAPES = {'attn.r_w_bias': (1, -1, 1, 1), 'attn.r_r_bias': (1, -1, 1)}
CHAR_LM_TOP = {'embed.weight': 'in_emb.weight', 'out_bias': 'out_emb.bias'}  # out_emb.weight: tied to in_emb

# NVIDIA/transformer-ls imagenet/models/msvit.py MsViT: stage S is `layer{S}`, entry 0 the patch embedding, layer j
# the attention block `2j+1` and the MLP block `2j+2`
VIL_EMBED = {'patch_embed.proj': '0.proj', 'patch_embed.norm': '0.norm_embed', 'cls_token': '0.cls_token'}
VIL_ATTN_BLOCK = {  # entry 2j+1
    'norm1': 'norm', 'attn.qkv': 'attn.qkv', 'attn.proj': 'attn.proj',
    'attn.dynamic_proj': 'attn.to_dynamic_projection', 'attn.norm_local': 'attn.dual_ln_full',
    'attn.norm_global': 'attn.dual_ln_dp', 'attn.rel_pos_table': 'attn.local_relative_position_bias_table',
    'attn.rel_pos_g2l': 'attn.g2l_relative_position_bias', 'attn.rel_pos_g2g': 'attn.g2g_relative_position_bias',
}
VIL_MLP_BLOCK = {'norm2': 'norm', 'mlp.fc1': 'mlp.fc1', 'mlp.fc2': 'mlp.fc2'}  # entry 2j+2
VIL_TOP = {'norm': 'norm', 'head': 'head'}

# microsoft/CvT lib/models/cls_cvt.py ConvolutionalVisionTransformer: stage i is `stage{i}` (0-based)
CVT_STAGE = {'patch_embed.proj': 'patch_embed.proj', 'patch_embed.norm': 'patch_embed.norm',
             'cls_token': 'cls_token'}
CVT_BLOCK = {
    'norm1': 'norm1', 'norm2': 'norm2', 'mlp.fc1': 'mlp.fc1', 'mlp.fc2': 'mlp.fc2', 'attn.proj': 'attn.proj',
    **{f'attn.conv_proj_{t}.{m}': f'attn.conv_proj_{t}.{m}' for t in 'qkv' for m in ('conv', 'bn')},
    **{f'attn.proj_{t}': f'attn.proj_{t}' for t in 'qkv'},
}
CVT_TOP = {'norm': 'norm', 'head': 'head'}

# whai362/PVT classification/pvt.py PyramidVisionTransformer (v1): stage S (1-based) is `patch_embed{S}`,
# `pos_embed{S}`, `block{S}.{j}`; one `cls_token` (the last stage's)
PVT_STAGE = {'patch_embed.proj': 'patch_embed{S}.proj', 'patch_embed.norm': 'patch_embed{S}.norm',
             'pos_embed': 'pos_embed{S}'}
PVT_BLOCK = {'norm1': 'norm1', 'norm2': 'norm2', 'mlp.fc1': 'mlp.fc1', 'mlp.fc2': 'mlp.fc2', 'attn.q': 'attn.q',
             'attn.kv': 'attn.kv', 'attn.proj': 'attn.proj', 'attn.sr': 'attn.sr', 'attn.norm': 'attn.norm'}
PVT_TOP = {'norm': 'norm', 'head': 'head'}


_STAGE_KEY = re.compile(r'^stages\.(\d+)\.(?:blocks\.(\d+)\.)?(.+)$')  # lsvision: stage, block (or None), rest


def _official_name(name: str, table: Mapping[str, str], family: str) -> str:
    """The authors' name of `name` (relative to its block or stage): the name itself, or its module, in the table."""
    if name in table:
        return table[name]
    module, _, param = name.rpartition('.')
    if module in table:
        return f'{table[module]}.{param}'
    raise KeyError(f'{family} layout: no official name for the lsvision key {name!r}; add it to the table in '
                   f"tests/official_layouts.py from the authors' key list")


# ---- Microsoft CvT ----

def _cvt_key(key: str) -> str:
    m = _STAGE_KEY.match(key)
    if m is None:
        return _official_name(key, CVT_TOP, 'CvT')
    stage, block, rest = m.groups()
    if block is None:
        return f'stage{stage}.' + _official_name(rest, CVT_STAGE, 'CvT')
    return f'stage{stage}.blocks.{block}.' + _official_name(rest, CVT_BLOCK, 'CvT')


def microsoft_cvt(model: nn.Module) -> StateDict:
    """microsoft/CvT `ConvolutionalVisionTransformer` state_dict (`stage{i}.*`, `norm`, `head`), as released."""
    return {_cvt_key(k): v.clone() for k, v in model.state_dict().items()}


# ---- ViL-LS (MsViT) ----

def _vil_key(key: str) -> str:
    m = _STAGE_KEY.match(key)
    if m is None:
        return _official_name(key, VIL_TOP, 'ViL-LS')
    layer, block, rest = f'layer{int(m.group(1)) + 1}', m.group(2), m.group(3)
    if block is None:
        return f'{layer}.' + _official_name(rest, VIL_EMBED, 'ViL-LS')
    j = int(block)
    if rest.split('.')[0] in ('norm2', 'mlp'):
        return f'{layer}.{2 * j + 2}.' + _official_name(rest, VIL_MLP_BLOCK, 'ViL-LS')
    return f'{layer}.{2 * j + 1}.' + _official_name(rest, VIL_ATTN_BLOCK, 'ViL-LS')


def vil_index_shape(attn: nn.Module) -> Tuple[int, int]:
    """Shape of the authors' int64 `relative_position_index` buffer of one attention layer.

    Long-short window w: (w^2, (w + 2 (w // 2))^2), the window's queries against its padded key window ((49, 169) at
    w = 7, (64, 256) at w = 8 in tiny224.pth / tiny384.pth and the spec's table); full attention over an H x W map:
    (H W, H W), cls tokens not included.
    """
    if hasattr(attn, 'window_size'):
        w = attn.window_size
        return w * w, (w + 2 * (w // 2)) ** 2
    h, w = attn.feat_size
    return h * w, h * w


def official_vil(model: nn.Module) -> Dict:
    """NVIDIA/transformer-ls `model_best.pth` of an lsvision ViL-LS: DDP `net` with the int64 index buffers.

    The index buffers have the authors' shape and zeros as values: lsvision computes its index and drops theirs.
    """
    net = {}
    modules = dict(model.named_modules())
    for k, v in model.state_dict().items():
        official = _vil_key(k)
        net['module.' + official] = v.clone()
        if k.endswith('.attn.qkv.weight'):
            index = official[:-len('qkv.weight')] + 'relative_position_index'
            shape = vil_index_shape(modules[k[:-len('.qkv.weight')]])
            net['module.' + index] = torch.zeros(shape, dtype=torch.int64, device=v.device)
    return {'net': net, 'arch': 'msvit', 'epoch': 300, 'best_acc': 0.0, 'optimizer': None, 'scheduler': None}


# ---- PVT v1 ----

def _pvt_key(key: str, last_stage: int) -> str:
    m = _STAGE_KEY.match(key)
    if m is None:
        return _official_name(key, PVT_TOP, 'PVT')
    stage, block, rest = int(m.group(1)), m.group(2), m.group(3)
    if block is not None:
        return f'block{stage + 1}.{block}.' + _official_name(rest, PVT_BLOCK, 'PVT')
    if rest == 'cls_token' and stage == last_stage:
        return 'cls_token'
    return _official_name(rest, PVT_STAGE, 'PVT').format(S=stage + 1)


def official_pvt(model: nn.Module) -> StateDict:
    """whai362/PVT v1 state_dict (`patch_embed1`, `pos_embed1`, `block1.0`, `cls_token`) of an lsvision PVT."""
    last = len(model.stages) - 1
    return {_pvt_key(k, last): v.clone() for k, v in model.state_dict().items()}


# ---- char-LM (TransformerLSModel) ----

def official_inv_freq(dim: int) -> torch.Tensor:
    """The official `pos_emb.inv_freq` buffer (Transformer-XL's PositionalEmbedding)."""
    return 1 / (10000 ** (torch.arange(0.0, dim, 2.0) / dim))


def _char_lm_layer(i: int, block: StateDict) -> StateDict:
    out = {}
    for name, value in block.items():
        if name == 'attn.pos_freq_offset':
            continue  # lsvision's per-layer record of the file's rounded frequencies: folded into pos_emb.inv_freq
        official = _official_name(name, CHAR_LM_LAYER, 'char-LM')
        if official in CHAR_LM_BIAS_SHAPES:
            value = value.reshape(CHAR_LM_BIAS_SHAPES[official] + (value.shape[-1],))
        out[f'layers.{i}.{official}'] = value
    return out


def official_char_lm(model: nn.Module) -> StateDict:
    """The authors' `TransformerLSModel` state_dict with the weights of an lsvision `CharLM`.

    `pos_emb.inv_freq` is the sinusoid frequencies plus the first layer's `pos_freq_offset` (zero unless the model
    was loaded from a file with rounded frequencies, such as fairseq's --fp16 checkpoints).
    """
    sd = model.state_dict()
    out = {}
    for k, v in sd.items():
        m = re.match(r'^blocks\.(\d+)\.(.+)$', k)
        if m is None:
            out[_official_name(k, CHAR_LM_TOP, 'char-LM')] = v
    out['out_emb.weight'] = sd['embed.weight']
    freq = official_inv_freq(sd['embed.weight'].shape[1]).to(sd['embed.weight'].device)
    offset = sd.get('blocks.0.attn.pos_freq_offset')
    out['pos_emb.inv_freq'] = freq if offset is None else freq + offset
    layers = sorted({int(m.group(1)) for k in sd if (m := re.match(r'^blocks\.(\d+)\.', k))})
    for i in layers:
        prefix = f'blocks.{i}.'
        out.update(_char_lm_layer(i, {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}))
    return {k: v.clone() for k, v in out.items()}


def fairseq(state_dict: StateDict) -> Dict:
    """A fairseq checkpoint (`checkpoint_best.pt`) around a `TransformerLSModel` state_dict."""
    return {'model': {FAIRSEQ_PREFIX + k: v for k, v in state_dict.items()}, 'args': None,
            'optimizer_history': [], 'extra_state': {}}
