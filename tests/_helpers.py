"""Helpers shared by the test modules: tool loading, weight perturbation, one tiny config per model family.

Test modules import them by name (``from _helpers import load_tool``): ``conftest.py`` puts ``tests/`` on sys.path.
"""
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Optional

import torch
import torch.nn as nn

import timm

import lsvision  # noqa: F401  (registers the models)

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / 'tools'

# one tiny config per image model family (the smallest registered model of each, shrunk by constructor kwargs):
# builds in milliseconds and runs at IMAGE_SIZE[name] (default 64) in a few ms, with every feature level present
TINY_FAMILIES: Dict[str, Dict[str, Any]] = {
    'cvt_13': dict(embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 2)),
    'cvt_ls_13': dict(embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 2), window_sizes=(4, 2, 2),
                      dp_ranks=(4, 2, 2)),
    'vil_ls_medium': dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 2, 2, 1)),
    'pvt_tiny_grc': dict(img_size=64, depths=(1, 1, 1, 1), embed_dims=(16, 32, 40, 64)),
    'pvt_v2_b0_grc': dict(img_size=64, depths=(1, 1, 1, 1)),
    'swin_tiny_patch4_window7_224_grc': dict(img_size=64, embed_dim=32, depths=(2, 1, 1, 1), num_heads=(2, 2, 4, 4)),
    'vit_small_patch16_224_grc': dict(img_size=64, embed_dim=64, depth=3, num_heads=2),  # timm's tests want 3 taps
}


def load_tool(name: str) -> ModuleType:
    """Imports ``tools/<name>.py`` as a module (tools/ is not a package).

    tools/ goes on sys.path first, as when the script runs: the tools import their helper modules
    (``tools/_bench_*.py``) by name.
    """
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def perturb(module: nn.Module, std: float = 0.1, generator: Optional[torch.Generator] = None) -> nn.Module:
    """Adds N(0, std²) noise to every parameter in place, so that each weight (bias, norm affine, rel-pos table)
    moves off its init and matters to the output; returns ``module``.

    Args:
        module: the module to perturb.
        std: standard deviation of the noise.
        generator: CPU random generator; None draws from torch's global one (as ``torch.randn_like``).
    """
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) * std)
    return module


def tiny_model(name: str, seed: int = 0, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` of :data:`TINY_FAMILIES`' config of ``name``, seeded; ``kwargs`` override it."""
    torch.manual_seed(seed)
    return timm.create_model(name, **{**TINY_FAMILIES[name], **kwargs})
