"""A byte-level language-modelling corpus that every Python install carries: its standard library's source.

Every top-level `*.py` file of `sysconfig.get_paths()['stdlib']`, sorted by name, concatenated as bytes; the first
90 % is the training split, the rest validation. The corpus differs between Python versions (CPython 3.11.7: 168
files, 4,698,388 bytes).

Written for lsvision, Apache-2.0.
"""
import sysconfig
from pathlib import Path
from typing import Optional, Tuple

import torch

__all__ = ['stdlib_bytes']


def stdlib_bytes(train_fraction: float = 0.9, root: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (train, val) uint8 tensors of the concatenated stdlib sources.

    Args:
        train_fraction: Share of the bytes in the training split (the first part).
        root: Folder to read instead of the stdlib (its top-level *.py files).
    """
    folder = Path(root or sysconfig.get_paths()['stdlib'])
    files = sorted(folder.glob('*.py'))
    if not files:
        raise FileNotFoundError(f'no *.py files in {folder}; pass root= a folder of Python sources')
    data = b''.join(f.read_bytes() for f in files)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    split = int(len(buf) * train_fraction)
    return buf[:split].clone(), buf[split:].clone()
