"""Helpers shared by the test modules: tool loading, weight perturbation, tiny model configs (one per model family,
and of the few other models tests build), an image folder for training runs, a free port for process groups.

Test modules import them by name (``from _helpers import load_tool``): ``conftest.py`` puts ``tests/`` on sys.path.
"""
import contextlib
import importlib.util
import multiprocessing
import os
import socket
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import GatedRecurrentCache

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
# tiny configs of the other models that tests build by name: a plain baseline and a variant of a family, each in
# its family's tiny sizes (not in TINY_FAMILIES: the per-family tests run one model a family)
TINY_VARIANTS: Dict[str, Dict[str, Any]] = {
    'pvt_tiny': dict(TINY_FAMILIES['pvt_tiny_grc']),  # PVT v1 without GRC
    'pvt_v2_b2_li_grc': dict(TINY_FAMILIES['pvt_tiny_grc']),  # PVT v2 with linear spatial-reduction attention
}
TINY_CONFIGS: Dict[str, Dict[str, Any]] = {**TINY_FAMILIES, **TINY_VARIANTS}
# a two-stage ViL-LS at 32 px (maps 8 / 4): a long-short stage with a cls token, then a full-attention one, head
# dims of 16 (the CUDA memory-efficient kernel's alignment); no BatchNorm anywhere
TINY_VIL_LS_TWO_STAGES: Dict[str, Any] = dict(
    img_size=32, embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2), patch_sizes=(4, 2),
    attn_types=('long_short', 'full'), num_cls_tokens=(1, 0), window_sizes=(2, 2), dp_ranks=(2, 2))
# a two-stage CvT at 64 px (maps 16 / 8): a stage without and one with the cls token, one block each (cvt_13; add
# window_sizes=(4, 2), dp_ranks=(4, 2) for cvt_ls_13): for tests whose cost grows with the layers traced (export,
# torch.compile)
TINY_CVT_TWO_STAGES: Dict[str, Any] = dict(
    embed_dims=(16, 32), num_heads=(1, 2), depths=(1, 1), patch_sizes=(7, 3), patch_strides=(4, 2),
    patch_paddings=(2, 1), cls_token_stages=(False, True))
# one config per family smaller than TINY_FAMILIES, for tests whose cost grows with the layers run or traced (ONNX
# export, the fake CUDA device): two stages of one block (Swin: two in its first stage, the plain and the shifted
# window; ViT: one block), each family keeping its kinds of stage (CvT: without and with the cls token; PVT: a reducing
# and a non-reducing stage, the cls token in the last; ViL-LS: a long-short and a full-attention one); head dims of 16
# or 32 (the CUDA memory-efficient kernel's alignment)
TINY_TWO_STAGE_FAMILIES: Dict[str, Dict[str, Any]] = {
    'cvt_13': TINY_CVT_TWO_STAGES,
    'cvt_ls_13': dict(TINY_CVT_TWO_STAGES, window_sizes=(4, 2), dp_ranks=(4, 2)),
    'vil_ls_medium': TINY_VIL_LS_TWO_STAGES,
    'pvt_tiny_grc': dict(img_size=64, depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), mlp_ratios=(8, 4),
                         sr_ratios=(2, 1)),
    'pvt_v2_b0_grc': dict(img_size=64, depths=(1, 1), embed_dims=(32, 64), num_heads=(1, 2), mlp_ratios=(8, 4),
                          sr_ratios=(8, 1)),
    'swin_tiny_patch4_window7_224_grc': dict(img_size=64, embed_dim=32, depths=(2, 1), num_heads=(2, 2)),
    'vit_small_patch16_224_grc': dict(img_size=64, embed_dim=64, depth=1, num_heads=2),
}
assert TINY_TWO_STAGE_FAMILIES.keys() == TINY_FAMILIES.keys(), 'one config per family'
# the cvt_ls_13 of the evaluation tools' tests: one block and one head a stage, the default windows
EVAL_CVT_LS: Dict[str, Any] = dict(embed_dims=(16, 32, 64), num_heads=(1, 1, 1), depths=(1, 1, 1))


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


def save_eval_checkpoint(path: Path) -> Path:
    """:data:`EVAL_CVT_LS` (seed 0) saved as a safetensors file at ``path``, for the evaluation tools; returns it."""
    torch.manual_seed(0)
    save_file(timm.create_model('cvt_ls_13', **EVAL_CVT_LS).state_dict(), str(path))
    return path


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
    """``timm.create_model`` of :data:`TINY_CONFIGS`' config of ``name``, seeded; ``kwargs`` override it."""
    torch.manual_seed(seed)
    return timm.create_model(name, **{**TINY_CONFIGS[name], **kwargs})


class _NoValuesOnMeta(TorchFunctionMode):
    """In-place ops on meta tensors return their input unchanged, except those that change a tensor's shape, strides
    or autograd flag: on the meta device a model's initialisation (trunc_normal_ and the like) runs through torch's
    Python reference ops, seconds a large model, and there is no value to set anyway."""

    KEEP = frozenset({'resize_', 'resize_as_', 'set_', 'as_strided_', 'squeeze_', 'unsqueeze_', 't_', 'transpose_',
                      'swapdims_', 'swapaxes_', 'requires_grad_'})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, '__name__', '')
        if (name.endswith('_') and not name.endswith('__') and name not in self.KEEP and args
                and isinstance(args[0], torch.Tensor) and args[0].is_meta):
            return args[0]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shapes_only():
    """Models built inside are on the meta device and skip their initialisation (see :class:`_NoValuesOnMeta`): for
    tests of shapes and parameter counts only, ~10x faster to build than on the meta device alone."""
    with torch.device('meta'), _NoValuesOnMeta():
        yield


def grc_modules(model: nn.Module) -> List[GatedRecurrentCache]:
    """Every GRC layer of ``model`` (image and sequence ones), in module order."""
    return [m for m in model.modules() if isinstance(m, GatedRecurrentCache)]


def grc_caches(model: nn.Module) -> List[torch.Tensor]:
    """A copy of every GRC layer's cache, in module order."""
    return [m.cache.clone() for m in grc_modules(model)]


def model_kwargs_args(kwargs: Dict[str, Any]) -> List[str]:
    """The words of ``--model-kwargs`` that give ``kwargs`` to the tools (``key=<Python literal>`` each, which they
    read back with ``ast.literal_eval``)."""
    return [f'{key}={value!r}' for key, value in kwargs.items()]


def write_two_class_images(root: Path, per_class: int = 12, size: int = 16) -> None:
    """An image folder of two classes that differ in where a bright square is, plus noise: ``root/train`` with
    ``per_class`` PNGs a class, ``root/val`` with 4; the same pixels on every call."""
    rng = np.random.RandomState(0)
    for split, n in (('train', per_class), ('val', 4)):
        for c in range(2):
            d = root / split / f'class{c}'
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = rng.randint(0, 60, (size, size, 3)).astype(np.uint8)
                img[2:8, (2 if c == 0 else 8):(8 if c == 0 else 14)] = 230
                Image.fromarray(img).save(d / f'{i:03d}.png')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _main_as_rank(rank: int, port: int, main: Callable[[List[str]], int], argv: List[str]) -> None:
    """One of two processes of a torchrun-like job (its environment set as torchrun sets it)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2', MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    code = main(argv)
    torch.distributed.destroy_process_group()
    sys.exit(code)


def run_as_two_processes(main: Callable[[List[str]], int], argv: List[str]) -> None:
    """A tool's ``main(argv)`` in two processes of one job (gloo; forked, so no second import of torch); both must
    exit with 0."""
    context, port = multiprocessing.get_context('fork'), free_port()
    procs = [context.Process(target=_main_as_rank, args=(rank, port, main, argv)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
