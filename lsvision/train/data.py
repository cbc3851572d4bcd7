"""Training data for tools/train.py: timm datasets and transforms, with a resumable, exactly reproducible order.

Resuming in the middle of an epoch must replay the rest of that epoch exactly. So the sampler's order is a pure
function of (seed, epoch) (a DistributedSampler or timm's RepeatAugSampler, also with one process), it can start at
any position, and each sample's augmentation is seeded from (seed, epoch, rank, position): the result depends
neither on the number of workers nor on where the run was interrupted.
"""
import collections
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.utils.data
from PIL import Image

from timm.data.dataset import ImageDataset
from timm.data.distributed_sampler import RepeatAugSampler
from timm.data.readers.img_extensions import get_img_extensions
from timm.data.readers.reader import Reader
from timm.data.readers.reader_image_folder import ReaderImageFolder
from timm.utils.misc import natural_key

__all__ = ['ResumableSampler', 'SeededTrainDataset', 'TrainBatchSampler', 'TrainSetupError', 'SplitScan',
           'ScannedFolderReader', 'derive_seed', 'scan_split', 'split_problems', 'class_counts_text',
           'skipped_files_text']

_logger = logging.getLogger(__name__)
_MAX_SKIPPED_IN_A_ROW = 20


class TrainSetupError(ValueError):
    """Arguments, data or checkpoint that cannot be used as given (the message says why and what to do)."""


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (splitmix64), so nearby (epoch, position) pairs get unrelated streams."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return x >> 1


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class ResumableSampler(torch.utils.data.Sampler):
    """Shards and shuffles like DistributedSampler (or RepeatAugSampler), can start mid-epoch, and tags each index.

    Yields (dataset index, epoch, position in this rank's epoch stream), which `SeededTrainDataset` turns into a
    per-sample seed.

    Args:
        dataset: The training dataset.
        num_replicas: Number of processes.
        rank: This process.
        seed: Shuffle seed (the same on every rank).
        num_repeats: Repeated augmentation count (timm's RepeatAugSampler) when > 0.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 num_repeats: float = 0):
        if num_repeats:
            self.base = RepeatAugSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                                         num_repeats=int(num_repeats))
            self.seed = seed  # RepeatAugSampler seeds its generator with the epoch; the offset goes there
        else:
            self.base = torch.utils.data.DistributedSampler(dataset, num_replicas=num_replicas, rank=rank,
                                                            shuffle=True, seed=seed)
            self.seed = 0
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order and skip its first `start` samples (already trained on before a restart)."""
        self.epoch = epoch
        self.start = start
        self.base.set_epoch(epoch + self.seed)

    def __iter__(self) -> Iterator[Tuple[int, int, int]]:
        for pos, index in enumerate(self.base):
            if pos >= self.start:
                yield int(index), self.epoch, pos

    def __len__(self) -> int:
        return max(0, len(self.base) - self.start)

    def full_len(self) -> int:
        return len(self.base)


class SeededTrainDataset(torch.utils.data.Dataset):
    """Wraps a training dataset: seeds the random generators per sample, and skips unreadable images.

    An image that cannot be opened or decoded is reported once (a warning naming the file and the reason) and the
    next image of the dataset takes its place, so the batch keeps its size and training goes on; after 20
    unreadable images in a row it stops with an error.

    Args:
        dataset: A timm ImageDataset or any map-style dataset returning (image, target).
        seed: Base seed of the run.
        rank: This process's rank (ranks augment differently).
    """

    def __init__(self, dataset: torch.utils.data.Dataset, seed: int = 0, rank: int = 0):
        self.dataset = dataset
        self.seed = seed
        self.rank = rank
        self._reported = set()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, tuple):
            index, epoch, pos = item
            seed_everything(derive_seed(self.seed, epoch, self.rank, pos))
        else:
            index = item
        ds = self.dataset
        if isinstance(ds, ImageDataset) and not ds.load_bytes and ds.additional_features is None:
            return self._load_image(ds, index)
        return ds[index]

    def _load_image(self, ds: ImageDataset, index: int) -> Tuple[Any, Any]:
        for _ in range(_MAX_SKIPPED_IN_A_ROW):
            img, target = ds.reader[index][:2]
            try:
                img = Image.open(img)
                img = img.convert(ds.input_img_mode) if ds.input_img_mode else img
                img.load()
                break
            except (OSError, ValueError, Image.DecompressionBombError) as e:
                name = ds.filename(index, absolute=True)
                if name not in self._reported:
                    self._reported.add(name)
                    _logger.warning(f'skipping unreadable image {name} ({type(e).__name__}: {e}); the next image '
                                    'of the dataset is used in its place. Remove or replace the file.')
                index = (index + 1) % len(ds)
        else:
            raise RuntimeError(f'{_MAX_SKIPPED_IN_A_ROW} unreadable images in a row (the last: '
                               f'{ds.filename(index, absolute=True)}); check the dataset folder')
        if ds.transform is not None:
            img = ds.transform(img)
        if target is None:
            target = -1
        elif ds.target_transform is not None:
            target = ds.target_transform(target)
        return img, target


def class_names_of(dataset: torch.utils.data.Dataset) -> Optional[List[str]]:
    """The class names of a folder or torchvision dataset in label order (what the model's logits mean), when it
    says: timm's folder reader's class_to_idx, or a torchvision dataset's classes."""
    reader = getattr(dataset, 'reader', None)
    class_to_idx = getattr(reader, 'class_to_idx', None) or getattr(dataset, 'class_to_idx', None)
    if class_to_idx and sorted(class_to_idx.values()) == list(range(len(class_to_idx))):
        return [str(name) for name, _ in sorted(class_to_idx.items(), key=lambda item: item[1])]
    classes = getattr(dataset, 'classes', None)
    return [str(c) for c in classes] if classes else None


def num_classes_of(dataset: torch.utils.data.Dataset) -> Optional[int]:
    """Number of classes of a folder or torchvision dataset, when it says."""
    reader = getattr(dataset, 'reader', None)
    class_to_idx = getattr(reader, 'class_to_idx', None) or getattr(dataset, 'class_to_idx', None)
    if class_to_idx:
        return len(set(class_to_idx.values()))
    classes = getattr(dataset, 'classes', None)
    return len(classes) if classes else None


class TrainBatchSampler(torch.utils.data.Sampler):
    """Batches of a `ResumableSampler`; what happens to the epoch's last, partial batch is explicit.

    With ``drop_last`` (timm's train.py) the partial batch is dropped. Without it the batch is kept, cut down to a
    multiple of ``multiple_of`` (2 under Mixup / CutMix, which pair each image with another in its batch), so at most
    ``multiple_of - 1`` images are left out of an epoch. All batches but the last are full, so a resumed epoch starts
    at ``batch * batch_size`` in the sampler's order.

    Args:
        sampler: The epoch's order.
        batch_size: Images per batch.
        drop_last: Drop the partial last batch.
        multiple_of: The size the kept last batch is cut to a multiple of.
    """

    def __init__(self, sampler: ResumableSampler, batch_size: int, drop_last: bool, multiple_of: int = 1):
        self.sampler, self.batch_size, self.drop_last, self.multiple_of = sampler, batch_size, drop_last, multiple_of

    def _last(self, n: int) -> int:
        """How many of the ``n`` samples left after the full batches form the last batch."""
        return 0 if self.drop_last else n - n % self.multiple_of

    def _batches(self, samples: int) -> Tuple[int, int]:
        """(batches, samples used) of an order of ``samples``."""
        full, rest = divmod(samples, self.batch_size)
        last = self._last(rest)
        return full + (last > 0), full * self.batch_size + last

    def batches_per_epoch(self) -> int:
        """Batches in a whole epoch (from its first sample)."""
        return self._batches(self.sampler.full_len())[0]

    def used_per_epoch(self) -> int:
        """Samples a whole epoch trains on (the rest are left out of it)."""
        return self._batches(self.sampler.full_len())[1]

    def __iter__(self) -> Iterator[List[Tuple[int, int, int]]]:
        batch = []
        for item in self.sampler:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        keep = self._last(len(batch))
        if keep:
            yield batch[:keep]

    def __len__(self) -> int:
        return self._batches(len(self.sampler))[0]


@dataclass
class SplitScan:
    """The class folders of one split of an image folder, as timm's folder reader sees them.

    Attributes:
        root: The split folder.
        counts: Class folder name -> images timm reads in it (its file types, sub-folders included), in class order.
        empty: Class folders (directly in ``root``) without one image timm reads.
        loose: Images directly in ``root``, outside any class folder.
        samples: (image path, class folder name) in timm's order (natural sort of the paths).
        skipped: Files that are not of timm's image types (hidden ones aside), which the split leaves out.
    """
    root: str
    counts: Dict[str, int]
    empty: List[str] = field(default_factory=list)
    loose: int = 0
    samples: List[Tuple[str, str]] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def dataset(self, class_to_idx: Dict[str, int], input_img_mode: Optional[str]) -> ImageDataset:
        """timm's ImageDataset of this split's images under ``class_to_idx`` (a class it does not name is left out),
        the samples and class map timm's folder reader would find, without walking the folder again."""
        samples = [(path, class_to_idx[name]) for path, name in self.samples if name in class_to_idx]
        return ImageDataset(self.root, reader=ScannedFolderReader(self.root, samples, class_to_idx),
                            input_img_mode=input_img_mode or 'RGB')


class ScannedFolderReader(ReaderImageFolder):
    """timm's folder reader over samples already found (`SplitScan.dataset`): a split is walked once."""

    def __init__(self, root: str, samples: List[Tuple[str, int]], class_to_idx: Dict[str, int]):
        Reader.__init__(self)
        self.root, self.samples, self.class_to_idx = root, samples, class_to_idx


def _walk_split(root: str) -> Tuple[List[Tuple[str, str]], List[str]]:
    """timm's `find_images_and_targets` walk (a class is the leaf folder an image lies in, timm's image types, the
    natural sort of the paths), which also keeps the files it passes over: (image path, class folder name) pairs
    and the other files, hidden ones (names starting with '.') aside, in one walk."""
    types = get_img_extensions(as_set=True)
    samples, skipped = [], []
    for dirpath, _, files in os.walk(root, topdown=False, followlinks=True):
        label = os.path.basename(os.path.relpath(dirpath, root)) if dirpath != root else ''
        for f in files:
            if os.path.splitext(f)[1].lower() in types:
                samples.append((os.path.join(dirpath, f), label))
            elif not f.startswith('.'):
                skipped.append(os.path.join(dirpath, f))
    return sorted(samples, key=lambda sample: natural_key(sample[0])), sorted(skipped, key=natural_key)


def scan_split(root: str) -> SplitScan:
    """The class folders of an image-folder split, their image counts and the files that are no images, by timm's
    own rules (`find_images_and_targets`: a class is the leaf folder an image lies in)."""
    samples, skipped = _walk_split(root)
    per_class = collections.Counter(name for _, name in samples)
    counts = {name: per_class[name] for name in sorted(per_class, key=natural_key)}
    loose = counts.pop('', 0)
    folders = sorted((d for d in os.listdir(root) if not d.startswith('.') and os.path.isdir(os.path.join(root, d))),
                     key=natural_key)
    return SplitScan(root, counts, [d for d in folders if d not in counts], loose, samples, skipped)


def skipped_files_text(scan: SplitScan, n: int = 3) -> str:
    """`2 file(s) in <root> are not .png/.jpg/.jpeg images and are skipped: a, b`, as validate.py words it."""
    return (f"{len(scan.skipped)} file(s) in {scan.root} are not {'/'.join(get_img_extensions())} images and are "
            f'skipped: {_listed(scan.skipped, n)}')


def _listed(names: Sequence[str], n: int = 8) -> str:
    return ', '.join(names[:n]) + (f', ... ({len(names)} in all)' if len(names) > n else '')


def split_problems(train: SplitScan, val: SplitScan, class_map: Optional[Dict[str, int]] = None,
                   class_map_name: str = '') -> List[str]:
    """What makes the two splits unusable together, each with its fix ([] when they agree).

    Validation must score the classes the model trains on, under the same labels: every class needs images in both
    splits (an empty folder would be dropped by timm's scan and shift the labels that follow it). With a class map
    the classes are the map's, and a folder the map does not name would be dropped silently.
    """
    problems = []
    for scan in (train, val):
        if scan.empty:
            paths = [os.path.join(scan.root, d) for d in scan.empty]
            problems.append(
                f'empty class folder(s) {_listed(paths)}: no image in them, so timm would drop the class and the '
                "splits' labels would not match. Put images of the class in them, or remove the class from both "
                f'splits (the folder of that name in {train.root} and in {val.root})')
        if scan.loose:
            problems.append(f'{scan.loose} image(s) lie directly in {scan.root}, outside any class folder; move them '
                            'into the folder of their class')
    classes = list(class_map) if class_map else list(train.counts)
    if class_map:
        for scan in (train, val):
            unnamed = [c for c in scan.counts if c not in class_map]
            if unnamed:
                problems.append(f'class folder(s) {_listed(unnamed)} in {scan.root} are not in --class-map '
                                f'{class_map_name}; add them to it, or move them out of {scan.root}')
        absent = [c for c in classes if c not in train.counts and c not in train.empty]
        if absent:
            problems.append(f'--class-map {class_map_name} names class(es) {_listed(absent)} that have no folder in '
                            f'{train.root}; add their training images as {train.root}/<class>/, or remove them from '
                            'the class map')
    else:
        extra = [c for c in val.counts if c not in train.counts and c not in train.empty]
        if extra:
            problems.append(
                f'validation class folder(s) {_listed(extra)} in {val.root} have no training folder in {train.root} '
                f'(the training classes: {_listed(classes)}), so the model has no output for them. Add their training '
                f'images as {train.root}/<class>/, or move the folder(s) out of {val.root}')
    missing = [c for c in classes if c not in val.counts and c not in val.empty and c in train.counts]
    if missing:
        problems.append(
            f'training class(es) {_listed(missing)} have no validation folder in {val.root}, so validation would not '
            f'score them. Add held-out images of each as {val.root}/<class>/, or move the training folder(s) out of '
            f'{train.root}')
    return problems


def class_counts_text(scan: SplitScan, n: int = 20) -> str:
    """`162 images in 4 classes (cat 40, dog 41, ...)`: every class up to ``n`` classes, else the range and the
    smallest classes."""
    items = list(scan.counts.items())
    text = f'{scan.total} images in {len(items)} classes'
    if len(items) <= n:
        return text + ' (' + ', '.join(f'{name} {count}' for name, count in items) + ')'
    smallest = sorted(items, key=lambda item: item[1])[:5]
    return (text + f', {smallest[0][1]}-{max(c for _, c in items)} a class (fewest: '
            + ', '.join(f'{name} {count}' for name, count in smallest) + ')')
