"""tools/validate.py and tools/robustness.py end to end on a real (tiny) lsvision model over the suite fixtures,
their outputs (JSON with checkpoint identity, markdown, PNG), model selection, errors, and --corrupt-on-the-fly.

The model is ``cvt_ls_13`` with one block of width 16/32/64 per stage (164k parameters, random weights saved as a
safetensors checkpoint), so the metrics are arbitrary: the tests check counts and that every derived number (CE,
mCE, BG-gap) is consistent with the raw ones. Exact metric values are tested with the colour oracle in
test_eval_suites.py.
"""
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from _helpers import EVAL_CVT_LS, load_tool, model_kwargs_args, run_script, save_eval_checkpoint
from eval_fixtures import (
    ColourOracle,
    make_suite_trees,
    truncate,
)

import timm

import lsvision  # noqa: F401  (registers cvt_ls_13)
from lsvision.eval import ALEXNET_ERRORS, CORRUPTIONS, EvalSettings, LayoutWarning, evaluate_corrupt_on_the_fly
from lsvision.eval.cli import resolve_model_names

ROOT = Path(__file__).resolve().parents[1]
TINY = model_kwargs_args(EVAL_CVT_LS)
# one torch thread: with 2 threads on 2 busy cores, OpenMP synchronisation made the all-suites run 25x slower (140 s)
ONE_THREAD = ['--threads', '1']


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp('eval_tools')
    trees = make_suite_trees(root)
    # the tools take the folders of ImageNet-A, -R and -9
    return dict(trees, ckpt=save_eval_checkpoint(root / 'tiny.safetensors'), a=trees['a']['root'],
                r=trees['r']['root'], in9=trees['in9'][0])


def test_validate_tool_subprocess(data, tmp_path):
    out = tmp_path / 'out'
    proc = run_script(
        [sys.executable, str(ROOT / 'tools' / 'validate.py'), '--models', 'cvt_ls_13', '--checkpoint',
         str(data['ckpt']), '--model-kwargs', *TINY, '--imagenet', str(data['imagenet']['root']), '--real-labels',
         str(data['imagenet']['real_json']), '--imagenet-v2', str(data['v2']), '--workers', '0', '--threads', '1',
         '--device', 'cpu', '--out-dir', str(out)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / 'results.json').read_text())
    assert res['tool'] == 'validate' and res['versions']['timm'] == timm.__version__
    (m,) = res['models']
    assert m['model'] == 'cvt_ls_13' and m['params'] == 164364
    # the weights are the checkpoint's (path and hash), not timm's pretrained ones
    assert m['pretrained'] is False and m['pretrained_tag'] is None and m['checkpoint'] == str(data['ckpt'])
    assert m['checkpoint_sha256'] == hashlib.sha256(data['ckpt'].read_bytes()).hexdigest()
    assert m['model_kwargs'] == dict(embed_dims=[16, 32, 64], num_heads=[1, 1, 1], depths=[1, 1, 1])
    inet = m['suites']['imagenet']
    assert inet['count'] == 6 and inet['real']['count'] == 5 and inet['real']['skipped_no_label'] == 1
    assert inet['protocol'] == dict(
        name='model_eval', input_size=[3, 224, 224], interpolation='bicubic', crop_pct=0.875, crop_mode='center',
        mean=list(timm.data.IMAGENET_DEFAULT_MEAN), std=list(timm.data.IMAGENET_DEFAULT_STD), standard=True,
        description=inet['protocol']['description'])
    assert any('holds 6 images in 2 class folders' in w for w in inet['layout_warnings'])
    assert {v: r['count'] for v, r in m['suites']['imagenet_v2'].items()} == {
        'matched-frequency': 10, 'threshold0.7': 10, 'top-images': 10}
    md = (out / 'results.md').read_text()
    assert '| model | params (M) | ImageNet top-1 | top-5 | ReaL | V2 matched-frequency | V2 threshold0.7 | ' \
           'V2 top-images |' in md
    assert md in proc.stdout and 'Layout warnings' in md
    assert not (out / 'imagenet_c.png').exists()


def test_robustness_tool_all_suites(data, tmp_path):
    tool = load_tool('robustness')
    out = tmp_path / 'out'
    with pytest.warns(LayoutWarning):
        rc = tool.main(['--models', 'cvt_ls_13', '--checkpoint', str(data['ckpt']), '--model-kwargs', *TINY,
                        '--imagenet', str(data['imagenet']['root']), '--imagenet-c', str(data['c']),
                        '--imagenet-a', str(data['a']), '--imagenet-r', str(data['r']), '--imagenet-9',
                        str(data['in9']), '--workers', '0', '--batch-size', '32', '--device', 'cpu', '--no-progress',
                        *ONE_THREAD, '--out-dir', str(out)])
    assert rc == 0
    res = json.loads((out / 'results.json').read_text())
    suites = res['models'][0]['suites']
    assert set(suites) == {'imagenet', 'imagenet_c', 'imagenet_a', 'imagenet_r', 'imagenet_9'}
    clean = 1 - suites['imagenet']['top1'] / 100
    c = suites['imagenet_c']
    assert c['clean_error'] == pytest.approx(100 * clean) and c['protocol']['name'] == 'no_resize'
    for name, row in c['corruptions'].items():
        errs = [row['severities'][str(s)]['error'] for s in range(1, 6)]
        assert all(row['severities'][str(s)]['count'] == 2 for s in range(1, 6))
        assert row['mean_error'] == pytest.approx(sum(errs) / 5)
        if name in ALEXNET_ERRORS:
            assert row['ce'] == pytest.approx(row['mean_error'] / ALEXNET_ERRORS[name])
    assert c['mce'] == pytest.approx(sum(c['corruptions'][n]['ce'] for n in CORRUPTIONS) / 15)
    assert c['relative_mce'] is not None and len(c['corruptions']) == 19
    assert (suites['imagenet_a']['count'], suites['imagenet_r']['count']) == (4, 5)
    in9 = suites['imagenet_9']
    assert in9['bg_gap'] == pytest.approx(in9['variants']['mixed_same']['top1'] - in9['variants']['mixed_rand']['top1'])
    md = (out / 'results.md').read_text()
    assert '## Summary (accuracy in %, mCE with AlexNet = 100)' in md
    for header in ('| mCE ↓ | rel. mCE ↓ | IN-A | IN-R | IN-9 original | IN-9 mixed_same | IN-9 mixed_rand | BG-gap |',
                   '| corruption | group | error (%) | CE | relative CE | error s1 |',
                   '| model | suite | top-1 | top-5 | top-1 without slicing | images |',
                   '| model | original | mixed_same | mixed_rand | only_fg | BG-gap |'):
        assert header in md
    png = (out / 'imagenet_c.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10000
    assert res['plot'] == str(out / 'imagenet_c.png')


def test_tool_errors(data, tmp_path, capsys):
    tool = load_tool('robustness')
    args = ['--models', 'cvt_ls_13', '--model-kwargs', *TINY, '--workers', '0', '--no-progress', *ONE_THREAD,
            '--out-dir', str(tmp_path)]
    # a layout error stops the run before scoring, naming the path
    rc = tool.main(args + ['--imagenet-c', str(data['a'])])
    assert rc == 2 and 'corruption folder' in capsys.readouterr().err
    rc = tool.main(args + ['--imagenet-9', str(data['in9']), '--checkpoint', 'a.pth', 'b.pth'])
    assert rc == 2 and '2 checkpoint(s) for 1 model(s)' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(['--models', 'cvt_ls_13'])  # no suite
    validate = load_tool('validate')
    with pytest.raises(SystemExit):
        validate.parse_args(['--models', 'x', '--imagenet', 'y', '--no-real', '--real-labels', 'z'])


@pytest.mark.filterwarnings('ignore::lsvision.eval.LayoutWarning')  # the fixture's image counts
def test_tools_leave_out_unreadable_images_and_refuse_empty_folders(data, tmp_path, capsys):
    imagenet = shutil.copytree(data['imagenet']['root'], tmp_path / 'imagenet')
    a = shutil.copytree(data['a'], tmp_path / 'imagenet-a')
    bad_val = next((imagenet / 'val').rglob('ILSVRC2012_val_00000005.JPEG'))
    truncate(bad_val)
    bad_a = sorted(a.rglob('*.jpg'))[0]
    bad_a.write_bytes(b'')
    args = ['--models', 'cvt_ls_13', '--model-kwargs', *TINY, '--workers', '0', '--no-progress', *ONE_THREAD]
    # both tools: the file is named, left out (not replaced by the next image), and listed in the JSON
    with pytest.warns(LayoutWarning, match=f'cannot read image {bad_val}'):
        rc = load_tool('validate').main(args + ['--imagenet', str(imagenet), '--real-labels',
                                                str(data['imagenet']['real_json']), '--out-dir', str(tmp_path / 'v')])
    assert rc == 0
    inet = json.loads((tmp_path / 'v' / 'results.json').read_text())['models'][0]['suites']['imagenet']
    assert (inet['images'], inet['count'], [s['file'] for s in inet['skipped']]) == (6, 5, [str(bad_val)])
    assert (inet['real']['count'], inet['real']['skipped_no_label']) == (4, 1)  # image 5 had the labels [1]
    assert f'cannot read image {bad_val}' in (tmp_path / 'v' / 'results.md').read_text()
    with pytest.warns(LayoutWarning, match=f'cannot read image {bad_a}'):
        rc = load_tool('robustness').main(args + ['--imagenet', str(imagenet), '--imagenet-a', str(a), '--out-dir',
                                                  str(tmp_path / 'r')])
    assert rc == 0
    suites = json.loads((tmp_path / 'r' / 'results.json').read_text())['models'][0]['suites']
    assert [s['file'] for s in suites['imagenet']['skipped']] == [str(bad_val)]
    assert (suites['imagenet_a']['images'], suites['imagenet_a']['count']) == (4, 3)
    assert [s['file'] for s in suites['imagenet_a']['skipped']] == [str(bad_a)]
    assert '| 3 (1 unreadable left out) |' in (tmp_path / 'r' / 'results.md').read_text()
    # an empty severity folder (class folders without images) is the tool's own error, naming it: no traceback
    c = shutil.copytree(data['c'] / 'contrast', tmp_path / 'c' / 'contrast')
    for path in (c / '2').rglob('*.JPEG'):
        path.unlink()
    capsys.readouterr()
    rc = load_tool('robustness').main(args + ['--imagenet-c', str(tmp_path / 'c'), '--corruptions', 'contrast',
                                              '--out-dir', str(tmp_path / 'c_out')])
    err = capsys.readouterr().err
    assert rc == 2 and f'error: ImageNet-C contrast/2: no images in {c / "2"}' in err and 'Traceback' not in err


def test_model_selection():
    assert resolve_model_names(['cvt_ls_1[37]', 'cvt_ls_13']) == ['cvt_ls_13', 'cvt_ls_17']
    assert resolve_model_names(['resnet1[08]']) == ['resnet18']  # falls back to timm's own models (no resnet10)
    assert resolve_model_names(['resnet50.tv_in1k']) == ['resnet50.tv_in1k']
    with pytest.raises(ValueError, match='no model matches'):
        resolve_model_names(['nothing_like_this_*'])
    with pytest.raises(ValueError, match='unknown model'):
        resolve_model_names(['cvt_ls_99'])


def test_corrupt_on_the_fly(data, tmp_path):
    import imagecorruptions  # noqa: F401  (the corrupt extra, which `make` installs: fail, never skip, without it)
    oracle = ColourOracle()
    settings = EvalSettings(batch_size=8, workers=0, progress=False)
    root = str(data['imagenet']['root'])
    res = evaluate_corrupt_on_the_fly(oracle, root, settings, ['brightness', 'gaussian_noise'], [1, 5])
    assert res['on_the_fly'] is True and 'not comparable' in res['generator']
    assert res['labels'] == 'ImageNet-1K wnid folders'
    assert res['corruptions']['brightness']['severities']['5']['count'] == 6
    # the oracle's clean error on these images is 1/6; strong brightness shifts every colour code
    assert res['corruptions']['brightness']['severities']['5']['error'] == 100
    assert res['corruptions']['brightness']['ce'] is None  # only 2 of 5 severities
    # seeded per image; the same through timm's PrefetchLoader (the CUDA path), which wraps the DataLoader
    prefetch = EvalSettings(batch_size=4, workers=0, progress=False, prefetcher=True)
    again = evaluate_corrupt_on_the_fly(oracle, root, prefetch, ['gaussian_noise'], [1, 5])
    assert again['corruptions']['gaussian_noise'] == res['corruptions']['gaussian_noise']
    # the transform itself: 224x224 like ImageNet-C, repeatable per image, and really corrupted
    from PIL import Image

    from lsvision.eval.corrupt import ImageNetCCorruption
    img = Image.new('RGB', (300, 260), (120, 60, 200))
    noise = ImageNetCCorruption('gaussian_noise', 3)
    first, second = np.asarray(noise(img)), np.asarray(noise(img))
    assert first.shape == (224, 224, 3) and np.array_equal(first, second)
    assert np.abs(first.astype(int) - np.array([120, 60, 200])).mean() > 10
    assert not np.array_equal(first, np.asarray(ImageNetCCorruption('gaussian_noise', 3, seed=1)(img)))
    # through the tool, on the real model, a partial suite: marked in the JSON and the markdown, and every mean named
    # for the corruptions and severities it averages (2 at severity 3 are not 'the mean over the 15')
    tool = load_tool('robustness')
    rc = tool.main(['--models', 'cvt_ls_13', '--model-kwargs', *TINY, '--corrupt-on-the-fly', root, '--corruptions',
                    'gaussian_noise', 'fog', '--severities', '3', '--workers', '0', '--no-progress', *ONE_THREAD,
                    '--out-dir', str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / 'results.json').read_text())
    fly = res['models'][0]['suites']['imagenet_c_on_the_fly']
    assert fly['on_the_fly'] and fly['corruptions']['fog']['severities']['3']['count'] == 6
    assert fly['mce'] is None and fly['mean_error_15'] is None and fly['mean_error_extra'] is None
    errs = [fly['corruptions'][c]['severities']['3']['error'] for c in ('gaussian_noise', 'fog')]
    assert fly['mean_error'] == dict(value=pytest.approx(sum(errs) / 2), corruptions=['gaussian_noise', 'fog'],
                                     severities=[3])
    assert any('mean error over the 15 need all 15' in n for n in fly['notes'])
    md = (tmp_path / 'results.md').read_text()
    assert 'applied on the fly (not the released ImageNet-C)' in md and 'over the 15' not in md.replace(
        'the mean error over the 15 need', '')
    assert f'mean error over 2 of the 15 (gaussian_noise, fog) at severity 3 {sum(errs) / 2:.2f}.' in md
    assert '| corruption | group | error (%) |' in md and not any('|  |' in line for line in md.splitlines())
