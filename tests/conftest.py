"""Shared pytest fixtures. `../shared/golden` (outputs of the authors' code) sits beside the checkout in CI."""
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import reference_attention directly
torch.set_num_threads(min(2, torch.get_num_threads()))

GOLDEN_ROOT = Path(__file__).resolve().parents[2] / 'shared' / 'golden'


@pytest.fixture(scope='session')
def golden_dir() -> Path:
    path = GOLDEN_ROOT / 'vil_ls_official'
    if not path.is_dir():
        if os.environ.get('CI'):
            pytest.fail(f'golden data missing at {path}: CI must have ../shared beside the checkout')
        pytest.skip(f'golden data not found at {path} (it sits beside the checkout in CI)')
    return path
