"""lsvision.eval.metrics: the cases mutmut found untested (docs/testing.md has the run and the survivors' table).

Each test names the mutants it kills; every number is worked out by hand from the definitions in the docstrings.
"""
import json
import math

import pytest
import torch

from lsvision.eval import metrics
from lsvision.eval.metrics import (
    In9Accuracy,
    TopKAccuracy,
    add_real_results,
    corruption_summary,
    real_labels,
    real_result,
)
from lsvision.eval.suites import ALEXNET_CLEAN_ERROR, ALEXNET_ERRORS, CORRUPTIONS, SEVERITIES, LayoutError


def _val_names(n):
    return [f'/data/val/n0/ILSVRC2012_val_{i + 1:08d}.JPEG' for i in range(n)]


def test_topk_subset_target_above_the_subset_is_refused_not_an_index_error():
    # subset [2, 3]: the position table has 4 rows; targets 4 and 9 lie above it and must give the subset error
    # (kills: `inside = None`, `len - 1` -> `len + 1`, sentinel -1 -> +1)
    acc = TopKAccuracy(topk=(1,), subset=[2, 3])
    for bad in (4, 9):
        with pytest.raises(ValueError, match=rf'targets \[{bad}\] are not in the class subset'):
            acc.update(torch.zeros(1, 10), torch.tensor([bad]))
    # the message lists only the bad targets, not class 2 at subset position 0 (kills `pos < 0` -> `<= 0`, `< 1`)
    with pytest.raises(ValueError, match=r'targets \[9\] are not'):
        acc.update(torch.zeros(3, 10), torch.tensor([2, 3, 9]))
    assert acc.count == 0


def test_topk_default_k_result_count_and_empty():
    acc = TopKAccuracy(topk=(1, 2))
    assert math.isnan(acc.accuracy()) and math.isnan(acc.accuracy(2))  # no images: nan, not ZeroDivisionError
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [1.0, 3.0, 2.0]])
    acc.update(logits, torch.tensor([0, 0, 2]))  # top1: row 0 only; top2: rows 0 and 2
    assert acc.accuracy() == acc.accuracy(1) == pytest.approx(100 / 3)  # default k is 1
    assert acc.accuracy(2) == pytest.approx(200 / 3)
    assert acc.result() == dict(top1=pytest.approx(100 / 3), top2=pytest.approx(200 / 3), count=3,
                                correct_top1=1, correct_top2=2)


def test_in9_counts_accumulate_over_batches_and_empty_is_nan():
    assert math.isnan(In9Accuracy([0, 1, -1]).accuracy())
    in9 = In9Accuracy([0, 1, -1])  # class 2 has no IN-9 class
    in9.update(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([0]))  # unmapped
    in9.update(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), torch.tensor([0, 0]))  # right, wrong
    assert in9.result() == dict(top1=pytest.approx(100 / 3), count=3, correct=1, unmapped_predictions=1)


def _real_json(tmp_path, labels):
    path = tmp_path / 'real.json'
    path.write_text(json.dumps(labels))
    return str(path)


def test_real_add_results_with_a_gap_and_default_evaluated(tmp_path):
    # 4 images, image 2 (index 1) unreadable: the loader yields indices [0, 2] then [3]; labels: 0, 1, 2, none
    real = real_labels(_val_names(4), _real_json(tmp_path, [[0], [1], [2], []]))
    eye = torch.eye(6)
    add_real_results(real, eye[[0, 2]], torch.tensor([0, 2]))  # rows belong to images 0 and 2: both right
    add_real_results(real, eye[[0]], torch.tensor([3]))  # image 3 has no label: not scored
    assert real.is_correct[1] == [True, True]
    # default `evaluated`: the evaluator's files up to the last one added (4); 2 scored
    assert real_result(real) == dict(top1=100.0, top5=100.0, count=2, skipped_no_label=2)
    assert real_result(real, evaluated=3)['skipped_no_label'] == 1


def test_real_label_count_mismatch_message(tmp_path):
    # the bundled file has 50,000 entries: the message names it and says what to pass instead
    with pytest.raises(LayoutError) as err:
        real_labels(_val_names(3))
    msg = str(err.value)
    assert msg.startswith('ReaL: 3 validation images but 50000 entries in the imagenet_real_labels.json bundled '
                          'with timm; ReaL needs the full 50,000-image val set (ILSVRC2012_val_00000001.JPEG ...), '
                          'or --real-labels with one entry per image')
    names = _val_names(2)
    names[1] = '/data/val/n0/img2.JPEG'
    with pytest.raises(LayoutError, match=r"e\.g\. 'img2\.JPEG'; ReaL labels are looked up by the original names "
                                          r'ILSVRC2012_val_XXXXXXXX\.JPEG$'):
        real_labels(names, _real_json(tmp_path, [[0], [1]]))


def test_real_label_count_checked_even_without_timms_assert(tmp_path, monkeypatch):
    # real_labels must not rely on RealLabelsImagenet's assert alone (kills `or` -> `and` in the count check)
    class NoAssert(metrics.RealLabelsImagenet):
        def __init__(self, filenames, real_json=None):
            with open(real_json) as f:
                self.real_labels = {f'ILSVRC2012_val_{i + 1:08d}.JPEG': v for i, v in enumerate(json.load(f))}
            self.filenames = filenames

    monkeypatch.setattr(metrics, 'RealLabelsImagenet', NoAssert)
    with pytest.raises(LayoutError, match='2 validation images but 3 entries'):
        real_labels(_val_names(2), _real_json(tmp_path, [[0], [1], [2]]))


def _alexnet_profile(corruptions=CORRUPTIONS):
    return {c: {s: ALEXNET_ERRORS[c] for s in SEVERITIES} for c in corruptions}


def test_corruption_summary_incomplete_sets_have_no_mce():
    # 14 of the 15, all complete: no mCE (not the mean over 14), no relative mCE even with a clean error
    res = corruption_summary(_alexnet_profile(CORRUPTIONS[1:]), clean_error=ALEXNET_CLEAN_ERROR)
    assert res['mce'] is None and res['relative_mce'] is None
    assert res['notes'] == ['mCE and the mean error over the 15 need all 15 corruptions at severities 1-5; have 14 ('
                            + ', '.join(CORRUPTIONS[1:]) + ') at severities [1, 2, 3, 4, 5]']
    assert res['mean_error_15'] is None and res['mean_error']['corruptions'] == list(CORRUPTIONS[1:])
    # all 15, one missing a severity: no mCE, no crash on its CE of None
    errors = _alexnet_profile()
    del errors['fog'][5]
    res = corruption_summary(errors, clean_error=0.3)
    assert res['mce'] is None and res['relative_mce'] is None and res['corruptions']['fog']['ce'] is None


def test_corruption_summary_without_clean_error_and_reported_fields():
    res = corruption_summary(_alexnet_profile())
    assert res['mce'] == pytest.approx(100) and res['relative_mce'] is None
    assert res['notes'] == ['relative CE needs the clean error (evaluate ImageNet val or pass --clean-error)']
    assert res['clean_error'] is None and res['alexnet_clean_error'] == pytest.approx(100 * ALEXNET_CLEAN_ERROR)
    res = corruption_summary(_alexnet_profile(), clean_error=0.25)
    assert res['notes'] == [] and res['clean_error'] == pytest.approx(25)
    assert res['alexnet_clean_error'] == pytest.approx(43.45)


def test_corruption_summary_extra_only_and_two_extras():
    res = corruption_summary({'spatter': {s: 0.2 for s in SEVERITIES}, 'saturate': {s: 0.4 for s in SEVERITIES}})
    assert res['mean_error_15'] is None and res['mce'] is None
    assert res['mean_error'] is None  # none of the 15
    assert res['mean_error_extra'] == dict(value=pytest.approx(30), corruptions=['spatter', 'saturate'],
                                           severities=list(SEVERITIES))  # mean of 20 % and 40 %
