"""Official Transformer-LS checkpoints -> lsvision sequence models.

* LRA (`lra/model_wrapper.py::ModelForSC` / `ModelForSCDual`): keys such as
  `model.embeddings.word_embeddings.weight`, `model.transformer_{i}.mha.{W_q,W_k,W_v,W_o,dconv_fc,dual_ln_l,
  dual_ln_s}.*`, `model.transformer_{i}.{norm1,norm2}.*`, `model.transformer_{i}.mlpblock.{0,3}.*`, `model.norm.*`,
  the cls vector (a key ending in `cls_embed` or `cls_token`), `seq_classifer.mlpblock.{0,2}.*`. The
  attention module may sit under another name than `mha` (it is found by its `W_q` weight).
* Char-LM (fairseq `TransformerLSModel`): per layer the attention `{proj_query,proj_key,proj_val,proj_out,dconv_1,
  r_net,r_net_chunk,dual_ln_win,dual_ln_dproj}.*`, `r_w_bias` (1, h, 1, 1, d), `r_r_bias` (1, h, 1, d), found by
  their names; the layer's two LayerNorms and FFN Linears are taken from the first name pattern that exists
  (`_LM_LAYER_CANDIDATES`); the embedding from a key ending in `embed_tokens.weight` (or `word_emb.weight`) and the
  output bias from a key ending in `out_bias` (or `output_projection.bias`, `out_layer.bias`).

A `module.` prefix (DataParallel) and a `{'model_state_dict': ...}` / `{'model': ...}` wrapper are accepted. Files
are read with `torch.load(..., weights_only=True)`. Keys that nothing maps are reported, not silently dropped.

Written for lsvision, Apache-2.0.
"""
import re
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

__all__ = ['convert_lra_state_dict', 'convert_char_lm_state_dict', 'load_official_checkpoint']

StateDict = Dict[str, torch.Tensor]

# (lsvision suffix, candidate official suffixes) inside one char-LM layer, beside the attention
_LM_LAYER_CANDIDATES: List[Tuple[str, Tuple[str, ...]]] = [
    ('norm1', ('self_attn_layer_norm', 'norm1', 'layer_norm1', 'ln1', 'layer_norm')),
    ('norm2', ('final_layer_norm', 'norm2', 'layer_norm2', 'ln2', 'ff_layer_norm')),
    ('mlp.fc1', ('fc1', 'ff.0', 'pos_ff.CoreNet.0', 'mlp.0', 'ffn.0')),
    ('mlp.fc2', ('fc2', 'ff.3', 'pos_ff.CoreNet.3', 'mlp.3', 'ffn.3')),
]
_LM_ATTN = {
    'proj_query': 'q', 'proj_key': 'k', 'proj_val': 'v', 'proj_out': 'proj', 'dconv_1': 'dynamic_proj',
    'r_net': 'r_net', 'r_net_chunk': 'r_net_chunk', 'dual_ln_win': 'norm_local', 'dual_ln_dproj': 'norm_global',
}


def _unwrap(state: Dict) -> StateDict:
    for key in ('model_state_dict', 'state_dict', 'model'):
        if key in state and isinstance(state[key], dict):
            state = state[key]
            break
    return {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def _take(state: StateDict, used: set, key: str) -> torch.Tensor:
    used.add(key)
    return state[key]


def _copy_module(state: StateDict, used: set, src: str, dst: str, out: StateDict) -> None:
    """Copies every `src.<param>` to `dst.<param>`."""
    found = False
    for k in list(state):
        if k.startswith(src + '.') and k.count('.') == src.count('.') + 1:
            out[dst + k[len(src):]] = _take(state, used, k)
            found = True
    if not found:
        raise KeyError(f'no parameters under {src!r} in the official state_dict')


def _check_unused(state: StateDict, used: set, what: str) -> None:
    left = sorted(set(state) - used)
    if left:
        raise KeyError(f'{what}: {len(left)} official keys have no lsvision counterpart: {left[:8]}'
                       f'{" ..." if len(left) > 8 else ""}')


def convert_lra_state_dict(state: Dict) -> StateDict:
    """Official LRA `ModelForSC` / `ModelForSCDual` state_dict -> `LraClassifier` / `LraDualClassifier` keys."""
    state = _unwrap(state)
    used: set = set()
    out: StateDict = {}
    emb = next((k for k in state if k.endswith('word_embeddings.weight')), None)
    if emb is None:
        raise KeyError('not an official LRA state_dict: no "...word_embeddings.weight" key')
    root = emb[:-len('embeddings.word_embeddings.weight')]  # 'model.' usually
    out['encoder.embed.weight'] = _take(state, used, emb)
    out['encoder.pos_embed.weight'] = _take(state, used, root + 'embeddings.position_embeddings.weight')
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(re.escape(root) + r'transformer_(\d+)\.', k))})
    for i in layers:
        pre = f'{root}transformer_{i}.'
        wq = next(k for k in state if k.startswith(pre) and k.endswith('.W_q.weight'))
        attn = wq[:-len('.W_q.weight')]
        dst = f'encoder.blocks.{i}.'
        for p in ('weight', 'bias'):
            out[dst + f'attn.qkv.{p}'] = torch.cat([_take(state, used, f'{attn}.W_{n}.{p}') for n in 'qkv'])
        _copy_module(state, used, f'{attn}.W_o', dst + 'attn.proj', out)
        if f'{attn}.dconv_fc.weight' in state:
            _copy_module(state, used, f'{attn}.dconv_fc', dst + 'attn.dynamic_proj', out)
        _copy_module(state, used, f'{attn}.dual_ln_l', dst + 'attn.norm_local', out)
        _copy_module(state, used, f'{attn}.dual_ln_s', dst + 'attn.norm_global', out)
        _copy_module(state, used, pre + 'norm1', dst + 'norm1', out)
        _copy_module(state, used, pre + 'norm2', dst + 'norm2', out)
        _copy_module(state, used, pre + 'mlpblock.0', dst + 'mlp.fc1', out)
        _copy_module(state, used, pre + 'mlpblock.3', dst + 'mlp.fc2', out)
    _copy_module(state, used, root + 'norm', 'encoder.norm', out)
    cls = next((k for k in state if k.endswith('cls_embed') or k.endswith('cls_token')), None)
    if cls is not None:
        out['encoder.cls_token'] = _take(state, used, cls).reshape(1, 1, -1)
    head = next(k[:-len('.mlpblock.0.weight')] for k in state if k.endswith('mlpblock.0.weight')
                and 'transformer_' not in k)
    _copy_module(state, used, head + '.mlpblock.0', 'head.0', out)
    _copy_module(state, used, head + '.mlpblock.2', 'head.2', out)
    _check_unused(state, used, 'LRA conversion')
    return out


def convert_char_lm_state_dict(state: Dict) -> StateDict:
    """Official fairseq char-LM (`TransformerLSModel`) state_dict -> `CharLM` keys."""
    state = _unwrap(state)
    used: set = set()
    out: StateDict = {}
    attn_keys = sorted((k for k in state if k.endswith('.proj_query.weight')), key=lambda k: [
        int(t) if t.isdigit() else t for t in re.split(r'(\d+)', k)])
    if not attn_keys:
        raise KeyError('not an official char-LM state_dict: no "...proj_query.weight" key')
    for i, key in enumerate(attn_keys):
        attn = key[:-len('.proj_query.weight')]
        layer = attn.rsplit('.', 1)[0]
        dst = f'blocks.{i}.'
        for src_name, dst_name in _LM_ATTN.items():
            _copy_module(state, used, f'{attn}.{src_name}', dst + f'attn.{dst_name}', out)
        for src_name, dst_name in (('r_w_bias', 'content_bias'), ('r_r_bias', 'pos_bias')):
            t = _take(state, used, f'{attn}.{src_name}')  # (1, h, 1, [1,] d) -> (h, d)
            out[dst + f'attn.{dst_name}'] = t.reshape(-1, t.shape[-1])
        for dst_name, candidates in _LM_LAYER_CANDIDATES:
            src = next((f'{layer}.{c}' for c in candidates if f'{layer}.{c}.weight' in state), None)
            if src is None:
                raise KeyError(f'layer {layer!r}: none of {candidates} found for {dst_name}')
            _copy_module(state, used, src, dst + dst_name, out)
    emb = next((k for k in state if k.endswith('embed_tokens.weight') or k.endswith('word_emb.weight')), None)
    bias = next((k for k in state if k.endswith('out_bias') or k.endswith('output_projection.bias')
                 or k.endswith('out_layer.bias')), None)
    if emb is None or bias is None:
        raise KeyError('char-LM state_dict: token embedding or output bias not found')
    out['embed.weight'] = _take(state, used, emb)
    out['out_bias'] = _take(state, used, bias)
    # a separate output weight tied to the embedding may be stored too: accept it only if it is equal
    for k in list(state):
        if k not in used and k.endswith('weight') and state[k].shape == out['embed.weight'].shape \
                and torch.equal(state[k], out['embed.weight']):
            used.add(k)
    used.update(k for k in state if k.endswith('.version') or k.endswith('_float_tensor'))
    _check_unused(state, used, 'char-LM conversion')
    return out


def load_official_checkpoint(model: nn.Module, path_or_state: Union[str, Dict], kind: Optional[str] = None) -> None:
    """Loads an official LRA or char-LM checkpoint into `model` (strict).

    Args:
        model: An `LraClassifier` / `LraDualClassifier` or a `CharLM`.
        path_or_state: A checkpoint file (read with weights_only=True) or a state_dict.
        kind: 'lra' or 'char_lm'; inferred from the model when None.
    """
    state = torch.load(path_or_state, map_location='cpu', weights_only=True) \
        if isinstance(path_or_state, str) else path_or_state
    if kind is None:
        kind = 'lra' if hasattr(model, 'encoder') else 'char_lm'
    converted = convert_lra_state_dict(state) if kind == 'lra' else convert_char_lm_state_dict(state)
    model.load_state_dict(converted, strict=True)
