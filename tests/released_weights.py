"""Offline stand-ins for the authors' released weights, in their real layouts and cache places.

* The Hub's microsoft/cvt-* repositories: a transformers ``CvtForImageClassification`` (random, perturbed weights
  and BatchNorm statistics) saved as ``pytorch_model.bin`` only, as on the Hub's ``main`` today, in a Hugging Face
  cache laid out as huggingface_hub writes it (``models--microsoft--cvt-13/{refs/main, snapshots/<commit>/}``). The
  reference outputs come from the same transformers model with its MLP activation set to QuickGELU (Microsoft's
  code; transformers' port uses GELU), so the key layout and the maths are transformers', not lsvision's.
* NVIDIA/transformer-ls ``model_best.pth`` files: the official key names (``tests/golden/vil_ls_official/
  full_key_shapes.json``, taken from the authors' model), random values, the ``net`` / ``module.`` wrapping with
  the int64 index buffers, numpy ``best_acc`` and an optimizer state, in timm's cache under the name the tag gives.

Nothing here downloads; the tests point ``HF_HUB_CACHE`` (with ``HF_HUB_OFFLINE=1``) and ``TORCH_HOME`` at the
folders these functions fill.
"""
import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from _helpers import perturb
from official_layouts import official_vil

import timm
from timm.layers import QuickGELU

GOLDEN_VIL = Path(__file__).resolve().parent / 'golden' / 'vil_ls_official'

# the Microsoft CvT configurations, as transformers' CvtConfig arguments (embed_dim, num_heads, depth)
CVT_ARCHS: Dict[str, Tuple[Sequence[int], Sequence[int], Sequence[int]]] = {
    'cvt_13': ((64, 192, 384), (1, 3, 6), (1, 2, 10)),
    'cvt_21': ((64, 192, 384), (1, 3, 6), (1, 4, 16)),
    'cvt_w24': ((192, 768, 1024), (3, 12, 16), (2, 2, 20)),
}


def transformers_cvt(arch: str, seed: int = 0, num_labels: int = 1000, quick_gelu: bool = True) -> nn.Module:
    """A transformers CvT of one of :data:`CVT_ARCHS` (or a (dims, heads, depths) tuple), every parameter and BN
    statistic moved off its init, in eval mode; with ``quick_gelu`` its MLPs use QuickGELU as Microsoft's code."""
    from transformers import CvtConfig, CvtForImageClassification
    dims, heads, depths = CVT_ARCHS[arch] if isinstance(arch, str) else arch
    config = CvtConfig(embed_dim=list(dims), num_heads=list(heads), depth=list(depths), num_labels=num_labels)
    torch.manual_seed(seed)
    model = CvtForImageClassification(config)
    g = torch.Generator().manual_seed(seed + 1)
    perturb(model, 0.05, g)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    if quick_gelu:
        for m in model.modules():
            if type(m).__name__ == 'CvtIntermediate':
                m.activation = QuickGELU()
    return model.eval()


def transformers_logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=x).logits


def put_in_hub_cache(cache: Path, repo_id: str, file: Path, filename: str = 'pytorch_model.bin') -> Path:
    """Place ``file`` in a Hugging Face cache as ``repo_id``'s ``main`` revision holds it (a hard link)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / 'snapshots' / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / 'refs').mkdir(exist_ok=True)
    (repo / 'refs' / 'main').write_text(commit)
    target = snapshot / filename
    if not target.exists():
        os.link(file, target)
    return target


def official_vil_shapes(name: str) -> Dict[str, Tuple[int, ...]]:
    """The official state_dict key shapes of a released ViL-LS: the authors' model's (``full_key_shapes.json``) for
    Medium and Base at 224; for Medium at 384 the authors' layout of the 384 model (w = 8, 24x24 and 12x12 maps),
    written with the test's own names (``official_layouts.official_vil``), which are the 224 file's keys."""
    shapes = json.loads((GOLDEN_VIL / 'full_key_shapes.json').read_text())
    if name in ('vil_ls_medium', 'vil_ls_base'):
        return {k: tuple(v) for k, v in shapes[f'{name}_224'].items()}
    net = official_vil(timm.create_model(name, device='meta'))['net']
    ours = {k[len('module.'):]: tuple(v.shape) for k, v in net.items()}
    assert ours.keys() == shapes['vil_ls_medium_224'].keys(), f"{name}: not the keys of the authors' Medium"
    return {k: ours[k] for k in shapes['vil_ls_medium_224']}  # in the authors' order


def official_vil_checkpoint(shapes: Dict[str, Tuple[int, ...]], seed: int) -> Dict:
    """A ``model_best.pth`` of the official trainer: ``net`` (DDP keys) with random float tensors and int64 index
    buffers, numpy ``best_acc``, an optimizer and a scheduler state."""
    g = torch.Generator().manual_seed(seed)
    net = {}
    for k, shape in shapes.items():
        if k.endswith('relative_position_index'):
            net['module.' + k] = torch.zeros(shape, dtype=torch.int64)
        elif k.endswith(('norm.weight', 'norm_embed.weight', 'dual_ln_dp.weight', 'dual_ln_full.weight')):
            net['module.' + k] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            net['module.' + k] = 0.05 * torch.randn(shape, generator=g)
    return {
        'net': net, 'arch': 'msvit', 'epoch': 299, 'best_acc': np.float64(83.8),
        'optimizer': {'state': {0: {'step': torch.tensor(1.0)}}, 'param_groups': [{'lr': 1e-3, 'params': [0]}]},
        'scheduler': {'last_epoch': 299, '_last_lr': [1e-5]},
    }


def vil_cache_file(torch_home: Path, name: str) -> Path:
    """Where timm keeps the tag's download: ``$TORCH_HOME/hub/checkpoints/<the tag's file name>``."""
    url = timm.models.get_pretrained_cfg(name).url
    assert isinstance(url, tuple), f'{name}: the url must name its cache file'
    folder = torch_home / 'hub' / 'checkpoints'
    folder.mkdir(parents=True, exist_ok=True)
    return folder / url[1]


def assert_loaded_from(model: nn.Module, tensors: Dict[str, torch.Tensor], head: Tuple[str, ...] = ()) -> None:
    """Every float tensor of ``model`` equals a tensor of the checkpoint (matched by value, whatever the layout's
    names), and every float tensor of the checkpoint is one of the model's: nothing left at its init, nothing
    dropped. ``head``: key prefixes of the classifier (model's and checkpoint's) left out, for a new class count."""
    def floats(d):
        return [v for k, v in d.items() if torch.is_tensor(v) and v.is_floating_point() and not k.startswith(head)]

    def fingerprint(v):  # shape and first values pick the candidates (cheap: CvT-W24 has 277M), torch.equal decides
        return tuple(v.shape), tuple(v.reshape(-1)[:4].tolist())
    by_key: Dict[Tuple, list] = {}
    for v in floats(tensors):
        by_key.setdefault(fingerprint(v), []).append(v)
    unmatched = []
    for name, v in model.state_dict().items():
        if not v.is_floating_point() or name.startswith(head):
            continue
        candidates = by_key.get(fingerprint(v), [])
        match = next((i for i, c in enumerate(candidates) if torch.equal(c, v)), None)
        if match is None:
            unmatched.append(name)
        else:
            candidates.pop(match)
    left = sum(len(c) for c in by_key.values())
    assert not unmatched, f'model tensors not loaded from the checkpoint: {unmatched[:8]}'
    assert left == 0, f'{left} checkpoint tensors were not loaded into the model'


def random_hub_state_dict(arch: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random weights in transformers' CvT layout for one of :data:`CVT_ARCHS`, without building the model (its
    keys and shapes come from a meta-device transformers model): for the loading lines, where the tensors only have
    to be traced to where they land (CvT-W24 has 277M parameters)."""
    from transformers import CvtConfig, CvtForImageClassification
    dims, heads, depths = CVT_ARCHS[arch]
    with torch.device('meta'):
        model = CvtForImageClassification(CvtConfig(
            embed_dim=list(dims), num_heads=list(heads), depth=list(depths), num_labels=1000))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in model.state_dict().items():
        if not v.is_floating_point():
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif k.endswith('running_var'):
            out[k] = torch.rand(v.shape, generator=g) + 0.5
        else:
            out[k] = torch.randn(v.shape, generator=g) * 0.02
    return out
