"""The authors' Transformer-XL code (tests/official/transformer_xl, kimiyoung/transformer-xl `pytorch/`), loaded for
tests, and the checkpoint layouts it and the Hugging Face Hub save.

`official()` imports their `mem_transformer` and `data_utils` as their scripts do (their folder and its `utils/` on
sys.path), then takes their generic module names (`utils`, `data_utils`, ...) out of `sys.modules` again so that
nothing else in the test session sees them. `proj_adaptive_softmax` reads `torch.version.cuda` at import; on a
CPU-only torch (None) it is given a version string for the import only.
"""
import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterator, Sequence

import torch
import torch.nn as nn

OFFICIAL_DIR = Path(__file__).resolve().parent / 'official' / 'transformer_xl'
_NAMES = ('mem_transformer', 'data_utils', 'proj_adaptive_softmax', 'log_uniform_sampler', 'utils',
          'utils.vocabulary')
_LOADED = None
_MODULES: Dict[str, object] = {}


def official() -> SimpleNamespace:
    """`MemTransformerLM` and `LMOrderedIterator` of the authors' code (imported once)."""
    global _LOADED
    if _LOADED is None:
        saved = {n: sys.modules.pop(n) for n in _NAMES if n in sys.modules}
        paths = [str(OFFICIAL_DIR), str(OFFICIAL_DIR / 'utils')]
        sys.path[:0] = paths
        cuda = torch.version.cuda
        try:
            if cuda is None:
                torch.version.cuda = '0.0'
            mem_transformer = importlib.import_module('mem_transformer')
            data_utils = importlib.import_module('data_utils')
            _MODULES.update({n: sys.modules[n] for n in _NAMES if n in sys.modules})
        finally:
            torch.version.cuda = cuda
            del sys.path[:len(paths)]
            for n in _NAMES:
                sys.modules.pop(n, None)
            sys.modules.update(saved)
        _LOADED = SimpleNamespace(MemTransformerLM=mem_transformer.MemTransformerLM,
                                  LMOrderedIterator=data_utils.LMOrderedIterator)
    return _LOADED


@contextmanager
def their_environment() -> Iterator[None]:
    """Their modules importable under their own names (as in their scripts), e.g. to pickle or unpickle their
    whole model as their train.py saves `model.pt`."""
    official()
    saved = {n: sys.modules[n] for n in _MODULES if n in sys.modules}
    sys.modules.update(_MODULES)
    try:
        yield
    finally:
        for n in _MODULES:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def official_model(vocab: int, depth: int, heads: int, head_dim: int, dim: int, inner: int, *, cutoffs: Sequence[int]
                   = (), div_val: int = 1, tgt_len: int = 8, mem_len: int = 8, clamp_len: int = -1,
                   same_length: bool = False, seed: int = 0, dtype=torch.float64) -> nn.Module:
    """The authors' `MemTransformerLM` as their train.py builds it for WikiText-103 (tied weights; with cutoffs the
    tail projections tied, `tie_projs = [False] + [True] * len(cutoffs)`), every parameter random (N(0, 0.3), layer
    norms around 1), in eval mode, keeping the order of the per-token losses (`crit.keep_order`)."""
    torch.manual_seed(seed)
    model = official().MemTransformerLM(
        vocab, depth, heads, dim, head_dim, inner, dropout=0., dropatt=0., tie_weight=True, d_embed=dim,
        div_val=div_val, tie_projs=[False] + [True] * len(cutoffs), tgt_len=tgt_len, ext_len=0, mem_len=mem_len,
        cutoffs=list(cutoffs), same_length=same_length, clamp_len=clamp_len)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std + (1. if 'layer_norm.weight' in name else 0.))
    model.crit.keep_order = True
    return model.to(dtype).eval()


def hub_layout(state: Dict[str, torch.Tensor], depth: int, untie_r: bool = True) -> Dict[str, torch.Tensor]:
    """The layout of the Hub's transfo-xl-wt103 weights (transformers' `TransfoXLLMHeadModel`) for the authors'
    state dict: the model under `transformer.`, the softmax under `crit.`; with `untie_r` (its config) each layer
    holds its own `dec_attn.r_w_bias` / `r_r_bias` instead of the model's shared ones (here copies of them)."""
    out = {}
    for k, v in state.items():
        if k.startswith('crit.'):
            out[k] = v
        elif untie_r and k in ('r_w_bias', 'r_r_bias'):
            for i in range(depth):
                out[f'transformer.layers.{i}.dec_attn.{k}'] = v.clone()
        else:
            out['transformer.' + k] = v
    return out
