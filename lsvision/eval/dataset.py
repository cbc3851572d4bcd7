"""The image dataset of the evaluation suites: exactly the files of a folder scan, no image ever replaced by another.

timm's ``ImageDataset`` returns the *next* sample when an image fails to decode, so one image is scored twice and the
unreadable one is never named. `EvalImageDataset` reads the file list of `scan_class_folders` (the one list behind the
reported counts) through timm's ``Reader`` interface and, instead of replacing an unreadable image, marks it in the
target it returns. In the evaluation loop `ImageChecks` drops the marked images, names them (a warning, or an error
under ``--strict``) and checks the image sizes where the protocol needs one size (ImageNet-C and -9: 224x224).

The target of a sample is an int64 tensor ``[label, index, readable, width, height]`` (see ``META_*``), so it passes
through timm's loaders unchanged (``fast_collate`` and the ``PrefetchLoader`` stack and move it like any target).
"""
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from PIL import Image

from timm.data import ImageDataset
from timm.data.readers.reader import Reader

from .suites import LayoutError, LayoutWarning, warn_or_raise

__all__ = ['EvalImageDataset', 'ImageChecks', 'unreadable_reason', 'META_LABEL', 'META_INDEX', 'META_READABLE',
           'META_WIDTH', 'META_HEIGHT']

META_LABEL, META_INDEX, META_READABLE, META_WIDTH, META_HEIGHT = range(5)
# what PIL raises for files that are not images, truncated or otherwise corrupt ones, and decompression bombs
_DECODE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def _read_image(path: str, mode: Optional[str]) -> Image.Image:
    """The decoded image (``load`` decodes every pixel, so a truncated file fails here, not in the transform)."""
    with Image.open(path) as img:
        img.load()
        return img.convert(mode) if mode else img.copy()


def unreadable_reason(path: str, mode: Optional[str] = 'RGB') -> Optional[str]:
    """Why ``path`` cannot be read as an image (exception type and message), or None if it can."""
    try:
        _read_image(path, mode)
    except _DECODE_ERRORS as e:
        return f'{type(e).__name__}: {e}'
    return None


class _FileListReader(Reader):
    """timm ``Reader`` over an explicit list of (path, label), e.g. ``FolderScan.samples``."""

    def __init__(self, root: str, samples: Sequence[Tuple[str, int]]):
        super().__init__()
        self.root = root
        self.samples = list(samples)

    def __getitem__(self, index: int) -> Tuple[Any, int]:
        path, target = self.samples[index]
        return open(path, 'rb'), target

    def __len__(self) -> int:
        return len(self.samples)

    def _filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        filename = self.samples[index][0]
        if basename:
            return os.path.basename(filename)
        return os.path.abspath(filename) if absolute else os.path.relpath(filename, self.root)


class EvalImageDataset(ImageDataset):
    """timm ``ImageDataset`` over an explicit file list that never substitutes one image for another.

    An image that cannot be opened or decoded comes back as a black placeholder with ``readable`` 0 in its target;
    the evaluation loop leaves it out (`ImageChecks`). The target also carries the image's index and size.

    Args:
        root: the folder the files lie in (for relative file names).
        samples: (image path, label) in loader order.
        transform: the eval transform (``timm.data.create_loader`` sets it).
        input_img_mode: PIL mode the images are converted to.
        indices: the positions in ``samples`` this dataset yields, in order (one process's shard under torchrun);
            default: all. The index in the target is the position in ``samples``.
    """

    def __init__(self, root: str, samples: Sequence[Tuple[str, int]], transform: Optional[Callable] = None,
                 input_img_mode: str = 'RGB', indices: Optional[Sequence[int]] = None):
        super().__init__(root, reader=_FileListReader(root, samples), input_img_mode=input_img_mode,
                         transform=transform)
        self.indices = range(len(samples)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Tuple[Any, torch.Tensor]:
        index = self.indices[position]
        path, label = self.reader.samples[index]
        try:
            img = _read_image(path, self.input_img_mode)
            readable, (width, height) = 1, img.size
        except _DECODE_ERRORS:
            img, readable, width, height = Image.new(self.input_img_mode or 'RGB', (224, 224)), 0, 0, 0
        if self.transform is not None:
            img = self.transform(img)
        return img, torch.tensor([label, index, readable, width, height], dtype=torch.long)


class ImageChecks:
    """The images of one set the loop evaluated, left out as unreadable, or found at the wrong size.

    Args:
        name: the set in messages, e.g. ``'ImageNet-C fog/3'`` or ``'ImageNet-9 mixed_same'``.
        dataset: the `EvalImageDataset` the loader reads (for the file names).
        strict: an unreadable or wrongly sized image raises a `LayoutError` instead of a warning.
        expected_size: (width, height) every image must have (the no-resize protocols); None accepts any size.
    """

    def __init__(self, name: str, dataset: EvalImageDataset, strict: bool = False,
                 expected_size: Optional[Tuple[int, int]] = None):
        self.name = name
        self.dataset = dataset
        self.strict = strict
        self.expected_size = expected_size
        self.evaluated = 0
        self.skipped: List[Dict[str, str]] = []
        self.off_size: Dict[str, List[str]] = {}
        self.warnings: List[str] = []

    def keep(self, meta: torch.Tensor) -> torch.Tensor:
        """The rows of a batch to score (a bool mask), from the targets of `EvalImageDataset`; records the others.

        Raises:
            LayoutError: under ``strict``, an unreadable or wrongly sized image.
        """
        meta = meta.cpu()
        readable = meta[:, META_READABLE] == 1
        for index in meta[~readable, META_INDEX].tolist():
            path = self.dataset.filename(index, absolute=True)
            reason = unreadable_reason(path, self.dataset.input_img_mode) or 'unreadable while loading'
            self.skipped.append(dict(file=path, reason=reason))
            message = (f'{self.name}: cannot read image {path} ({reason}); it is left out, not replaced: the image '
                       'count n is the images evaluated')
            warn_or_raise(self.warnings, message, self.strict, stacklevel=4)
        if self.expected_size is not None:
            sizes = meta[:, [META_WIDTH, META_HEIGHT]]
            wrong = readable & (sizes != torch.tensor(self.expected_size)).any(dim=1)
            for index, (width, height) in zip(meta[wrong, META_INDEX].tolist(), sizes[wrong].tolist()):
                path = self.dataset.filename(index, absolute=True)
                if self.strict:
                    raise LayoutError(self._size_message(f'{width}x{height}', [path], 1) +
                                      ' (--strict turns this into an error)')
                self.off_size.setdefault(f'{width}x{height}', []).append(path)
        self.evaluated += int(readable.sum())
        return readable

    def _size_message(self, sizes: str, files: List[str], n: int) -> str:
        width, height = self.expected_size
        return (f'{self.name}: {n} image(s) are {sizes}, not {width}x{height} (e.g. {files[0]}); the no-resize '
                f'protocol assumes {width}x{height} images, so the eval transform resized and centre-cropped them '
                'and the result is not comparable with published ones')

    def state(self) -> Dict[str, Any]:
        """What this process found (to gather across processes): images evaluated, skipped, off-size, warnings."""
        return dict(evaluated=self.evaluated, skipped=self.skipped, off_size=self.off_size, warnings=self.warnings)

    def merge(self, states: Sequence[Dict[str, Any]]) -> None:
        """Becomes the union of the `state` of every process, in rank order (= file order with contiguous shards).

        The wrongly sized images' warning is issued by `finish` once, for the merged set.
        """
        self.evaluated = sum(s['evaluated'] for s in states)
        self.skipped = [item for s in states for item in s['skipped']]
        self.warnings = [w for s in states for w in s['warnings']]
        off_size: Dict[str, List[str]] = {}
        for s in states:
            for size, files in s['off_size'].items():
                off_size.setdefault(size, []).extend(files)
        self.off_size = off_size

    def finish(self) -> Dict[str, Any]:
        """Warns about wrongly sized images (one warning for the set) and returns what the results record.

        Under torchrun call it after `merge`: the numbers are then the whole set's on every process.

        Raises:
            LayoutError: no image of the set could be read.
        """
        if self.off_size:
            n = sum(len(files) for files in self.off_size.values())
            sizes = ', '.join(f'{size} ({len(files)})' for size, files in self.off_size.items())
            message = self._size_message(sizes, next(iter(self.off_size.values())), n)
            self.warnings.append(message)
            warnings.warn(message, LayoutWarning, stacklevel=3)
        if not self.evaluated:
            example = f' (e.g. {self.skipped[0]["file"]}: {self.skipped[0]["reason"]})' if self.skipped else ''
            raise LayoutError(f'{self.name}: none of its {len(self.dataset.reader)} images could be read{example}; '
                              'nothing to evaluate')
        return dict(count=self.evaluated, skipped=self.skipped, off_size=self.off_size)
