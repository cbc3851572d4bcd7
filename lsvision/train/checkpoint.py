"""Training checkpoints: atomic writes, weights_only loading, RNG states as plain values, last / best / top-k.

Everything a resumed run needs is a tensor, a number, a string, or a list/dict of those, so
`torch.load(..., weights_only=True)` reads it back.
"""
import errno
import logging
import os
import random
import shutil
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ['CheckpointWriteError', 'save_atomic', 'link_atomic', 'load_checkpoint', 'get_rng_state', 'set_rng_state',
           'CheckpointKeeper']

_logger = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, over quota); the message names the folder, the file before
    stays as it was."""


# what torch.save raises when a write comes up short: the zip writer checks its position after each record
_SHORT_WRITE_MESSAGES = ('unexpected pos', 'file write failed')


def _is_out_of_space(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _SHORT_WRITE_MESSAGES)


def save_atomic(obj: Any, path: str) -> None:
    """torch.save to a temporary file beside `path`, then os.replace: a reader never sees half a file.

    Raises:
        CheckpointWriteError: the disk (or quota) ran out during the write; `path` keeps its previous content and
            the temporary file is removed.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f'{path}.tmp-{os.getpid()}'
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        if not _is_out_of_space(e):
            raise
        try:
            free = f'{shutil.disk_usage(folder).free / 2 ** 20:.1f} MiB free'
        except OSError:
            free = 'free space unknown'
        kept = f'the previous {os.path.basename(path)} is intact' if os.path.exists(path) else 'nothing was kept'
        raise CheckpointWriteError(
            f'cannot write checkpoint {path}: the disk holding {folder} is full or over quota '
            f'({free}; torch: {str(e).strip()[:120]}); {kept}. Free space there, lower --checkpoint-hist, or '
            'write the run elsewhere with --output') from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def link_atomic(src: str, path: str) -> None:
    """Make `path` a hard link to `src` (one copy on disk, as timm's CheckpointSaver), or a copy where the file system
    has no hard links; through a temporary name and os.replace, so `path` is never half written."""
    tmp = f'{path}.tmp-{os.getpid()}'
    try:
        if os.path.exists(tmp):
            os.remove(tmp)
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str, map_location: str = 'cpu') -> Dict[str, Any]:
    """torch.load with weights_only=True, with a clear error for a missing or unreadable file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint not found: {path}')
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise RuntimeError(f'cannot read checkpoint {path} (weights_only=True): {e}') from e


def get_rng_state() -> Dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states, as tensors and plain values."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        'python': [py_version, list(py_state), py_gauss],
        'numpy': [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    py_version, py_state, py_gauss = state['python']
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


class CheckpointKeeper:
    """Keeps `last.pth.tar`, `model_best.pth.tar`, the top-k epoch checkpoints by metric, and `recovery.pth.tar`.

    Args:
        output_dir: Run directory.
        max_history: Number of epoch checkpoints kept (`checkpoint-<epoch>.pth.tar`, best first).
        decreasing: True when a lower metric is better (loss).
    """

    def __init__(self, output_dir: str, max_history: int = 10, decreasing: bool = False):
        self.output_dir = output_dir
        self.max_history = max_history
        self.decreasing = decreasing
        self.history: List[Tuple[str, float]] = []  # (path, metric), best first
        self.best_metric: Optional[float] = None
        self.best_epoch: Optional[int] = None

    def _better(self, a: float, b: Optional[float]) -> bool:
        return b is None or (a < b if self.decreasing else a > b)

    def state_dict(self) -> Dict[str, Any]:
        return dict(history=[[p, m] for p, m in self.history], best_metric=self.best_metric,
                    best_epoch=self.best_epoch)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.history = [(p, m) for p, m in state.get('history', [])]
        self.best_metric = state.get('best_metric')
        self.best_epoch = state.get('best_epoch')

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def save_epoch(self, state: Dict[str, Any], epoch: int, metric: Optional[float]) -> None:
        """Write last (always); the epoch file if it makes the top-k and best if it is the best so far are hard links
        to it (one file on disk, however many names; the next epoch's `last` is a new file, so they keep this state).

        `state` must already hold this keeper's state (call `state_dict()` after `update`); see `update`.
        """
        last = self.path('last.pth.tar')
        save_atomic(state, last)
        if metric is None:
            return
        name = self.path(f'checkpoint-{epoch}.pth.tar')
        if any(p == name for p, _ in self.history):
            link_atomic(last, name)
        if epoch == self.best_epoch:
            link_atomic(last, self.path('model_best.pth.tar'))

    def update(self, epoch: int, metric: Optional[float]) -> List[str]:
        """Record this epoch's metric; return the epoch files that fell out of the top-k (to delete after saving)."""
        if metric is None:
            return []
        if self._better(metric, self.best_metric):
            self.best_metric, self.best_epoch = metric, epoch
        name = self.path(f'checkpoint-{epoch}.pth.tar')
        self.history = [(p, m) for p, m in self.history if p != name] + [(name, metric)]
        self.history.sort(key=lambda pm: pm[1], reverse=not self.decreasing)
        dropped = [p for p, _ in self.history[self.max_history:]]
        self.history = self.history[:self.max_history]
        return dropped

    @staticmethod
    def remove(paths: List[str]) -> None:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)
