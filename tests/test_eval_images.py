"""Every image is counted exactly once (issue 20): hidden files are never images, an unreadable image is named and
left out (never replaced by the next one), ImageNet-C and -9 images must be 224x224, empty folders are the suites'
own errors, and the default loader workers fit the usable cores.

Each test builds a tiny tree with the quirk a real download or copy has and scores it with the colour oracle of
tests/eval_fixtures.py, so the expected counts and metrics are exact.
"""
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
from eval_fixtures import (
    WNIDS,
    ColourOracle,
    add_mac_junk,
    imagenet_c_profile,
    make_imagenet,
    make_imagenet_9,
    make_imagenet_ar,
    make_imagenet_c,
    make_v2,
    truncate,
)
from PIL import Image

from lsvision.eval import (
    EXPECTED_IMAGES,
    SEVERITIES,
    EvalSettings,
    LayoutError,
    LayoutWarning,
    evaluate_imagenet,
    evaluate_imagenet_9,
    evaluate_imagenet_ar,
    evaluate_imagenet_c,
    evaluate_v2,
    subset_synsets,
)

# batches of 4: left-out images fall in the middle of a batch and in a partial last batch
SETTINGS = EvalSettings(batch_size=4, workers=0, progress=False)
STRICT = EvalSettings(batch_size=4, workers=0, progress=False, strict=True)


@pytest.fixture(scope='module')
def oracle():
    return ColourOracle()


def run(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and the messages of the LayoutWarnings it issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = fn(*args, **kwargs)
    return result, [str(w.message) for w in caught if issubclass(w.category, LayoutWarning)]


def make_all_suites(root: Path) -> Path:
    make_imagenet(root / 'imagenet')
    make_v2(root / 'v2')
    make_imagenet_c(root / 'c', ['contrast', 'pixelate'])
    make_imagenet_ar(root / 'a', 'a')
    make_imagenet_ar(root / 'r', 'r')
    make_imagenet_9(root / 'bg')
    return root


def evaluate_all_suites(root: Path, oracle: ColourOracle) -> dict:
    return dict(
        imagenet=evaluate_imagenet(oracle, str(root / 'imagenet'), SETTINGS, real=True,
                                   real_json=str(root / 'imagenet' / 'real.json')),
        v2=evaluate_v2(oracle, str(root / 'v2'), SETTINGS),
        c=evaluate_imagenet_c(oracle, str(root / 'c'), SETTINGS, corruptions=['contrast', 'pixelate']),
        a=evaluate_imagenet_ar(oracle, str(root / 'a' / 'imagenet-a'), SETTINGS, 'a'),
        r=evaluate_imagenet_ar(oracle, str(root / 'r' / 'imagenet-r'), SETTINGS, 'r'),
        in9=evaluate_imagenet_9(oracle, str(root / 'bg'), SETTINGS),
    )


def test_hidden_files_are_never_images_in_any_suite(tmp_path, oracle):
    clean = make_all_suites(tmp_path / 'clean')
    mac = tmp_path / 'mac'
    shutil.copytree(clean, mac)
    assert add_mac_junk(mac) > 300  # ._x.JPEG beside every image, .DS_Store in every folder
    # netatalk keeps its AppleDouble files in a hidden folder, named like the images; Finder leaves .Trashes
    class_folder = mac / 'imagenet' / 'val' / WNIDS[0]
    (class_folder / '.AppleDouble').mkdir()
    (class_folder / '.AppleDouble' / 'ILSVRC2012_val_00000001.JPEG').write_bytes(b'\x00\x05\x16\x07junk')
    (mac / 'imagenet' / 'val' / '.Trashes').mkdir()
    expected, expected_warnings = run(evaluate_all_suites, clean, oracle)
    got, got_warnings = run(evaluate_all_suites, mac, oracle)
    # counts, metrics, ReaL, warnings: all as without the junk (up to the root folder's name)
    assert json.loads(json.dumps(got).replace(str(mac), '<root>')) == \
        json.loads(json.dumps(expected).replace(str(clean), '<root>'))
    assert [w.replace(str(mac), '<root>') for w in got_warnings] == \
        [w.replace(str(clean), '<root>') for w in expected_warnings]
    assert (got['imagenet']['count'], got['imagenet']['real']['count'], got['imagenet']['skipped']) == (6, 5, [])
    assert got['c']['corruptions']['pixelate']['severities']['1']['count'] == 2
    assert got['in9']['variants']['original']['count'] == 9


def test_unreadable_images_are_named_and_left_out_never_replaced(tmp_path, oracle, monkeypatch):
    fx = make_imagenet(tmp_path / 'in')
    folder = fx['root'] / 'val' / WNIDS[1]
    empty, cut = folder / 'ILSVRC2012_val_00000004.JPEG', folder / 'ILSVRC2012_val_00000005.JPEG'
    empty.write_bytes(b'')
    truncate(cut)  # the header is intact: it opens, and fails when its pixels are decoded
    res, caught = run(evaluate_imagenet, oracle, str(fx['root']), SETTINGS, real=True, real_json=str(fx['real_json']))
    # images 1, 2, 3 (coloured as class 5: wrong) and 6 are scored; 4 and 5 are not, and nothing takes their place
    assert (res['images'], res['count'], res['correct_top1'], res['correct_top5']) == (6, 4, 3, 4)
    assert [s['file'] for s in res['skipped']] == [str(empty), str(cut)]
    assert 'cannot identify image file' in res['skipped'][0]['reason']
    assert 'image file is truncated' in res['skipped'][1]['reason']
    for path in (empty, cut):
        assert [w for w in caught if f'cannot read image {path}' in w and 'left out, not replaced' in w]
    assert set(caught) <= set(res['layout_warnings'])
    # ReaL keeps matching labels to the right files: image 2 has none; 1 ([0]) and 3 ([0, 5]) right, 6 ([2]) wrong
    assert (res['real']['count'], res['real']['skipped_no_label']) == (3, 1)
    assert res['real']['top1'] == pytest.approx(200 / 3)
    # --strict: the first unreadable image is an error naming it (with the fixture's counts taken as the full set's)
    monkeypatch.setitem(EXPECTED_IMAGES, 'imagenet', (6, 2))
    with pytest.raises(LayoutError, match=f'cannot read image {empty}.*--strict'):
        evaluate_imagenet(oracle, str(fx['root']), STRICT, real=False)


def test_imagenet_c_and_9_images_must_be_224(tmp_path, oracle, monkeypatch):
    c = make_imagenet_c(tmp_path / 'c', ['pixelate'])
    resized = sorted((c / 'pixelate' / '3').rglob('*.JPEG'))
    for path in resized:  # pixelate/3 re-generated at 256x256: same classes, another size
        Image.open(path).resize((256, 256)).save(path, quality=85)
    res, caught = run(evaluate_imagenet_c, oracle, str(c), SETTINGS, corruptions=['pixelate'])
    message = f'ImageNet-C pixelate/3: 2 image(s) are 256x256 (2), not 224x224 (e.g. {resized[0]})'
    assert [w for w in caught if w.startswith(message)] and [w for w in res['layout_warnings'] if message in w]
    sev3 = res['corruptions']['pixelate']['severities']['3']
    assert sev3['off_size'] == {'256x256': [str(p) for p in resized]}
    assert res['corruptions']['pixelate']['severities']['2']['off_size'] == {}
    assert [res['corruptions']['pixelate']['severities'][str(s)]['error'] for s in SEVERITIES] == \
        [100 * imagenet_c_profile(0, s) / 2 for s in SEVERITIES]  # still scored, as the warning says
    bg, _ = make_imagenet_9(tmp_path / 'bg', ('original', 'mixed_same', 'mixed_rand'))
    odd = next((bg / 'mixed_rand' / 'val' / '03_reptile').iterdir())
    Image.open(odd).resize((300, 224)).save(odd, quality=90)
    res, caught = run(evaluate_imagenet_9, oracle, str(bg), SETTINGS)
    assert [w for w in caught if w.startswith(f'ImageNet-9 mixed_rand: 1 image(s) are 300x224 (1), not 224x224 '
                                              f'(e.g. {odd})')]
    assert res['variants']['mixed_rand']['off_size'] == {'300x224': [str(odd)]}
    assert res['variants']['original']['off_size'] == {}
    # --strict: an error naming the variant and the size (with the fixture's counts taken as the full set's)
    monkeypatch.setitem(EXPECTED_IMAGES, 'imagenet_9', (9, 9))
    with pytest.raises(LayoutError, match=r'ImageNet-9 mixed_rand: 1 image\(s\) are 300x224, not 224x224.*--strict'):
        evaluate_imagenet_9(oracle, str(bg), STRICT)


@pytest.mark.filterwarnings('ignore::lsvision.eval.LayoutWarning')
def test_empty_folders_are_errors_naming_them(tmp_path, oracle):
    c = make_imagenet_c(tmp_path / 'c', ['contrast'])
    severity = c / 'contrast' / '2'
    for path in severity.rglob('*.JPEG'):
        path.unlink()
    add_mac_junk(severity)  # class folders with nothing but hidden junk
    with pytest.raises(LayoutError, match=r'ImageNet-C contrast/2: no images in \S*contrast/2 \(its 2 class folder'):
        evaluate_imagenet_c(oracle, str(c), SETTINGS, corruptions=['contrast'])
    shutil.rmtree(severity)
    severity.mkdir()
    (severity / '.DS_Store').write_bytes(b'junk')
    with pytest.raises(LayoutError, match=r'ImageNet-C contrast/2: no class folders in \S*contrast/2'):
        evaluate_imagenet_c(oracle, str(c), SETTINGS, corruptions=['contrast'])
    # one empty class folder among full ones
    a = make_imagenet_ar(tmp_path / 'a', 'a')['root']
    extra = a / subset_synsets('a')[5]
    extra.mkdir()
    with pytest.raises(LayoutError, match=rf'ImageNet-A: 1 class folder\(s\) hold no images: {extra}'):
        evaluate_imagenet_ar(oracle, str(a), SETTINGS, 'a')
    # an IN-9 variant whose class folders are empty
    bg, _ = make_imagenet_9(tmp_path / 'bg', ('original', 'mixed_same', 'mixed_rand'))
    for path in (bg / 'mixed_rand').rglob('*.JPEG'):
        path.unlink()
    with pytest.raises(LayoutError, match=r'ImageNet-9 mixed_rand: no images in \S*mixed_rand/val'):
        evaluate_imagenet_9(oracle, str(bg), SETTINGS)
    # a set none of whose images can be read: an error, not a NaN error rate
    c2 = make_imagenet_c(tmp_path / 'c2', ['fog'])
    for path in (c2 / 'fog' / '1').rglob('*.JPEG'):
        path.write_bytes(b'')
    with pytest.raises(LayoutError, match=r'ImageNet-C fog/1: none of its 2 images could be read'):
        evaluate_imagenet_c(oracle, str(c2), SETTINGS, corruptions=['fog'])


def test_default_workers_fit_the_usable_cores(tmp_path, oracle, monkeypatch):
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0, 1}, raising=False)  # a 2-core machine
    assert EvalSettings().workers == 2
    a = make_imagenet_ar(tmp_path / 'a', 'a')['root']
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        res = evaluate_imagenet_ar(oracle, str(a), EvalSettings(batch_size=2, progress=False), 'a')
    assert res['count'] == 4
    assert not [str(w.message) for w in caught if 'worker processes' in str(w.message)]  # PyTorch's warning
