"""Long-document classification from the Python standard library's source, with no download.

Documents are consecutive windows of `doc_len` bytes (4096 by default) of the `.py` files of a top-level stdlib
package; the label is the package. Tokens are bytes (ids 0-255, padding 256, vocabulary 257). The split is by file,
so no file contributes to both train and test. Tests inside packages (`test*` folders, `idle_test`, `test_*.py`)
and the `test` package itself are left out: they read alike across packages.

Which packages qualify depends on the Python version (e.g. `distutils` and `lib2to3` are gone in 3.12+); the rule
is fixed: at least `min_files` files and `min_docs` documents. CPython 3.11.7 gives 11 classes: asyncio, distutils,
email, encodings, idlelib, importlib, lib2to3, multiprocessing, tkinter, unittest, xml.
"""
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch

__all__ = ['ByteDocs', 'PAD_ID', 'VOCAB_SIZE', 'stdlib_root', 'package_files', 'build_stdlib_docs']

PAD_ID = 256
VOCAB_SIZE = 257


@dataclass
class ByteDocs:
    """Byte documents of one split.

    Attributes:
        tokens: (n, doc_len) int64 byte ids, PAD_ID after the end of a short document.
        lengths: (n,) real bytes per document.
        labels: (n,) class index.
        files: Source file (relative to the stdlib root) of each document.
        classes: Class names (package names), index = label.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    files: List[str]
    classes: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def mask(self) -> torch.Tensor:
        """(n, doc_len) bool, True on real bytes."""
        return torch.arange(self.tokens.shape[1])[None] < self.lengths[:, None]

    def class_counts(self) -> List[int]:
        return torch.bincount(self.labels, minlength=len(self.classes)).tolist()

    def subset(self, index: torch.Tensor) -> 'ByteDocs':
        idx = index.tolist()
        return ByteDocs(self.tokens[index], self.lengths[index], self.labels[index], [self.files[i] for i in idx],
                        self.classes)


def stdlib_root() -> Path:
    """The standard library folder of the running Python."""
    return Path(sysconfig.get_paths()['stdlib'])


def _is_test_path(rel: Path) -> bool:
    return any(p.startswith('test') or p == 'idle_test' for p in rel.parts[:-1]) or rel.name.startswith('test_')


def package_files(root: Optional[Union[str, Path]] = None) -> Dict[str, List[Path]]:
    """{top-level package: its non-test `.py` files (sorted)} for every package folder of the stdlib but `test`."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f'standard library folder {root} does not exist; pass the folder that holds os.py')
    out = {}
    for pkg in sorted(p for p in root.iterdir() if p.is_dir() and (p / '__init__.py').is_file()):
        if pkg.name == 'test':
            continue
        files = sorted(f for f in pkg.rglob('*.py') if f.is_file() and not _is_test_path(f.relative_to(pkg)))
        if files:
            out[pkg.name] = files
    return out


def _windows(data: bytes, doc_len: int, min_doc_len: int) -> List[bytes]:
    docs = [data[i:i + doc_len] for i in range(0, len(data), doc_len)]
    return [d for d in docs if len(d) >= min_doc_len]


def _to_docs(items: List[Tuple[bytes, int, str]], doc_len: int, classes: List[str]) -> ByteDocs:
    tokens = torch.full((len(items), doc_len), PAD_ID, dtype=torch.long)
    lengths = torch.zeros(len(items), dtype=torch.long)
    for i, (doc, _, _) in enumerate(items):
        tokens[i, :len(doc)] = torch.frombuffer(bytearray(doc), dtype=torch.uint8).long()
        lengths[i] = len(doc)
    labels = torch.tensor([label for _, label, _ in items], dtype=torch.long)
    return ByteDocs(tokens, lengths, labels, [f for _, _, f in items], classes)


def build_stdlib_docs(
        root: Optional[Union[str, Path]] = None,
        doc_len: int = 4096,
        min_doc_len: Optional[int] = None,
        min_files: int = 6,
        min_docs: int = 40,
        test_fraction: float = 0.2,
        max_train_per_class: Optional[int] = 120,
        max_test_per_class: Optional[int] = 30,
        min_classes: int = 8,
        seed: int = 0,
) -> Tuple[ByteDocs, ByteDocs]:
    """Builds the train and test documents.

    Args:
        root: Standard library folder (default: the running Python's).
        doc_len: Bytes per document; a file's last window is kept if it has at least `min_doc_len` bytes (padded).
        min_doc_len: Shortest document kept (default doc_len // 4).
        min_files: A package needs this many files to be a class (so that a by-file split exists).
        min_docs: ... and this many documents.
        test_fraction: Files go to test (in a fixed order by CRC32 of their path) until this fraction of the
            package's documents is reached; the rest is train.
        max_train_per_class: Keep at most this many train documents per class (a seeded random subset).
        max_test_per_class: Likewise for test.
        min_classes: Raise if fewer packages qualify.
        seed: Seed of the subsets.

    Returns:
        (train, test). The split is by file: no file has documents in both.
    """
    root = Path(root) if root is not None else stdlib_root()
    min_doc_len = doc_len // 4 if min_doc_len is None else min_doc_len
    per_package = {}
    for name, files in package_files(root).items():
        docs = [(f, _windows(f.read_bytes(), doc_len, min_doc_len)) for f in files]
        docs = [(f, d) for f, d in docs if d]
        if len(docs) >= min_files and sum(len(d) for _, d in docs) >= min_docs:
            per_package[name] = docs
    classes = sorted(per_package)
    if len(classes) < min_classes:
        raise ValueError(
            f'only {len(classes)} stdlib packages under {root} have >= {min_files} files and >= {min_docs} '
            f'documents of {doc_len} bytes ({classes}); lower min_files / min_docs / doc_len')
    gen = torch.Generator().manual_seed(seed)
    train, test = [], []
    for label, name in enumerate(classes):
        docs = sorted(per_package[name], key=lambda fd: (zlib.crc32(str(fd[0].relative_to(root)).encode()), fd[0]))
        total = sum(len(d) for _, d in docs)
        split = {'train': [], 'test': []}
        n_test = 0
        for f, windows in docs:
            # a file goes to test while test is short of its share; at least one file stays for train
            to_test = n_test < test_fraction * total and f is not docs[-1][0]
            rel = str(f.relative_to(root))
            split['test' if to_test else 'train'] += [(w, label, rel) for w in windows]
            n_test += len(windows) if to_test else 0
        for part, cap, out in (('train', max_train_per_class, train), ('test', max_test_per_class, test)):
            items = split[part]
            if cap is not None and len(items) > cap:
                keep = torch.randperm(len(items), generator=gen)[:cap].sort().values.tolist()
                items = [items[i] for i in keep]
            out += items
    return _to_docs(train, doc_len, classes), _to_docs(test, doc_len, classes)

