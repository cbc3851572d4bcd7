"""How a run shares the machine and keeps its user informed: one thread policy and one progress clock for every
training and evaluation tool (tools/train.py, train_lm.py, train_mt.py, detect.py, validate.py, robustness.py and the
demos).

Threads: `--threads 0` (every tool's default) takes `auto_threads()`: the cores the current load leaves free, at
least 1. On a busy machine more torch threads than free cores make every step slower (OpenMP threads spend their time
waiting for each other: train_lm.py measured 225-430 tokens/s with torch's default threads against ~3,000 with 1 on
2 cores at load 5).

Progress: `ProgressClock` says when a progress line is due, every N steps or every N seconds, whichever comes first,
so that a slow run is never silent for long.

Fresh processes: `fresh_process_context(preload)` starts each child from a server that imported `preload` once.

Both ``lsvision.eval`` and ``lsvision.train`` may import it; it imports only torch.
"""
import logging
import os
import sys
import time
from multiprocessing import forkserver, get_context
from multiprocessing.context import BaseContext
from typing import Optional, Sequence

import torch

__all__ = ['auto_threads', 'set_threads', 'threads_help', 'ProgressClock', 'PROGRESS_SECONDS', 'PROGRESS_HELP',
           'fresh_process_context']

_logger = logging.getLogger(__name__)

# the longest a run stays silent by default (seconds between progress lines when the steps are slow)
PROGRESS_SECONDS = 30.
PROGRESS_HELP = ('also a progress line whenever this many seconds have passed since the last one, so that a slow '
                 'run is never silent for longer (0: a line every step)')


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)


def auto_threads(max_threads: Optional[int] = None) -> int:
    """Torch threads for this process: the cores the load leaves free (1-minute load average), shared by the
    processes torchrun starts on this machine (LOCAL_WORLD_SIZE), at least 1 and at most `max_threads` (None: the
    usable cores)."""
    cores = _usable_cores()
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else 0.
    local = max(1, int(os.environ.get('LOCAL_WORLD_SIZE', '1') or 1))
    free = int(cores - load + 0.5) // local
    return max(1, min(max_threads or cores, cores // local or 1, free))


def threads_help(max_threads: Optional[int] = None) -> str:
    """The `--threads` help every tool shows (the policy in one sentence)."""
    cap = f', at most {max_threads}' if max_threads else ''
    return ('torch CPU threads per process (0 = auto: the cores the current load leaves free, at least 1' + cap
            + '; on a busy machine more threads than free cores make every step slower, so 1 is often fastest)')


def set_threads(threads: int = 0, max_threads: Optional[int] = None, log: bool = True) -> int:
    """Apply a tool's `--threads` (0: `auto_threads(max_threads)`) to torch; returns the count set."""
    if threads < 0:
        raise ValueError(f'--threads must be 0 (auto) or a positive count, got {threads}')
    n = threads or auto_threads(max_threads)
    torch.set_num_threads(n)
    if log:
        how = 'as given' if threads else (f'auto: {_usable_cores()} cores, load '
                                          f'{os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.:.1f}')
        _logger.info(f'torch threads: {n} ({how}; --threads N to choose)')
    return n


class ProgressClock:
    """When a progress line is due: every `every_steps` steps (None or 0: never by count) or when `every_s`
    seconds have passed since the last line (or since the clock started), whichever comes first.

    Call `due(step)` after each step; it is True at most once per step and restarts the clock when it is.
    """

    def __init__(self, every_steps: Optional[int] = None, every_s: Optional[float] = PROGRESS_SECONDS):
        self.every_steps, self.every_s = every_steps or 0, every_s
        self.last = time.monotonic()

    def due(self, step: int, force: bool = False) -> bool:
        now = time.monotonic()
        by_count = bool(self.every_steps) and step % self.every_steps == 0
        by_clock = self.every_s is not None and now - self.last >= self.every_s
        if force or by_count or by_clock:
            self.last = now
            return True
        return False


def fresh_process_context(preload: Sequence[str]) -> BaseContext:
    """multiprocessing's forkserver, its server started (once per process) with this process's ``sys.path`` and the
    modules ``preload`` imported: each child is forked from that clean state (nothing run in it, its own lifetime peak
    memory) without importing torch, timm and lsvision again (seconds of CPU each, as a ``spawn`` child would). A
    server started before (another preload) still forks fresh children; they import what they need themselves."""
    ctx, saved = get_context('forkserver'), os.environ.get('PYTHONPATH')
    ctx.set_forkserver_preload(list(preload))
    os.environ['PYTHONPATH'] = os.pathsep.join(p for p in sys.path if p)  # the server imports what this process does
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop('PYTHONPATH') if saved is None else os.environ.update(PYTHONPATH=saved)
    return ctx
