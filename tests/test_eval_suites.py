"""lsvision.eval: exact metrics of every suite on tiny trees in their real layouts, scored by the colour oracle
(tests/eval_fixtures.py), the hand-computed ImageNet-C formulas, the data files timm ships, and the layout checks."""
import json
import re
import shutil
import warnings

import pytest
import torch
from eval_fixtures import (
    WNIDS,
    ColourOracle,
    colour,
    imagenet_c_profile,
    make_suite_trees,
    save_image,
)

from lsvision.eval import (
    ALEXNET_CLEAN_ERROR,
    ALEXNET_ERRORS,
    ALL_CORRUPTIONS,
    CORRUPTIONS,
    EXTRA_CORRUPTIONS,
    SEVERITIES,
    EvalSettings,
    In9Accuracy,
    LayoutError,
    LayoutWarning,
    TopKAccuracy,
    corruption_summary,
    evaluate_imagenet,
    evaluate_imagenet_9,
    evaluate_imagenet_ar,
    evaluate_imagenet_c,
    evaluate_v2,
    imagenet_class_map,
    in_to_in9,
    markdown_report,
    subset_indices,
    subset_synsets,
)

SETTINGS = EvalSettings(batch_size=16, workers=0, progress=False)


@pytest.fixture(scope='module')
def oracle():
    return ColourOracle()


@pytest.fixture(scope='module')
def trees(tmp_path_factory):
    return make_suite_trees(tmp_path_factory.mktemp('suites'))


def test_colour_oracle_decodes_every_class_after_jpeg_and_eval_transform(tmp_path):
    from timm.data import create_transform
    oracle = ColourOracle()
    transform = create_transform(224, interpolation='bicubic', crop_pct=0.875)
    from PIL import Image
    batch = []
    classes = list(range(0, 1000, 37)) + [555, 999]  # every digit in every position
    for k in classes:
        save_image(tmp_path / f'{k}.jpg', k)
        batch.append(transform(Image.open(tmp_path / f'{k}.jpg').convert('RGB')))
    logits = oracle(torch.stack(batch))
    assert logits.argmax(1).tolist() == classes
    assert colour(407) == (112, 12, 187)
    # strict full ranking: all 1000 logits distinct
    assert len(set(logits[0].tolist())) == 1000


def test_timm_data_files():
    wnids = imagenet_class_map()
    assert list(wnids) == sorted(wnids) and len(wnids) == 1000
    for subset in 'ar':
        idx, syn = subset_indices(subset), subset_synsets(subset)
        assert len(idx) == len(syn) == 200
        assert idx == sorted(idx) and [wnids[s] for s in syn] == idx
    assert len(set(subset_indices('a')) & set(subset_indices('r'))) == 86
    table = in_to_in9()
    assert len(table) == 1000 and table.count(-1) == 630
    assert [table.count(c) for c in range(9)] == [116, 52, 42, 36, 35, 27, 26, 20, 16]
    assert table[171] == table[172] == -1 and table[151] == 0 and table[407] == 2 and table[0] == 8


def test_corruption_summary_alexnet_profile_is_100():
    alexnet = {c: {s: ALEXNET_ERRORS[c] for s in SEVERITIES} for c in CORRUPTIONS}
    alexnet['spatter'] = {s: 0.5 for s in SEVERITIES}
    res = corruption_summary(alexnet, clean_error=ALEXNET_CLEAN_ERROR)
    assert res['mce'] == pytest.approx(100) and res['relative_mce'] == pytest.approx(100)
    assert all(res['corruptions'][c]['ce'] == pytest.approx(100) for c in CORRUPTIONS)
    assert res['corruptions']['spatter']['ce'] is None and res['mean_error_extra']['value'] == pytest.approx(50)
    assert res['mean_error_15'] == pytest.approx(100 * sum(ALEXNET_ERRORS.values()) / 15)


def test_corruption_summary_by_hand():
    # gaussian_noise errors 0.1..0.5: CE = mean(0.3) / 0.886428; relative with E_clean 0.2
    errors = {c: {s: ALEXNET_ERRORS[c] for s in SEVERITIES} for c in CORRUPTIONS}
    errors['gaussian_noise'] = {s: s / 10 for s in SEVERITIES}
    res = corruption_summary(errors, clean_error=0.2)
    ce = 100 * 0.3 / 0.886428
    assert res['corruptions']['gaussian_noise']['ce'] == pytest.approx(ce)
    assert res['corruptions']['gaussian_noise']['relative_ce'] == pytest.approx(100 * 0.1 / (0.886428 - 0.4345))
    assert res['mce'] == pytest.approx((ce + 14 * 100) / 15)
    # CE is a ratio of sums, not the mean of per-severity ratios (these differ for uneven errors)
    assert ce != pytest.approx(sum(100 * s / 10 / 0.886428 for s in SEVERITIES) / 5 + 1)
    # missing severities or corruptions: no CE / mCE, with the reason
    partial = corruption_summary({'fog': {1: 0.5, 2: 0.5}})
    assert partial['mce'] is None and partial['corruptions']['fog']['ce'] is None
    assert any('severities 1-5' in n for n in partial['notes']) and any('15' in n for n in partial['notes'])


def test_topk_subset_and_in9_accumulators():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [3.0, 0.0, 1.0, 2.0]])
    acc = TopKAccuracy(topk=(1, 2), subset=[2, 3])
    acc.update(logits, torch.tensor([3, 3]))  # sliced: [1, 2] -> 3 right; [1, 2] -> 3 right
    assert acc.correct == {1: 2, 2: 2}
    with pytest.raises(ValueError, match='not in the class subset'):
        acc.update(logits, torch.tensor([1, 3]))
    in9 = In9Accuracy(in_to_in9())
    x = torch.zeros(3, 1000)
    x[0, 151], x[1, 171], x[2, 7] = 1, 1, 1  # dog, unmapped dog-like, bird
    in9.update(x, torch.tensor([0, 0, 0]))
    assert in9.result() == dict(top1=pytest.approx(100 / 3), count=3, correct=1, unmapped_predictions=1)


def test_imagenet_and_real(trees, oracle):
    fx = trees['imagenet']
    with pytest.warns(LayoutWarning, match='holds 6 images in 2 class folders; the full dataset has 50000 in 1000'):
        res = evaluate_imagenet(oracle, str(fx['root']), SETTINGS, real=True, real_json=str(fx['real_json']))
    assert (res['count'], res['correct_top1'], res['correct_top5']) == (6, 5, 6)
    assert res['top1'] == pytest.approx(500 / 6)
    assert res['real']['count'] == 5 and res['real']['skipped_no_label'] == 1
    assert res['real']['top1'] == pytest.approx(80) and res['real']['top5'] == pytest.approx(100)
    assert res['protocol']['name'] == 'model_eval' and res['protocol']['crop_pct'] == 0.875
    # the bundled 50,000-entry labels do not fit 6 images: auto mode records why, required mode raises
    with pytest.warns(LayoutWarning):
        auto = evaluate_imagenet(oracle, str(fx['root'] / 'val'), SETTINGS)
    assert auto['real'] is None and '50000 entries' in auto['real_note'] and auto['top1'] == res['top1']
    md = markdown_report(dict(models=[dict(model='oracle', params=0, suites=dict(imagenet=auto))]))
    assert '| oracle | - | 83.33 | 100.00 | - |' in md and '- oracle: ReaL skipped: ReaL: 6 validation images' in md
    with pytest.raises(LayoutError, match='ReaL: 6 validation images but 50000 entries'), \
            pytest.warns(LayoutWarning):
        evaluate_imagenet(oracle, str(fx['root']), SETTINGS, real=True)


def test_v2_labels_from_folder_names(trees, oracle):
    with pytest.warns(LayoutWarning):
        res = evaluate_v2(oracle, str(trees['v2']), SETTINGS)
    assert list(res) == ['matched-frequency', 'threshold0.7', 'top-images']
    assert res['matched-frequency']['top1'] == 100 and res['top-images']['top1'] == 100
    assert (res['threshold0.7']['correct_top1'], res['threshold0.7']['correct_top5']) == (9, 9)
    with pytest.warns(LayoutWarning):
        one = evaluate_v2(oracle, str(trees['v2'] / 'imagenetv2-top-images-format-val'), SETTINGS)
    assert list(one) == ['top-images'] and one['top-images']['count'] == 10


def test_imagenet_c_exact(trees, oracle):
    with pytest.warns(LayoutWarning):
        res = evaluate_imagenet_c(oracle, str(trees['c']), SETTINGS, clean_error=0.25)
    assert res['corruptions_evaluated'] == list(ALL_CORRUPTIONS)  # the extras present are picked up
    assert res['protocol']['name'] == 'no_resize' and res['protocol']['crop_pct'] == 1.0
    assert res['protocol']['standard'] is True
    ces, rel = [], []
    for ci, c in enumerate(ALL_CORRUPTIONS):
        errs = [imagenet_c_profile(ci, s) / 2 for s in SEVERITIES]
        row = res['corruptions'][c]
        assert [row['severities'][str(s)]['error'] for s in SEVERITIES] == pytest.approx([100 * e for e in errs])
        assert row['mean_error'] == pytest.approx(100 * sum(errs) / 5)
        if c in EXTRA_CORRUPTIONS:
            assert row['ce'] is None and row['extra']
        else:
            ces.append(100 * sum(errs) / 5 / ALEXNET_ERRORS[c])
            rel.append(100 * (sum(errs) / 5 - 0.25) / (ALEXNET_ERRORS[c] - ALEXNET_CLEAN_ERROR))
            assert row['ce'] == pytest.approx(ces[-1]) and row['relative_ce'] == pytest.approx(rel[-1])
    assert res['mce'] == pytest.approx(sum(ces) / 15) and res['relative_mce'] == pytest.approx(sum(rel) / 15)


def test_imagenet_c_subset_has_no_mce(trees, oracle):
    with pytest.warns(LayoutWarning):
        res = evaluate_imagenet_c(oracle, str(trees['c']), SETTINGS, corruptions=['fog', 'spatter'], severities=[3])
    assert res['mce'] is None and res['corruptions']['fog']['ce'] is None
    assert res['corruptions']['fog']['severities']['3']['error'] == 100 * imagenet_c_profile(9, 3) / 2


def test_imagenet_a_r_masked_differs_from_unmasked(trees, oracle):
    with pytest.warns(LayoutWarning):
        a = evaluate_imagenet_ar(oracle, str(trees['a']['root']), SETTINGS, 'a')
        r = evaluate_imagenet_ar(oracle, str(trees['r']['root']), SETTINGS, 'r')
    assert (a['count'], a['top1'], a['top1_unmasked']) == (4, 75, 50)
    assert (a['top5'], a['top5_unmasked']) == (100, 50)
    assert (r['count'], r['top1'], r['top1_unmasked']) == (5, 80, 60)
    assert (r['top5'], r['top5_unmasked']) == (100, 100)


def test_imagenet_9_unmapped_is_wrong_and_bg_gap(trees, oracle):
    root, expected = trees['in9']
    with pytest.warns(LayoutWarning):
        res = evaluate_imagenet_9(oracle, str(root), SETTINGS)
    assert list(res['variants']) == ['original', 'mixed_same', 'mixed_rand', 'only_fg']
    for v, acc in expected.items():
        assert res['variants'][v]['top1'] == pytest.approx(acc)
    assert res['variants']['mixed_same']['unmapped_predictions'] == 1
    assert res['bg_gap'] == pytest.approx(100 * 1 / 9 * 2)  # 8/9 - 6/9
    assert res['protocol']['name'] == 'no_resize' and res['protocol']['standard']


def test_non_224_model_and_prefetcher(trees):
    # a model at another input size sees the whole 224 image resized to it, flagged non-standard; timm's
    # PrefetchLoader (normalising on the device, the CUDA path) gives the same results on the CPU
    settings = EvalSettings(batch_size=4, workers=0, progress=False, prefetcher=True)
    with pytest.warns(LayoutWarning):
        res = evaluate_imagenet_9(ColourOracle(input_size=64), str(trees['in9'][0]), settings,
                                  variants=['mixed_same'])
    assert res['protocol']['standard'] is False and res['protocol']['input_size'] == [3, 64, 64]
    assert 'NON-STANDARD' in res['protocol']['description']
    assert res['variants']['mixed_same']['top1'] == pytest.approx(800 / 9) and res['bg_gap'] is None


# ---- layout checks ----

def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_flat_val_folder_is_refused(tmp_path, oracle):
    for i in range(1, 4):
        save_image(tmp_path / 'val' / f'ILSVRC2012_val_{i:08d}.JPEG', 0)
    with pytest.raises(LayoutError, match=r'3 images lie directly in .*val \(e\.g\. ILSVRC2012_val_00000001\.JPEG\); '
                                          r'a flat folder carries no labels.*val/n01440764/<image>'):
        evaluate_imagenet(oracle, str(tmp_path), SETTINGS)


def test_unknown_class_folder_is_refused(tmp_path, trees, oracle):
    root = _copy(trees['imagenet']['root'], tmp_path / 'in')
    (root / 'val' / WNIDS[0]).rename(root / 'val' / 'goldfish')
    with pytest.raises(LayoutError, match=r"not classes of this suite: 'goldfish'.*'n01440764'"):
        evaluate_imagenet(oracle, str(root), SETTINGS, real=False)
    v2 = _copy(trees['v2'] / 'imagenetv2-top-images-format-val', tmp_path / 'imagenetv2-top-images-format-val')
    (v2 / '999').rename(v2 / '1000')
    with pytest.raises(LayoutError, match="'1000'"):
        evaluate_v2(oracle, str(v2), SETTINGS)
    # an ImageNet class that is not one of the 200 of ImageNet-A
    a = _copy(trees['a']['root'], tmp_path / 'imagenet-a')
    save_image(a / WNIDS[0] / 'x.jpg', 0)
    with pytest.raises(LayoutError, match=f"'{WNIDS[0]}'"):
        evaluate_imagenet_ar(oracle, str(a), SETTINGS, 'a')
    # IN-C pointed one level too deep: severity folders where wnids belong
    with pytest.raises(LayoutError, match=r"folder\(s\) in .*fog are not classes of this suite: '1', '2'"):
        evaluate_imagenet(oracle, str(trees['c'] / 'fog'), SETTINGS, real=False)


def test_missing_corruption_or_severity_folder(tmp_path, trees, oracle):
    root = _copy(trees['c'], tmp_path / 'c')
    shutil.rmtree(root / 'fog' / '4')
    with pytest.raises(LayoutError, match=r'severity folder .*fog/4 is missing'):
        evaluate_imagenet_c(oracle, str(root), SETTINGS)
    shutil.rmtree(root / 'contrast')
    with pytest.raises(LayoutError, match=r'corruption folder .*contrast is missing'):
        evaluate_imagenet_c(oracle, str(root), SETTINGS, corruptions=['contrast'])


def test_in9_missing_variant_and_bad_class_folder(tmp_path, trees, oracle):
    root = _copy(trees['in9'][0], tmp_path / 'bg')
    shutil.rmtree(root / 'mixed_rand')
    with pytest.raises(LayoutError, match=r'variant folder .*mixed_rand is missing'):
        evaluate_imagenet_9(oracle, str(root), SETTINGS)
    (root / 'original' / 'val' / '02_wheeled vehicle').rename(root / 'original' / 'val' / 'wheeled vehicle')
    with pytest.raises(LayoutError, match="'wheeled vehicle' has no prefix"):
        evaluate_imagenet_9(oracle, str(root), SETTINGS, variants=['original'])


def test_image_counts_warn_or_fail_strict(tmp_path, trees, oracle):
    a = _copy(trees['a']['root'], tmp_path / 'imagenet-a')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        res = evaluate_imagenet_ar(oracle, str(a), SETTINGS, 'a')
    msg = [str(w.message) for w in caught if issubclass(w.category, LayoutWarning)]
    assert msg and 'holds 4 images in 2 class folders; the full dataset has 7500 in 200' in msg[0]
    assert res['layout_warnings'] == msg
    strict = EvalSettings(batch_size=16, workers=0, progress=False, strict=True)
    with pytest.raises(LayoutError, match='7500 in 200.*--strict'):
        evaluate_imagenet_ar(oracle, str(a), strict, 'a')
    (a / 'notes.bmp').write_text('x')  # a stray file at the root is not an image timm reads: ignored
    (a / subset_synsets('a')[0] / 'thumb.webp').write_bytes(b'x')
    with pytest.warns(LayoutWarning) as caught:
        evaluate_imagenet_ar(oracle, str(a), SETTINGS, 'a')
    assert any(re.search(r'1 file\(s\) in .* are not .png/.jpg/.jpeg images and are skipped .*thumb.webp',
                         str(w.message)) for w in caught)


def test_real_labels_must_match_file_names(tmp_path, trees, oracle):
    fx = trees['imagenet']
    root = _copy(fx['root'], tmp_path / 'in')
    src = root / 'val' / WNIDS[1] / 'ILSVRC2012_val_00000006.JPEG'
    src.rename(src.with_name('img6.JPEG'))
    with pytest.raises(LayoutError, match="without a label entry, e.g. 'img6.JPEG'"), pytest.warns(LayoutWarning):
        evaluate_imagenet(oracle, str(root), SETTINGS, real=True, real_json=str(fx['real_json']))
    (root / 'short.json').write_text(json.dumps([[0]] * 5))
    with pytest.raises(LayoutError, match='6 validation images but 5 entries'), pytest.warns(LayoutWarning):
        evaluate_imagenet(oracle, str(root), SETTINGS, real=True, real_json=str(root / 'short.json'))


def test_model_without_imagenet_head_is_refused(trees):
    model = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 10))
    with pytest.raises(ValueError, match=r'shape \(.*, 10\); this suite needs 1000 classes'), \
            pytest.warns(LayoutWarning):
        evaluate_imagenet_ar(model, str(trees['a']['root']), SETTINGS, 'a')
