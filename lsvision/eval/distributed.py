"""Evaluation across processes and machines (torchrun): each image scored by exactly one process, results merged.

Under ``torchrun`` every process scans the same folders, takes one contiguous shard of each set's file list
(`shard_range`: no padding, no duplicates; a process may get none), scores it, and the per-set counts are gathered
(``all_gather_object``) and merged in rank order, so every process ends with the numbers one process would compute
and rank 0 writes them. Without torchrun (or with one process) a gather returns the process's own values and the
shard is the whole set.

The process group comes from torchrun's environment through timm's ``init_distributed_device_so`` (gloo on CPU, nccl
on CUDA, ``cuda:LOCAL_RANK``). Every node must see the datasets at the same path: `check_paths` compares what each
process sees before the first image is read, and a set whose file list differs between processes is an error.
"""
import hashlib
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .suites import LayoutError

__all__ = ['EvalProcesses', 'init_eval_processes', 'rank_and_world', 'shard_range', 'all_gather', 'check_paths',
           'check_same_files', 'JobProgress', 'close_eval_processes', 'error_prefix', 'DatasetShard']


@dataclass
class EvalProcesses:
    """This process's place in the job: ``rank`` of ``world_size``, and its device."""
    rank: int
    world_size: int
    device: torch.device

    @property
    def primary(self) -> bool:
        return self.rank == 0


def rank_and_world() -> Tuple[int, int]:
    """(rank, world size) of the initialised process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_eval_processes(device: str) -> EvalProcesses:
    """Joins torchrun's process group if the environment has one (timm's ``init_distributed_device_so``).

    Args:
        device: ``'cpu'`` (gloo) or ``'cuda'`` (nccl; each process takes ``cuda:LOCAL_RANK``).
    """
    if dist.is_available() and dist.is_initialized():
        rank, world = rank_and_world()
        return EvalProcesses(rank, world, torch.device(device))
    from timm.utils.distributed import init_distributed_device_so
    found = init_distributed_device_so(device=device)
    return EvalProcesses(found['global_rank'], found['world_size'], torch.device(found['device']))


def shard_range(n: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> range:
    """The contiguous slice of ``range(n)`` that process ``rank`` of ``world_size`` scores.

    The slices of all processes cover ``range(n)`` once, in rank order; sizes differ by at most one, and a world
    larger than ``n`` leaves some processes an empty slice (no padding).
    """
    if rank is None or world_size is None:
        rank, world_size = rank_and_world()
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def all_gather(obj: Any) -> List[Any]:
    """Every process's ``obj`` in rank order (``[obj]`` without a process group)."""
    rank, world = rank_and_world()
    if world == 1:
        return [obj]
    out: List[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _problem(flag: str, path: str) -> Optional[str]:
    if not os.path.exists(path):
        return f'{flag} {path} does not exist'
    if not os.access(path, os.R_OK | (os.X_OK if os.path.isdir(path) else 0)):
        return f'{flag} {path} is not readable'
    return None


def check_paths(paths: Dict[str, Optional[str]]) -> None:
    """Checks that every process can read every dataset path, before the first image (a node without the mount
    would otherwise fail alone and leave the others waiting).

    Args:
        paths: option name -> path (None: not given).

    Raises:
        FileNotFoundError: on every process, naming each process (rank and host) and path that failed.
    """
    mine = [p for p in (_problem(flag, path) for flag, path in paths.items() if path) if p]
    rank, world = rank_and_world()
    found = all_gather((rank, socket.gethostname(), mine))
    failed = [(f'rank {r} on {host}: ' if world > 1 else '') + problem
              for r, host, problems in found for problem in problems]
    if failed:
        same = ('; every node must see the datasets at the same path (a shared file system, or the same copy at '
                'the same place on each node)' if world > 1 else '')
        raise FileNotFoundError('cannot read the data: ' + '; '.join(failed) + same)


def check_same_files(name: str, samples: Sequence[Tuple[str, int]]) -> None:
    """Checks that every process listed the same files for a set (the shards are slices of that list).

    Raises:
        LayoutError: on every process, naming the processes whose list differs from rank 0's.
    """
    if rank_and_world()[1] == 1:
        return
    digest = hashlib.sha256(repr(list(samples)).encode()).hexdigest()
    found = all_gather((socket.gethostname(), len(samples), digest))
    differ = [f'rank {r} on {host} ({n} images)' for r, (host, n, d) in enumerate(found) if d != found[0][2]]
    if differ:
        raise LayoutError(f'{name}: the processes see different files ({", ".join(differ)} differ from rank 0 on '
                           f'{found[0][0]}, {found[0][1]} images); every node must see the same dataset at the same '
                           'path')


class JobProgress:
    """One progress bar for the whole evaluation job, on rank 0: images done (all processes) / total, and the ETA.

    The total grows as suites are scanned (ImageNet-C adds all its sets at once). Within a set rank 0 counts its own
    images times the number of processes (the shards differ by at most one image); at the end of each set the count
    is set to the exact total the processes gathered.

    Args:
        enabled: show a bar (rank 0 only; the other processes never show one).
    """

    def __init__(self, enabled: bool = True):
        rank, self.world_size = rank_and_world()
        self.bar = None
        if enabled and rank == 0:
            from tqdm import tqdm
            self.bar = tqdm(total=0, unit='img', desc='eval', dynamic_ncols=True, smoothing=0.1)
        self.exact = 0  # images of the finished sets
        self.t0 = time.perf_counter()

    def add_total(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total += n
            self.bar.refresh()

    def set_description(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text, refresh=False)

    def advance(self, n_local: int) -> None:
        """Rank 0 scored ``n_local`` more images (an estimate of all processes' progress until `finish_set`)."""
        if self.bar is not None:
            self.bar.update(min(n_local * self.world_size, self.bar.total - self.bar.n))

    def finish_set(self, n_all: int) -> None:
        """A set is done: ``n_all`` images (readable or not) by all processes together."""
        self.exact += n_all
        if self.bar is not None:
            self.bar.update(self.exact - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def close_eval_processes() -> None:
    """Leaves the process group (if this process joined one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def error_prefix() -> str:
    """``'[rank R] '`` under torchrun with several processes (each prints its own errors), else ''."""
    rank, world = rank_and_world()
    return f'[rank {rank}] ' if world > 1 else ''


class DatasetShard(torch.utils.data.Dataset):
    """The items ``indices`` of a map-style dataset (e.g. ``shard_range`` of it), whose ``transform`` stays the
    dataset's own (``timm.data.create_loader`` sets it on the dataset it is given)."""

    def __init__(self, dataset: Any, indices: Sequence[int]):
        self.dataset = dataset
        self.indices = indices

    @property
    def transform(self) -> Any:
        return self.dataset.transform

    @transform.setter
    def transform(self, value: Any) -> None:
        self.dataset.transform = value

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Any:
        return self.dataset[self.indices[position]]
