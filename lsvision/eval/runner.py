"""The shared evaluation loop and one runner per suite: folder checks, timm dataset and loader, metrics.

Each runner takes any ImageNet-1K classifier (an ``nn.Module`` mapping (B, 3, H, W) to (B, 1000) logits) and returns a
JSON-ready dict with the raw counts, the metrics, the preprocessing protocol and the layout warnings. Protocols:
ImageNet, ReaL, V2, A and R use the model's own eval transform (``timm.data.resolve_model_data_config``);
ImageNet-C and ImageNet-9, whose images are already 224x224, are not resized (CenterCrop 224 with crop_pct 1.0 is an
exact identity, as hendrycks/robustness' ImageNet-C test.py); a model whose input size is not 224 (a training run's,
or ``--img-size``) gets the whole 224 image resized to its size, flagged non-standard.

Every set is read from the file list of its folder scan (`EvalImageDataset`): hidden files are never images, an
image that cannot be read is left out with a warning naming it (an error under ``strict``), never replaced by another,
so ``count`` is the images evaluated and ``skipped`` lists the others; ImageNet-C and -9 images that are not 224x224
give a warning naming the set and the size (an error under ``strict``).
"""
import hashlib
import math
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.transforms import Compose
from tqdm import tqdm

from timm.data import RealLabelsImagenet, create_loader, resolve_model_data_config

from .dataset import META_INDEX, META_LABEL, EvalImageDataset, ImageChecks
from .distributed import JobProgress, all_gather, check_same_files, rank_and_world, shard_range
from .metrics import In9Accuracy, TopKAccuracy, add_real_results, corruption_summary, real_labels, real_result
from .suites import (
    CORRUPTIONS,
    EXPECTED_IMAGES,
    EXTRA_CORRUPTIONS,
    SEVERITIES,
    FolderScan,
    LayoutError,
    LayoutWarning,
    imagenet_c_folders,
    imagenet_class_map,
    in9_class_map,
    in9_folders,
    in_to_in9,
    resolve_split,
    scan_class_folders,
    subset_indices,
    subset_synsets,
    v2_class_map,
    v2_folders,
    visible_folders,
)

__all__ = [
    'EvalSettings', 'model_eval_protocol', 'no_resize_protocol', 'predict', 'evaluate_imagenet', 'evaluate_v2',
    'evaluate_imagenet_c', 'evaluate_imagenet_ar', 'evaluate_imagenet_9', 'evaluate_corrupt_on_the_fly',
    'evaluate_folder', 'file_sha256', 'usable_cores', 'default_workers',
]

WNID_EXAMPLE = 'n01440764'
NO_RESIZE_SIZE = (224, 224)  # the size of every ImageNet-C and ImageNet-9 image (width, height)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, which containers and ``taskset`` narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity masks
        return os.cpu_count() or 1


def default_workers() -> int:
    """Data loader workers by default: 4, but never more than the usable cores (PyTorch warns above them)."""
    return min(4, usable_cores())


@dataclass
class EvalSettings:
    """How to run: batch size, loader workers, device, autocast dtype, and layout strictness.

    ``data_overrides`` (e.g. ``{'crop_pct': 1.0, 'img_size': 256}``) go to ``resolve_model_data_config`` as ``args``
    and so change the model-eval protocol of ImageNet, ReaL, V2, A and R (recorded in the output).
    """
    batch_size: int = 64
    workers: int = field(default_factory=default_workers)
    device: torch.device = field(default_factory=lambda: torch.device('cpu'))
    amp_dtype: Optional[torch.dtype] = None
    strict: bool = False
    progress: bool = True
    data_overrides: Dict[str, Any] = field(default_factory=dict)
    prefetcher: Optional[bool] = None  # timm's PrefetchLoader (normalises on the device); None: on for CUDA
    channels_last: bool = False  # inputs in channels-last memory format (the model's weights too: the caller's part)
    input_img_mode: str = 'RGB'  # the PIL mode images are converted to (a training run's --input-img-mode, e.g. 'L')
    tracker: Optional[JobProgress] = None  # the job's progress bar (shared by copies); made at first use

    def job_progress(self) -> JobProgress:
        """The progress bar of the whole job (rank 0 only; disabled without ``progress``)."""
        if self.tracker is None:
            self.tracker = JobProgress(self.progress)
        return self.tracker


def model_eval_protocol(model: nn.Module, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The model's own eval preprocessing (timm's ``resolve_model_data_config``), as a JSON-ready dict."""
    cfg = resolve_model_data_config(model, args=dict(overrides or {}))
    return dict(
        name='model_eval', input_size=list(cfg['input_size']), interpolation=cfg['interpolation'],
        crop_pct=cfg['crop_pct'], crop_mode=cfg.get('crop_mode', 'center'), mean=list(cfg['mean']),
        std=list(cfg['std']), standard=True,
        description=f"the model's eval transform: resize {math.floor(cfg['input_size'][-1] / cfg['crop_pct'])} "
                    f"({cfg['interpolation']}, crop_pct {cfg['crop_pct']}), centre crop {cfg['input_size'][-1]}, "
                    'normalise')


def no_resize_protocol(model: nn.Module, size: int = 224, overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The preprocessing of ImageNet-C (Hendrycks' test.py) and ImageNet-9: no resize of the 224x224 images.

    A model whose input size is not ``size`` (its eval config under ``overrides``: a training run's input size, or
    ``--img-size``) gets each whole image resized to its input size (crop_pct 1.0), marked ``standard: False``.
    """
    cfg = resolve_model_data_config(model, args=dict(overrides or {}))
    model_size = tuple(cfg['input_size'][-2:])
    standard = model_size == (size, size)
    return dict(
        name='no_resize', input_size=[cfg['input_size'][0], *model_size], interpolation=cfg['interpolation'],
        crop_pct=1.0, crop_mode='center', mean=list(cfg['mean']), std=list(cfg['std']), standard=standard,
        description=('CenterCrop 224 of the 224x224 images (identity), normalise; no resize (Hendrycks)' if standard
                     else f'NON-STANDARD: the 224x224 images are resized to the model input {model_size} '
                          f"({cfg['interpolation']}), normalise"))


def _loader(dataset: Any, protocol: Dict[str, Any], settings: EvalSettings) -> Any:
    cuda = settings.device.type == 'cuda'
    prefetcher = cuda if settings.prefetcher is None else settings.prefetcher
    return create_loader(
        dataset, input_size=tuple(protocol['input_size']), batch_size=settings.batch_size, is_training=False,
        interpolation=protocol['interpolation'], mean=tuple(protocol['mean']), std=tuple(protocol['std']),
        crop_pct=protocol['crop_pct'], crop_mode=protocol['crop_mode'], num_workers=settings.workers,
        device=settings.device, use_prefetcher=prefetcher, pin_memory=cuda, persistent_workers=False)


def predict(
        model: nn.Module,
        loader: Any,
        settings: EvalSettings,
        desc: str = '',
        num_classes: int = 1000,
        checks: Optional[ImageChecks] = None,
        progress: Optional[JobProgress] = None,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The evaluation loop: yields (float32 logits on CPU, targets, dataset indices) batch by batch in dataset order.

    With an `EvalImageDataset` (targets carry label, index, readability and size), ``checks`` decides which images
    are scored: unreadable ones are left out (their rows never reach the model) and recorded there. ``progress``
    (the job's bar) counts the batches' images; without it the loop shows its own bar (``settings.progress``).

    Raises:
        ValueError: the model does not output ``num_classes`` logits, or ``checks`` is missing for an
            `EvalImageDataset`.
    """
    amp = (torch.autocast(settings.device.type, dtype=settings.amp_dtype) if settings.amp_dtype is not None
           else nullcontext())
    model.eval()
    seen = 0
    batches = loader if progress is not None else tqdm(loader, desc=desc, leave=False,
                                                       disable=not settings.progress, unit='batch')
    for images, target in batches:
        if progress is not None:
            progress.advance(len(target))
        if target.ndim == 2:  # EvalImageDataset: [label, index, readable, width, height] per image
            if checks is None:
                raise ValueError('predict: a loader of an EvalImageDataset needs the ImageChecks of the set')
            meta = target.cpu()
            keep = checks.keep(meta)
            target, index = meta[keep, META_LABEL], meta[keep, META_INDEX]
            if not keep.all():
                images = images[keep.to(images.device)]
        else:
            target, index = target.cpu(), torch.arange(seen, seen + len(target))
            seen += len(target)
        if not len(target):
            continue
        with torch.inference_mode(), amp:
            images = images.to(settings.device, non_blocking=True)
            if settings.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            logits = model(images)
        if logits.ndim != 2 or logits.shape[1] != num_classes:
            raise ValueError(f'the model outputs logits of shape {tuple(logits.shape)}; this suite needs '
                             f'{num_classes} classes ' + _head_hint(num_classes))
        yield logits.float().cpu(), target, index


def _head_hint(num_classes: int) -> str:
    """What to do about a model whose head does not have the suite's ``num_classes`` logits."""
    if num_classes == 1000:
        return ('(an ImageNet-1K head): the ImageNet suites score the 1000 ImageNet classes. A model trained on '
                'classes of its own is evaluated on a folder of them: validate.py --data-dir DIR, robustness.py '
                '--corrupt-on-the-fly DIR')
    return ("(the folder's classes): name one class per logit of the model, in logit order (--class-map FILE), or "
            'build the model with that many (--model-kwargs num_classes=N, for a checkpoint without a training run)')


def _score(
        model: nn.Module,
        scan: FolderScan,
        protocol: Dict[str, Any],
        settings: EvalSettings,
        name: str,
        update: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
        expected_size: Optional[Tuple[int, int]] = None,
        wrap: Optional[Callable[[Any], None]] = None,
        num_classes: int = 1000,
        accumulators: Sequence[Any] = (),
        counted: bool = False,
) -> Dict[str, Any]:
    """Scores the images of ``scan``: ``update(logits, targets, indices)`` per batch of readable images.

    Under torchrun this process scores its shard of the file list (`shard_range`) and the ``accumulators`` that
    ``update`` fills are then merged across processes, so on return they hold the whole set's counts everywhere.

    Args:
        expected_size: (width, height) every image must have (no-resize protocols); None: any size.
        wrap: called with the dataset after the loader set its transform (e.g. to prepend a corruption).
        accumulators: what ``update`` accumulates: `TopKAccuracy`, `In9Accuracy`, timm's ``RealLabelsImagenet``
            or integer count tensors.
        counted: the set's images are already in the job's progress total.

    Returns:
        the record of the set: folder, images found, ``count`` evaluated, ``skipped`` (unreadable: file and reason),
        ``off_size`` (size -> files, with ``expected_size``), protocol and the warnings of the scan and the images.
    """
    check_same_files(name, scan.samples)
    progress = settings.job_progress()
    if not counted:
        progress.add_total(len(scan.samples))
    progress.set_description(name)
    dataset = EvalImageDataset(scan.root, scan.samples, input_img_mode=settings.input_img_mode,
                               indices=shard_range(len(scan.samples)))
    loader = _loader(dataset, protocol, settings)
    if wrap is not None:
        wrap(dataset)
    checks = ImageChecks(name, dataset, settings.strict, expected_size)
    for logits, target, index in predict(model, loader, settings, name, num_classes, checks, progress):
        update(logits, target, index)
    gathered = all_gather((checks.state(), [_counts(acc) for acc in accumulators]))
    checks.merge([state for state, _ in gathered])
    rank = rank_and_world()[0]
    for r, (_, counts) in enumerate(gathered):
        if r != rank:
            for acc, c in zip(accumulators, counts):
                _add_counts(acc, c)
    progress.finish_set(len(scan.samples))
    images = checks.finish()
    if expected_size is None:
        images.pop('off_size')
    return dict(root=os.path.abspath(scan.root), images=scan.total, class_folders=len(scan.counts),
                protocol=protocol, **images, layout_warnings=scan.warnings + checks.warnings)


def _counts(acc: Any) -> Any:
    """The part of an accumulator that another process adds to its own (exact integers, or ReaL's per-image hits)."""
    if isinstance(acc, torch.Tensor):
        return acc
    if isinstance(acc, TopKAccuracy):
        return dict(count=acc.count, correct=acc.correct)
    if isinstance(acc, In9Accuracy):
        return dict(count=acc.count, correct=acc.correct, unmapped=acc.unmapped)
    if isinstance(acc, RealLabelsImagenet):
        return acc.is_correct
    raise TypeError(f'cannot merge a {type(acc).__name__} across processes')


def _add_counts(acc: Any, counts: Any) -> None:
    """Adds another process's `_counts` to ``acc``."""
    if isinstance(acc, torch.Tensor):
        acc.add_(counts)
    elif isinstance(acc, RealLabelsImagenet):  # accuracy is the mean of per-image hits: order does not matter
        for k, hits in counts.items():
            acc.is_correct[k].extend(hits)
    else:
        acc.count += counts['count']
        if isinstance(acc.correct, dict):
            acc.correct = {k: acc.correct[k] + counts['correct'][k] for k in acc.correct}
        else:
            acc.correct += counts['correct']
        if isinstance(acc, In9Accuracy):
            acc.unmapped += counts['unmapped']


def evaluate_imagenet(
        model: nn.Module,
        root: str,
        settings: EvalSettings,
        real: Optional[bool] = None,
        real_json: Optional[str] = None,
) -> Dict[str, Any]:
    """ImageNet-1K val top-1/top-5 (%) and ReaL top-1/top-5 over the images with a non-empty ReaL label list.

    Args:
        root: ``val/`` (``<root>/<wnid>/ILSVRC2012_val_XXXXXXXX.JPEG``) or its parent.
        real: True requires ReaL (a mismatch with the labels raises), False skips it, None computes it when the
            image names match the label file and otherwise records why not.
        real_json: ReaL labels (one list per val image); default: the copy bundled with timm.
    """
    class_map = imagenet_class_map()
    scan = scan_class_folders(resolve_split(root), class_map, 'ImageNet', EXPECTED_IMAGES['imagenet'],
                              WNID_EXAMPLE, settings.strict)
    real_eval, real_note = None, None
    if real or real is None:
        try:
            real_eval = real_labels([path for path, _ in scan.samples], real_json)
        except LayoutError as e:
            if real:
                raise
            real_note = f'ReaL skipped: {e}'
    protocol = model_eval_protocol(model, settings.data_overrides)
    acc = TopKAccuracy()

    def update(logits: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> None:
        acc.update(logits, target)
        if real_eval is not None:
            add_real_results(real_eval, logits, index)

    accumulators = [acc] if real_eval is None else [acc, real_eval]
    out = dict(_score(model, scan, protocol, settings, 'ImageNet', update, accumulators=accumulators),
               **acc.result())
    out['real'] = real_result(real_eval, acc.count) if real_eval is not None else None
    if real_eval is not None:
        out['real']['labels'] = real_json or 'timm/data/_info/imagenet_real_labels.json'
    if real_note:
        out['real_note'] = real_note
    return out


def _raise_class_mismatch(root: str, found: List[str], class_names: List[str], extra: List[str],
                          missing: List[str]) -> None:
    """The folder suite's error for class folders that are not the model's classes: both lists, and what to do."""
    what = [f'Folder: {found}; model: {class_names}']
    if extra:
        what.append(f'not classes of the model: {extra} (the model has no logit for them: move these folders out '
                    f'of {root}, or evaluate a checkpoint trained on them)')
    if missing:
        what.append(f'classes without a folder: {missing} (add their images, or pass --allow-missing-classes to '
                    'score the classes present)')
    raise LayoutError(f'folder: the class folders of {root} are not the classes the model was trained on. '
                      + '; '.join(what) + '.')


def evaluate_folder(
        model: nn.Module,
        root: str,
        settings: EvalSettings,
        class_names: Sequence[str],
        allow_missing: bool = False,
) -> Dict[str, Any]:
    """Top-1/top-5, per-class top-1 (%) and the mean cross-entropy on any image folder (``<root>/<class>/<image>``):
    suite ``folder``.

    Images are labelled by their folder's name in ``class_names``, so a folder's own order or a missing class never
    shifts a label.

    Args:
        root: the folder whose sub-folders are the classes (e.g. ``my_data/val``).
        class_names: the model's classes in the order of its logits (the training run's); the folder must hold
            exactly these class folders, each with images.
        allow_missing: score a folder that holds only some of the classes (the others without a folder or with an
            empty one; listed as ``missing_classes``, their per-class top-1 None). The logits still span every class.

    Raises:
        LayoutError: the folder holds classes the model was not trained on, or (without ``allow_missing``) lacks
            some of its classes (both lists named, with what to do), or any layout problem of
            ``scan_class_folders``.
    """
    class_names = list(class_names)
    missing: List[str] = []
    if os.path.isdir(root):
        found = visible_folders(root)
        extra, missing = sorted(set(found) - set(class_names)), [c for c in class_names if c not in found]
        if extra or (missing and not allow_missing):
            _raise_class_mismatch(root, found, class_names, extra, missing)
    class_map = {name: i for i, name in enumerate(class_names)}
    scan = scan_class_folders(root, class_map, 'folder', example=class_names[0], strict=settings.strict,
                              allow_empty=allow_missing, empty_hint=(
                                  'Restore their images, or score the other classes: remove the empty folder(s) '
                                  'and pass --allow-missing-classes'))
    missing += [c for c in class_names if scan.counts.get(c) == 0]
    protocol = model_eval_protocol(model, settings.data_overrides)
    acc = TopKAccuracy()
    seen = torch.zeros(len(class_names), dtype=torch.long)
    hits = torch.zeros(len(class_names), dtype=torch.long)
    loss_sum = torch.zeros(1, dtype=torch.float64)

    def update(logits: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> None:
        acc.update(logits, target)
        seen.add_(torch.bincount(target, minlength=len(class_names)))
        hits.add_(torch.bincount(target[logits.argmax(1) == target], minlength=len(class_names)))
        # summed per batch in float32, then in float64: as tools/train.py's validation sums its loss
        loss_sum.add_(F.cross_entropy(logits, target, reduction='sum').double())

    out = dict(_score(model, scan, protocol, settings, 'folder', update, num_classes=len(class_names),
                      accumulators=[acc, seen, hits, loss_sum]), **acc.result())
    out['loss'] = loss_sum.item() / acc.count if acc.count else None  # mean cross-entropy, training's "val loss"
    out['classes'] = class_names
    out['missing_classes'] = [c for c in class_names if c in missing]
    out['per_class'] = {name: dict(count=int(seen[i]), top1=100.0 * int(hits[i]) / int(seen[i]) if seen[i] else None)
                        for i, name in enumerate(class_names)}
    return out


def evaluate_v2(model: nn.Module, root: str, settings: EvalSettings,
                variants: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """ImageNetV2 top-1/top-5 (%) per variant present (or ``variants``); labels are int(folder name)."""
    class_map = v2_class_map()
    folders = v2_folders(root, variants)
    scans = {v: scan_class_folders(p, class_map, f'ImageNetV2 {v}', EXPECTED_IMAGES['imagenet_v2'], '0',
                                   settings.strict) for v, p in folders.items()}
    protocol = model_eval_protocol(model, settings.data_overrides)
    out = {}
    for variant, scan in scans.items():
        acc = TopKAccuracy()
        record = _score(model, scan, protocol, settings, f'ImageNetV2 {variant}', _update_accuracy(acc),
                        accumulators=[acc])
        out[variant] = dict(record, **acc.result(), labels='int(folder name)')
    return out


def evaluate_imagenet_c(
        model: nn.Module,
        root: str,
        settings: EvalSettings,
        corruptions: Optional[Sequence[str]] = None,
        severities: Sequence[int] = SEVERITIES,
        clean_error: Optional[float] = None,
) -> Dict[str, Any]:
    """ImageNet-C raw top-1 error per (corruption, severity), CE per corruption, mCE and relative mCE.

    Args:
        root: ``<root>/<corruption>/<severity>/<wnid>/<image>``.
        corruptions: default: the 15 of mCE, plus those of the 4 extra ones that are present.
        severities: default 1..5 (CE needs all five).
        clean_error: the model's clean ImageNet top-1 error (fraction) for relative CE.

    Every folder is checked before the first image is scored, so a broken tree fails in seconds, not hours.
    """
    if corruptions is None:
        corruptions = list(CORRUPTIONS) + [c for c in EXTRA_CORRUPTIONS if os.path.isdir(os.path.join(root, c))]
    class_map = imagenet_class_map()
    folders = imagenet_c_folders(root, corruptions, severities)

    def scan(key: Tuple[str, int], list_files: bool) -> FolderScan:
        return scan_class_folders(folders[key], class_map, f'ImageNet-C {key[0]}/{key[1]}',
                                  EXPECTED_IMAGES['imagenet_c'], WNID_EXAMPLE, settings.strict, emit=False,
                                  list_files=list_files)

    scans = {key: scan(key, list_files=False) for key in folders}  # checks and counts; the file lists come per set
    details = [w for scan in scans.values() for w in scan.warnings]
    summary = []
    if details:  # one warning for the run, not one per (corruption, severity) folder
        n_folders = sum(bool(scan.warnings) for scan in scans.values())
        summary = [f'ImageNet-C: {n_folders} of {len(scans)} (corruption, severity) folders differ from the real '
                   f'dataset, e.g. {details[0]}']
        warnings.warn(summary[0], LayoutWarning, stacklevel=2)
    protocol = no_resize_protocol(model, overrides=settings.data_overrides)
    out = _corruption_results(model, {key: partial(scan, key, True) for key in folders},
                              {key: scan.total for key, scan in scans.items()}, protocol, settings, clean_error,
                              'ImageNet-C', NO_RESIZE_SIZE)
    return dict(out, root=os.path.abspath(root), layout_warnings=summary + out['layout_warnings'],
                layout_warning_details=details)


def _corruption_results(model: nn.Module, sets: Dict[Tuple[str, int], Callable[[], FolderScan]],
                        totals: Dict[Tuple[str, int], int], protocol: Dict[str, Any], settings: EvalSettings,
                        clean_error: Optional[float], suite: str, expected_size: Optional[Tuple[int, int]] = None,
                        wrap: Optional[Callable[[str, int, Any], None]] = None,
                        num_classes: int = 1000) -> Dict[str, Any]:
    """Raw error per (corruption, severity) and the CE summary.

    Args:
        sets: (corruption, severity) -> the scan (with its file list) of the set, made when the set is scored.
        totals: (corruption, severity) -> the images of the set (all sets go into the progress total up front).

    Returns:
        the summary; ``layout_warnings`` holds the image warnings only (unreadable or wrongly sized images, per
        set), ``skipped`` every image left out.
    """
    errors: Dict[str, Dict[int, float]] = {}
    raw: Dict[str, Dict[str, Any]] = {}
    image_warnings: List[str] = []
    skipped: List[Dict[str, str]] = []
    settings.job_progress().add_total(sum(totals.values()))
    for (c, s), list_set in sets.items():
        scan = list_set()
        acc = TopKAccuracy()
        record = _score(model, scan, protocol, settings, f'{suite} {c}/{s}', _update_accuracy(acc), expected_size,
                        None if wrap is None else partial(wrap, c, s), num_classes, [acc], counted=True)
        if record['images'] != totals[c, s]:  # the folder changed since it was counted
            settings.job_progress().add_total(record['images'] - totals[c, s])
        image_warnings += record['layout_warnings'][len(scan.warnings):]  # the scans' own ones are summarised
        skipped += record['skipped']
        errors.setdefault(c, {})[s] = 1 - acc.correct[1] / acc.count
        raw.setdefault(c, {})[str(s)] = dict(error=100 * errors[c][s], count=acc.count, correct=acc.correct[1],
                                             top5=acc.accuracy(5), images=record['images'],
                                             skipped=record['skipped'], off_size=record.get('off_size', {}))
    summary = corruption_summary(errors, clean_error)
    for c, by_sev in raw.items():
        summary['corruptions'][c]['severities'] = by_sev
    return dict(summary, protocol=protocol, severities=sorted({s for _, s in sets}),
                corruptions_evaluated=list(errors), skipped=skipped, layout_warnings=image_warnings)


def _update_accuracy(acc: Any) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The ``update`` of `_score` for an accumulator that takes (logits, targets)."""
    return lambda logits, target, index: acc.update(logits, target)


def evaluate_imagenet_ar(model: nn.Module, root: str, settings: EvalSettings, subset: str) -> Dict[str, Any]:
    """ImageNet-A (``subset='a'``) or -R (``'r'``): top-1/top-5 (%) with the logits sliced to the 200 classes.

    Targets are the 1000-class index of each wnid folder (a folder outside the 200 is an error); the accuracy without
    slicing (argmax over all 1000) is kept as ``top1_unmasked`` for reference.
    """
    name = f'ImageNet-{subset.upper()}'
    indices, synsets = subset_indices(subset), subset_synsets(subset)
    full_map = imagenet_class_map()
    if [full_map[w] for w in synsets] != indices:  # the shipped index and synset lists must agree
        raise RuntimeError(f'timm imagenet_{subset}_indices.txt and _synsets.txt disagree')
    class_map = {w: full_map[w] for w in synsets}
    scan = scan_class_folders(root, class_map, name, EXPECTED_IMAGES[f'imagenet_{subset}'], synsets[0],
                              settings.strict)
    protocol = model_eval_protocol(model, settings.data_overrides)
    masked, unmasked = TopKAccuracy(subset=indices), TopKAccuracy()

    def update(logits: torch.Tensor, target: torch.Tensor, index: torch.Tensor) -> None:
        masked.update(logits, target)
        unmasked.update(logits, target)

    record = _score(model, scan, protocol, settings, name, update, accumulators=[masked, unmasked])
    return dict(record, **masked.result(), top1_unmasked=unmasked.accuracy(1),
                top5_unmasked=unmasked.accuracy(5), logits=f'sliced to the 200 {name} classes (timm '
                                                           f'_info/imagenet_{subset}_indices.txt)')


def evaluate_imagenet_9(model: nn.Module, root: str, settings: EvalSettings,
                        variants: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """ImageNet-9 accuracy (%) per variant (argmax over 1000, mapped to 9; unmapped is wrong) and the BG-gap."""
    folders = in9_folders(root, variants)
    table = in_to_in9()
    scans, maps = {}, {}
    for v, path in folders.items():
        maps[v] = in9_class_map(visible_folders(path) if os.path.isdir(path) else [])
        scans[v] = scan_class_folders(path, maps[v], f'ImageNet-9 {v}', EXPECTED_IMAGES['imagenet_9'], '00_dog',
                                      settings.strict)
    protocol = no_resize_protocol(model, overrides=settings.data_overrides)
    out: Dict[str, Any] = dict(variants={}, protocol=protocol, root=os.path.abspath(root),
                               mapping='argmax over 1000 logits, then in_to_in9; unmapped (-1) counts as wrong')
    for v, scan in scans.items():
        acc = In9Accuracy(table)
        record = _score(model, scan, protocol, settings, f'ImageNet-9 {v}', _update_accuracy(acc), NO_RESIZE_SIZE,
                        accumulators=[acc])
        out['variants'][v] = dict(record, **acc.result())
    res = out['variants']
    out['bg_gap'] = (res['mixed_same']['top1'] - res['mixed_rand']['top1']
                     if 'mixed_same' in res and 'mixed_rand' in res else None)
    return out


def evaluate_corrupt_on_the_fly(
        model: nn.Module,
        root: str,
        settings: EvalSettings,
        corruptions: Sequence[str] = CORRUPTIONS,
        severities: Sequence[int] = SEVERITIES,
        clean_error: Optional[float] = None,
        seed: int = 0,
        class_names: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """ImageNet-C-style errors on any class-folder val set, corrupting each image on the fly (``lsvision[corrupt]``).

    Class folders named by ImageNet wnids get the ImageNet-1K labels, and CE/mCE against AlexNet's ImageNet-C errors
    are computed but only approximate the real ImageNet-C; any other folder names are labelled by ``class_names``
    (the model's classes in logit order, e.g. its training run's), else in natural sort order (the model must have
    that many classes), and only raw errors mean anything. Results carry ``on_the_fly: True``.
    """
    from .corrupt import ImageNetCCorruption, load_imagecorruptions
    load_imagecorruptions()  # fail before scanning if the extra is missing
    root = resolve_split(root)
    if not os.path.isdir(root):
        raise LayoutError(f'corrupt-on-the-fly: folder {root} does not exist (expected {root}/<class>/<image>)')
    names = visible_folders(root)
    wnid_map = imagenet_class_map()
    imagenet_labels = bool(names) and all(n in wnid_map for n in names)
    if imagenet_labels:
        class_map, labels, num_classes = wnid_map, 'ImageNet-1K wnid folders', 1000
    elif class_names:
        class_map = {n: i for i, n in enumerate(class_names)}
        labels, num_classes = "the model's classes (its training run's)", len(class_map)
    else:
        from timm.utils.misc import natural_key
        class_map = {n: i for i, n in enumerate(sorted(names, key=natural_key))}
        labels, num_classes = 'folder names in natural sort order (not ImageNet wnids)', len(class_map)
    scan = scan_class_folders(root, class_map, 'corrupt-on-the-fly', None, WNID_EXAMPLE, settings.strict)
    protocol = no_resize_protocol(model, overrides=settings.data_overrides)
    sets = {(c, s): lambda: scan for c in corruptions for s in severities}

    def wrap(c: str, s: int, dataset: Any) -> None:
        dataset.transform = Compose([ImageNetCCorruption(c, s, seed=seed), dataset.transform])

    out = _corruption_results(model, sets, {key: scan.total for key in sets}, protocol, settings, clean_error,
                              'corrupt-on-the-fly', None, wrap, num_classes)
    out['layout_warnings'] = scan.warnings + out['layout_warnings']
    if not imagenet_labels:
        out.update(mce=None, relative_mce=None)
        for row in out['corruptions'].values():
            row.update(ce=None, relative_ce=None)
        out['notes'].append('CE/mCE are ImageNet-only (AlexNet normalisers); raw errors only')
    out.update(root=os.path.abspath(root), on_the_fly=True, labels=labels, seed=seed,
               generator='imagecorruptions-imaug: Resize 256, CenterCrop 224, corruption, JPEG q85 (not the released '
                         'ImageNet-C JPEGs; not comparable with published ImageNet-C numbers)')
    return out


def file_sha256(path: str) -> str:
    """sha256 of a file (the identity of a checkpoint in the results)."""
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        for chunk in iter(lambda: f.read(1 << 20), b''):
            digest.update(chunk)
    return digest.hexdigest()
