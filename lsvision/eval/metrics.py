"""Metrics of the evaluation suites: top-k (optionally within a class subset), ReaL, IN-9 mapping and mCE.

All accumulators take batches of ImageNet-1K logits (B, 1000) in dataset order and keep integer counts, so results
are exact fractions of the images seen.
"""
import json
import os
import pkgutil
from typing import Dict, List, Mapping, Optional, Sequence

import torch

from timm.data import RealLabelsImagenet

from .suites import ALEXNET_CLEAN_ERROR, ALEXNET_ERRORS, CORRUPTIONS, EXTRA_CORRUPTIONS, SEVERITIES, LayoutError

__all__ = ['TopKAccuracy', 'In9Accuracy', 'real_labels', 'add_real_results', 'real_result', 'corruption_summary']


class TopKAccuracy:
    """Top-k accuracy over all logits, or within a class subset (ImageNet-A/-R: the logits are sliced first).

    Args:
        topk: the k values to count (clipped to the number of classes scored).
        subset: ImageNet-1K indices of the classes to keep; targets are 1000-class indices that must lie in it.
            The prediction is the argmax over ``logits[:, subset]``, so a model that favours a class outside the
            subset falls back to its best in-subset class (Hendrycks' eval.py for A and R).
    """

    def __init__(self, topk: Sequence[int] = (1, 5), subset: Optional[Sequence[int]] = None):
        self.topk = tuple(topk)
        self.subset = None if subset is None else torch.as_tensor(list(subset), dtype=torch.long)
        if self.subset is not None:
            self._position = torch.full((int(self.subset.max()) + 1,), -1, dtype=torch.long)
            self._position[self.subset] = torch.arange(len(self.subset))
        self.count = 0
        self.correct = {k: 0 for k in self.topk}

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch: ``logits`` (B, C) and ``target`` (B,) class indices of the full C classes."""
        target = target.long().cpu()
        logits = logits.float().cpu()
        if self.subset is not None:
            inside = target <= len(self._position) - 1
            pos = torch.full_like(target, -1)
            pos[inside] = self._position[target[inside]]
            if (pos < 0).any():
                raise ValueError(f'targets {sorted(set(target[pos < 0].tolist()))} are not in the class subset')
            logits, target = logits[:, self.subset], pos
        maxk = min(max(self.topk), logits.shape[1])
        pred = logits.topk(maxk, dim=1).indices
        hits = pred == target[:, None]
        for k in self.topk:
            self.correct[k] += int(hits[:, :k].any(dim=1).sum())
        self.count += len(target)

    def accuracy(self, k: int = 1) -> float:
        """Top-k accuracy in %."""
        return 100.0 * self.correct[k] / self.count if self.count else float('nan')

    def result(self) -> Dict[str, float]:
        return dict({f'top{k}': self.accuracy(k) for k in self.topk}, count=self.count,
                    **{f'correct_top{k}': self.correct[k] for k in self.topk})


class In9Accuracy:
    """ImageNet-9 accuracy of a 1000-class model: argmax over all 1000 logits, then mapped to 0..8.

    A prediction of one of the 630 classes without an IN-9 class (-1) counts as wrong; there is no probability
    summing and no restriction to the 370 mapped classes (MadryLab ``tools/model_utils.eval_model``).
    """

    def __init__(self, in_to_in9: Sequence[int]):
        self.table = torch.as_tensor(list(in_to_in9), dtype=torch.long)
        self.count = 0
        self.correct = 0
        self.unmapped = 0

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Adds a batch: ``logits`` (B, 1000), ``target`` (B,) IN-9 classes 0..8."""
        pred = self.table[logits.float().cpu().argmax(dim=1)]
        self.correct += int((pred == target.long().cpu()).sum())
        self.unmapped += int((pred < 0).sum())
        self.count += len(target)

    def accuracy(self) -> float:
        return 100.0 * self.correct / self.count if self.count else float('nan')

    def result(self) -> Dict[str, float]:
        return dict(top1=self.accuracy(), count=self.count, correct=self.correct,
                    unmapped_predictions=self.unmapped)


def real_labels(filenames: Sequence[str], real_json: Optional[str] = None) -> RealLabelsImagenet:
    """timm's ReaL evaluator for the images ``filenames`` in loader order, after checking they match the labels.

    Args:
        filenames: the dataset's image paths in the order the loader yields them (no shuffling).
        real_json: a ``real.json`` (one list of labels per ``ILSVRC2012_val_{i+1:08d}.JPEG``); default: the copy
            bundled with timm (50,000 entries, which needs the full val set).

    Raises:
        LayoutError: the number of images differs from the label file's entries, or a file name has no entry.
    """
    names = [os.path.basename(f) for f in filenames]
    try:
        real = RealLabelsImagenet(names, real_json=real_json)
        n_labels = len(real.real_labels)
    except AssertionError:  # timm asserts one label entry per image
        real, n_labels = None, None
    if real is None or n_labels != len(names):
        if n_labels is None:
            n_labels = _json_len(real_json)
        raise LayoutError(
            f'ReaL: {len(names)} validation images but {n_labels} entries in '
            f'{real_json or "the imagenet_real_labels.json bundled with timm"}; ReaL needs the full 50,000-image val '
            'set (ILSVRC2012_val_00000001.JPEG ...), or --real-labels with one entry per image')
    missing = [n for n in names if n not in real.real_labels]
    if missing:
        raise LayoutError(f'ReaL: file names without a label entry, e.g. {missing[0]!r}; ReaL labels are looked up by '
                          'the original names ILSVRC2012_val_XXXXXXXX.JPEG')
    return real


def _json_len(real_json: Optional[str]) -> int:
    if real_json is None:
        return len(json.loads(pkgutil.get_data('timm.data', '_info/imagenet_real_labels.json')))
    with open(real_json) as f:
        return len(json.load(f))


def add_real_results(real: RealLabelsImagenet, logits: torch.Tensor, indices: torch.Tensor) -> None:
    """Adds a batch to timm's ReaL evaluator, whose ``add_result`` matches rows to files by position: ``indices``
    are the images' positions in its file list, so images left out (unreadable) never shift the labels."""
    indices = indices.tolist()
    if indices == list(range(real.sample_idx, real.sample_idx + len(indices))):
        real.add_result(logits)
        return
    for row, index in zip(logits, indices):
        real.sample_idx = index
        real.add_result(row[None])


def real_result(real: RealLabelsImagenet, evaluated: Optional[int] = None) -> Dict[str, float]:
    """ReaL top-1/top-5 (%) and how many images were scored (those with a non-empty label list).

    Args:
        evaluated: the images evaluated (default: all of the evaluator's files up to the last one added).
    """
    scored = len(real.is_correct[real.topk[0]])
    evaluated = real.sample_idx if evaluated is None else evaluated
    return dict({f'top{k}': real.get_accuracy(k) for k in real.topk}, count=scored,
                skipped_no_label=evaluated - scored)


def _covered(errors: Mapping[str, Mapping[int, float]], names: Sequence[str]) -> Dict[str, object]:
    """The corruptions and severities a mean over ``names`` covers: one severity list if all share it, else one
    per corruption."""
    sev = {c: sorted(errors[c]) for c in names}
    shared = {tuple(v) for v in sev.values()}
    return dict(corruptions=list(names), severities=list(shared.pop()) if len(shared) == 1 else sev)


def _mean_error(per_corruption: Mapping[str, Mapping[str, Optional[float]]], errors: Mapping[str, Mapping[int, float]],
                names: Sequence[str]) -> Optional[Dict[str, object]]:
    """The mean of the per-corruption errors (%) over ``names``, with what it covers; None if ``names`` is empty."""
    if not names:
        return None
    return dict(value=sum(per_corruption[c]['mean_error'] for c in names) / len(names), **_covered(errors, names))


def corruption_summary(
        errors: Mapping[str, Mapping[int, float]],
        clean_error: Optional[float] = None,
        alexnet_errors: Mapping[str, float] = ALEXNET_ERRORS,
        alexnet_clean_error: float = ALEXNET_CLEAN_ERROR,
) -> Dict[str, object]:
    """ImageNet-C summary from raw top-1 errors (fractions) per corruption and severity.

    CE_c = sum_s E_{s,c} / sum_s E^AlexNet_{s,c} = mean_s E_{s,c} / A_c (A_c is AlexNet's mean over the 5 severities),
    mCE = mean of CE_c over the 15 corruptions only; relative CE_c = (mean_s E_{s,c} - E_clean) / (A_c - A_clean).
    CE needs all 5 severities of a corruption and mCE all 15 corruptions; what cannot be computed is None, with the
    reason in ``notes``. The extra corruptions are reported as raw error only.

    Args:
        errors: corruption -> severity -> top-1 error as a fraction.
        clean_error: the model's own clean ImageNet top-1 error (fraction), for relative CE; None skips it.

    Returns:
        dict with per-corruption ``mean_error``, ``ce``, ``relative_ce`` (all in %), ``mce``, ``relative_mce``,
        ``mean_error_15`` (the unnormalised mean over the 15 at severities 1-5; None, with the reason in ``notes``,
        unless all of them were evaluated), ``mean_error`` and ``mean_error_extra`` (the mean over the evaluated
        corruptions of the 15, resp. the extra ones, as ``value`` with the ``corruptions`` and ``severities`` it
        covers; None if there are none) and ``notes``.
    """
    per_corruption: Dict[str, Dict[str, Optional[float]]] = {}
    notes: List[str] = []
    for c, by_sev in errors.items():
        mean_err = sum(by_sev.values()) / len(by_sev)
        row: Dict[str, Optional[float]] = dict(mean_error=100 * mean_err, ce=None, relative_ce=None,
                                               extra=c in EXTRA_CORRUPTIONS)
        if c in alexnet_errors:
            if sorted(by_sev) == list(SEVERITIES):
                row['ce'] = 100 * mean_err / alexnet_errors[c]
                if clean_error is not None:
                    row['relative_ce'] = 100 * (mean_err - clean_error) / (alexnet_errors[c] - alexnet_clean_error)
            else:
                notes.append(f'{c}: CE needs severities 1-5, have {sorted(by_sev)}')
        per_corruption[c] = row
    main = [c for c in CORRUPTIONS if c in per_corruption]
    complete = len(main) == len(CORRUPTIONS) and all(per_corruption[c]['ce'] is not None for c in main)
    if not complete:
        notes.append(f'mCE and the mean error over the 15 need all 15 corruptions at severities 1-5; have '
                     f'{len(main)} ({", ".join(main)})' + (f' at severities {_covered(errors, main)["severities"]}'
                                                          if main else ''))
    if clean_error is None:
        notes.append('relative CE needs the clean error (evaluate ImageNet val or pass --clean-error)')
    extra = [c for c in EXTRA_CORRUPTIONS if c in per_corruption]
    return dict(
        corruptions=per_corruption,
        mce=sum(per_corruption[c]['ce'] for c in main) / len(main) if complete else None,
        relative_mce=(sum(per_corruption[c]['relative_ce'] for c in main) / len(main)
                      if complete and clean_error is not None else None),
        mean_error_15=sum(per_corruption[c]['mean_error'] for c in main) / len(main) if complete else None,
        mean_error=_mean_error(per_corruption, errors, main),
        mean_error_extra=_mean_error(per_corruption, errors, extra),
        clean_error=None if clean_error is None else 100 * clean_error,
        alexnet_clean_error=100 * alexnet_clean_error,
        notes=notes,
    )
