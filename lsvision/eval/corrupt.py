"""ImageNet-C-style corruptions applied on the fly, for val sets that have no released -C version.

Uses the optional extra ``imagecorruptions-imaug`` (``pip install 'lsvision[corrupt]'``; import name
``imagecorruptions``), which runs all 19 corruptions under numpy 2. The pipeline follows how ImageNet-C was made
(``create_c/make_imagenet_c.py``): Resize(256), CenterCrop(224), corruption, JPEG quality 85. It does not reproduce
the released JPEGs bit for bit, and impulse_noise and glass_blur draw from RNGs that ``np.random.seed`` does not
control, so results are close to, not equal to, those on the real ImageNet-C.
"""
import io
import zlib
from typing import Any, Callable

import numpy as np
from PIL import Image
from torchvision.transforms import CenterCrop, Resize

__all__ = ['ImageNetCCorruption', 'load_imagecorruptions']


def load_imagecorruptions() -> Callable[..., np.ndarray]:
    """``imagecorruptions.corrupt``, or an ImportError that says which extra to install."""
    try:
        from imagecorruptions import corrupt
    except ImportError as e:
        raise ImportError("--corrupt-on-the-fly needs the optional extra: pip install 'lsvision[corrupt]' "
                          f'(package imagecorruptions-imaug); import failed: {e}') from e
    return corrupt


class ImageNetCCorruption:
    """PIL image -> corrupted 224x224 PIL image, made the way ImageNet-C was.

    Each image gets its own numpy seed from its pixels and ``seed``, so a run is repeatable (except impulse_noise and
    glass_blur, see the module docstring) and independent of batch order or worker count.

    Args:
        corruption: one of the 19 ImageNet-C corruption names.
        severity: 1..5.
        resize: shorter side before the crop (256, as ImageNet-C).
        crop: centre crop (224).
        jpeg_quality: quality of the JPEG round trip after the corruption (85, as ImageNet-C); None skips it.
        seed: mixed into each image's seed.
    """

    def __init__(self, corruption: str, severity: int, resize: int = 256, crop: int = 224,
                 jpeg_quality: Any = 85, seed: int = 0):
        self.corrupt = load_imagecorruptions()
        self.corruption = corruption
        self.severity = severity
        self.resize = Resize(resize)
        self.crop = CenterCrop(crop)
        self.jpeg_quality = jpeg_quality
        self.seed = seed

    def __call__(self, img: Image.Image) -> Image.Image:
        img = self.crop(self.resize(img.convert('RGB')))
        pixels = np.asarray(img)
        np.random.seed((zlib.crc32(pixels.tobytes()) + self.seed) % 2 ** 32)
        out = self.corrupt(pixels, corruption_name=self.corruption, severity=self.severity)
        img = Image.fromarray(np.uint8(np.clip(out, 0, 255)))
        if self.jpeg_quality:
            buf = io.BytesIO()
            img.save(buf, format='JPEG', quality=self.jpeg_quality)
            buf.seek(0)
            img = Image.open(buf).convert('RGB')
        return img

    def __repr__(self) -> str:
        return (f'{type(self).__name__}({self.corruption!r}, severity={self.severity}, '
                f'jpeg_quality={self.jpeg_quality}, seed={self.seed})')
