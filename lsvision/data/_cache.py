"""Generated datasets in a shared cache directory: built once, by one process at a time.

Several processes may ask for the same tree at once (torchrun's ranks, parallel test workers, two demos): a file lock
beside the tree makes the first build it and the others wait and reuse it, and the tree is built in a temporary
sibling and moved into place, so that no reader ever sees half of one.
"""
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator

from filelock import FileLock

__all__ = ['building', 'publish']


@contextmanager
def building(root: str) -> Iterator[None]:
    """Holds ``<root>.lock`` (creating the parent folder) while the caller checks for ``root`` and builds it."""
    os.makedirs(os.path.dirname(root), exist_ok=True)
    with FileLock(root + '.lock'):
        yield


@contextmanager
def publish(root: str, prefix: str) -> Iterator[str]:
    """A temporary sibling folder of ``root`` to build in; moved to ``root`` (replacing a stale tree) when the block
    ends without an error, removed otherwise. Use it inside `building`."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=os.path.dirname(root))
    try:
        yield tmp
        if os.path.exists(root):
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
