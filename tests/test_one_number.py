"""One number per checkpoint: tools/validate.py and tools/robustness.py evaluate a tools/train.py checkpoint the way
its run's validation did (input size, preprocessing, classes, precision, batch size), so validate.py's top-1 is
training's own last validation top-1; flags still win (``--no-amp``: float32) and the results say which precision.

One tiny CvT-LS run (module fixture) on a two-class folder at 64 px (not the model's default 224) under the configs'
AMP setting: bfloat16 autocast on CPU. Its validation loss is the sharp check: any difference in precision,
preprocessing or weights moves it, where a top-1 over 8 images would rarely move.
"""
import csv
import json
from pathlib import Path

import pytest
import yaml
from _helpers import ROOT, load_tool, write_two_class_images
from PIL import Image

import lsvision  # noqa: F401  (registers the models)
from lsvision.runs import TrainingRun
from lsvision.train import parse_args, run

TINY = ['--model-kwargs', 'embed_dims=(16,32,32)', 'num_heads=(1,1,1)', 'depths=(1,1,1)']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A two-class folder (16 training, 8 validation images of 16 px, three of them grayscale, RGBA or JPEG of odd
    sizes) and a 1-epoch run at 64 px with the configs' amp setting; returns the data folder and the run folder."""
    root = tmp_path_factory.mktemp('one_number')
    data = root / 'data'
    write_two_class_images(data, per_class=8)
    val = data / 'val'  # as a folder of photographs: a grayscale image, an RGBA one and a JPEG, of odd sizes
    Image.open(val / 'class0' / '000.png').convert('L').resize((23, 17)).save(val / 'class0' / '000.png')
    Image.open(val / 'class1' / '001.png').convert('RGBA').resize((19, 29)).save(val / 'class1' / '001.png')
    Image.open(val / 'class0' / '002.png').resize((31, 20)).save(val / 'class0' / '002.jpg', quality=80)
    (val / 'class0' / '002.png').unlink()
    config = yaml.safe_load((ROOT / 'configs' / 'cvt_ls_13.yaml').read_text())
    assert config['amp'] is True and config.get('amp_dtype') is None  # the default: bfloat16 on CPU
    result = run(parse_args([str(data), '--model', 'cvt_ls_13', '--img-size', '64', '--epochs', '1', '-b', '4',
                             '-j', '0', '--amp', '--lr', '2e-3', '--warmup-epochs', '0', '--seed', '1',
                             '--output', str(root / 'out'), '--experiment', 'run', '--progress', 'log', *TINY]))
    return data, Path(result['output_dir'])


def _validate(argv, out: Path) -> dict:
    assert load_tool('validate').main([*argv, '--workers', '0', '--no-progress', '--out-dir', str(out)]) == 0
    return json.loads((out / 'results.json').read_text())


def test_validate_gives_trainings_last_top1_in_the_runs_precision(trained, tmp_path):
    data, run_dir = trained
    last = run_dir / 'last.pth.tar'
    argv = ['--data-dir', str(data / 'val'), '--model', 'cvt_ls_13', '--checkpoint', str(last)]
    res = _validate(argv, tmp_path / 'run')
    (model,) = res['models']
    folder = model['suites']['folder']
    trained_result = json.loads((run_dir / 'result.json').read_text())
    with open(run_dir / 'summary.csv') as f:
        last_row = list(csv.DictReader(f))[-1]
    assert folder['count'] == 8 and folder['protocol']['input_size'] == [3, 64, 64]
    assert model['precision']['autocast'] == 'bfloat16' and 'training run' in model['precision']['source']
    assert model['batch_size'] == 4  # the run's validation batch
    # the same images, weights, preprocessing, precision and batches: the same hits and the same loss. Training sums
    # float32 percentages (timm's accuracy) where validate.py counts hits, so top-1 agrees to rounding
    assert folder['correct_top1'] == round(trained_result['top1'] * 8 / 100)
    assert folder['top1'] == pytest.approx(trained_result['top1'], abs=1e-9)
    assert folder['top1'] == pytest.approx(float(last_row['eval_top1']), abs=1e-4)  # summary.csv: 4 decimals
    assert folder['loss'] == pytest.approx(trained_result['eval_loss'], rel=1e-12)
    md = (tmp_path / 'run' / 'results.md').read_text()
    assert 'precision: bfloat16 autocast (training run: amp true, amp_dtype bfloat16), batch size 4' in md

    fp32 = _validate(argv + ['--no-amp'], tmp_path / 'fp32')['models'][0]
    assert fp32['precision'] == dict(autocast=None, source='--no-amp')
    assert fp32['suites']['folder']['loss'] != pytest.approx(trained_result['eval_loss'], rel=1e-6)  # it matters
    assert 'precision: float32 (--no-amp)' in (tmp_path / 'fp32' / 'results.md').read_text()


def test_robustness_on_a_64px_run_is_64px_and_not_standard(trained, tmp_path):
    data, run_dir = trained
    out = tmp_path / 'rob'
    argv = ['--model', 'cvt_ls_13', '--checkpoint', str(run_dir / 'last.pth.tar'), '--corrupt-on-the-fly',
            str(data / 'val'), '--corruptions', 'gaussian_noise', '--severities', '1', '--workers', '0',
            '--no-progress', '--out-dir', str(out)]
    assert load_tool('robustness').main(argv) == 0
    (model,) = json.loads((out / 'results.json').read_text())['models']
    result = model['suites']['imagenet_c_on_the_fly']
    assert result['protocol']['input_size'] == [3, 64, 64] and result['protocol']['standard'] is False
    assert result['labels'] == "the model's classes (its training run's)"
    assert result['corruptions']['gaussian_noise']['severities']['1']['count'] == 8
    assert model['precision']['autocast'] == 'bfloat16'
    assert '(non-standard)' in (out / 'results.md').read_text()


def test_run_precision_is_trainings_autocast():
    """tools/train.py validates under its training autocast: amp_dtype as recorded, unset: bfloat16 on CPU and
    float16 on CUDA (lsvision.train.engine._optimization); amp off: float32 whatever amp_dtype says."""
    assert TrainingRun(dict(model='m', amp=True), 'x').autocast_dtype('cpu') == 'bfloat16'
    assert TrainingRun(dict(model='m', amp=True), 'x').autocast_dtype('cuda') == 'float16'
    assert TrainingRun(dict(model='m', amp=True, amp_dtype='float16'), 'x').autocast_dtype('cpu') == 'float16'
    assert TrainingRun(dict(model='m', amp=False, amp_dtype='bfloat16'), 'x').autocast_dtype('cuda') is None
