"""scikit-learn's bundled handwritten digits as an ImageFolder tree: the embedded dataset of the training demo.

The 1,797 8x8 images (UCI optdigits test set, shipped inside scikit-learn, so nothing is downloaded) are split once
into a fixed stratified train/val split, upsampled, and written as PNGs under `<root>/train/<class>/` and
`<root>/val/<class>/`, a layout `timm.data.create_dataset('', root)` reads like ImageNet.
"""
import json
import os
from typing import Dict

import numpy as np
from PIL import Image

from ._cache import building, publish

__all__ = ['DIGITS_CLASSES', 'export_digits', 'default_digits_root']

DIGITS_CLASSES = tuple(str(i) for i in range(10))
_VERSION = 1  # bump when the export (split, size, format) changes, so stale trees are rebuilt


def default_digits_root() -> str:
    """Cache directory of the exported tree: $LSVISION_CACHE or ~/.cache/lsvision, then `digits`."""
    cache = os.environ.get('LSVISION_CACHE') or os.path.join(os.path.expanduser('~'), '.cache', 'lsvision')
    return os.path.join(cache, 'digits')


def _split(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Stratified split: a boolean val mask with `val_fraction` of each class (fixed by `seed`)."""
    rng = np.random.RandomState(seed)
    is_val = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        is_val[idx[:int(round(len(idx) * val_fraction))]] = True
    return is_val


def export_digits(
        root: str = '',
        img_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
) -> Dict[str, object]:
    """Write the digits as an ImageFolder tree once and return its description.

    Args:
        root: Target directory ('' = `default_digits_root()`). An existing export with the same settings is reused.
        img_size: Side of the written images (8x8 upsampled, bicubic).
        val_fraction: Fraction of each class held out for validation.
        seed: Seed of the split.

    Returns:
        Dict with `root`, `train` and `val` directories and the image counts.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - scikit-learn is an install requirement
        raise ImportError('the digits demo needs scikit-learn: pip install scikit-learn') from e
    root = os.path.abspath(root or default_digits_root())
    meta = dict(version=_VERSION, img_size=img_size, val_fraction=val_fraction, seed=seed)
    meta_path = os.path.join(root, 'export.json')
    with building(root):  # another process exporting the same tree: wait for it, then reuse its export
        if os.path.isfile(meta_path):
            with open(meta_path) as f:
                done = json.load(f)
            if all(done.get(k) == v for k, v in meta.items()):
                return done
        digits = load_digits()
        images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)  # values 0..16 -> 0..255
        labels = digits.target
        is_val = _split(labels, val_fraction, seed)
        with publish(root, '.digits-') as tmp:  # a killed export never leaves a half-written tree behind
            for split in ('train', 'val'):
                for c in DIGITS_CLASSES:
                    os.makedirs(os.path.join(tmp, split, c))
            for i, (img, label, val) in enumerate(zip(images, labels, is_val)):
                pil = Image.fromarray(img, mode='L').resize((img_size, img_size), Image.BICUBIC)
                pil.save(os.path.join(tmp, 'val' if val else 'train', str(label), f'{i:04d}.png'))
            done = dict(meta, root=root, train=os.path.join(root, 'train'), val=os.path.join(root, 'val'),
                        num_train=int((~is_val).sum()), num_val=int(is_val.sum()))
            with open(os.path.join(tmp, 'export.json'), 'w') as f:
                json.dump(done, f, indent=2)
    return done
