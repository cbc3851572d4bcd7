"""Official Transformer-LS and Transformer-XL checkpoints -> lsvision sequence models.

* LRA (`lra/model_wrapper.py::ModelForSC` / `ModelForSCDual`): keys such as
  `model.embeddings.word_embeddings.weight`, `model.transformer_{i}.mha.{W_q,W_k,W_v,W_o,dconv_fc,dual_ln_l,
  dual_ln_s}.*`, `model.transformer_{i}.{norm1,norm2}.*`, `model.transformer_{i}.mlpblock.{0,3}.*`, `model.norm.*`,
  the cls vector (a key ending in `cls_embed` or `cls_token`), `seq_classifer.mlpblock.{0,2}.*`. The
  attention module may sit under another name than `mha` (it is found by its `W_q` weight).
  An r = 0 layer keeps an empty `dconv_fc` (0 rows): it is dropped, as the lsvision r = 0 layer has none.
  A `module.` prefix (DataParallel) and a `{'model_state_dict': ...}` / `{'model': ...}` wrapper are accepted.
* Char-LM: the authors' `TransformerLSModel` (`autoregressive/model_lib/model.py`), exactly its names
  (`tests/golden/char_lm_official/keys.json`): `in_emb.weight`, `out_emb.{weight,bias}` (weight tied to
  `in_emb`), the `pos_emb.inv_freq` buffer (checked against lsvision's sinusoid frequencies within the rounding of
  its dtype, and kept as every layer's `pos_freq_offset`: fairseq `--fp16` saves it rounded to fp16), and per
  layer `layers.{i}.attn.{proj_query,proj_key,proj_val,proj_out,dconv_1,r_net,r_net_chunk,dual_ln_win,
  dual_ln_dproj}.*`, `r_w_bias` (1, h, 1, 1, d), `r_r_bias` (1, h, 1, d), `layers.{i}.{norm1,norm2}.*`,
  `layers.{i}.ff.{fc1,fc2}.*`. Either the bare state_dict or a fairseq checkpoint (`checkpoint_best.pt`: the same
  keys under `['model']` with the prefix `decoder.model.`).

* Transformer-XL (kimiyoung/transformer-xl `pytorch/mem_transformer.py::MemTransformerLM`, attn_type 0): the
  module's state_dict, `word_emb.emb_layers.{i}.weight`, `word_emb.emb_projs.{i}` (div_val > 1),
  `layers.{i}.dec_attn.{qkv_net,o_net,r_net}.weight`, `layers.{i}.dec_attn.layer_norm.*`,
  `layers.{i}.pos_ff.CoreNet.{0,3}.*`, `layers.{i}.pos_ff.layer_norm.*`, `r_w_bias`, `r_r_bias`, the
  `pos_emb.inv_freq` buffer (checked, then dropped), `crit.cluster_{weight,bias}`, `crit.out_layers.{i}.{weight,bias}`
  (weights tied to the embedding: they must be equal, or absent), `crit.out_projs.{i}` (the head's own; the tails'
  tied to `emb_projs`). Their train.py pickles the whole module (`model.pt`); in their environment
  `torch.load('model.pt', weights_only=False).state_dict()` gives this state_dict (save it with `torch.save`). The
  Hugging Face Hub's `transfo-xl/transfo-xl-wt103` (transformers' `TransfoXLLMHeadModel`) holds the same names
  under `transformer.` (and `crit.`), with per-layer `layers.{i}.dec_attn.r_w_bias` / `r_r_bias` (`untie_r`).

Files are read with `torch.load(..., weights_only=True)`. Every key that nothing maps is named in the error, never
silently dropped, and the models load strictly. Half-precision files (fairseq `--fp16`, `.half()` state_dicts) load
into a model of any dtype: `load_state_dict` casts each tensor to the model's.

`load_official_checkpoint` also sets what the authors' code runs with and the weights alone do not say: a char-LM's
`cache_mode='official'` (fairseq starts from a zero cache that is attended like real tokens), an LRA model's pooling
after the file (its cls vector: `'cls'`, official `--cls_last_layer`; none: `'mean_official'`, the official MEAN
pooling). `official_settings=False` loads the weights only.

Written for lsvision, Apache-2.0.
"""
import logging
import re
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from lsvision.layers import sinusoid_frequencies

from .transformer_xl import TransformerXL

__all__ = ['convert_lra_state_dict', 'convert_char_lm_state_dict', 'convert_txl_state_dict',
           'load_official_checkpoint']

StateDict = Dict[str, torch.Tensor]
_logger = logging.getLogger(__name__)

_FAIRSEQ_PREFIX = 'decoder.model.'  # fairseq's TransformerLS LM -> TransformerLSDecoder -> .model
# one char-LM layer: official module -> lsvision module, and the official module's parameters
_LM_LAYER: List[Tuple[str, str, Tuple[str, ...]]] = [
    ('attn.proj_query', 'attn.q', ('weight',)),
    ('attn.proj_key', 'attn.k', ('weight',)),
    ('attn.proj_val', 'attn.v', ('weight',)),
    ('attn.proj_out', 'attn.proj', ('weight',)),
    ('attn.dconv_1', 'attn.dynamic_proj', ('weight', 'bias')),
    ('attn.r_net', 'attn.r_net', ('weight',)),
    ('attn.r_net_chunk', 'attn.r_net_chunk', ('weight', 'bias')),
    ('attn.dual_ln_win', 'attn.norm_local', ('weight', 'bias')),
    ('attn.dual_ln_dproj', 'attn.norm_global', ('weight', 'bias')),
    ('norm1', 'norm1', ('weight', 'bias')),
    ('norm2', 'norm2', ('weight', 'bias')),
    ('ff.fc1', 'mlp.fc1', ('weight', 'bias')),
    ('ff.fc2', 'mlp.fc2', ('weight', 'bias')),
]
# the Transformer-XL biases u, v: (1, h, 1, 1, d) and (1, h, 1, d) -> (h, d)
_LM_BIASES = (('attn.r_w_bias', 'attn.content_bias'), ('attn.r_r_bias', 'attn.pos_bias'))


def _unwrap(state: Dict) -> StateDict:
    for key in ('model_state_dict', 'state_dict', 'model'):
        if key in state and isinstance(state[key], dict):
            state = state[key]
            break
    return {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def _take(state: StateDict, used: set, key: str) -> torch.Tensor:
    if key not in state:
        raise KeyError(f'the official key {key!r} is missing from the state_dict')
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
        wq = next((k for k in state if k.startswith(pre) and k.endswith('.W_q.weight')), None)
        if wq is None:
            raise KeyError(f'layer {pre!r} of the official LRA state_dict has no attention ("...W_q.weight" key)')
        attn = wq[:-len('.W_q.weight')]
        dst = f'encoder.blocks.{i}.'
        for p in ('weight', 'bias'):
            out[dst + f'attn.qkv.{p}'] = torch.cat([_take(state, used, f'{attn}.W_{n}.{p}') for n in 'qkv'])
        _copy_module(state, used, f'{attn}.W_o', dst + 'attn.proj', out)
        dconv = state.get(f'{attn}.dconv_fc.weight')
        if dconv is not None and dconv.numel() == 0:  # r = 0: the official layer keeps an empty projection
            used.update(k for k in state if k.startswith(f'{attn}.dconv_fc.') and state[k].numel() == 0)
        elif dconv is not None:
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
    head = next((k[:-len('.mlpblock.0.weight')] for k in state if k.endswith('mlpblock.0.weight')
                 and 'transformer_' not in k), None)
    if head is None:
        raise KeyError('the official LRA state_dict has no classifier ("seq_classifer.mlpblock.0.weight" key)')
    _copy_module(state, used, head + '.mlpblock.0', 'head.0', out)
    _copy_module(state, used, head + '.mlpblock.2', 'head.2', out)
    _check_unused(state, used, 'LRA conversion')
    return out


def _check_layout(layout: str, missing: List[str], unused: List[str]) -> None:
    """A KeyError `<layout>: ...` naming the official keys missing and the keys without an lsvision counterpart."""
    if missing or unused:
        problems = [f'{text}: {keys[:8]}{" ..." if len(keys) > 8 else ""}' for text, keys in (
            (f'{len(missing)} official keys are missing', missing),
            (f'{len(unused)} keys have no lsvision counterpart', unused)) if keys]
        raise KeyError(f'{layout}: ' + '; '.join(problems))


def _unwrap_char_lm(state: Dict) -> Tuple[StateDict, str]:
    """The bare `TransformerLSModel` state_dict inside an official char-LM file, and what the file was.

    A fairseq checkpoint holds it under `['model']` with the prefix `decoder.model.`; every other key there is
    reported by name.
    """
    if 'model' in state and isinstance(state['model'], dict):
        inner = state['model']
        stray = sorted(k for k in inner if not k.startswith(_FAIRSEQ_PREFIX))
        if stray:
            more = ' ...' if len(stray) > 8 else ''
            raise KeyError(f'fairseq char-LM checkpoint: {len(stray)} keys under ["model"] lack the prefix '
                           f'{_FAIRSEQ_PREFIX!r} of the TransformerLSModel: {stray[:8]}{more}')
        return {k[len(_FAIRSEQ_PREFIX):]: v for k, v in inner.items()}, 'fairseq char-LM checkpoint'
    return dict(state), 'char-LM state_dict'


def _inv_freq_offset(inv_freq: torch.Tensor, dim: int) -> torch.Tensor:
    """The official `pos_emb.inv_freq` buffer minus lsvision's sinusoid frequencies (fp32), after checking that it
    holds those frequencies up to the rounding of its dtype.

    An fp32 file gives zeros (same formula), or an ulp where the CPU that wrote it rounded float32 `10000 ** x`
    otherwise than this one does; a fairseq `--fp16` file holds them rounded to fp16 (up to 4.9e-4
    relative), and the model it saved ran with the rounded ones, so the offset keeps them.

    Raises:
        ValueError: Another shape, or frequencies further off than the rounding of the stored dtype allows (the
            checkpoint was trained with other position encodings); the message gives the dtype and the largest
            relative difference.
    """
    if tuple(inv_freq.shape) != (dim // 2,):
        raise ValueError(f'pos_emb.inv_freq has shape {tuple(inv_freq.shape)}, expected ({dim // 2},) for width {dim}')
    exact = sinusoid_frequencies(dim, torch.float64)
    rel = (inv_freq.double() - exact).abs() / exact
    # one unit of relative rounding of the stored dtype (round-to-nearest errs by half of it); at least 1e-5 so that
    # fp32/fp64 frequencies computed by another formula pass
    tol = max(torch.finfo(inv_freq.dtype).eps, 1e-5) if inv_freq.is_floating_point() else 1e-5
    worst = int(rel.argmax())
    if not rel[worst] <= tol:
        raise ValueError(f'pos_emb.inv_freq ({inv_freq.dtype}) differs from the sinusoid frequencies lsvision uses '
                         f'(10000^(-2k/D)) by up to {rel[worst].item():.3g} relative (entry {worst}: '
                         f'{inv_freq[worst].item()} vs {exact[worst].item()}), more than {inv_freq.dtype} rounding '
                         f'allows ({tol:.3g}); the checkpoint was trained with other position encodings and cannot '
                         'be loaded.')
    return inv_freq.float() - sinusoid_frequencies(dim, torch.float32)


def convert_char_lm_state_dict(state: Dict) -> StateDict:
    """Official char-LM (`TransformerLSModel`) state_dict or fairseq checkpoint -> `CharLM` keys.

    The official names (`tests/golden/char_lm_official/keys.json`): `in_emb.weight`, `out_emb.weight` (tied to
    `in_emb.weight`: it must be equal), `out_emb.bias`, `pos_emb.inv_freq` (checked within the rounding of its
    dtype; what rounding moved goes into every layer's `attn.pos_freq_offset`), and per layer the modules of
    `_LM_LAYER` and the biases of `_LM_BIASES`. Tensors keep the file's dtype (fp16 for fairseq `--fp16`).

    Raises:
        KeyError: Naming every official key that is missing and every key that has no lsvision counterpart.
        ValueError: The frequencies or the tied output weight do not fit.
    """
    state, what = _unwrap_char_lm(state)
    used: set = set()
    out: StateDict = {}
    missing: List[str] = []

    def take(key: str) -> Optional[torch.Tensor]:
        if key not in state:
            missing.append(key)
            return None
        return _take(state, used, key)

    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r'^layers\.(\d+)\.', k))})
    for i in range(max(layers, default=-1) + 1):
        src, dst = f'layers.{i}.', f'blocks.{i}.'
        for src_name, dst_name, params in _LM_LAYER:
            for param in params:
                t = take(f'{src}{src_name}.{param}')
                if t is not None:
                    out[f'{dst}{dst_name}.{param}'] = t
        for src_name, dst_name in _LM_BIASES:
            t = take(src + src_name)
            if t is not None:
                out[dst + dst_name] = t.reshape(-1, t.shape[-1])
    emb, out_weight, out_bias, inv_freq = (
        take(k) for k in ('in_emb.weight', 'out_emb.weight', 'out_emb.bias', 'pos_emb.inv_freq'))
    _check_layout(f'{what} is not in the official TransformerLSModel layout (NVIDIA/transformer-ls autoregressive/)',
                  missing, sorted(set(state) - used))
    if not torch.equal(out_weight, emb):
        raise ValueError(f"{what}: 'out_emb.weight' differs from 'in_emb.weight'; the official model ties them, and "
                         'lsvision CharLM has one tied matrix')
    offset = _inv_freq_offset(inv_freq, emb.shape[1])
    for i in range(max(layers, default=-1) + 1):
        out[f'blocks.{i}.attn.pos_freq_offset'] = offset.clone()
    out['embed.weight'] = emb
    out['out_bias'] = out_bias
    return out


# one Transformer-XL layer: the authors' module -> lsvision's, and its parameters
_TXL_LAYER: List[Tuple[str, str, Tuple[str, ...]]] = [
    ('dec_attn.qkv_net', 'attn.qkv', ('weight',)),
    ('dec_attn.r_net', 'attn.r_net', ('weight',)),
    ('dec_attn.o_net', 'attn.proj', ('weight',)),
    ('dec_attn.layer_norm', 'norm1', ('weight', 'bias')),
    ('pos_ff.CoreNet.0', 'mlp.fc1', ('weight', 'bias')),
    ('pos_ff.CoreNet.3', 'mlp.fc2', ('weight', 'bias')),
    ('pos_ff.layer_norm', 'norm2', ('weight', 'bias')),
]
_HUB_PREFIX = 'transformer.'  # transformers' TransfoXLLMHeadModel: the MemTransformerLM body; `crit.` beside it


def _txl_layout(state: Dict) -> Tuple[StateDict, str]:
    """The MemTransformerLM names of a Transformer-XL state_dict (the Hub's `transformer.` prefix removed)."""
    state = _unwrap(state)
    if not any(k.startswith(_HUB_PREFIX) for k in state):
        return state, 'Transformer-XL state_dict'
    stray = sorted(k for k in state if not k.startswith((_HUB_PREFIX, 'crit.')))
    if stray:
        raise KeyError(f'Hugging Face Transformer-XL weights: {len(stray)} keys are neither under '
                       f"'{_HUB_PREFIX}' nor 'crit.': {stray[:8]}")
    return {k[len(_HUB_PREFIX):] if k.startswith(_HUB_PREFIX) else k: v for k, v in state.items()}, \
        'Hugging Face Transformer-XL weights (transfo-xl-wt103 layout)'


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal tensors; the same view of one storage (a tied parameter saved twice) without reading it, and meta
    tensors (shapes only) by shape."""
    if a.shape != b.shape:
        return False
    if a.is_meta or b.is_meta:
        return True
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()):
        return True
    return torch.equal(a, b)


def _check_tied(what: str, tied: Optional[torch.Tensor], to: torch.Tensor, name: str, source: str) -> None:
    if tied is not None and not _same_values(tied, to):
        raise ValueError(f"{what}: {name!r} differs from {source!r}; lsvision's Transformer-XL ties them (the "
                         "authors' WikiText-103 models: tie_weight, tie_projs of the tail clusters) and cannot load "
                         'untied ones')


def convert_txl_state_dict(state: Dict) -> StateDict:
    """Transformer-XL's `MemTransformerLM` state_dict (or the Hub's `TransfoXLLMHeadModel` one) -> `TransformerXL`.

    Shared u, v give `r_w_bias` / `r_r_bias` (heads, head_dim), per-layer ones (the Hub's `untie_r`) stacked to
    (depth, heads, head_dim). One embedding (div_val 1) gives `embed.weight`; several (div_val > 1) give
    `embed.layers.{i}.weight` and `embed.projs.{i}`, the head's own output projection `crit.head_proj`. The output
    biases of the clusters are concatenated into `crit.bias`.

    Raises:
        KeyError: Naming every expected key that is missing and every key that has no lsvision counterpart.
        ValueError: Untied output weights or tail projections, an input projection with div_val 1, other
            position frequencies.
    """
    state, what = _txl_layout(state)
    used: set = set()
    out: StateDict = {}
    missing: List[str] = []

    def take(key: str, optional: bool = False) -> Optional[torch.Tensor]:
        if key not in state:
            if not optional:
                missing.append(key)
            return None
        return _take(state, used, key)

    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r'^layers\.(\d+)\.', k))})
    depth = max(layers, default=-1) + 1
    for i in range(depth):
        for src_name, dst_name, params in _TXL_LAYER:
            for param in params:
                t = take(f'layers.{i}.{src_name}.{param}')
                if t is not None:
                    out[f'blocks.{i}.{dst_name}.{param}'] = t
    for name in ('r_w_bias', 'r_r_bias'):
        if name in state or f'layers.0.dec_attn.{name}' not in state:
            out[name] = take(name)
        else:  # untie_r: one per layer
            per_layer = [take(f'layers.{i}.dec_attn.{name}') for i in range(depth)]
            if all(t is not None for t in per_layer):
                out[name] = torch.stack(per_layer)
    n_emb = len({k for k in state if re.match(r'^word_emb\.emb_layers\.\d+\.weight$', k)})
    emb = [take(f'word_emb.emb_layers.{i}.weight') for i in range(max(n_emb, 1))]
    projs = [take(f'word_emb.emb_projs.{i}', optional=n_emb <= 1) for i in range(max(n_emb, 1))]
    out_w = [take(f'crit.out_layers.{i}.weight', optional=True) for i in range(max(n_emb, 1))]
    out_b = [take(f'crit.out_layers.{i}.bias') for i in range(max(n_emb, 1))]
    out_p = [take(f'crit.out_projs.{i}', optional=True) for i in range(max(n_emb, 1))]
    n_clusters = len({k for k in state if k.startswith('crit.cluster_')})
    if n_clusters:
        out['crit.cluster_weight'], out['crit.cluster_bias'] = take('crit.cluster_weight'), take('crit.cluster_bias')
    inv_freq = take('pos_emb.inv_freq', optional=True)
    _check_layout(f"{what} is not in the layout of the authors' MemTransformerLM (kimiyoung/transformer-xl "
                  'pytorch/mem_transformer.py, attn_type 0)', missing, sorted(set(state) - used))
    for i, (w, tied) in enumerate(zip(emb, out_w)):
        _check_tied(what, tied, w, f'crit.out_layers.{i}.weight', f'word_emb.emb_layers.{i}.weight')
    if n_emb <= 1:
        if projs[0] is not None:
            raise ValueError(f'{what}: an input projection word_emb.emb_projs.0 (d_embed {projs[0].shape[1]} != '
                             f'd_model {projs[0].shape[0]}) with div_val 1; lsvision embeds in d_model directly')
        out['embed.weight'] = emb[0]
    else:
        for i in range(n_emb):
            out[f'embed.layers.{i}.weight'], out[f'embed.projs.{i}'] = emb[i], projs[i]
        for i in range(1, n_emb):
            _check_tied(what, out_p[i], projs[i], f'crit.out_projs.{i}', f'word_emb.emb_projs.{i}')
        if out_p[0] is None:
            raise KeyError(f"{what}: 'crit.out_projs.0' (the head's output projection) is missing")
        out['crit.head_proj'] = out_p[0]
    out['crit.bias'] = torch.cat(out_b)
    if inv_freq is not None:
        _inv_freq_offset(inv_freq, out['blocks.0.attn.r_net.weight'].shape[1])  # checks the frequencies
    return out


def _fit_txl_biases(model: nn.Module, converted: StateDict, what: str) -> None:
    """Shared u, v into a model with per-layer ones (`untie_r`): the same value for every layer."""
    for name in ('r_w_bias', 'r_r_bias'):
        t, target = converted[name], getattr(model, name)
        if t.dim() == 2 and target.dim() == 3:
            converted[name] = t.expand(target.shape[0], -1, -1).clone()
        elif t.dim() == 3 and target.dim() == 2:
            raise ValueError(f"{what} has per-layer {name} (untie_r, as the Hub's transfo-xl-wt103); build the model "
                             'with untie_r=True (txl_wt103_large has it)')


def _set_official_settings(model: nn.Module, kind: str, converted: StateDict) -> None:
    """Sets what the authors' code runs the checkpoint with (see `load_official_checkpoint`)."""
    if kind == 'char_lm':
        if getattr(model, 'cache_mode', 'official') != 'official':
            _logger.info("official char-LM checkpoint: cache_mode %r -> 'official'", model.cache_mode)
            model.cache_mode = 'official'
        return
    encoder = model.encoder
    pool = 'cls' if 'encoder.cls_token' in converted else 'mean_official'
    if encoder.pool != pool:
        _logger.info('official LRA checkpoint %s a cls vector: pool %r -> %r',
                     'with' if pool == 'cls' else 'without', encoder.pool, pool)
        encoder.set_pool(pool)


def load_official_checkpoint(
        model: nn.Module,
        path_or_state: Union[str, Dict],
        kind: Optional[str] = None,
        official_settings: bool = True,
) -> None:
    """Loads an official LRA or char-LM checkpoint into `model` (strict) so that it gives the official outputs.

    Besides the weights, the official code runs a checkpoint with settings that the file does not hold; with
    `official_settings` (default) they are set on `model`:

    * char-LM: `cache_mode='official'`. fairseq starts every stream from a zero cache (B, M, D) per layer that is
      attended like real tokens, and the weights were trained that way. lsvision's default `'masked'` masks the
      cache slots that no real token has filled yet: the first blocks of a stream then differ from the official
      model's (until every layer's cache holds states computed from filled caches), later ones are equal.
    * LRA: the pooling after the file. With a cls vector (official `--cls_last_layer`) `pool='cls'`; without one
      `pool='mean_official'`, the official MEAN pooling: the final-normed tokens times the padding mask, averaged
      over all n positions (real tokens summed, divided by n). A cls parameter the model lacks is added, one the
      file lacks is removed. (An official model trained with `pooling_mode CLS` and no `--cls_last_layer`, a cls
      *token id* prepended to the input, saves no cls vector either; lsvision has no such mode.)

    Args:
        model: An `LraClassifier` / `LraDualClassifier`, a `CharLM` or a `TransformerXL`.
        path_or_state: A checkpoint file (read with weights_only=True) or a loaded checkpoint / state_dict: for the
            char-LM the bare `TransformerLSModel` state_dict or a fairseq checkpoint (`['model']`); for
            Transformer-XL the `MemTransformerLM` state_dict or the Hub's weights (`convert_txl_state_dict`; shared
            u, v go into every layer of an `untie_r` model). fp16 files (fairseq `--fp16`) are accepted: every
            tensor is cast to the model's dtype.
        kind: 'lra', 'char_lm' or 'txl'; inferred from the model when None.
        official_settings: Set the settings above (False: load the weights only and keep the model's settings; an
            LRA model whose pooling does not fit the file's cls vector then fails the strict load).

    Raises:
        KeyError, ValueError: The checkpoint does not fit (the message names the keys).
        RuntimeError: From `load_state_dict` (strict) when the model's settings differ from the checkpoint's.
    """
    state = torch.load(path_or_state, map_location='cpu', weights_only=True) \
        if isinstance(path_or_state, str) else path_or_state
    if kind is None:
        kind = 'txl' if isinstance(model, TransformerXL) else 'lra' if hasattr(model, 'encoder') else 'char_lm'
    if kind not in ('lra', 'char_lm', 'txl'):
        raise ValueError(f"kind must be 'lra', 'char_lm' or 'txl', got {kind!r}")
    if kind == 'txl':
        converted = convert_txl_state_dict(state)
        _fit_txl_biases(model, converted, 'the Transformer-XL checkpoint')
        model.load_state_dict(converted, strict=True)
        return
    converted = convert_lra_state_dict(state) if kind == 'lra' else convert_char_lm_state_dict(state)
    if official_settings:
        _set_official_settings(model, kind, converted)
    model.load_state_dict(converted, strict=True)  # copies, casting each tensor to the model's dtype
