"""Layouts of the ImageNet evaluation suites, their class maps and the checks that guard them.

Every suite is a folder tree that timm's folder reader loads (``timm.data.create_dataset``) with an explicit class
map, so that a partial or misnamed tree can never be silently re-indexed. The checks here run before any image is
scored: a missing corruption or severity folder, class folders the map does not know, class folders without images
and images lying flat in the root raise a ``LayoutError`` that names the path and what was expected; image counts
that differ from the real dataset's and files that are not images give a ``LayoutWarning`` (fixtures and subsets are
legitimate, but never unnoticed). Hidden files (names starting with '.': AppleDouble ``._x.JPEG``, ``.DS_Store``) are
never images. The scan's file list is the one the loader reads.

Facts (counts, folder names, AlexNet normalisers, the IN-9 mapping) are from the datasets' own repositories:
hendrycks/robustness (ImageNet-C), hendrycks/natural-adv-examples (-A), hendrycks/imagenet-r (-R),
MadryLab/backgrounds_challenge (-9), google-research/reassessed-imagenet (ReaL), modestyachts/ImageNetV2 (V2).
"""
import os
import pkgutil
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from timm.data import ImageNetInfo
from timm.data.readers.img_extensions import get_img_extensions
from timm.utils.misc import natural_key

__all__ = [
    'CORRUPTIONS', 'EXTRA_CORRUPTIONS', 'ALL_CORRUPTIONS', 'CORRUPTION_GROUPS', 'SEVERITIES', 'ALEXNET_ERRORS',
    'ALEXNET_CLEAN_ERROR', 'V2_VARIANTS', 'IN9_CLASSES', 'IN9_VARIANTS', 'IN9_RANGES', 'EXPECTED_IMAGES',
    'LayoutError', 'LayoutWarning', 'FolderScan', 'imagenet_class_map', 'v2_class_map', 'in9_class_map',
    'subset_indices', 'subset_synsets', 'in_to_in9', 'is_hidden', 'visible_folders', 'scan_class_folders',
    'resolve_split', 'imagenet_c_folders', 'v2_folders', 'in9_folders',
]

# ImageNet-C: the 15 corruptions of mCE in the order of the paper (noise, blur, weather, digital) and the 4 held-out
# ones of extra.tar, which have no AlexNet normalisers and are reported as raw error only.
CORRUPTION_GROUPS: Dict[str, Tuple[str, ...]] = {
    'noise': ('gaussian_noise', 'shot_noise', 'impulse_noise'),
    'blur': ('defocus_blur', 'glass_blur', 'motion_blur', 'zoom_blur'),
    'weather': ('snow', 'frost', 'fog', 'brightness'),
    'digital': ('contrast', 'elastic_transform', 'pixelate', 'jpeg_compression'),
}
CORRUPTIONS: Tuple[str, ...] = tuple(c for group in CORRUPTION_GROUPS.values() for c in group)
EXTRA_CORRUPTIONS: Tuple[str, ...] = ('speckle_noise', 'gaussian_blur', 'spatter', 'saturate')
ALL_CORRUPTIONS: Tuple[str, ...] = CORRUPTIONS + EXTRA_CORRUPTIONS
SEVERITIES: Tuple[int, ...] = (1, 2, 3, 4, 5)

# AlexNet top-1 error on each corruption, mean over the 5 severities (google-research/augmix imagenet.py, "taken from
# hendrycks/robustness"; identical in mmcls CorruptionError). CE_c = mean_s E_{s,c} / ALEXNET_ERRORS[c].
ALEXNET_ERRORS: Dict[str, float] = {
    'gaussian_noise': 0.886428, 'shot_noise': 0.894468, 'impulse_noise': 0.922640, 'defocus_blur': 0.819880,
    'glass_blur': 0.826268, 'motion_blur': 0.785948, 'zoom_blur': 0.798360, 'snow': 0.866816, 'frost': 0.826572,
    'fog': 0.819324, 'brightness': 0.564592, 'contrast': 0.853204, 'elastic_transform': 0.646056,
    'pixelate': 0.717840, 'jpeg_compression': 0.606500,
}
# AlexNet clean top-1 error for relative mCE. No official constant exists: the paper's table shows 43.5, torchvision's
# old table for alexnet-owt-4df8aa71 43.45, its current docs 43.48 (relative mCE moves by ~0.1-0.2 across these).
ALEXNET_CLEAN_ERROR = 0.4345

# ImageNetV2: variant -> folder the tarball extracts to; files are <folder>/<class index 0..999>/<hash>.jpeg
V2_VARIANTS: Dict[str, str] = {
    'matched-frequency': 'imagenetv2-matched-frequency-format-val',
    'threshold0.7': 'imagenetv2-threshold0.7-format-val',
    'top-images': 'imagenetv2-top-images-format-val',
}

# ImageNet-9 (Backgrounds Challenge): <root>/<variant>/val/<NN_name>/*; fg_mask holds masks, not test images
IN9_CLASSES: Tuple[str, ...] = (
    '00_dog', '01_bird', '02_wheeled vehicle', '03_reptile', '04_carnivore', '05_insect', '06_musical instrument',
    '07_primate', '08_fish')
IN9_VARIANTS: Tuple[str, ...] = (
    'original', 'mixed_same', 'mixed_rand', 'mixed_next', 'only_fg', 'no_fg', 'only_bg_b', 'only_bg_t')
# in_to_in9.json as inclusive ranges of ImageNet indices per IN-9 class (370 mapped, the other 630 map to -1); the
# MadryLab repository has no licence, so the mapping is carried as this table and tested on its per-class counts.
IN9_RANGES: Dict[int, Tuple[Tuple[int, int], ...]] = {
    0: ((151, 170), (173, 268)),
    1: ((7, 24), (87, 100), (127, 146)),
    2: tuple((i, i) for i in (
        407, 408, 428, 436, 444, 468, 511, 547, 555, 561, 565, 569, 573, 586, 603, 609, 612, 627, 656, 661, 665, 670,
        671, 675, 690, 705, 717, 734, 751, 757, 791, 802, 803, 817, 820, 829, 847, 864, 866, 867, 870, 880)),
    3: ((33, 68),),
    4: ((269, 280), (286, 299), (356, 362), (387, 388)),
    5: ((300, 326),),
    6: tuple((i, i) for i in (
        401, 402, 420, 432, 486, 494, 513, 541, 546, 558, 566, 577, 579, 593, 594, 641, 642, 683, 684, 687, 699, 776,
        822, 875, 881, 889)),
    7: ((365, 384),),
    8: ((0, 6), (389, 397)),
}

# Images (and classes) of the full datasets; IN-C counts are per (corruption, severity), V2 and IN-9 per variant
EXPECTED_IMAGES: Dict[str, Tuple[int, int]] = {
    'imagenet': (50000, 1000),
    'imagenet_c': (50000, 1000),
    'imagenet_v2': (10000, 1000),
    'imagenet_a': (7500, 200),
    'imagenet_r': (30000, 200),
    'imagenet_9': (4050, 9),
}

_IMG_EXTENSIONS = set(get_img_extensions())


class LayoutError(ValueError):
    """A suite's folder tree is not in the layout its labels depend on."""


class LayoutWarning(UserWarning):
    """A suite's folder tree is usable but differs from the real dataset (e.g. fewer images)."""


def imagenet_class_map() -> Dict[str, int]:
    """wnid -> ImageNet-1K index, from timm's sorted synset list (the order of every ImageNet-1K classifier)."""
    return {wnid: i for i, wnid in enumerate(ImageNetInfo('imagenet-1k').label_names())}


def v2_class_map() -> Dict[str, int]:
    """ImageNetV2 folder name -> index: the folders are named by their class index (0..999), not by sort order."""
    return {str(i): i for i in range(1000)}


def in9_class_map(folder_names: Sequence[str]) -> Dict[str, int]:
    """IN-9 class folder -> 0..8 from its two-digit prefix (``'02_wheeled vehicle'`` -> 2).

    Raises:
        LayoutError: a folder without an ``NN_`` prefix in 00..08, or two folders with the same prefix.
    """
    class_map = {}
    for name in folder_names:
        m = re.fullmatch(r'(\d\d)_.+', name)
        if not m or int(m.group(1)) >= len(IN9_CLASSES):
            raise LayoutError(f'ImageNet-9 class folder {name!r} has no prefix 00_ .. 08_; expected the folders '
                              f'{", ".join(map(repr, IN9_CLASSES))}')
        class_map[name] = int(m.group(1))
    dup = sorted({v for v in class_map.values() if list(class_map.values()).count(v) > 1})
    if dup:
        raise LayoutError(f'ImageNet-9 class folders share a prefix: {[n for n, v in class_map.items() if v in dup]}')
    return class_map


def _info_lines(name: str) -> List[str]:
    data = pkgutil.get_data('timm.data', f'_info/{name}')
    return [line.strip() for line in data.decode('utf-8').splitlines() if line.strip()]


def subset_indices(subset: str) -> List[int]:
    """The 200 ImageNet-1K indices of ImageNet-A (``'a'``) or ImageNet-R (``'r'``), increasing; shipped with timm."""
    return [int(x) for x in _info_lines(f'imagenet_{subset}_indices.txt')]


def subset_synsets(subset: str) -> List[str]:
    """The 200 wnids of ImageNet-A or -R, in the order of `subset_indices`."""
    return _info_lines(f'imagenet_{subset}_synsets.txt')


def in_to_in9() -> List[int]:
    """ImageNet-1K index -> IN-9 class (0..8), or -1 for the 630 classes IN-9 does not map (``in_to_in9.json``)."""
    table = [-1] * 1000
    for cls, ranges in IN9_RANGES.items():
        for lo, hi in ranges:
            for i in range(lo, hi + 1):
                table[i] = cls
    return table


@dataclass
class FolderScan:
    """What a class-folder tree holds: the images to evaluate, per class folder, and the problems found.

    ``samples`` is the one file list of the set: the dataset the loader reads is built from it
    (`lsvision.eval.dataset.EvalImageDataset`), so the counts reported are the images evaluated. It is empty for a
    scan made with ``list_files=False`` (counts only).
    """
    root: str
    counts: Dict[str, int]
    samples: List[Tuple[str, int]] = field(default_factory=list)  # (image path, label), timm's natural order
    warnings: List[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def warn_or_raise(found: List[str], message: str, strict: bool, emit: bool = True, stacklevel: int = 3) -> None:
    """Appends ``message`` to ``found`` and issues it as a `LayoutWarning`, or raises it as a `LayoutError` if
    ``strict``; ``emit=False`` only collects it (the caller summarises)."""
    if strict:
        raise LayoutError(message + ' (--strict turns this into an error)')
    found.append(message)
    if emit:
        warnings.warn(message, LayoutWarning, stacklevel=stacklevel)


def is_hidden(name: str) -> bool:
    """Names starting with '.' are never data: macOS AppleDouble files (``._x.JPEG``), ``.DS_Store``, ``.Trashes``."""
    return name.startswith('.')


def visible_folders(path: str) -> List[str]:
    """The sorted names of the sub-folders of ``path`` that are not hidden."""
    return sorted(e for e in os.listdir(path) if not is_hidden(e) and os.path.isdir(os.path.join(path, e)))


def scan_class_folders(
        root: str,
        class_map: Dict[str, int],
        suite: str,
        expected: Optional[Tuple[int, int]] = None,
        example: str = '<class>',
        strict: bool = False,
        emit: bool = True,
        list_files: bool = True,
        allow_empty: bool = False,
        empty_hint: str = 'Restore the images or remove the folder(s).',
) -> FolderScan:
    """Lists the images of ``root``, which holds one folder of images per class, every folder a key of ``class_map``.

    Hidden files and folders (names starting with '.') are never images and are not looked at.

    Args:
        root: the folder whose sub-folders are the classes (e.g. ``val/``).
        class_map: folder name -> label.
        suite: suite name for messages.
        expected: (images, class folders) of the full dataset; a difference warns (or raises if ``strict``).
        example: a folder name to show in messages, e.g. ``'n01440764'``.
        strict: raise on count differences and on files that are not images, instead of warning.
        emit: issue the warnings (``LayoutWarning``); False only collects them in the result (the caller summarises).
        list_files: keep the file list; False only counts (to check many sets up front without holding millions of
            paths, e.g. ImageNet-C's 3.75 M: each set is scanned again, with its list, when it is read).
        allow_empty: class folders without images are counted (0 images) instead of an error, as long as one holds
            images.
        empty_hint: what the error about empty class folders tells the user to do.

    Returns:
        the images (only files timm reads: .png/.jpg/.jpeg in any case) with their labels, the count per class folder,
        and the warnings issued.

    Raises:
        LayoutError: ``root`` missing, images directly in ``root`` (a flat folder has no labels), no class folders,
            folder names the class map does not know, class folders with sub-folders, or class folders without
            images.
    """
    layout = f'{root}/{example}/<image>'
    if not os.path.isdir(root):
        raise LayoutError(f'{suite}: folder {root} does not exist (expected {layout})')
    entries = sorted(e for e in os.listdir(root) if not is_hidden(e))
    flat = [e for e in entries if os.path.isfile(os.path.join(root, e)) and _is_image(e)]
    if flat:
        raise LayoutError(
            f'{suite}: {len(flat)} images lie directly in {root} (e.g. {flat[0]}); a flat folder carries no labels. '
            f'Expected one sub-folder per class: {layout}. For the ImageNet val set, sort the images into wnid '
            'folders (e.g. with the valprep.sh script of the soumith/imagenetloader.torch repository).')
    folders = [e for e in entries if os.path.isdir(os.path.join(root, e))]
    if not folders:
        raise LayoutError(f'{suite}: no class folders in {root} (expected {layout})')
    unknown = [f for f in folders if f not in class_map]
    if unknown:
        raise LayoutError(
            f'{suite}: {len(unknown)} folder(s) in {root} are not classes of this suite: '
            f'{", ".join(map(repr, unknown[:5]))}{" ..." if len(unknown) > 5 else ""}; expected class folders '
            f'like {example!r} ({layout}). Point the suite at the folder that holds the class folders.')
    scan = FolderScan(root=root, counts={})
    for folder in folders:
        path = os.path.join(root, folder)
        images, skipped, nested = [], [], []
        for dirpath, dirnames, files in os.walk(path, followlinks=True):
            dirnames[:] = [d for d in dirnames if not is_hidden(d)]
            nested.extend(os.path.join(dirpath, d) for d in dirnames)
            for f in files:
                if _is_image(f):
                    images.append(os.path.join(dirpath, f))
                elif not is_hidden(f):
                    skipped.append(os.path.join(dirpath, f))
        if nested:
            raise LayoutError(f'{suite}: class folder {path} has sub-folders ({nested[0]}); expected images '
                              f'directly in each class folder ({layout})')
        scan.counts[folder] = len(images)
        if list_files:
            scan.samples += [(f, class_map[folder]) for f in images]
        if skipped:
            warn_or_raise(scan.warnings, f'{suite}: {len(skipped)} file(s) in {path} are not .png/.jpg/.jpeg images '
                                         f'and are skipped (e.g. {skipped[0]})', strict, emit)
    empty = [os.path.join(root, f) for f, n in scan.counts.items() if n == 0]
    if len(empty) == len(folders):
        raise LayoutError(f'{suite}: no images in {root} (its {len(folders)} class folder(s) are empty; only '
                          '.png/.jpg/.jpeg files not starting with "." count)')
    if empty and not allow_empty:
        more = ' ...' if len(empty) > 3 else ''
        raise LayoutError(f'{suite}: {len(empty)} class folder(s) hold no images: {", ".join(empty[:3])}{more}; only '
                          f'.png/.jpg/.jpeg files not starting with "." count. {empty_hint}')
    scan.samples.sort(key=lambda sample: natural_key(sample[0]))  # the order of timm's folder reader
    if expected is not None:
        n_images, n_classes = expected
        if scan.total != n_images or len(folders) != n_classes:
            warn_or_raise(scan.warnings, f'{suite}: {root} holds {scan.total} images in {len(folders)} class '
                                         f'folders; the full dataset has {n_images} in {n_classes}. Results are not '
                                         'comparable with published ones.', strict, emit)
    return scan


def _is_image(filename: str) -> bool:
    return not is_hidden(filename) and os.path.splitext(filename)[1].lower() in _IMG_EXTENSIONS


def resolve_split(root: str, split: str = 'val') -> str:
    """``root/split`` if that folder exists, else ``root`` (``imagenet/`` and ``imagenet/val/`` both work)."""
    candidate = os.path.join(root, split)
    return candidate if os.path.isdir(candidate) else root


def imagenet_c_folders(
        root: str,
        corruptions: Sequence[str],
        severities: Sequence[int] = SEVERITIES,
) -> Dict[Tuple[str, int], str]:
    """(corruption, severity) -> folder of an ImageNet-C tree ``<root>/<corruption>/<severity>/<wnid>/<image>``.

    Raises:
        LayoutError: ``root`` missing, an unknown corruption name, or a corruption or severity folder missing.
    """
    if not os.path.isdir(root):
        raise LayoutError(f'ImageNet-C: folder {root} does not exist (expected {root}/<corruption>/<1..5>/<wnid>/)')
    unknown = [c for c in corruptions if c not in ALL_CORRUPTIONS]
    if unknown:
        raise LayoutError(f'ImageNet-C: unknown corruption(s) {unknown}; known: {", ".join(ALL_CORRUPTIONS)}')
    folders = {}
    for c in corruptions:
        if not os.path.isdir(os.path.join(root, c)):
            present = sorted(e for e in os.listdir(root) if os.path.isdir(os.path.join(root, e)))
            raise LayoutError(f'ImageNet-C: corruption folder {os.path.join(root, c)} is missing (found: '
                              f'{", ".join(present) or "nothing"}); expected {root}/<corruption>/<1..5>/<wnid>/')
        for s in severities:
            path = os.path.join(root, c, str(s))
            if not os.path.isdir(path):
                raise LayoutError(f'ImageNet-C: severity folder {path} is missing; every corruption needs the '
                                  f'severity folders {", ".join(map(str, severities))} ({root}/{c}/<1..5>/<wnid>/)')
            folders[(c, s)] = path
    return folders


def v2_folders(root: str, variants: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """variant -> folder of the ImageNetV2 variants under ``root`` (or ``root`` itself if it is one of them).

    Raises:
        LayoutError: none of the variant folders found, or a requested variant missing.
    """
    names = {v: os.path.join(root, folder) for v, folder in V2_VARIANTS.items()}
    base = os.path.basename(os.path.normpath(root))
    own = [v for v, folder in V2_VARIANTS.items() if folder == base]
    if own:
        found = {own[0]: root}
    else:
        found = {v: p for v, p in names.items() if os.path.isdir(p)}
    if variants:
        missing = [v for v in variants if v not in found]
        if missing:
            raise LayoutError(f'ImageNetV2: variant folder(s) {[names.get(v, v) for v in missing]} missing '
                              f'(found {list(found) or "none"}; variants: {", ".join(V2_VARIANTS)})')
        found = {v: found[v] for v in variants}
    if not found:
        raise LayoutError(f'ImageNetV2: no variant folder in {root}; expected one or more of '
                          f'{", ".join(V2_VARIANTS.values())} (as extracted from the tarballs), each holding '
                          'folders 0..999')
    return found


def in9_folders(root: str, variants: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """variant -> class-folder root (``<root>/<variant>/val``) of the ImageNet-9 variants present under ``root``.

    ``original``, ``mixed_same`` and ``mixed_rand`` (the BG-gap) are required; the other variants are taken when
    present, or exactly ``variants`` when given.

    Raises:
        LayoutError: a required or requested variant folder missing.
    """
    if not os.path.isdir(root):
        raise LayoutError(f'ImageNet-9: folder {root} does not exist (expected {root}/<variant>/val/<NN_class>/)')
    required = list(variants) if variants else ['original', 'mixed_same', 'mixed_rand']
    unknown = [v for v in required if v not in IN9_VARIANTS]
    if unknown:
        raise LayoutError(f'ImageNet-9: unknown variant(s) {unknown}; known: {", ".join(IN9_VARIANTS)}')
    found = {}
    for v in IN9_VARIANTS:
        path = os.path.join(root, v)
        if os.path.isdir(path):
            found[v] = resolve_split(path)
        elif v in required:
            raise LayoutError(f'ImageNet-9: variant folder {path} is missing (expected {path}/val/<NN_class>/); '
                              f'needed: {", ".join(required)}')
    return {v: found[v] for v in (required if variants else found)}
