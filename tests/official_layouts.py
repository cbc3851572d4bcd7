"""The authors' checkpoint layouts, written from lsvision models by inverting lsvision's key maps (test helpers).

Each function takes an lsvision model (or its state_dict) and returns what the authors' code would save for the same
weights, so that a test can load it back through lsvision's documented calls and compare.
"""
import re
from typing import Dict

import torch
import torch.nn as nn

from lsvision.models.vil_ls import official_key_to_lsvision
from lsvision.sequence.convert import _LM_BIASES, _LM_LAYER

FAIRSEQ_PREFIX = 'decoder.model.'
_VIL_ATTN = {  # lsvision -> official names in the ViL-LS attention
    'qkv': 'qkv', 'proj': 'proj', 'dynamic_proj': 'to_dynamic_projection', 'norm_local': 'dual_ln_full',
    'norm_global': 'dual_ln_dp', 'rel_pos_table': 'local_relative_position_bias_table',
    'rel_pos_g2l': 'g2l_relative_position_bias', 'rel_pos_g2g': 'g2g_relative_position_bias',
}


def microsoft_cvt(model: nn.Module) -> Dict[str, torch.Tensor]:
    """microsoft/CvT `ConvolutionalVisionTransformer` state_dict (`stage{i}.*`, `norm`, `head`), as released."""
    return {re.sub(r'^stages\.(\d+)\.', r'stage\1.', k): v.clone() for k, v in model.state_dict().items()}


def _vil_key(key: str) -> str:
    m = re.match(r'^stages\.(\d+)\.(.+)$', key)
    if m is None:
        return key  # norm, head
    layer, rest = f'layer{int(m.group(1)) + 1}', m.group(2)
    embed = {'patch_embed.proj.': '0.proj.', 'patch_embed.norm.': '0.norm_embed.', 'cls_token': '0.cls_token'}
    for ours, theirs in embed.items():
        if rest.startswith(ours):
            return f'{layer}.{theirs}{rest[len(ours):]}'
    b = re.match(r'^blocks\.(\d+)\.(norm1|norm2|attn|mlp)\.(.+)$', rest)
    j, part, tail = int(b.group(1)), b.group(2), b.group(3)
    if part == 'attn':
        name, _, param = tail.partition('.')
        return f'{layer}.{2 * j + 1}.attn.{_VIL_ATTN[name]}' + (f'.{param}' if param else '')
    if part == 'norm1':
        return f'{layer}.{2 * j + 1}.norm.{tail}'
    return f'{layer}.{2 * j + 2}.{"norm" if part == "norm2" else "mlp"}.{tail}'


def official_vil(model: nn.Module) -> Dict:
    """NVIDIA/transformer-ls `model_best.pth` of an lsvision ViL-LS: DDP `net` with the int64 index buffers."""
    net = {}
    for k, v in model.state_dict().items():
        official = _vil_key(k)
        assert official_key_to_lsvision(official) == k, (k, official)  # the inverse of lsvision's map
        net['module.' + official] = v.clone()
        if k.endswith('.attn.qkv.weight'):
            index = official[:-len('qkv.weight')] + 'relative_position_index'
            net['module.' + index] = torch.zeros(1, dtype=torch.int64)  # dropped on load
    return {'net': net, 'arch': 'msvit', 'epoch': 300, 'best_acc': 0.0, 'optimizer': None, 'scheduler': None}


def official_pvt(model: nn.Module) -> Dict[str, torch.Tensor]:
    """whai362/PVT v1 state_dict (`patch_embed1`, `pos_embed1`, `block1.0`, `cls_token`) of an lsvision PVT."""
    out = {}
    for k, v in model.state_dict().items():
        k = re.sub(r'^stages\.(\d+)\.cls_token$', 'cls_token', k)
        k = re.sub(r'^stages\.(\d+)\.(patch_embed|pos_embed|blocks)',
                   lambda m: ('block' if m.group(2) == 'blocks' else m.group(2)) + str(int(m.group(1)) + 1), k)
        out[k] = v.clone()
    return out


def official_inv_freq(dim: int) -> torch.Tensor:
    """The official `pos_emb.inv_freq` buffer (Transformer-XL's PositionalEmbedding)."""
    return 1 / (10000 ** (torch.arange(0.0, dim, 2.0) / dim))


def official_char_lm(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The authors' `TransformerLSModel` state_dict with the weights of an lsvision `CharLM`."""
    sd = model.state_dict()
    heads = model.blocks[0].attn.content_bias.shape[0]
    out = {'in_emb.weight': sd['embed.weight'], 'pos_emb.inv_freq': official_inv_freq(model.dim),
           'out_emb.weight': sd['embed.weight'], 'out_emb.bias': sd['out_bias']}
    shapes = {'attn.content_bias': (1, heads, 1, 1, -1), 'attn.pos_bias': (1, heads, 1, -1)}
    for i in range(len(model.blocks)):
        for theirs, ours, params in _LM_LAYER:
            for param in params:
                out[f'layers.{i}.{theirs}.{param}'] = sd[f'blocks.{i}.{ours}.{param}']
        for theirs, ours in _LM_BIASES:
            out[f'layers.{i}.{theirs}'] = sd[f'blocks.{i}.{ours}'].reshape(shapes[ours])
    return {k: v.clone() for k, v in out.items()}


def fairseq(state_dict: Dict[str, torch.Tensor]) -> Dict:
    """A fairseq checkpoint (`checkpoint_best.pt`) around a `TransformerLSModel` state_dict."""
    return {'model': {FAIRSEQ_PREFIX + k: v for k, v in state_dict.items()}, 'args': None,
            'optimizer_history': [], 'extra_state': {}}
