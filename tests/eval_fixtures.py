"""Tiny trees of the evaluation suites in their real layouts, and a colour-oracle classifier.

Every image is a solid colour that encodes an ImageNet class k: channel value = 12 + 25 * digit for the hundreds
(R), tens (G) and ones (B) digit of k. ``ColourOracle`` un-normalises its input, averages each channel, rounds to the
digits and gives k the logit 10 and every other class j the logit -j / 1000: a strict full ranking, so masked
argmax and top-5 have no ties and expected metrics are exact. An image made with another class's colour is a
prediction error on purpose.
"""
import json
import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn as nn
from PIL import Image

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from lsvision.eval import (
    ALL_CORRUPTIONS,
    IN9_CLASSES,
    SEVERITIES,
    V2_VARIANTS,
    imagenet_class_map,
    subset_synsets,
)

WNIDS = list(imagenet_class_map())


def colour(k: int) -> Tuple[int, int, int]:
    """The RGB colour that encodes ImageNet class k."""
    return tuple(12 + 25 * int(d) for d in f'{k:03d}')


def save_image(path: Path, k: int, size: Tuple[int, int] = (80, 64), quality: int = 90, mode: str = 'RGB') -> None:
    """A solid image of class k's colour (``mode='L'``: grey, for a repdigit class such as 555)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    value = colour(k)
    img = Image.new('RGB', size, value) if mode == 'RGB' else Image.new('L', size, value[0])
    img.save(path, quality=quality)


class ColourOracle(nn.Module):
    """A 1000-class 'model' that reads the class from the image colour (an exact, deterministic classifier)."""

    def __init__(self, input_size: int = 224):
        super().__init__()
        self.register_buffer('mean', torch.tensor(IMAGENET_DEFAULT_MEAN).view(1, 3, 1, 1))
        self.register_buffer('std', torch.tensor(IMAGENET_DEFAULT_STD).view(1, 3, 1, 1))
        self.register_buffer('ramp', -torch.arange(1000, dtype=torch.float32) / 1000)
        self.num_classes = 1000
        self.pretrained_cfg = dict(input_size=(3, input_size, input_size), interpolation='bicubic', crop_pct=0.875,
                                   mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        pixels = (x * self.std + self.mean).mean(dim=(2, 3)) * 255
        digits = ((pixels - 12) / 25).round().clamp(0, 9).long()
        return digits[:, 0] * 100 + digits[:, 1] * 10 + digits[:, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ramp.expand(len(x), -1).clone()
        logits[torch.arange(len(x)), self.decode(x)] = 10.0
        return logits


def make_imagenet(root: Path) -> Dict[str, object]:
    """val/<wnid>/ILSVRC2012_val_{i:08d}.JPEG for i = 1..6 over classes 0 and 1, and a 6-entry real.json.

    Image 3 (folder of class 0) has the colour of class 5; its ReaL labels [0, 5] make it right for ReaL. Image 2 has
    no ReaL label (skipped); image 6 (class 1, coloured 1) has the ReaL label [2], wrong for ReaL.
    Expected: top-1 5/6, top-5 6/6; ReaL top-1 4/5, top-5 5/5 (image 6's top-5 is 1, 0, 2, 3, 4).
    """
    images = [(0, 0, [0]), (0, 0, []), (0, 5, [0, 5]), (1, 1, [1]), (1, 1, [1]), (1, 1, [2])]  # folder, colour, ReaL
    for i, (cls, col, _) in enumerate(images, 1):
        save_image(root / 'val' / WNIDS[cls] / f'ILSVRC2012_val_{i:08d}.JPEG', col)
    real = root / 'real.json'
    real.write_text(json.dumps([labels for _, _, labels in images]))
    return dict(root=root, real_json=real, n=len(images))


def make_v2(root: Path) -> Path:
    """The three V2 variants with folders {0, 2, 10, 100, 999}, two images each coloured int(folder); in
    threshold0.7 one image of folder 10 has the colour of 11 (its top-5 is 11, 0, 1, 2, 3: wrong at top-5 too)."""
    for variant, folder in V2_VARIANTS.items():
        for k in (0, 2, 10, 100, 999):
            for j in range(2):
                col = 11 if (variant == 'threshold0.7' and k == 10 and j == 0) else k
                save_image(root / folder / str(k) / f'{k:03x}{j}ab12cd.jpeg', col)
    return root


def imagenet_c_profile(corruption_index: int, severity: int) -> int:
    """Number of wrong images (of 2) at a corruption and severity: a fixed, varied error profile."""
    return (corruption_index + severity) % 3


def make_imagenet_c(root: Path, corruptions: Sequence[str] = ALL_CORRUPTIONS) -> Path:
    """<root>/<corruption>/<1..5>/<wnid>/ILSVRC2012_val_*.JPEG, 224x224 JPEG q85, one image of class 0 and one of
    class 1 per (corruption, severity); ``imagenet_c_profile`` of them carry a wrong colour (class 7)."""
    for ci, c in enumerate(corruptions):
        for s in SEVERITIES:
            n_wrong = imagenet_c_profile(ci, s)
            for j, cls in enumerate((0, 1)):
                col = 7 if j < n_wrong else cls
                save_image(root / c / str(s) / WNIDS[cls] / f'ILSVRC2012_val_{j + 1:08d}.JPEG', col, (224, 224), 85)
    return root


def make_imagenet_ar(root: Path, subset: str) -> Dict[str, object]:
    """imagenet-a/ or imagenet-r/ with README.txt and 3 class folders (the subset's first three wnids), 4 images.

    Images: two right; one in the folder of the subset's lowest index coloured class 0 (outside both A and R): wrong
    unmasked, right masked (the descending ramp makes the lowest in-set index the masked argmax); one in the second
    folder coloured the third class (wrong both ways). R also gets a greyscale image of class 555 (in R), right.
    Expected: A unmasked 2/4, masked 3/4; R unmasked 3/5, masked 4/5.
    """
    synsets = subset_synsets(subset)
    wnid_index = imagenet_class_map()
    idx = [wnid_index[w] for w in synsets[:3]]
    folder = root / f'imagenet-{subset}'
    folder.mkdir(parents=True)
    (folder / 'README.txt').write_text('ImageNet-{subset} fixture\n')
    name = '0.000116_digital clock _ digital clock_0.865662.jpg' if subset == 'a' else 'art_0.jpg'
    save_image(folder / synsets[0] / name, idx[0])
    save_image(folder / synsets[1] / ('1.0 x.jpg' if subset == 'a' else 'sketch_0.jpg'), idx[1])
    save_image(folder / synsets[0] / ('2.0 y.jpg' if subset == 'a' else 'cartoon_1.jpg'), 0)
    save_image(folder / synsets[1] / ('3.0 z.jpg' if subset == 'a' else 'art_3.jpg'), idx[2])
    if subset == 'r':
        wnid = WNIDS[555]
        save_image(folder / wnid / 'sketch_9.jpg', 555, mode='L')
    return dict(root=folder, indices=idx)


IN9_REPRESENTATIVE = (151, 7, 407, 33, 269, 300, 401, 365, 0)


def make_imagenet_9(root: Path, variants: Sequence[str] = ('original', 'mixed_same', 'mixed_rand', 'only_fg')
                    ) -> Tuple[Path, Dict[str, float]]:
    """<root>/<variant>/val/<NN_name>/n0000_*.JPEG (224x224), one image per class coloured its representative
    ImageNet index; mixed_same gets one image coloured 171 (a dog index mapped to -1: wrong), mixed_rand that and two
    images coloured another IN-9 class. Returns the root and the expected accuracy per variant (%)."""
    wrong = {'original': {}, 'mixed_same': {0: 171}, 'mixed_rand': {0: 171, 1: 151, 8: 7}, 'only_fg': {2: 999}}
    expected = {}
    for v in variants:
        for cls, name in enumerate(IN9_CLASSES):
            k = wrong.get(v, {}).get(cls, IN9_REPRESENTATIVE[cls])
            save_image(root / v / 'val' / name / f'n0000_{cls:04d}.JPEG', k, (224, 224), 90)
        expected[v] = 100 * (len(IN9_CLASSES) - len(wrong.get(v, {}))) / len(IN9_CLASSES)
    return root, expected


def make_suite_trees(root: Path) -> Dict[str, object]:
    """Every suite's tree under ``root``, as its ``make_*`` returns it: imagenet, v2, c (all corruptions), a, r,
    in9 (the root and the expected accuracies)."""
    return dict(
        imagenet=make_imagenet(root / 'imagenet'),
        v2=make_v2(root / 'v2'),
        c=make_imagenet_c(root / 'imagenet-c'),
        a=make_imagenet_ar(root / 'a', 'a'),
        r=make_imagenet_ar(root / 'r', 'r'),
        in9=make_imagenet_9(root / 'bg'),
    )


def list_files(root: Path) -> List[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# AppleDouble header (magic 0x00051607, version 2): what macOS writes as ._<name> beside each file it copies
APPLEDOUBLE = b'\x00\x05\x16\x07\x00\x02\x00\x00' + b'Mac OS X        ' + b'\x00' * 64


def add_mac_junk(root: Path) -> int:
    """Adds what a copy from a Mac leaves: ``._<name>`` beside every file and folder, ``.DS_Store`` in every folder.

    Returns:
        the number of junk files added (``._x.JPEG`` ones have an image extension but are not images).
    """
    added = 0
    for dirpath, dirnames, files in os.walk(root):
        for name in files + dirnames:
            (Path(dirpath) / f'._{name}').write_bytes(APPLEDOUBLE)
            added += 1
        (Path(dirpath) / '.DS_Store').write_bytes(b'\x00\x00\x00\x01Bud1' + b'\x00' * 32)
        added += 1
    return added


def truncate(path: Path, keep: float = 0.9) -> None:
    """Cuts a file to ``keep`` of its bytes (a download or copy that stopped early); at 0.9 a fixture JPEG keeps its
    header, so it opens and only fails when its pixels are decoded."""
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
