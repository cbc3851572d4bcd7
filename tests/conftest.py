"""Shared pytest fixtures. Golden outputs of the authors' code live in the repository, under `tests/golden/`.

Shared helpers that are not fixtures live in `tests/_helpers.py` (importable as `_helpers`, since `tests/` is put on
sys.path here): `load_tool` (a tools/ script as a module), `perturb` (weights off their init), `TINY_FAMILIES`,
`TINY_CONFIGS` and `tiny_model` (one tiny config per model family, and of the other models tests build), and a few
more (an image folder to train on, a free port, the GRC layers of a model, the evaluation tools' checkpoint).
"""
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import _helpers, reference_attention, ... directly
# Torch threads of a test process: at most 2, and the cores shared out between pytest-xdist's workers (`make unit`
# runs 2 on 2 cores: 1 each). More OpenMP threads than free cores make every step many times slower, the threads
# spinning while they wait for each other: two processes of 2 threads each doing a tiny model's training steps on
# 2 busy cores took 18-200 s where 1 thread each took 3.5 s. The tests' own subprocesses inherit the count through
# OMP_NUM_THREADS (a tool's --threads still sets its own).
_WORKERS = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1') or 1)
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)
_THREADS = max(1, min(2, torch.get_num_threads(), _CORES // _WORKERS))
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ['OMP_NUM_THREADS'] = str(_THREADS)

# the one root of the golden data (tests/golden/README.md says where each folder came from)
GOLDEN_ROOT = Path(__file__).resolve().parent / 'golden'


def golden_path(name: str) -> Path:
    """A file or folder under :data:`GOLDEN_ROOT`; fails the test (never skips) when it is missing."""
    path = GOLDEN_ROOT / name
    if not path.exists():
        pytest.fail(f'golden data missing at {path}: it is part of the repository, restore it with '
                    f'`git checkout -- {path.relative_to(GOLDEN_ROOT.parents[1])}`')
    return path


@pytest.fixture(scope='session')
def golden_root() -> Path:
    """The root of the golden data (one folder per reference: vil_ls_official/, char_lm_official/, ...)."""
    return golden_path('.')


@pytest.fixture(scope='session')
def golden_dir() -> Path:
    """The official ViL-LS reference outputs (tests/golden/vil_ls_official)."""
    return golden_path('vil_ls_official')


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Tools run in-process set torch's thread count (``--threads 1``); every test gets the suite's count back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """Tools run in-process set up logging (timm's `setup_default_logging`, `logging.basicConfig`): a handler on the
    root logger bound to that test's captured stderr, which is closed once the test ends, so that a later test's log
    lines would print "--- Logging error ---" tracebacks. Every test gets the root logger's handlers and level back
    (pytest's own capturing handlers it manages itself)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers and not type(handler).__module__.startswith('_pytest'):
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """An empty Hugging Face cache (offline) and TORCH_HOME; huggingface_hub read its settings at import, so its
    constants are pointed there too."""
    import huggingface_hub.constants as hf_constants
    hub, torch_home = tmp_path / 'hf', tmp_path / 'torch'
    hub.mkdir()
    monkeypatch.setenv('HF_HUB_CACHE', str(hub))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setenv('TORCH_HOME', str(torch_home))
    monkeypatch.setattr(hf_constants, 'HF_HUB_CACHE', str(hub))
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', True)
    return hub, torch_home
