"""Shared pytest fixtures. `../shared/golden` (outputs of the authors' code) sits beside the checkout in CI."""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference_attention directly
torch.set_num_threads(min(2, torch.get_num_threads()))

GOLDEN_ROOT = Path(__file__).resolve().parents[2] / 'shared' / 'golden'


def _golden_path(path: Path) -> Path:
    """`path` if it exists; else the test fails in CI and is skipped elsewhere."""
    if not path.exists():
        if os.environ.get('CI'):
            pytest.fail(f'golden data missing at {path}: CI must have ../shared beside the checkout')
        pytest.skip(f'golden data not found at {path} (it sits beside the checkout in CI)')
    return path


@pytest.fixture(scope='session')
def golden_root() -> Path:
    """The root of the golden data (one folder per reference: vil_ls_official/, char_lm_official/, ...)."""
    return _golden_path(GOLDEN_ROOT)


@pytest.fixture(scope='session')
def golden_dir(golden_root: Path) -> Path:
    """The official ViL-LS reference outputs."""
    return _golden_path(golden_root / 'vil_ls_official')
