"""tools/segment.py: exact resume (from a checkpoint mid-run and across an epoch's end), evaluation of a saved
checkpoint (whole-image and a covering sliding window agree), two processes training and evaluating as one, recipes,
and the errors with their hints. A tiny CvT-LS Semantic FPN on generated shapes of 40 x 48."""
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from _helpers import ROOT, TINY_CONFIGS, load_tool, model_kwargs_args, run_as_two_processes

from lsvision.data.coco_shapes import generate_semantic_shapes
from lsvision.segmentation.engine import SegmentationSetupError

segment = load_tool('segment')

TINY = ['--model', 'cvt_ls_13', '--model-kwargs', *model_kwargs_args(TINY_CONFIGS['cvt_ls_13']),
        '--head-kwargs', 'fpn_channels=8', 'channels=8', '--dataset', 'folder', '--crop-size', '32', '32',
        '--train-scale', '48', '40', '--test-scale', '--batch-size', '2', '--workers', '0', '--threads', '1',
        '--lr', '1e-3', '--log-interval', '1', '--eval-interval', '0']


@pytest.fixture(scope='module')
def shapes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('shapes')
    generate_semantic_shapes(str(root), num_train=5, num_val=3, image_size=(40, 48), object_sizes=(10, 24), seed=2)
    return root


def _train(shapes: Path, out: Path, *extra: str) -> dict:
    assert segment.main(['--data-dir', str(shapes), '--output', str(out), '--experiment', 'run', *TINY, *extra]) == 0
    return json.loads((out / 'run' / 'result.json').read_text())


def test_resume_is_exact(shapes, tmp_path):
    """5 images, batches of 2: two batches an epoch (the fifth image dropped), so 5 iterations cross two epoch ends.
    Killed after iteration 3 (its checkpoint mid-epoch) and resumed: the same weights, losses and metrics. Under
    bfloat16 autocast (the CPU's AMP), which the resumed run takes from the recorded arguments."""
    straight = _train(shapes, tmp_path / 'a', '--iters', '5', '--checkpoint-interval', '1', '--amp')
    with pytest.raises(SystemExit, match='stopped after 3 iterations'):
        _train(shapes, tmp_path / 'b', '--iters', '5', '--checkpoint-interval', '1', '--amp',
               '--stop-after-updates', '3')
    last = tmp_path / 'b' / 'run' / 'last.pth.tar'
    state = torch.load(last, weights_only=True)
    assert (state['iters'], state['epoch'], state['batch']) == (3, 1, 1)
    assert segment.main(['--resume', str(last)]) == 0
    resumed = json.loads((tmp_path / 'b' / 'run' / 'result.json').read_text())
    a = torch.load(tmp_path / 'a' / 'run' / 'last.pth.tar', weights_only=True)
    b = torch.load(last, weights_only=True)
    assert (a['iters'], a['epoch'], a['batch']) == (b['iters'], b['epoch'], b['batch']) == (5, 2, 1)
    assert all(torch.equal(v, b['state_dict'][k]) for k, v in a['state_dict'].items())
    assert resumed['history'] == straight['history'] and resumed['metrics'] == straight['metrics']
    m = straight['metrics']
    assert m['images'] == 3 and len(m['IoU']) == 4 and m['classes'][0] == 'background'
    report = (tmp_path / 'a' / 'run' / 'report.md').read_text()
    assert '| mIoU | mAcc | aAcc |' in report and '| background |' in report and 'Trained 5 iterations' in report
    # the recorded model and data, evaluated whole and by a window that covers every image: the same numbers
    for mode in (['--test-mode', 'whole'], ['--test-mode', 'slide', '--test-crop', '64', '64']):
        out = tmp_path / ('eval-' + mode[1])
        assert segment.main(['--eval-only', '--checkpoint', str(last), '--output', str(out), *mode]) == 0
        assert json.loads((out / 'result.json').read_text())['metrics'] == resumed['metrics']
    with pytest.raises(SegmentationSetupError, match='drop the flags and -c that change the segmentor'):
        segment.run(segment.parse_args(['--eval-only', '--checkpoint', str(last), '--head-kwargs', 'channels=4']))


def test_two_processes_train_and_evaluate_as_one(shapes, tmp_path):
    """Two processes (gloo; forked, so no second import of torch) train UperNet with BatchNorm on a GRC backbone and
    evaluate, each scoring a shard; one process scoring the saved checkpoint gets every number equal. This holds only
    if DDP, the per-update GRC cache averaging and the BatchNorm statistics keep both processes' states equal, and
    the per-class counts of the two shards are summed."""
    grc = ['--model', 'pvt_tiny_grc', '--model-kwargs', *model_kwargs_args(TINY_CONFIGS['pvt_tiny_grc']),
           '--segmentor', 'upernet', '--head-kwargs', 'channels=8']
    argv = ['--data-dir', str(shapes), *TINY, *grc, '--iters', '2', '--device', 'cpu',
            '--output', str(tmp_path), '--experiment', 'two']
    run_as_two_processes(segment.main, argv)
    weights = tmp_path / 'two' / 'last.pth.tar'
    assert torch.load(weights, weights_only=True)['iters'] == 2
    data = ['--data-dir', str(shapes), *TINY, *grc]
    assert segment.main(data + ['--eval-only', '--checkpoint', str(weights), '--output', str(tmp_path / 'one')]) == 0
    two, one = (json.loads((tmp_path / name / 'result.json').read_text()) for name in ('two', 'one'))
    assert (two['processes'], one['processes']) == (2, 1)
    assert one['metrics'] == two['metrics'] and one['metrics']['images'] == 3


def _error(capsys, argv) -> str:
    assert segment.main(argv) == 2
    return capsys.readouterr().err


def test_errors_say_what_to_do(shapes, tmp_path, capsys, caplog):
    config = tmp_path / 'typo.yaml'
    config.write_text('model: cvt_ls_13\nlearning_rate: 0.1\n')
    err = _error(capsys, ['-c', str(config)])
    assert "unknown key 'learning_rate'" in err and 'tools/segment.py --help' in err
    assert 'no backbone: give --model' in _error(capsys, ['--data-dir', str(shapes)])
    recipe = str(ROOT / 'configs' / 'segmentation' / 'semantic_fpn_cvt_ls_13_ade20k_40k.yaml')
    assert 'no data: give --data-dir' in _error(capsys, ['-c', recipe])
    assert 'no such file' in _error(capsys, ['--resume', str(tmp_path / 'nope.pth.tar')])
    bare = tmp_path / 'bare'
    (bare / 'images' / 'val').mkdir(parents=True)
    (bare / 'masks' / 'val').mkdir(parents=True)
    for name in ('000001', '000002'):
        os.link(shapes / 'images' / 'val' / f'{name}.png', bare / 'images' / 'val' / f'{name}.png')
    os.link(shapes / 'masks' / 'val' / '000001.png', bare / 'masks' / 'val' / '000001.png')
    argv = ['--data-dir', str(bare), *TINY, '--eval-only', '--output', str(tmp_path / 'skipped')]
    with pytest.raises(SegmentationSetupError, match='--class-names NAME'):
        segment.run(segment.parse_args(argv))
    argv += ['--class-names', 'background', 'square', 'circle', 'triangle']  # the hint, followed
    assert segment.main(argv) == 2
    assert f'missing mask: {bare}/images/val/000002.png' in caplog.text and '--skip-bad-images' in caplog.text
    assert segment.main(argv + ['--skip-bad-images']) == 0  # the hint, followed: scored without that image
    report = json.loads((tmp_path / 'skipped' / 'result.json').read_text())
    assert report['val']['left_out'] == 1 and report['metrics']['images'] == 1
    assert 'Left out as bad input (1 images): missing mask' in (tmp_path / 'skipped' / 'report.md').read_text()
    upernet = ['--data-dir', str(shapes), *TINY, '--segmentor', 'upernet', '--output', str(tmp_path)]
    with pytest.raises(SegmentationSetupError, match='fpn_channels: the upernet head takes channels, pool_scales'):
        segment.run(segment.parse_args(upernet))
    with pytest.raises(SegmentationSetupError, match='--batch-size 2 or more, or --head-kwargs norm=gn'):
        segment.run(segment.parse_args(upernet + ['--head-kwargs', 'channels=8', '--batch-size', '1']))
    # no released weights: no traceback, the fix in segment.py's flags, then the Python route
    assert segment.main(argv + ['--backbone-weights', 'pretrained']) == 2
    assert 'cvt_ls_13 has no released weights. Fix: give a weights file of cvt_ls_13, --backbone-weights FILE' in \
        caplog.text
    with pytest.raises(SegmentationSetupError, match='did you mean cvt_ls_13'):
        segment.run(segment.parse_args(argv + ['--model', 'cvt_ls13']))


def test_recipes_and_documented_commands(monkeypatch):
    """The ADE20K recipes are PVT's Semantic FPN schedule (AdamW 1e-4, poly 0.9, 40k iterations, 16 images per
    update over 8 processes, 512 x 512 crops); no arguments: the demo; every `tools/segment.py` line of the docs
    parses."""
    recipes = sorted((ROOT / 'configs' / 'segmentation').glob('*_ade20k_40k.yaml'))
    assert {'semantic_fpn_cvt_ls_13_ade20k_40k.yaml', 'semantic_fpn_pvt_small_ade20k_40k.yaml'} <= {
        p.name for p in recipes}
    for path in recipes:
        args = segment.parse_args(['-c', str(path), '--data-dir', '/data/ade'])
        assert (args.iters, args.opt, args.lr, args.weight_decay, args.poly_power) == (40000, 'adamw', 1e-4, 1e-4,
                                                                                       0.9), path.name
        assert (args.batch_size * 8, args.crop_size, args.dataset) == (16, [512, 512], 'ade20k')
        assert args.model in path.name and args.segmentor in path.name
    demo = segment.parse_args([])  # no config and no data: the demo preset, scored before and after training
    assert demo.data_dir == '' and demo.config == segment.DEMO_CONFIG and demo.time_budget > 0 and demo.eval_untrained
    commands = []
    texts = [(ROOT / name).read_text() for name in ('README.md', 'Makefile', 'docs/segmentation.md')]
    for text in texts + [segment.__doc__]:
        text = re.sub(r'\\+\n\s*', ' ', text)
        commands += [m.group(1) for m in re.finditer(r'(?:python|torchrun[^`\n]*) tools/segment\.py([^`\n#]*)', text)]
    monkeypatch.chdir(ROOT)
    checked = [segment.parse_args(shlex.split(line)) for line in commands if '<' not in line and '...' not in line]
    assert len(checked) >= 3 and all(args.model for args in checked)
