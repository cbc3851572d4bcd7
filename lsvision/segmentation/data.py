"""Semantic segmentation data: ADE20K, Cityscapes and plain image / mask folders, with mmsegmentation's pipelines.

Layouts (each gives (image, mask) file pairs, matched by name):
- ADE20K (`ade20k_pairs`, ADEChallengeData2016): `images/<split>/*.jpg` and `annotations/<split>/<name>.png`
  (splits `training`, `validation`); label 0 ("other objects") is ignored and the 150 classes shift down by one
  (mmsegmentation's `reduce_zero_label`: 0 -> 255, k -> k - 1).
- Cityscapes (`cityscapes_pairs`): `leftImg8bit/<split>/<city>/<name>_leftImg8bit.png` and
  `gtFine/<split>/<city>/<name>_gtFine_labelTrainIds.png` (19 classes as trainIds, 255 ignored; the trainId PNGs
  are what cityscapesscripts' createTrainIdLabelImgs.py writes).
- An image / mask folder pair (`folder_pairs`): every image of the image folder (.jpg, .jpeg, .png, .bmp, .tif,
  .tiff) and the mask `<name>.png` of the same name in the mask folder; the masks hold class indices 0..K-1 and 255
  for pixels not counted, and the class names come with the data.

A mask is a single-channel PNG (mode L, P or I;16) of the image's size. Bad input, checked when the dataset is built
(every problem named with its file): a missing mask, an image or mask that cannot be read, a mask of another size
than its image, a mask with values that are no class (>= num_classes after the layout's mapping) and not the ignore
index: an error (`SegmentationDataError`) listing them, unless `skip_bad=True`, which leaves those images out
(`left_out` names them, and the report counts them).

Training samples go through mmsegmentation's ADE20K / Cityscapes pipeline (`TrainPipeline`): random rescale with a
ratio in [0.5, 2] of a (long, short) scale keeping the aspect ratio, a random crop retried (up to 10 times) until no
class covers more than `cat_max_ratio` of it, a horizontal flip (p 0.5), the photometric distortion (brightness,
contrast, saturation, hue, each with p 0.5), normalization, and padding to the crop size (image 0 after
normalization, label 255). Its random draws come from a generator seeded by (seed, epoch, index), so a resumed run
sees the same crops. Evaluation images are rescaled to the test scale (keeping the aspect ratio) and normalized; the
metric compares the prediction, resized back, with the mask at its own size.
"""
import glob
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.utils.data
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF
from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv

from ..eval.distributed import all_gather, shard_range
from ..train.data import derive_seed
from .models import IGNORE_INDEX

__all__ = ['ADE20K_CLASSES', 'CITYSCAPES_CLASSES', 'IMAGE_EXTENSIONS', 'SegmentationDataError',
           'SegmentationProblem', 'SegmentationDataset', 'TrainPipeline', 'ade20k_pairs', 'cityscapes_pairs',
           'folder_pairs', 'rescale_size', 'collate_segmentation']

# ADE20K's 150 SceneParsing classes in label order 1..150 (mmsegmentation's ADE20KDataset.classes)
ADE20K_CLASSES = (
    'wall', 'building', 'sky', 'floor', 'tree', 'ceiling', 'road', 'bed', 'windowpane', 'grass', 'cabinet',
    'sidewalk', 'person', 'earth', 'door', 'table', 'mountain', 'plant', 'curtain', 'chair', 'car', 'water',
    'painting', 'sofa', 'shelf', 'house', 'sea', 'mirror', 'rug', 'field', 'armchair', 'seat', 'fence', 'desk', 'rock',
    'wardrobe', 'lamp', 'bathtub', 'railing', 'cushion', 'base', 'box', 'column', 'signboard', 'chest of drawers',
    'counter', 'sand', 'sink', 'skyscraper', 'fireplace', 'refrigerator', 'grandstand', 'path', 'stairs', 'runway',
    'case', 'pool table', 'pillow', 'screen door', 'stairway', 'river', 'bridge', 'bookcase', 'blind', 'coffee table',
    'toilet', 'flower', 'book', 'hill', 'bench', 'countertop', 'stove', 'palm', 'kitchen island', 'computer',
    'swivel chair', 'boat', 'bar', 'arcade machine', 'hovel', 'bus', 'towel', 'light', 'truck', 'tower', 'chandelier',
    'awning', 'streetlight', 'booth', 'television receiver', 'airplane', 'dirt track', 'apparel', 'pole', 'land',
    'bannister', 'escalator', 'ottoman', 'bottle', 'buffet', 'poster', 'stage', 'van', 'ship', 'fountain',
    'conveyer belt', 'canopy', 'washer', 'plaything', 'swimming pool', 'stool', 'barrel', 'basket', 'waterfall',
    'tent', 'bag', 'minibike', 'cradle', 'oven', 'ball', 'food', 'step', 'tank', 'trade name', 'microwave', 'pot',
    'animal', 'bicycle', 'lake', 'dishwasher', 'screen', 'blanket', 'sculpture', 'hood', 'sconce', 'vase',
    'traffic light', 'tray', 'ashcan', 'fan', 'pier', 'crt screen', 'plate', 'monitor', 'bulletin board', 'shower',
    'radiator', 'glass', 'clock', 'flag')
# Cityscapes' 19 evaluated classes in trainId order (cityscapesscripts' labels.py)
CITYSCAPES_CLASSES = (
    'road', 'sidewalk', 'building', 'wall', 'fence', 'pole', 'traffic light', 'traffic sign', 'vegetation', 'terrain',
    'sky', 'person', 'rider', 'car', 'truck', 'bus', 'train', 'motorcycle', 'bicycle')
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff')
_LISTED = 8  # problems an error message lists before "and N more"


class SegmentationDataError(ValueError):
    """Segmentation data that cannot be used as it is; the message names the files and how to go on."""


@dataclass
class SegmentationProblem:
    """One bad pair: its kind (`missing mask`, `unreadable image`, `unreadable mask`, `size mismatch`, `bad label`),
    the image file, and what is wrong."""
    kind: str
    image: str
    detail: str

    def __str__(self) -> str:
        return f'{self.kind}: {self.image}: {self.detail}'


def _listing(folder: str, what: str) -> None:
    if not os.path.isdir(folder):
        raise SegmentationDataError(f'{what} folder not found: {folder}')


def ade20k_pairs(root: str, split: str) -> List[Tuple[str, str]]:
    """(image, mask) paths of an ADE20K split (`training` or `validation`) under `root` (ADEChallengeData2016)."""
    images, masks = os.path.join(root, 'images', split), os.path.join(root, 'annotations', split)
    _listing(images, f'ADE20K image ({root}/images/<split>, split {split!r})')
    return [(p, os.path.join(masks, os.path.splitext(os.path.basename(p))[0] + '.png'))
            for p in sorted(glob.glob(os.path.join(images, '*.jpg')))]


def cityscapes_pairs(root: str, split: str) -> List[Tuple[str, str]]:
    """(image, mask) paths of a Cityscapes split (`train`, `val`) under `root`: leftImg8bit and gtFine trainIds."""
    images = os.path.join(root, 'leftImg8bit', split)
    _listing(images, f'Cityscapes image ({root}/leftImg8bit/<split>, split {split!r})')
    pairs = []
    for path in sorted(glob.glob(os.path.join(images, '*', '*_leftImg8bit.png'))):
        city, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)[:-len('_leftImg8bit.png')]
        pairs.append((path, os.path.join(root, 'gtFine', split, city, f'{name}_gtFine_labelTrainIds.png')))
    return pairs


def folder_pairs(image_dir: str, mask_dir: str) -> List[Tuple[str, str]]:
    """(image, mask) paths: every image of `image_dir` and the `<name>.png` of `mask_dir`."""
    _listing(image_dir, 'image')
    _listing(mask_dir, 'mask')
    names = sorted(n for n in os.listdir(image_dir) if n.lower().endswith(IMAGE_EXTENSIONS))
    return [(os.path.join(image_dir, n), os.path.join(mask_dir, os.path.splitext(n)[0] + '.png')) for n in names]


def _read_mask(path: str) -> np.ndarray:
    with Image.open(path) as im:
        if im.mode not in ('L', 'P', 'I;16', 'I'):
            raise ValueError(f'a mask is a single-channel PNG of class indices (mode L, P or I;16), this one has mode '
                             f'{im.mode}')
        return np.asarray(im).astype(np.int64)


def _map_labels(mask: np.ndarray, reduce_zero_label: bool) -> np.ndarray:
    """mmsegmentation's reduce_zero_label: 0 -> ignore, k -> k - 1 (255 stays ignored)."""
    if not reduce_zero_label:
        return mask
    out = mask - 1
    out[(mask == 0) | (mask == IGNORE_INDEX)] = IGNORE_INDEX
    return out


class SegmentationDataset(torch.utils.data.Dataset):
    """(image, mask) pairs as normalized image tensors and int64 label maps.

    Args:
        pairs: (image path, mask path) pairs (`ade20k_pairs`, `cityscapes_pairs`, `folder_pairs`).
        class_names: The classes, in label order (their count is the model's).
        reduce_zero_label: ADE20K's mapping (0 ignored, labels shifted down by one).
        mean: Normalization mean (of pixel values in [0, 1]: the backbone's).
        std: Normalization std.
        pipeline: The training augmentation (:class:`TrainPipeline`), or None for evaluation.
        test_scale: Evaluation: rescale each image to fit this (long, short) size keeping its aspect ratio (None:
            its own size). The label keeps its size.
        skip_bad: Leave bad pairs out (else a `SegmentationDataError` lists them).
        seed: Seed of the training augmentation.
        name: What the messages call this data (e.g. its folder).
    """

    def __init__(self, pairs: Sequence[Tuple[str, str]], class_names: Sequence[str], reduce_zero_label: bool = False,
                 mean: Sequence[float] = (0.485, 0.456, 0.406), std: Sequence[float] = (0.229, 0.224, 0.225),
                 pipeline: Optional['TrainPipeline'] = None, test_scale: Optional[Tuple[int, int]] = None,
                 skip_bad: bool = False, seed: int = 0, name: str = ''):
        self.class_names, self.reduce_zero_label = list(class_names), reduce_zero_label
        self.mean, self.std = list(mean), list(std)
        self.pipeline, self.test_scale, self.seed, self.epoch = pipeline, test_scale, seed, 0
        self.name = name or (os.path.dirname(pairs[0][0]) if pairs else '')
        if not pairs:
            raise SegmentationDataError(f'no images found in {self.name or "the given folders"} (extensions '
                                        f'{", ".join(IMAGE_EXTENSIONS)})')
        self.problems = self._find_problems(list(pairs))
        if self.problems and not skip_bad:
            raise self._problems_error()
        bad = {p.image for p in self.problems}
        self.left_out = sorted(bad)
        self.pairs = [p for p in pairs if p[0] not in bad]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def _pair_problem(self, image: str, mask: str) -> Optional[SegmentationProblem]:
        if not os.path.isfile(mask):
            return SegmentationProblem('missing mask', image, f'no mask {mask}')
        try:
            with Image.open(image) as im:
                size = im.size
        except (UnidentifiedImageError, OSError) as e:
            return SegmentationProblem('unreadable image', image, str(e))
        try:
            labels = _map_labels(_read_mask(mask), self.reduce_zero_label)
        except (UnidentifiedImageError, OSError, ValueError) as e:
            return SegmentationProblem('unreadable mask', image, f'{mask}: {e}')
        if labels.shape != (size[1], size[0]):
            return SegmentationProblem('size mismatch', image, f'the image is {size[0]} x {size[1]} (width x '
                                                               f'height), its mask {mask} {labels.shape[1]} x '
                                                               f'{labels.shape[0]}')
        bad = np.unique(labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.num_classes))])
        if bad.size:
            raw = [int(v) + (1 if self.reduce_zero_label else 0) for v in bad[:5]]
            return SegmentationProblem('bad label', image, f'{mask} has values {raw} that are no class of the '
                                                           f'{self.num_classes} (0..{self.num_classes - 1}'
                                                           + (', read as value - 1 with 0 ignored' if
                                                              self.reduce_zero_label else '')
                                                           + f') and not the ignore value {IGNORE_INDEX}')
        return None

    def _find_problems(self, pairs: List[Tuple[str, str]]) -> List[SegmentationProblem]:
        """Every bad pair; under torchrun each process checks a shard and all get the whole list."""
        mine = [p for i in shard_range(len(pairs)) for p in [self._pair_problem(*pairs[i])] if p]
        return [p for part in all_gather(mine) for p in part]

    def _problems_error(self) -> SegmentationDataError:
        kinds: Dict[str, int] = {}
        for p in self.problems:
            kinds[p.kind] = kinds.get(p.kind, 0) + 1
        listed = '\n  '.join(str(p) for p in self.problems[:_LISTED])
        more = f'\n  ... and {len(self.problems) - _LISTED} more' if len(self.problems) > _LISTED else ''
        return SegmentationDataError(
            f'{self.name}: {len(self.problems)} bad image(s) (' + ', '.join(f'{n} {k}' for k, n in kinds.items())
            + f'):\n  {listed}{more}\nFix them, or leave them out of training and evaluation with --skip-bad-images '
            '(skip_bad=True); the report then counts and names them.')

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.pairs)

    def read(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pair as stored: a uint8 image (3, H, W) and the mapped int64 labels (H, W)."""
        image, mask = self.pairs[index]
        try:
            with Image.open(image) as im:
                rgb = TF.to_image(im.convert('RGB'))
        except (UnidentifiedImageError, OSError) as e:  # the header was fine when the dataset was built
            raise SegmentationDataError(f'cannot decode image {image}: {e}; replace or remove the file') from None
        return rgb, torch.from_numpy(_map_labels(_read_mask(mask), self.reduce_zero_label))

    def normalize(self, image: torch.Tensor) -> torch.Tensor:
        """A uint8-valued image (3, H, W) normalized with the dataset's mean and std."""
        return TF.normalize(image.float() / 255, self.mean, self.std)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        image, label = self.read(index)
        if self.pipeline is not None:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, self.epoch, index))
            return self.pipeline(image, label, generator, self)
        if self.test_scale is not None:
            size = rescale_size(image.shape[-2:], self.test_scale)
            image = TF.resize(image, list(size), InterpolationMode.BILINEAR, antialias=False)
        return self.normalize(image), label


def rescale_size(size: Sequence[int], scale: Sequence[int], ratio: float = 1.0) -> Tuple[int, int]:
    """(height, width) of an image of `size` rescaled, keeping its aspect ratio, to fit `scale` x `ratio` ((long,
    short) edges at most), as mmcv's `imrescale` (rounded half up)."""
    h, w = size
    long_edge, short_edge = max(scale) * ratio, min(scale) * ratio
    factor = min(int(long_edge) / max(h, w), int(short_edge) / min(h, w))
    return int(h * factor + 0.5), int(w * factor + 0.5)


@dataclass
class TrainPipeline:
    """mmsegmentation's training pipeline of its ADE20K and Cityscapes configs (see the module docstring).

    Args:
        scale: (long, short) edge bounds the random ratio multiplies ((2048, 512) for ADE20K, (2048, 1024) for
            Cityscapes).
        ratio_range: Range of the random ratio.
        crop_size: (height, width) of the random crop, and of every sample (padded where the image is smaller).
        cat_max_ratio: Largest share of the crop's labelled pixels one class may cover (1: no retry).
        flip_prob: Probability of a horizontal flip.
        photometric: Apply mmsegmentation's PhotoMetricDistortion.
    """
    scale: Tuple[int, int] = (2048, 512)
    ratio_range: Tuple[float, float] = (0.5, 2.0)
    crop_size: Tuple[int, int] = (512, 512)
    cat_max_ratio: float = 0.75
    flip_prob: float = 0.5
    photometric: bool = True
    _tries: int = field(default=10, repr=False)

    def __call__(self, image: torch.Tensor, label: torch.Tensor, g: torch.Generator,
                 dataset: SegmentationDataset) -> Tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.ratio_range
        ratio = lo + float(torch.rand((), generator=g)) * (hi - lo)
        size = list(rescale_size(image.shape[-2:], self.scale, ratio))
        image = TF.resize(image, size, InterpolationMode.BILINEAR, antialias=False)
        label = TF.resize(label[None], size, InterpolationMode.NEAREST)[0]
        image, label = self._crop(image, label, g)
        if float(torch.rand((), generator=g)) < self.flip_prob:
            image, label = image.flip(-1), label.flip(-1)
        image = image.float()
        if self.photometric:
            image = photometric_distortion(image, g)
        image = dataset.normalize(image)
        ph, pw = self.crop_size[0] - image.shape[-2], self.crop_size[1] - image.shape[-1]
        if ph > 0 or pw > 0:
            image = torch.nn.functional.pad(image, (0, max(pw, 0), 0, max(ph, 0)), value=0.)
            label = torch.nn.functional.pad(label, (0, max(pw, 0), 0, max(ph, 0)), value=IGNORE_INDEX)
        return image, label

    def _crop(self, image: torch.Tensor, label: torch.Tensor, g: torch.Generator
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """mmsegmentation's RandomCrop: retried until no class covers more than cat_max_ratio of the crop."""
        ch, cw = self.crop_size
        mh, mw = max(image.shape[-2] - ch, 0), max(image.shape[-1] - cw, 0)
        for _ in range(self._tries):
            y = int(torch.randint(mh + 1, (), generator=g))
            x = int(torch.randint(mw + 1, (), generator=g))
            crop = label[y:y + ch, x:x + cw]
            if self.cat_max_ratio >= 1:
                break
            counts = torch.bincount(crop[crop != IGNORE_INDEX].flatten())
            counts = counts[counts > 0]
            if len(counts) > 1 and counts.max() / counts.sum() < self.cat_max_ratio:
                break
        return image[:, y:y + ch, x:x + cw], crop


def photometric_distortion(image: torch.Tensor, g: torch.Generator, brightness: float = 32,
                           contrast: Tuple[float, float] = (0.5, 1.5), saturation: Tuple[float, float] = (0.5, 1.5),
                           hue: int = 18) -> torch.Tensor:
    """mmsegmentation's PhotoMetricDistortion on a float image (3, H, W) with values in [0, 255]: brightness
    (+ U(-32, 32)), contrast (x U(0.5, 1.5)) before or after the HSV steps (chosen at random), saturation
    (x U(0.5, 1.5)) and hue (+ an integer in [-18, 18) of OpenCV's 180 hue steps), each with probability 0.5, values
    clipped to [0, 255] after each step."""
    def coin() -> bool:
        return bool(torch.randint(2, (), generator=g))

    def uniform(lo: float, hi: float) -> float:
        return lo + float(torch.rand((), generator=g)) * (hi - lo)

    if coin():
        image = (image + uniform(-brightness, brightness)).clamp(0, 255)
    contrast_first = coin()
    if contrast_first and coin():
        image = (image * uniform(*contrast)).clamp(0, 255)
    change_saturation, change_hue = coin(), coin()
    if change_saturation or change_hue:
        hsv = _rgb_to_hsv(image / 255)
        if change_saturation:
            hsv[1] = (hsv[1] * uniform(*saturation)).clamp(0, 1)
        if change_hue:
            hsv[0] = (hsv[0] + int(torch.randint(-hue, hue, (), generator=g)) / 180) % 1.0
        image = (_hsv_to_rgb(hsv) * 255).clamp(0, 255)
    if not contrast_first and coin():
        image = (image * uniform(*contrast)).clamp(0, 255)
    return image


def collate_segmentation(batch: List[Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Training batches: every sample has the crop size, so images and labels stack."""
    images, labels = zip(*batch)
    return torch.stack(images), torch.stack(labels)
