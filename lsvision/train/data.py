"""Training data for tools/train.py: timm datasets and transforms, with a resumable, exactly reproducible order.

Resuming in the middle of an epoch must replay the rest of that epoch exactly. So the sampler's order is a pure
function of (seed, epoch) (a DistributedSampler or timm's RepeatAugSampler, also with one process), it can start at
any position, and each sample's augmentation is seeded from (seed, epoch, rank, position): the result depends
neither on the number of workers nor on where the run was interrupted.
"""
import logging
import random
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.utils.data
from PIL import Image

from timm.data.dataset import ImageDataset
from timm.data.distributed_sampler import RepeatAugSampler

__all__ = ['ResumableSampler', 'SeededTrainDataset', 'derive_seed']

_logger = logging.getLogger(__name__)
_MAX_SKIPPED_IN_A_ROW = 20


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
