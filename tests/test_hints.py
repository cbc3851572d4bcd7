"""Hints that work: each error hint of the evaluation tools, followed as written, leads forward (the next run gets
further or succeeds); unknown model names get "did you mean" in every tool; and lsvision.eval reads training runs
through lsvision.runs without importing lsvision.train."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import ROOT, load_tool
from eval_fixtures import make_imagenet_ar
from PIL import Image

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.eval.cli import resolve_model_names

CLASSES = ['circle', 'square', 'triangle']
KWARGS = dict(embed_dims=(16, 32, 32), num_heads=(1, 1, 1), depths=(1, 1, 1))


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint as tools/train.py writes it (state dict, the run's arguments, its classes in logit order) of a
    tiny 3-class cvt_ls_13 at 32 px, trained (so the record says) in float32 with channels-last tensors."""
    torch.manual_seed(0)
    model = timm.create_model('cvt_ls_13', num_classes=3, **KWARGS)
    path = tmp_path_factory.mktemp('hints') / 'run' / 'last.pth.tar'
    path.parent.mkdir()
    torch.save(dict(arch='cvt_ls_13', state_dict=model.state_dict(), class_names=CLASSES,
                    args=dict(model='cvt_ls_13', num_classes=3, model_kwargs=KWARGS, input_size=[3, 32, 32],
                              batch_size=4, amp=False, channels_last=True)), path)
    return path


def _folder(root: Path, classes, per_class: int = 2) -> Path:
    rng = np.random.RandomState(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.randint(0, 255, (32, 32, 3)).astype(np.uint8)).save(root / name / f'{i}.png')
    return root


def _validate(checkpoint: Path, folder: Path, out: Path, *extra: str) -> int:
    return load_tool('validate').main(['--data-dir', str(folder), '--model', 'cvt_ls_13', '--checkpoint',
                                       str(checkpoint), '--workers', '0', '--no-progress', '--out-dir', str(out),
                                       *extra])


def _folder_result(out: Path) -> dict:
    return json.loads((out / 'results.json').read_text())['models'][0]['suites']['folder']


def test_class_mismatch_hints_lead_to_a_result(checkpoint, tmp_path, capsys):
    """Another class's folder and a missing class: move the folder out as told, then --allow-missing-classes as told;
    labels follow the names (no shift)."""
    val = _folder(tmp_path / 'val', ['circle', 'square', 'star'])
    assert _validate(checkpoint, val, tmp_path / 'o1') == 2
    err = capsys.readouterr().err
    assert "not classes of the model: ['star'] (the model has no logit for them: move these folders out" in err
    assert "classes without a folder: ['triangle'] (add their images, or pass --allow-missing-classes" in err
    assert '--class-map' not in err  # it would not help: the classes are the checkpoint's already
    shutil.move(str(val / 'star'), str(tmp_path / 'star'))
    assert _validate(checkpoint, val, tmp_path / 'o2') == 2
    err = capsys.readouterr().err
    assert 'not classes of the model' not in err and '--allow-missing-classes' in err
    assert _validate(checkpoint, val, tmp_path / 'o3', '--allow-missing-classes') == 0
    model = json.loads((tmp_path / 'o3' / 'results.json').read_text())['models'][0]
    assert model['channels_last'] is True
    assert model['precision'] == dict(autocast=None, source='training run: amp false')
    folder = _folder_result(tmp_path / 'o3')
    assert folder['count'] == 4 and folder['missing_classes'] == ['triangle'] and folder['classes'] == CLASSES
    assert {c: r['count'] for c, r in folder['per_class'].items()} == dict(circle=2, square=2, triangle=0)
    assert folder['per_class']['triangle']['top1'] is None


def test_empty_class_folder_hint_leads_to_a_result(checkpoint, tmp_path, capsys):
    val = _folder(tmp_path / 'val', CLASSES)
    for image in (val / 'square').iterdir():
        image.unlink()
    assert _validate(checkpoint, val, tmp_path / 'o1') == 2
    err = capsys.readouterr().err
    assert 'square' in err and 'remove the empty folder(s) and pass --allow-missing-classes' in err
    (val / 'square').rmdir()
    assert _validate(checkpoint, val, tmp_path / 'o2', '--allow-missing-classes') == 0
    assert _folder_result(tmp_path / 'o2')['missing_classes'] == ['square']
    _folder(val, ['square'])  # or restore the images, as told
    assert _validate(checkpoint, val, tmp_path / 'o3') == 0
    assert _folder_result(tmp_path / 'o3')['count'] == 6


def test_no_released_weights_names_the_tools_flags(tmp_path, caches, capsys):
    """--pretrained on a model without released weights: no traceback, the fix in the tool's flags first, then
    the Python route."""
    folder = _folder(tmp_path / 'val', CLASSES, per_class=1)
    for tool in ('validate', 'robustness'):
        suite = ['--data-dir', str(folder)] if tool == 'validate' else ['--imagenet-a', str(folder)]
        assert load_tool(tool).main(suite + ['--model', 'cvt_ls_13', '--pretrained', '--workers', '0',
                                             '--no-progress', '--out-dir', str(tmp_path / tool)]) == 2
        err = capsys.readouterr().err
        assert 'error: cvt_ls_13 has no released weights. Fix: give a weights file of cvt_ls_13 as --checkpoint FILE' \
            in err and err.index('leave out --pretrained') < err.index('In Python (library users)')


def test_imagenet_suite_on_a_model_of_own_classes_hint_leads_to_a_result(checkpoint, tmp_path, capsys):
    """ImageNet-A needs 1000 logits; the hint names the suite for a model of its own classes, which then runs."""
    make_imagenet_ar(tmp_path / 'a', 'a')
    common = ['--model', 'cvt_ls_13', '--checkpoint', str(checkpoint), '--workers', '0', '--no-progress']
    robustness = load_tool('robustness')
    assert robustness.main([*common, '--imagenet-a', str(tmp_path / 'a' / 'imagenet-a'),
                            '--out-dir', str(tmp_path / 'o1')]) == 2
    err = capsys.readouterr().err
    assert 'this suite needs 1000 classes' in err and 'robustness.py --corrupt-on-the-fly DIR' in err
    val = _folder(tmp_path / 'val', CLASSES, per_class=1)
    assert robustness.main([*common, '--corrupt-on-the-fly', str(val), '--corruptions', 'gaussian_noise',
                            '--severities', '1', '--out-dir', str(tmp_path / 'o2')]) == 0
    result = json.loads((tmp_path / 'o2' / 'results.json').read_text())['models'][0]['suites']
    assert result['imagenet_c_on_the_fly']['corruptions']['gaussian_noise']['severities']['1']['count'] == 3


def test_a_grayscale_run_is_evaluated_in_its_image_mode(tmp_path):
    """A run trained on one channel (--input-img-mode L, input size 1x32x32, its own mean/std): its RGB val images
    are read as training read them, so the model sees one channel."""
    torch.manual_seed(0)
    model = timm.create_model('cvt_ls_13', num_classes=3, in_chans=1, **KWARGS)
    path = tmp_path / 'run' / 'last.pth.tar'
    path.parent.mkdir()
    torch.save(dict(arch='cvt_ls_13', state_dict=model.state_dict(), class_names=CLASSES,
                    args=dict(model='cvt_ls_13', num_classes=3, model_kwargs=KWARGS, input_size=[1, 32, 32],
                              input_img_mode='L', mean=[0.5], std=[0.25], batch_size=4)), path)
    assert _validate(path, _folder(tmp_path / 'val', CLASSES), tmp_path / 'o') == 0
    result = json.loads((tmp_path / 'o' / 'results.json').read_text())['models'][0]
    assert result['input_img_mode'] == 'L' and result['model_kwargs']['in_chans'] == 1
    assert result['suites']['folder']['count'] == 6
    assert result['suites']['folder']['protocol']['input_size'] == [1, 32, 32]


def _suggestion(err: str) -> str:
    return re.search(r'did you mean ([\w.]+)', err).group(1)


@pytest.mark.parametrize('tool', ['validate', 'robustness'])
def test_eval_tools_suggest_model_names(tool, tmp_path, capsys):
    suite = ['--data-dir', str(tmp_path)] if tool == 'validate' else ['--imagenet-a', str(tmp_path)]
    assert load_tool(tool).main([*suite, '--model', 'cvt_ls13', '--out-dir', str(tmp_path / 'o')]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'cvt_ls13'; did you mean cvt_ls_13" in err
    assert resolve_model_names([_suggestion(err)]) == ['cvt_ls_13']  # the suggestion is a model the tools take
    assert load_tool(tool).main([*suite, '--model', 'ls_lra_listops', '--out-dir', str(tmp_path / 'o')]) == 2
    assert "'ls_lra_listops' is a sequence model (lsvision.sequence.create_model)" in capsys.readouterr().err


def test_benchmark_suggests_model_and_configuration_names(capsys):
    benchmark = load_tool('benchmark')
    assert benchmark.main(['--models', 'cvt_ls_13', 'vil_ls_medum@full']) == 2
    assert "unknown model 'vil_ls_medum'; did you mean vil_ls_medium" in capsys.readouterr().err
    assert benchmark.main(['--suite', 'sequence', '--names', 'sdpa_ful']) == 2
    err = capsys.readouterr().err
    assert "unknown configuration 'sdpa_ful'; did you mean sdpa_full" in err
    assert _suggestion(err) in benchmark.SEQUENCE_CONFIGS


def test_detection_benchmark_suggests_model_names(tmp_path, capsys):
    benchmark = load_tool('benchmark')
    assert benchmark.main(['detection', '--models', 'cvt_ls_13', 'cvt_ls13', '--out', str(tmp_path)]) == 2
    assert "unknown model 'cvt_ls13'; did you mean cvt_ls_13" in capsys.readouterr().err
    assert benchmark.main(['detection', '--baseline', 'cvt13', '--out', str(tmp_path)]) == 2
    assert "unknown model 'cvt13'; did you mean cvt_13" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


def test_compile_times_and_converter_suggest_model_names(tmp_path, capsys):
    assert load_tool('compile_times').main(['--model', 'cvt_ls13', '--modes', 'eager']) == 2
    assert "unknown model 'cvt_ls13'; did you mean cvt_ls_13" in capsys.readouterr().err
    convert = load_tool('convert_vil_ls')
    with pytest.raises(SystemExit):
        convert.parse_args(['in.pth', 'out.safetensors', '--model', 'vil_ls_medum'])
    err = capsys.readouterr().err
    assert "unknown model 'vil_ls_medum'; did you mean vil_ls_medium" in err
    assert convert.parse_args(['in.pth', 'out.safetensors', '--model', _suggestion(err)]).model == 'vil_ls_medium'


@pytest.mark.parametrize('tool, typo, meant', [('demo_listops', 'lss', 'ls'), ('demo_bytelm', 'ful', 'full'),
                                               ('demo_hsw', 'hsw-ls', 'hsw_ls')])
def test_sequence_demos_suggest_model_names(tool, typo, meant, capsys):
    demo = load_tool(tool)
    parse = getattr(demo, 'parse_args', None) or demo.main  # demo_hsw parses in main (a typo stops it there)
    with pytest.raises(SystemExit):
        parse(['--models', typo])
    err = capsys.readouterr().err
    assert f'unknown model {typo!r}; did you mean {meant}' in err and _suggestion(err) == meant
    if hasattr(demo, 'parse_args'):
        assert demo.parse_args(['--models', meant]).models == [meant]


def test_image_demo_suggests_model_names(monkeypatch, capsys):
    monkeypatch.setattr(sys, 'argv', ['demo.py', '--models', 'cvt_ls_13x', 'cvt_13'])
    assert load_tool('demo').main() == 2  # a typo beside a good name is not dropped silently
    assert "no lsvision model matches ['cvt_ls_13x']; Did you mean cvt_ls_13," in capsys.readouterr().err


def test_eval_imports_nothing_of_train():
    """lsvision.eval (and the tools over it) read training runs through lsvision.runs, which imports neither eval
    nor train: the evaluation side loads no training code."""
    code = ('import sys, json; import lsvision.runs; runs = sorted(sys.modules); '
            "sys.path.insert(0, 'tools'); import validate, robustness; print(json.dumps([runs, sorted(sys.modules)]))")
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    after_runs, after_eval = json.loads(proc.stdout.splitlines()[-1])
    assert not [m for m in after_runs if m.startswith(('lsvision.train', 'lsvision.eval'))]
    assert 'lsvision.eval.cli' in after_eval
    assert not [m for m in after_eval if m == 'lsvision.train' or m.startswith('lsvision.train.')]
