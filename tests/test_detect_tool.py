"""tools/detect.py: config and flag handling with its error messages (each hint followed), exact resume, and
evaluation under two processes (torchrun, gloo) equal to one. A tiny CvT-LS Mask R-CNN on 64 x 64 generated shapes."""
import json
import logging
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _helpers import ROOT, TINY_CONFIGS, free_port, load_tool, model_kwargs_args, run_as_two_processes, torchrun

from lsvision.data.coco_shapes import generate_coco_shapes
from lsvision.detection.data import CocoDataError
from lsvision.detection.engine import DetectionSetupError

detect = load_tool('detect')

TINY = ['--model', 'cvt_ls_13', '--model-kwargs', *model_kwargs_args(TINY_CONFIGS['cvt_ls_13']),
        '--fpn-channels', '16', '--min-size', '64', '--max-size', '64', '--batch-size', '2', '--workers', '0',
        '--threads', '1', '--warmup-iters', '2', '--lr', '1e-3', '--log-interval', '1',
        '--detector-kwargs', 'rpn_pre_nms_top_n_train=100', 'rpn_post_nms_top_n_train=50',
        'rpn_pre_nms_top_n_test=100', 'rpn_post_nms_top_n_test=50', 'box_batch_size_per_image=16',
        'box_detections_per_img=10']


@pytest.fixture(scope='module')
def shapes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('shapes')
    generate_coco_shapes(str(root), num_train=4, num_val=3, image_size=(64, 64), object_sizes=(12, 30), seed=2)
    return root


def _train(shapes: Path, out: Path, *extra: str) -> dict:
    argv = ['--data-dir', str(shapes), '--train-split', 'train', '--val-split', 'val', '--output', str(out), *TINY,
            *extra]
    assert detect.main(argv) == 0
    return json.loads((out / 'run' / 'result.json').read_text())


def test_resume_is_exact(shapes, tmp_path, caplog):
    # under bfloat16 autocast (the CPU's AMP), which the resumed run takes from the recorded arguments
    straight = _train(shapes, tmp_path / 'a', '--epochs', '2', '--experiment', 'run', '--amp')
    _train(shapes, tmp_path / 'b', '--epochs', '1', '--experiment', 'run', '--amp')
    resumed = tmp_path / 'b' / 'run' / 'last.pth.tar'
    caplog.set_level(logging.INFO)
    assert detect.main(['--resume', str(resumed), '--epochs', '2']) == 0  # the flag beats the recorded epochs
    assert f'resumed at update 2 (epoch 1, batch 0 of it) from {resumed}' in caplog.text
    end = json.loads((tmp_path / 'b' / 'run' / 'result.json').read_text())
    a = torch.load(tmp_path / 'a' / 'run' / 'last.pth.tar', weights_only=True)
    b = torch.load(resumed, weights_only=True)
    assert (a['next_epoch'], a['num_updates']) == (b['next_epoch'], b['num_updates']) == (2, 4)
    for key, value in a['state_dict'].items():
        assert torch.equal(value, b['state_dict'][key]), key
    assert end['history'][1]['train_loss'] == straight['history'][1]['train_loss']
    assert end['metrics'] == straight['metrics']
    assert set(straight['metrics']) == {'bbox', 'segm'} and straight['metrics']['bbox']['images'] == 3
    report = (tmp_path / 'a' / 'run' / 'report.md').read_text()
    assert '| box |' in report and '| mask |' in report and 'pycocotools' in report
    # reports are plain files like the checkpoints: 0666 less the umask (not mkstemp's 0600)
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / 'a' / 'run').iterdir() if p.is_file()}
    assert {'last.pth.tar', 'result.json', 'report.md', 'args.yaml', 'detections.json'} <= set(modes)
    assert set(modes.values()) == {0o666 & ~umask}, modes
    # killed mid-epoch: the recovery checkpoint of update 3 (epoch 1, batch 1 of 2) resumes to the same weights
    with pytest.raises(SystemExit, match='stopped after 3 updates'):
        _train(shapes, tmp_path / 'c', '--epochs', '2', '--experiment', 'run', '--amp', '--recovery-interval', '1',
               '--stop-after-updates', '3')
    recovery = tmp_path / 'c' / 'run' / 'recovery.pth.tar'
    assert torch.load(recovery, weights_only=True)['next_batch'] == 1
    assert detect.main(['--resume', str(recovery)]) == 0
    c = torch.load(tmp_path / 'c' / 'run' / 'last.pth.tar', weights_only=True)
    assert all(torch.equal(value, c['state_dict'][key]) for key, value in a['state_dict'].items())
    history = json.loads((tmp_path / 'c' / 'run' / 'result.json').read_text())['history']
    untimed = [[{k: v for k, v in epoch.items() if k != 'train_seconds'} for epoch in h]
               for h in (history, end['history'])]
    assert untimed[0] == untimed[1]  # the epoch's mean losses too
    # stopped by the time budget after its first update: its recovery checkpoint resumes to the same weights
    _train(shapes, tmp_path / 'd', '--epochs', '2', '--experiment', 'run', '--amp', '--time-budget', '1e-9')
    assert detect.main(['--resume', str(tmp_path / 'd' / 'run' / 'recovery.pth.tar'), '--time-budget', '0']) == 0
    d = torch.load(tmp_path / 'd' / 'run' / 'last.pth.tar', weights_only=True)
    assert all(torch.equal(value, d['state_dict'][key]) for key, value in a['state_dict'].items())
    # --checkpoint takes the detector (and data, amp) the checkpoint records; a flag that changes it is explained
    assert detect.main(['--eval-only', '--checkpoint', str(resumed), '--output', str(tmp_path / 'eval')]) == 0
    assert json.loads((tmp_path / 'eval' / 'result.json').read_text())['metrics'] == end['metrics']
    with pytest.raises(DetectionSetupError, match='drop the flags and -c that change the detector'):
        detect.run(detect.parse_args(['--eval-only', '--checkpoint', str(resumed), '--fpn-channels', '8']))
    recorded = yaml.safe_load((tmp_path / 'a' / 'run' / 'args.yaml').read_text())
    assert (recorded['epochs'], recorded['amp']) == (2, True)


def test_a_warmup_longer_than_the_run_is_warned_and_progress_comes_on_a_clock(shapes, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    _train(shapes, tmp_path, '--epochs', '1', '--experiment', 'run', '--warmup-iters', '5', '--log-interval', '1000',
           '--log-interval-s', '0')
    assert ('--warmup-iters 5 is not shorter than the run (2 updates): the lr rises from 1e-06 and never reaches '
            '0.001; lower --warmup-iters (the run: --epochs 1 of 2 updates)') in caplog.text
    # --log-interval 1000 alone: one line at the epoch's end; the clock (0 s here): one after every update
    assert [r.getMessage().split(':')[0] for r in caplog.records if r.getMessage().startswith('epoch 0 (1 of 1) ')] \
        == ['epoch 0 (1 of 1) 1/2', 'epoch 0 (1 of 1) 2/2']


def test_torchrun_training_and_evaluation(shapes, tmp_path):
    """Two processes (torchrun, gloo) train a GRC backbone and evaluate; one process scoring the saved weights gives
    the same metrics and detections. Rank 1 scores its half with its own weights and caches, so this holds only if
    DDP and the per-update cache averaging keep both processes' states equal."""
    grc = ['--model', 'pvt_tiny_grc', '--model-kwargs', *model_kwargs_args(TINY_CONFIGS['pvt_tiny_grc'])]
    data = ['--data-dir', str(shapes), '--train-split', 'train', '--val-split', 'val', *TINY, *grc]
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT))
    done = torchrun(['--nproc_per_node', '2', '--master_port', str(free_port()), str(ROOT / 'tools' / 'detect.py'),
                     *data, '--batch-size', '1', '--epochs', '1', '--device', 'cpu', '--output', str(tmp_path),
                     '--experiment', 'two'], tmp_path / 'logs', env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count('box AP') == 1  # rank 0 reports
    weights = tmp_path / 'two' / 'last.pth.tar'
    assert torch.load(weights, weights_only=True)['num_updates'] == 2  # 4 images, 2 processes x 1
    assert detect.main(data + ['--eval-only', '--checkpoint', str(weights), '--output', str(tmp_path / 'one')]) == 0
    two, one = (json.loads((tmp_path / name / 'result.json').read_text()) for name in ('two', 'one'))
    assert two['processes'] == 2 and one['processes'] == 1
    assert one['metrics'] == two['metrics'] and one['metrics']['bbox']['detections'] > 0
    detections = [json.loads((tmp_path / name / 'detections.json').read_text()) for name in ('one', 'two')]
    assert detections[0] == detections[1]
    assert sorted({d['image_id'] for d in detections[0]}) == [1, 2, 3]  # every image, once


def test_config_and_flags(tmp_path):
    config = tmp_path / 'recipe.yaml'
    config.write_text('model: cvt_ls_13\nlr: 0.5\ndecay_milestones: [3, 4]\namp: true\n')
    for flag in ('-c', '--config'):
        args = detect.parse_args([flag, str(config), '--data-dir', 'x'])
        assert (args.lr, args.decay_milestones, args.amp, args.epochs) == (0.5, [3, 4], True, 12)
        assert args.config == str(config)
    args = detect.parse_args(['-c', str(config), '--data-dir', 'x', '--lr', '0.25', '--no-amp',
                              '--decay-milestones', '9'])
    assert (args.lr, args.decay_milestones, args.amp) == (0.25, [9], False)  # flags beat the config
    demo = detect.parse_args([])  # no config and no data: the demo preset
    assert demo.data_dir == '' and demo.config == detect.DEMO_CONFIG and demo.time_budget > 0


def test_help_gives_the_defaults_of_a_data_dir_run_and_the_demo_preset_apart(capsys):
    with pytest.raises(SystemExit):
        detect.parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    options, preset = text.split('Without --data-dir, -c and a run to continue (--resume, or a --checkpoint that '
                                 'records its arguments), the demo preset')
    for flag, default in (('--model MODEL', ''), ('--min-size MIN_SIZE', '800'), ('--time-budget SECONDS', '0')):
        described = options[options.index(f'{flag} '):]  # its help, up to the first default shown
        assert described[described.index('(default:'):].startswith(f'(default: {default})'), flag
    args = detect.parse_args(['--data-dir', 'x', '--model', 'cvt_ls_13'])
    assert (args.min_size, args.time_budget) == (800, 0)  # what the help says
    assert 'configs/detection/mask_rcnn_shapes_demo.yaml replaces these defaults' in preset
    demo = detect.parse_args([])
    for flag in (f'--model {demo.model},', f'--min-size {demo.min_size},', f'--time-budget {demo.time_budget:g},',
                 'depths=[1,1,2]'):
        assert flag in preset, flag


def test_recipes_are_the_pvt_1x_schedule():
    recipes = sorted((ROOT / 'configs' / 'detection').glob('mask_rcnn_*_1x.yaml'))
    assert {'mask_rcnn_cvt_ls_13_1x.yaml', 'mask_rcnn_pvt_small_grc_1x.yaml'} <= {p.name for p in recipes}
    for path in recipes:
        args = detect.parse_args(['-c', str(path), '--data-dir', '/data/coco'])
        assert (args.epochs, args.opt, args.lr, args.weight_decay, args.decay_milestones) == (12, 'adamw', 1e-4, 1e-4,
                                                                                             [8, 11]), path.name
        assert (args.min_size, args.max_size, args.detector) == (800, 1333, 'mask_rcnn') and args.model in path.name


def _error(capsys, argv) -> str:
    assert detect.main(argv) == 2
    return capsys.readouterr().err


def test_non_finite_loss_stops_the_run(shapes, tmp_path, caplog):
    argv = ['--data-dir', str(shapes), '--train-split', 'train', '--val-split', 'val', '--output', str(tmp_path),
            *TINY, '--lr', '1e10', '--warmup-iters', '0', '--batch-size', '1', '--epochs', '2']
    assert detect.main(argv) == 1
    assert 'the training loss is nan at update' in caplog.text and 'Lower --lr' in caplog.text


def test_errors_say_what_to_do(tmp_path, capsys, caplog, shapes):
    config = tmp_path / 'typo.yaml'
    config.write_text('model: cvt_ls_13\nlearning_rate: 0.1\n')
    err = _error(capsys, ['-c', str(config)])
    assert "unknown key 'learning_rate'" in err and 'tools/detect.py --help' in err
    config.write_text('model: cvt_ls_13\nlr: fast\n')
    assert 'lr: expected float' in _error(capsys, ['-c', str(config)])
    assert 'no backbone: give --model' in _error(capsys, ['--data-dir', str(shapes)])
    recipe = str(ROOT / 'configs' / 'detection' / 'mask_rcnn_cvt_ls_13_1x.yaml')
    assert 'no data: give --data-dir' in _error(capsys, ['-c', recipe])
    assert 'no such file' in _error(capsys, ['--resume', str(tmp_path / 'nope.pth.tar')])
    data = ['--data-dir', str(shapes), '--train-split', 'train', '--val-split', 'val', *TINY, '--eval-only']
    with pytest.raises(CocoDataError, match='pass --num-classes 4'):
        detect.run(detect.parse_args(data + ['--num-classes', '81']))
    assert detect.main(data + ['--num-classes', '4']) == 0  # the hint, followed
    broken = tmp_path / 'broken'
    shutil.copytree(shapes, broken)
    (broken / 'val' / '000002.png').write_text('not an image')
    # and a box wholly outside its image: counted, and named in the log and the report
    val_file = broken / 'annotations' / 'instances_val.json'
    coco = json.loads(val_file.read_text())
    coco['annotations'].append(dict(id=999, image_id=1, category_id=coco['categories'][0]['id'], area=16.0,
                                    bbox=[70, 10, 4, 4], iscrowd=0, segmentation=[[70, 10, 74, 10, 74, 14]]))
    val_file.write_text(json.dumps(coco))
    argv = ['--data-dir', str(broken), *data[2:], '--output', str(tmp_path / 'skipped')]
    assert detect.main(argv) == 2
    assert 'unreadable image: image 2 (000002.png)' in caplog.text and '--skip-bad-images' in caplog.text
    assert detect.main(argv + ['--skip-bad-images']) == 0  # the hint, followed: scored without that image
    report = json.loads((tmp_path / 'skipped' / 'result.json').read_text())
    assert report['val']['left_out_images'] == [2] and report['metrics']['bbox']['images'] == 2
    markdown = (tmp_path / 'skipped' / 'report.md').read_text()
    assert 'Left out as bad input (1 images): unreadable image: image 2' in markdown
    named = 'annotation 999: bbox [70, 10, 4, 4] lies wholly outside the 64x64 image'
    assert f'val: 1 degenerate box(es): image 1 (000001.png), {named}' in caplog.text
    assert f'Val split: 1 degenerate box(es): image 1 (000001.png), {named}' in markdown
    assert report['val']['degenerate_boxes'] == 1 and report['val']['degenerate_examples'][0]['annotation_id'] == 999
    with pytest.raises(DetectionSetupError, match='did you mean cvt_ls_13'):
        detect.run(detect.parse_args(data + ['--model', 'cvt_ls13']))
    # no released weights: no traceback, the fix in detect.py's flags, then the Python route
    caplog.clear()
    assert detect.main(data + ['--backbone-weights', 'pretrained']) == 2
    assert 'cvt_ls_13 has no released weights. Fix: give a weights file of cvt_ls_13, --backbone-weights FILE' in \
        caplog.text and "--backbone-weights ''.\nIn Python (library users): backbone_weights=" in caplog.text


def test_documented_commands_parse(monkeypatch):
    """Every `tools/detect.py ...` line of the README, the Makefile, docs/detection.md and the tool's docstring
    parses with the current tool (lines with placeholders, <run> or ..., left out)."""
    commands = []
    texts = [(ROOT / name).read_text() for name in ('README.md', 'Makefile', 'docs/detection.md')] + [detect.__doc__]
    for text in texts:
        text = re.sub(r'\\+\n\s*', ' ', text)  # continued lines
        commands += [m.group(1) for m in re.finditer(r'(?:python|torchrun[^`\n]*) tools/detect\.py([^`\n#]*)', text)]
    monkeypatch.chdir(ROOT)  # the commands' config paths are relative to the checkout
    checked = 0
    for line in commands:
        if '<' in line or '...' in line or '--help' in line:
            continue
        args = detect.parse_args(shlex.split(line))
        assert args.model, line
        checked += 1
    assert checked >= 4


def test_two_processes_evaluate_with_rank_0s_batchnorm_statistics(shapes, tmp_path):
    """Two processes (gloo; forked, so no second import of torch) train the tiny CvT-LS, whose convolutional
    projections have BatchNorm, for one update and evaluate, each scoring a shard: the same detections as one process
    scoring the saved weights. Each process's BatchNorm running statistics follow its own batch in training, so this
    holds only if every process scores with rank 0's (those the checkpoint holds)."""
    argv = ['--data-dir', str(shapes), '--train-split', 'train', '--val-split', 'val', *TINY, '--epochs', '1',
            '--device', 'cpu', '--detector', 'faster_rcnn', '--output', str(tmp_path), '--experiment', 'two']
    run_as_two_processes(detect.main, argv)
    weights = tmp_path / 'two' / 'last.pth.tar'
    assert torch.load(weights, weights_only=True)['num_updates'] == 1  # 4 images, 2 processes x batch 2
    one = ['--eval-only', '--checkpoint', str(weights), '--output', str(tmp_path / 'one')]
    assert detect.main([*argv[:-4], *one]) == 0
    two, one = (json.loads((tmp_path / name / 'detections.json').read_text()) for name in ('two', 'one'))
    assert two == one and sorted({d['image_id'] for d in one}) == [1, 2, 3]
