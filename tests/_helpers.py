"""Helpers shared by the test modules: tool loading, weight perturbation, tiny model configs (one per model family,
and of the few other models tests build), an image folder for training runs, a free port for process groups.

Test modules import them by name (``from _helpers import load_tool``): ``conftest.py`` puts ``tests/`` on sys.path.
"""
import atexit
import contextlib
import importlib.util
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence
from unittest import mock

import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import GatedRecurrentCache
from lsvision.runtime import fresh_process_context

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


# what the forkserver imports once per test process, so that each torchrun worker starts with them imported
_FORKSERVER_PRELOAD = ['torch', 'torch.distributed', 'timm', 'lsvision', 'torchvision']
_TORCHRUN_SIGNALS = ('SIGTERM', 'SIGINT', 'SIGHUP', 'SIGQUIT')  # the ones torchrun's agent takes over


def forkserver() -> str:
    """The start method for test processes: 'forkserver', its server (lsvision.runtime.fresh_process_context, as the
    benchmarks' fresh processes use it) importing torch, timm, torchvision and lsvision once per test process (a
    spawned interpreter imports them each time, ~9 CPU-s)."""
    return fresh_process_context(_FORKSERVER_PRELOAD).get_start_method()


def _run_as_main(argv: Sequence[str]) -> None:
    """``python SCRIPT ARGS`` (argv = [SCRIPT, *ARGS]) in a forkserver child: the platform's default start method (a
    forkserver child inherits 'forkserver'; a new interpreter has e.g. 'fork' on Linux before Python 3.14, which the
    DataLoader's worker processes use), sys.argv and sys.path[0] as the interpreter sets them, the script as
    ``__main__``."""
    multiprocessing.set_start_method(None, force=True)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name='__main__')


class _ScriptWithEnv:
    """A torchrun worker's entrypoint: the test's environment, then the script as ``python SCRIPT ARGS`` runs it (what
    torchrun's ``--run-path`` entrypoint does, with the script's folder first on sys.path as the interpreter puts
    it). A class, so that it pickles to the forkserver and has the ``__name__`` torchrun names a run after."""

    def __init__(self, env: Dict[str, str]):
        self.env = env
        self.__name__ = self.__qualname__ = 'run_script_path'

    def __call__(self, script: str, *script_args: str) -> None:
        os.environ.update(self.env)
        _run_as_main([script, *script_args])


def torchrun(torchrun_args: Sequence[str], log_dir: Path, env: Optional[Dict[str, str]] = None
             ) -> subprocess.CompletedProcess:
    """``torchrun TORCHRUN_ARGS`` (single node) by torchrun's own code in this process: its argument parsing, its
    elastic agent and rendezvous, with its ``--run-path --start-method forkserver --redirects 3 --log-dir`` options.

    The workers are forked from a forkserver that has torch, timm and lsvision imported (once per test process),
    so a launch costs no imports: a ``torchrun`` command costs three interpreters' imports (~25 CPU-s). ``env`` is
    the command's environment (its differences from this process's are set in each worker). Returns what
    ``subprocess.run(['torchrun', ...], capture_output=True)`` would: exit status 1 when a worker failed (stderr
    ends with torchrun's failure summary), stdout / stderr the workers' outputs, rank 0 first.
    """
    from torch.distributed import run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    log_dir.mkdir(parents=True, exist_ok=True)
    args = torchrun_module.parse_args(['--run-path', '--start-method', forkserver(), '--redirects', '3',
                                       '--log-dir', str(log_dir), *torchrun_args])
    overrides = {k: v for k, v in (env or {}).items() if os.environ.get(k) != v}
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in _TORCHRUN_SIGNALS}
    returncode, failure = 0, ''
    try:  # torchrun's run(), its --run-path entrypoint wrapped to set the environment first
        with mock.patch.object(torchrun_module, 'run_script_path', _ScriptWithEnv(overrides)):
            torchrun_module.run(args)
    except ChildFailedError as e:
        returncode, failure = 1, f'{e}\n'
    finally:
        for name, handler in handlers.items():  # pytest's own handlers back (Ctrl-C, timeouts)
            signal.signal(getattr(signal, name), handler)
    outputs = {}
    for stream in ('stdout', 'stderr'):
        logs = sorted(log_dir.rglob(f'{stream}.log'), key=lambda f: (int(f.parent.name), str(f)))
        outputs[stream] = ''.join(f.read_text(errors='replace') for f in logs)
    return subprocess.CompletedProcess(['torchrun', *torchrun_args], returncode, outputs['stdout'],
                                       outputs['stderr'] + failure)


def _script_process(argv: List[str], cwd: str, env: Dict[str, str], out: str, err: str) -> None:
    """The forked child of :func:`run_script`: outputs to files, the given environment and folder, then the script
    as ``__main__`` (sys.argv and sys.path[0] as the interpreter sets them)."""
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    os.environ.clear()
    os.environ.update(env)
    if 'OMP_NUM_THREADS' in env:  # read at torch's import, which the forkserver did
        torch.set_num_threads(int(env['OMP_NUM_THREADS']))
    if 'huggingface_hub.constants' in sys.modules:  # HF_HUB_OFFLINE, HF_HOME, ...: read at its import, as above
        importlib.reload(sys.modules['huggingface_hub.constants'])
    os.chdir(cwd)
    try:
        _run_as_main(argv[1:])
    finally:  # an interpreter runs them at exit; a multiprocessing child does not
        atexit._run_exitfuncs()


def run_script(argv: Sequence[str], cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """What ``subprocess.run(argv, cwd=, env=, capture_output=True, text=True, timeout=)`` returns for
    ``argv = [sys.executable, SCRIPT, *args]``, from a process forked from the forkserver (torch, timm, torchvision
    and lsvision imported once per test process) instead of a new interpreter (~9 CPU-s of imports each).

    The script runs as ``__main__`` with its own sys.argv, environment, folder and sys.path[0]; its exit status is
    the interpreter's (SystemExit's code, 1 on an uncaught exception with its traceback on stderr); torch's thread
    count and huggingface_hub's settings (HF_HUB_OFFLINE, HF_HOME, ...), read at their import, are taken again from
    the script's environment. Not for tests of what an interpreter imports, nor for other variables read at import.
    """
    assert argv[0] == sys.executable and str(argv[1]).endswith('.py'), argv
    with tempfile.TemporaryDirectory(prefix='run_script_') as tmp:
        out, err = os.path.join(tmp, 'stdout'), os.path.join(tmp, 'stderr')
        child = multiprocessing.get_context(forkserver()).Process(
            target=_script_process, args=([str(a) for a in argv], str(cwd or os.getcwd()),
                                          dict(os.environ if env is None else env), out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(list(argv), timeout)
        with open(out, errors='replace') as o, open(err, errors='replace') as e:
            return subprocess.CompletedProcess(list(argv), child.exitcode, o.read(), e.read())
