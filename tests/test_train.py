"""tools/train.py and lsvision.train: configs, exact mid-epoch resume, DDP with torchrun, bad data."""
import contextlib
import csv
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from _helpers import load_tool, run_script, torchrun, write_two_class_images
from PIL import Image

import lsvision
from lsvision.data import DIGITS_CLASSES, export_digits
from lsvision.train import (
    ConfigError,
    NonFiniteLossError,
    TrainSetupError,
    build_parser,
    load_checkpoint,
    load_config,
    parse_args,
    run,
)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / 'tools' / 'train.py'
# a 2-stage-LS CvT small enough for a CPU test: 16x16 input -> maps 4 / 2 / 1
TINY_MODEL = [
    '--model', 'cvt_ls_13', '--num-classes', '2', '--input-size', '3', '16', '16', '--model-kwargs',
    'embed_dims=(16,32,32)', 'num_heads=(1,1,1)', 'depths=(1,1,1)', 'patch_sizes=(5,3,3)', 'patch_strides=(4,2,2)',
    'patch_paddings=(2,1,1)', 'window_sizes=(2,1,1)', 'dp_ranks=(2,1,1)',
    '--mean', '0.5', '0.5', '0.5', '--std', '0.5', '0.5', '0.5', '--crop-pct', '1.0', '--threads', '1',
    '--opt', 'adamw', '--lr', '1e-3', '--warmup-epochs', '0', '--seed', '3', '--progress', 'log',
]


@pytest.fixture(scope='module')
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('images')
    write_two_class_images(root)
    return root


def _final_rows(summary: Path):
    with open(summary) as f:
        return list(csv.DictReader(f))


def test_every_registered_model_has_a_config_that_loads():
    parser = build_parser()
    for name in lsvision.models.list_models():
        path = ROOT / 'configs' / f'{name}.yaml'
        assert path.is_file(), f'{name} has no configs/{name}.yaml (run tools/make_configs.py)'
        cfg = load_config(str(path), parser)
        assert cfg['model'] == name
        args = parse_args(['-c', str(path)])
        assert args.model == name and args.opt == 'adamw' and args.epochs == 300 and args.lr_base > 0
    demo = load_config(str(ROOT / 'configs' / 'digits_demo.yaml'), parser)
    assert demo['model'] in lsvision.models.list_models()


def test_config_sets_defaults_and_command_line_overrides_it(tmp_path):
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(dict(model='cvt_ls_13', batch_size=32, lr_base='1e-3', mixup=0.8,
                                        model_kwargs=dict(depths=[1, 1, 1]))))
    args = parse_args(['-c', str(path), '--batch-size', '8'])
    assert args.batch_size == 8 and args.lr_base == 1e-3 and args.mixup == 0.8
    assert args.model_kwargs == {'depths': [1, 1, 1]}
    args = parse_args(['-c', str(path), '--model-kwargs', 'num_heads=(1,2,4)'])
    assert args.model_kwargs == {'depths': [1, 1, 1], 'num_heads': (1, 2, 4)}


@pytest.mark.parametrize('cfg, message', [
    (dict(model='cvt_ls_13', batch_sise=32), "unknown key 'batch_sise'"),
    (dict(model='cvt_ls_13', lr_base='fast'), 'lr_base: expected float'),
    (dict(model='cvt_ls_13', amp='yes'), 'amp: expected true or false'),
    (dict(model='cvt_ls_13', input_size=[3, 224]), 'input_size: expected a list of 3'),
])
def test_bad_config_is_a_clear_error(tmp_path, cfg, message):
    path = tmp_path / 'bad.yaml'
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=message) as e:
        parse_args(['-c', str(path)])
    assert str(path) in str(e.value)
    if 'batch_sise' in cfg:
        assert 'did you mean batch_size' in str(e.value)
        # the tool prints it as one line and exits 2, before any training starts
        assert load_tool('train').main(['-c', str(path)]) == 2


def _train_args(image_root: Path, out: Path, *extra: str):
    return [str(image_root), '--output', str(out), '--experiment', 'run', *TINY_MODEL, *extra]


def test_killed_mid_epoch_and_resumed_equals_uninterrupted(image_root, tmp_path):
    # 24 images, batch 4 -> 6 batches, 3 updates per epoch (accumulation 2); EMA, drop path, mixup, random
    # erasing and RandAugment all draw random numbers, and a worker process loads the data
    common = ['--epochs', '2', '-b', '4', '--grad-accum-steps', '2', '--model-ema', '--model-ema-decay', '0.9',
              '--drop-path', '0.1', '--mixup', '0.2', '--reprob', '0.5', '--aa', 'rand-m5', '-j', '1',
              '--recovery-interval', '2', '--log-interval', '1']
    full = run(parse_args(_train_args(image_root, tmp_path / 'full', *common)))
    assert full['epochs_done'] == 2 and full['num_updates'] == 6

    killed = run_script(
        [sys.executable, str(TRAIN), *_train_args(image_root, tmp_path / 'cut', *common), '--stop-after-steps', '4'],
        timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert killed.returncode == 3, killed.stderr[-3000:]
    recovery = tmp_path / 'cut' / 'run' / 'recovery.pth.tar'
    state = load_checkpoint(str(recovery))  # weights_only=True
    assert (state['next_epoch'], state['next_batch'], state['num_updates']) == (1, 2, 4)  # mid epoch 1 (from 0)

    resumed = run(parse_args(_train_args(image_root, tmp_path / 'cut', *common, '--resume', str(recovery))))
    assert resumed['num_updates'] == 6
    # result.json: run totals (both sessions, as the uninterrupted run's), this session's under `session`
    assert resumed['samples_seen'] == full['samples_seen'] == 48 and full['session']['resumed_from'] is None
    session = resumed['session']
    assert (session['resumed_from'], session['updates'], session['samples_seen']) == (str(recovery), 2, 16)
    assert resumed['train_seconds'] >= session['train_seconds'] and resumed['total_seconds'] > session['total_seconds']
    assert json.loads((tmp_path / 'cut' / 'run' / 'result.json').read_text())['session'] == session
    a = load_checkpoint(str(tmp_path / 'full' / 'run' / 'last.pth.tar'))
    b = load_checkpoint(str(tmp_path / 'cut' / 'run' / 'last.pth.tar'))
    for key in ('state_dict', 'state_dict_ema'):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            torch.testing.assert_close(b[key][name], a[key][name], rtol=1e-5, atol=1e-6, msg=f'{key} {name}')
    assert a['optimizer']['state'][0]['step'] == b['optimizer']['state'][0]['step']
    # the same metrics: summary rows of the resumed run equal the uninterrupted run's
    rows_a = _final_rows(tmp_path / 'full' / 'run' / 'summary.csv')
    rows_b = _final_rows(tmp_path / 'cut' / 'run' / 'summary.csv')
    assert len(rows_a) == len(rows_b) == 2
    for ra, rb in zip(rows_a, rows_b):
        for k in ('train_loss', 'eval_loss', 'eval_top1'):
            assert math.isclose(float(ra[k]), float(rb[k]), rel_tol=1e-4, abs_tol=1e-5), (k, ra, rb)
    run_dir = tmp_path / 'full' / 'run'
    assert (run_dir / 'model_best.pth.tar').is_file() and (run_dir / 'args.yaml').is_file()
    assert not (run_dir / 'recovery.pth.tar').exists()  # superseded by last.pth.tar at the epoch end
    assert not list(run_dir.glob('*.tmp-*'))
    replay = parse_args(['-c', str(run_dir / 'args.yaml')])  # args.yaml is a valid config
    assert replay.grad_accum_steps == 2 and replay.model_kwargs['depths'] == [1, 1, 1]


def test_two_process_torchrun_gloo(image_root, tmp_path):
    proc = torchrun(['--standalone', '--nproc_per_node=2', str(TRAIN),
                     *_train_args(image_root, tmp_path, '--epochs', '1', '-b', '4', '-j', '0', '--log-interval', '1',
                                  '--sync-bn')],
                    tmp_path.parent / f'{tmp_path.name}_logs',
                    dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert 'backend gloo' in proc.stderr
    assert 'weights identical on all 2 processes' in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['run']  # both ranks use rank 0's run directory
    rows = _final_rows(tmp_path / 'run' / 'summary.csv')
    assert len(rows) == 1 and math.isfinite(float(rows[0]['train_loss']))
    state = load_checkpoint(str(tmp_path / 'run' / 'last.pth.tar'))
    assert state['num_updates'] == 3  # 24 images / (2 processes x 4)
    assert all(torch.isfinite(v).all() for v in state['state_dict'].values() if v.is_floating_point())


def test_corrupt_image_is_skipped_with_a_warning_naming_it(image_root, tmp_path, caplog):
    root = tmp_path / 'data'
    shutil.copytree(image_root, root)
    bad = root / 'train' / 'class1' / '005.png'
    bad.write_bytes(b'not a png at all')
    truncated = root / 'train' / 'class0' / '007.png'
    truncated.write_bytes(truncated.read_bytes()[:60])
    with caplog.at_level(logging.WARNING):
        result = run(parse_args(_train_args(root, tmp_path / 'out', '--epochs', '1', '-b', '4', '-j', '0')))
    assert result['num_updates'] == 6 and math.isfinite(result['eval_loss'])
    for path in (bad, truncated):
        assert any(f'skipping unreadable image {path}' in r.getMessage() for r in caplog.records), caplog.text


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(image_root, tmp_path, caplog):
    # epoch 0 trains normally (lr 1e-3); at epoch 1 the lr jumps to 1e30 (step schedule), the weights blow up
    args = parse_args(_train_args(image_root, tmp_path, '--epochs', '3', '-b', '4', '-j', '0', '--opt', 'sgd',
                                  '--sched', 'multistep', '--decay-milestones', '1', '--decay-rate', '1e33',
                                  '--lr', '1e-3', '--log-interval', '1'))
    with caplog.at_level(logging.INFO), pytest.raises(NonFiniteLossError, match='non-finite training loss') as e:
        run(args)
    # batches are counted from 1, as in the progress lines: the bad batch is the one after the last line
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith('epoch 1 (2 of 3) [')]
    good = int(progress[-1].split('[')[1].split('/')[0]) if progress else 0
    assert f'at epoch 1 (2 of 3), batch {good + 1}/6 ' in str(e.value)
    assert f'found at batch {good + 1}/6' in str(e.value)
    last = tmp_path / 'run' / 'last.pth.tar'
    assert f'Last good checkpoint: {last}' in str(e.value)
    state = load_checkpoint(str(last))
    assert state['next_epoch'] == 1
    assert all(torch.isfinite(v).all() for v in state['state_dict'].values() if v.is_floating_point())


def test_digits_export(tmp_path):
    info = export_digits(str(tmp_path / 'digits'), img_size=16)
    assert (info['num_train'], info['num_val']) == (1438, 359)
    counts = {c: len(list((tmp_path / 'digits' / 'val' / c).glob('*.png'))) for c in DIGITS_CLASSES}
    assert sum(counts.values()) == 359 and min(counts.values()) >= 35  # stratified: ~36 per class
    img = Image.open(next((tmp_path / 'digits' / 'train' / '3').glob('*.png')))
    assert img.size == (16, 16)
    assert export_digits(str(tmp_path / 'digits'), img_size=16) == info  # reused, not rewritten


def test_digits_export_by_several_processes_at_once_is_built_once(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import sklearn.datasets
    builds = []
    load = sklearn.datasets.load_digits
    monkeypatch.setattr(sklearn.datasets, 'load_digits', lambda: builds.append(1) or load())
    with ThreadPoolExecutor(3) as pool:  # three callers at once, as torchrun's ranks or parallel test workers
        infos = list(pool.map(lambda _: export_digits(str(tmp_path / 'digits'), img_size=12), range(3)))
    assert len(builds) == 1 and infos[0] == infos[1] == infos[2]  # one built it, the others waited and reused it
    assert len(list((tmp_path / 'digits').rglob('*.png'))) == 1797
    assert sorted(p.name for p in tmp_path.iterdir()) == ['digits', 'digits.lock']  # no temporary tree left


@pytest.mark.parametrize('num_repeats', [0, 3])
def test_resumable_sampler_order_depends_only_on_seed_and_epoch(num_repeats):
    from lsvision.train.data import ResumableSampler
    data = list(range(600))
    ranks = [ResumableSampler(data, num_replicas=2, rank=r, seed=7, num_repeats=num_repeats) for r in (0, 1)]
    for s in ranks:
        s.set_epoch(4)
    full = [list(s) for s in ranks]
    assert [pos for _, _, pos in full[0]] == list(range(len(full[0]))) and full[0][0][1] == 4
    if num_repeats:  # each index is augmented num_repeats times, spread over the ranks
        counts = np.bincount([i for s in full for i, _, _ in s], minlength=600)
        assert counts.max() <= num_repeats and len(full[0]) == len(full[1])
    else:  # a partition of the dataset
        assert sorted(i for s in full for i, _, _ in s) == data
    again = ResumableSampler(data, num_replicas=2, rank=0, seed=7, num_repeats=num_repeats)
    again.set_epoch(4, start=40)  # a resumed process skips what was trained
    assert list(again) == full[0][40:] and len(again) == len(full[0]) - 40
    again.set_epoch(5)
    assert [i for i, _, _ in again] != [i for i, _, _ in full[0]]


def test_time_budget_stops_evaluates_and_leaves_a_resumable_checkpoint(image_root, tmp_path):
    result = run(parse_args(_train_args(image_root, tmp_path, '--epochs', '2', '-b', '4', '-j', '0',
                                        '--time-budget', '1e-9')))
    assert result['stopped_by_time_budget'] and result['num_updates'] == 1
    assert math.isfinite(result['top1'])
    state = load_checkpoint(result['last_checkpoint'])
    assert (state['next_epoch'], state['next_batch']) == (0, 1)
    # --resume auto: the most advanced checkpoint of the run directory named by --experiment; the run's arguments
    # (its time budget too) are restored, so the budget is lifted explicitly
    resumed = run(parse_args(_train_args(image_root, tmp_path, '--epochs', '2', '-b', '4', '-j', '0',
                                         '--resume', 'auto', '--time-budget', '0')))
    assert resumed['output_dir'] == result['output_dir']
    assert resumed['num_updates'] == 12 and not resumed['stopped_by_time_budget']


@pytest.fixture(scope='module')
def one_epoch_run(image_root, tmp_path_factory) -> Path:
    """A finished 1-epoch run of the tiny CvT-LS (24 images, batch 4: 6 updates); returns its run directory."""
    out = tmp_path_factory.mktemp('one_epoch')
    run(parse_args(_train_args(image_root, out, '--epochs', '1', '-b', '4', '-j', '0')))
    return out / 'run'


def test_resume_alone_restores_the_run_and_names_what_the_command_line_changes(one_epoch_run, tmp_path, caplog):
    run_dir = tmp_path / 'run'
    shutil.copytree(one_epoch_run, run_dir)
    last = run_dir / 'last.pth.tar'
    args = parse_args(['--resume', str(last), '--epochs', '2'])  # nothing else: not the digits demo
    assert args.model == 'cvt_ls_13' and args.model_kwargs['depths'] == [1, 1, 1] and args.num_classes == 2
    assert args.data_dir and args.batch_size == 4 and args.resume_config == str(last)  # the checkpoint's record
    assert args.resume_overrides == ['epochs: 1 -> 2']
    with caplog.at_level(logging.INFO):
        result = run(args)
    assert result['num_updates'] == 12 and result['output_dir'] == str(run_dir)
    assert 'given on the command line: epochs: 1 -> 2' in caplog.text
    assert f'resumed {last}: at epoch 1 (2 of 2), 0 of its batches done, 6 updates' in caplog.text
    # --resume auto with the run's name, and args.yaml when a checkpoint records no arguments
    auto = parse_args(['--resume', 'auto', '--output', str(tmp_path), '--experiment', 'run'])
    assert auto.model == 'cvt_ls_13' and auto.epochs == 2 and auto.resume_config == str(run_dir / 'args.yaml')
    state = load_checkpoint(str(last))
    del state['args']
    torch.save(state, run_dir / 'old.pth.tar')
    assert parse_args(['--resume', str(run_dir / 'old.pth.tar')]).resume_config == str(run_dir / 'args.yaml')


def test_resume_with_another_model_is_refused_naming_both(one_epoch_run, capsys):
    last = str(one_epoch_run / 'last.pth.tar')
    with pytest.raises(ConfigError, match='that run trains cvt_ls_13, not --model cvt_13'):
        parse_args(['--resume', last, '--model', 'cvt_13'])
    assert load_tool('train').main(['--resume', last, '--model', 'cvt_13']) == 2
    assert 'cvt_ls_13' in capsys.readouterr().err


def test_checkpoint_of_another_model_is_a_short_error_naming_both(one_epoch_run, image_root, tmp_path, caplog):
    from lsvision.eval.cli import load_model
    from lsvision.models import CheckpointMismatchError
    last = str(one_epoch_run / 'last.pth.tar')
    # validate.py's loader: a plain model (torch's strict load) and a GRC model (the GRC filter's check)
    for name, kwargs in (('cvt_13', dict(embed_dims=(16, 32, 32), num_heads=(1, 1, 1), depths=(1, 1, 1))),
                         ('pvt_v2_b0_grc', dict(depths=(1, 1, 1, 1)))):
        with pytest.raises(CheckpointMismatchError) as e:
            load_model(name, last, model_kwargs=kwargs)
        message = str(e.value)
        assert len(message) < 1000, message
        assert f'does not fit {name} (it holds cvt_ls_13 weights)' in message and 'stages.0' in message
        assert 'GRC' not in message
    # train.py --initial-checkpoint and --pretrained-path: the same message, exit code 2, before training
    args = _train_args(image_root, tmp_path, '--epochs', '1', '-b', '4', '-j', '0')
    args[args.index('embed_dims=(16,32,32)')] = 'embed_dims=(16,32,48)'
    for flags in (['--initial-checkpoint', last], ['--pretrained', '--pretrained-path', last]):
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            assert load_tool('train').main(args + flags) == 2
        (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert 'does not fit cvt_ls_13 (it holds cvt_ls_13 weights of another configuration' in error
        assert 'other shape' in error and len(error) < 1000
    assert not (tmp_path / 'run' / 'last.pth.tar').exists()


def test_unknown_model_lists_close_names(image_root, tmp_path):
    with pytest.raises(TrainSetupError, match="unknown model 'cvt_ls13'; did you mean cvt_ls_13"):
        run(parse_args([str(image_root), '--model', 'cvt_ls13', '--output', str(tmp_path)]))


def test_missing_split_folder_is_an_error_not_the_training_set(image_root, tmp_path):
    only_train = tmp_path / 'only_train'
    shutil.copytree(image_root / 'train', only_train / 'train')
    with pytest.raises(TrainSetupError, match='no validation split in .*only_train.*would score the training'):
        run(parse_args(_train_args(only_train, tmp_path / 'out', '--epochs', '1')))
    flat = tmp_path / 'flat'  # class folders at the root next to val/: training on the root would include val/
    shutil.copytree(image_root / 'train', flat)
    shutil.copytree(image_root / 'val', flat / 'val')
    with pytest.raises(TrainSetupError, match='no training split'):
        run(parse_args(_train_args(flat, tmp_path / 'out', '--epochs', '1')))
    assert not (tmp_path / 'out').exists()


def test_no_flags_override_a_config_and_amp_is_bfloat16_on_cpu(image_root, tmp_path, caplog):
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(dict(model='cvt_ls_13', amp=True, no_aug=True, model_ema=True, pin_mem=True)))
    args = parse_args(['-c', str(path), '--no-amp', '--aug', '--no-model-ema', '--no-pin-mem'])
    assert (args.amp, args.no_aug, args.model_ema, args.pin_mem) == (False, False, False, False)
    assert parse_args(['-c', str(path)]).amp_dtype is None  # resolved by the device
    with caplog.at_level(logging.INFO):
        result = run(parse_args(_train_args(image_root, tmp_path / 'out', '--epochs', '1', '-b', '4', '-j', '0',
                                            '--amp', '--no-prefetcher')))
    assert 'AMP: bfloat16 autocast on cpu' in caplog.text and math.isfinite(result['eval_loss'])
    assert 'data: normalised in the loader workers, pin_memory False' in caplog.text
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # e.g. AVX2 only: autocast is slower than float32
        assert 'this CPU has no native bfloat16' in caplog.text
    assert yaml.safe_load((tmp_path / 'out' / 'run' / 'args.yaml').read_text())['amp_dtype'] == 'bfloat16'


def test_img_size_reaches_a_fixed_size_model(image_root, tmp_path):
    # Swin-GRC is built for one input size; --img-size must build it at that size (timm's img_size=)
    args = [str(image_root), '--output', str(tmp_path), '--experiment', 'run', '--model',
            'swin_tiny_patch4_window7_224_grc', '--num-classes', '2', '--img-size', '64', '--model-kwargs',
            'embed_dim=16', 'depths=(1,1,1,1)', 'num_heads=(1,1,1,1)', '--crop-pct', '1.0', '--threads', '1',
            '--epochs', '1', '-b', '8', '-j', '0', '--warmup-epochs', '0', '--progress', 'log']
    result = run(parse_args(args))
    assert result['num_updates'] == 3 and math.isfinite(result['eval_loss'])
    state = load_checkpoint(result['last_checkpoint'])
    assert state['state_dict']['layers.0.blocks.0.attn.grc.cache'].shape[1] == 49  # 7x7 window slots


def test_ema_and_model_metrics_logged_lr_column_aligned_and_long_warmup_warned(image_root, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        run(parse_args(_train_args(image_root, tmp_path, '--epochs', '2', '-b', '4', '-j', '0', '--model-ema',
                                   '--model-ema-decay', '0.5', '--warmup-epochs', '1', '--warmup-lr', '1e-5',
                                   '--log-interval', '1')))
    rows = _final_rows(tmp_path / 'run' / 'summary.csv')
    assert {'eval_top1', 'eval_loss', 'eval_ema_top1', 'eval_ema_loss'} <= set(rows[0])
    assert rows[0]['eval_loss'] != rows[0]['eval_ema_loss']
    # the lr of each row is the lr the epoch trained with, as its progress lines say: warmup_lr in epoch 0, then
    # cosine from 1e-3 over 2 epochs at t=1 (the row of epoch 0 used to hold this next epoch's lr)
    assert float(rows[0]['lr']) == pytest.approx(1e-5) and float(rows[1]['lr']) == pytest.approx(5e-4)
    epoch_0 = [r.getMessage() for r in caplog.records if r.getMessage().startswith('epoch 0 (1 of 2) [6/6]')]
    assert epoch_0 and ' lr 1e-05 ' in epoch_0[-1]
    (end_0,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith('epoch 0 (1 of 2): ')]
    assert 'lr 1e-05; model: val loss' in end_0 and 'EMA (picks best): val loss' in end_0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and 'warmup' in r.getMessage()]
    assert "lr warmup: 1 epochs (6 of the run's 12 updates) from 1e-05 to 0.001" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run(parse_args(_train_args(image_root, tmp_path / 'warm', '--epochs', '1', '-b', '8', '-j', '0',
                                   '--warmup-epochs', '5')))
    assert '--warmup-epochs 5 is not shorter than the run (1 epochs)' in caplog.text


def test_progress_lines_come_on_a_clock_too(image_root, tmp_path, caplog):
    """--log-interval-s: a progress line whenever that many seconds have passed (0: after every update), so a run of
    slow steps is never silent for long, whatever --log-interval says."""
    with caplog.at_level(logging.INFO):
        run(parse_args(_train_args(image_root, tmp_path, '--epochs', '1', '-b', '8', '-j', '0', '--log-interval',
                                   '1000', '--log-interval-s', '0')))
    done = [int(m[1]) for m in (re.match(r'epoch 0 \(1 of 1\) \[(\d+)/(\d+)\]', r.getMessage()) for r in caplog.records)
            if m]
    assert len(done) > 1 and done == list(range(1, len(done) + 1))


TOOLS_WITH_THREADS = ['train', 'train_lm', 'train_mt', 'detect', 'validate', 'robustness', 'demo_lm', 'demo_mt',
                      'demo_bytelm', 'demo_listops', 'demo_hsw']


@pytest.mark.parametrize('tool', TOOLS_WITH_THREADS)
def test_every_training_and_evaluation_tool_states_the_one_thread_policy(tool, capsys):
    from lsvision.runtime import threads_help
    with pytest.raises(SystemExit) as e:
        load_tool(tool).main(['--help'])
    assert e.value.code == 0
    text = ' '.join(capsys.readouterr().out.split())
    assert threads_help().split(', at least 1')[0] in text  # 'torch CPU threads per process (0 = auto: the cores..'


def test_last_best_and_epoch_checkpoints_are_one_file(image_root, tmp_path):
    run(parse_args(_train_args(image_root, tmp_path, '--epochs', '2', '-b', '4', '-j', '0', '--checkpoint-hist',
                               '2')))
    run_dir = tmp_path / 'run'
    inodes = {p.name: p.stat().st_ino for p in run_dir.glob('*.pth.tar')}
    assert set(inodes) == {'last.pth.tar', 'model_best.pth.tar', 'checkpoint-0.pth.tar', 'checkpoint-1.pth.tar'}
    assert inodes['checkpoint-1.pth.tar'] == inodes['last.pth.tar'] != inodes['checkpoint-0.pth.tar']
    assert inodes['model_best.pth.tar'] in (inodes['checkpoint-0.pth.tar'], inodes['checkpoint-1.pth.tar'])
    assert load_checkpoint(str(run_dir / 'checkpoint-0.pth.tar'))['next_epoch'] == 1  # epoch 0's state, kept


def test_link_atomic_copies_where_links_fail(tmp_path, monkeypatch):
    from lsvision.train.checkpoint import link_atomic, save_atomic
    save_atomic({'x': torch.arange(3)}, str(tmp_path / 'last.pth.tar'))

    def no_links(src, dst):
        raise OSError('hard links not supported')
    monkeypatch.setattr(os, 'link', no_links)
    link_atomic(str(tmp_path / 'last.pth.tar'), str(tmp_path / 'best.pth.tar'))
    assert torch.equal(load_checkpoint(str(tmp_path / 'best.pth.tar'))['x'], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ['best.pth.tar', 'last.pth.tar']


def test_torchrun_host_syncs_once_per_log_interval_and_grc_caches_once_per_step(image_root, tmp_path):
    # 2 processes x 6 batches of 2, 2 micro-batches per optimizer step (3 steps), a log step every 4 batches (at
    # batches 4 and 6). tests/count_host_syncs.py records every .item() / .tolist() / all_reduce of the run.
    # lr 0: the weights stay put, so the caches differ between the two runs only by the cache sync (without it,
    # DDP's buffer broadcast keeps rank 0's cache updates); the all-reduce itself equals the global batch
    # (test_grc.py)
    states = {}
    for sync in ('--grc-sync-cache', '--no-grc-sync-cache'):
        args = [str(image_root), '--output', str(tmp_path), '--experiment', sync[2:], '--model', 'pvt_v2_b0_grc',
                '--num-classes', '2', '--input-size', '3', '32', '32', '--model-kwargs', 'depths=(1,1,1,1)',
                'embed_dims=(16,32,32,32)', 'num_heads=(1,1,1,1)', '--crop-pct', '1.0', '--threads', '1',
                '--epochs', '1', '-b', '2', '--grad-accum-steps', '2', '-j', '0', '--warmup-epochs', '0', '--lr', '0',
                '--progress', 'log', '--log-interval', '4', '--opt', 'sgd']
        script = str(ROOT / 'tests' / 'count_host_syncs.py') if sync == '--grc-sync-cache' else str(TRAIN)
        if sync == '--no-grc-sync-cache':
            args.append(sync)  # the default is on
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1', SYNC_EVENTS=str(tmp_path / 'events'))
        proc = torchrun(['--standalone', '--nproc_per_node=2', script, *args], tmp_path / f'logs{sync}', env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        states[sync] = load_checkpoint(str(tmp_path / sync[2:] / 'last.pth.tar'))['state_dict']
        if sync == '--no-grc-sync-cache':
            assert "caches follow rank 0's batches only" in proc.stderr, proc.stderr[-3000:]
            assert 'DDP buffer broadcast on' in proc.stderr
            continue
        assert 'GRC cache sync on: after every optimizer step one all-reduce averages the caches of the 4 GRC ' \
               'layers over 2 processes' in proc.stderr, proc.stderr[-3000:]
        assert 'DDP buffer broadcast off' in proc.stderr
        assert 'weights identical on all 2 processes' in proc.stderr  # the caches included
        cache_numel = sum(v.numel() for k, v in states[sync].items() if k.endswith('.grc.cache'))
        for rank in (0, 1):
            events = json.loads((tmp_path / f'events.{rank}.json').read_text())
            train = [e for e in events if e['phase'] == 'train']
            names = ['grc sync' if e['kind'] == 'all_reduce' and e['numel'] == cache_numel else e['kind']
                     for e in train]
            # one GRC all-reduce after each optimizer step, never inside no_sync; the loss is read (one all-reduce,
            # one read) only at the log steps: no host sync on a micro-batch
            step = ['forward', 'forward', 'step', 'grc sync']
            read = ['all_reduce', 'tolist']
            assert names == step + step + read + step + read, names
            assert [e['no_sync'] for e in train if e['kind'] == 'forward'] == [True, False] * 3
            assert not any(e['no_sync'] for e in train if e['kind'] != 'forward')
            assert all(e['phase'] != 'train' for e in events if e['kind'] == 'item')
        # the first sync: every layer's cache becomes the mean of the two processes' caches
        before, after = zip(*(torch.load(tmp_path / f'events.{rank}.caches', weights_only=True) for rank in (0, 1)))
        assert len(before[0]) == 4 and not torch.equal(before[0][0], before[1][0])
        for b0, b1, a0, a1 in zip(*before, *after):
            torch.testing.assert_close(a0, (b0 + b1) / 2)
            assert torch.equal(a0, a1)
    synced, rank_0 = states['--grc-sync-cache'], states['--no-grc-sync-cache']
    assert synced.keys() == rank_0.keys() and sum(k.endswith('.grc.cache') for k in synced) == 4
    for k, v in synced.items():
        if k.endswith('.grc.cache'):
            assert v.abs().sum() > 0 and not torch.allclose(v, rank_0[k]), k
        else:
            assert torch.equal(v, rank_0[k]), k


def test_missing_data_folder_is_named(tmp_path, caplog):
    missing = tmp_path / 'imagenet'
    with pytest.raises(TrainSetupError, match=f'data folder {missing} does not exist. Give the dataset root'):
        run(parse_args([str(missing), '--model', 'cvt_ls_13', '--output', str(tmp_path)]))
    with caplog.at_level(logging.ERROR):
        assert load_tool('train').main(['--data-dir', str(missing), '--model', 'cvt_13']) == 2
    assert f'data folder {missing} does not exist' in caplog.text


@pytest.mark.parametrize('flags, message', [
    (['--log-wandb'], '--log-wandb needs the wandb package: pip install wandb'),
    (['--resplit', '--no-prefetcher'], '--resplit leaves the first half of each batch unerased'),
])
def test_flags_that_cannot_work_are_refused_before_training(image_root, tmp_path, flags, message):
    if '--log-wandb' in flags and importlib.util.find_spec('wandb') is not None:
        pytest.skip('wandb is installed: --log-wandb works')
    with pytest.raises(TrainSetupError, match=message):
        run(parse_args(_train_args(image_root, tmp_path, *flags)))
    assert not (tmp_path / 'run').exists()


_TORCH_SHORT_WRITE = '[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534'


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(['unshare', '-rm', 'true'], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_FULL_DISK_SCRIPT = """
import json, os, sys, torch
from lsvision.train.checkpoint import CheckpointWriteError, load_checkpoint, save_atomic
path = os.path.join(sys.argv[1], 'last.pth.tar')
save_atomic({'x': torch.arange(10)}, path)
try:
    save_atomic({'x': torch.zeros(2 ** 18)}, path)  # 1 MiB into 256 KiB
except CheckpointWriteError as e:
    kept = load_checkpoint(path)['x'].tolist()
    print(json.dumps(dict(message=str(e), files=sorted(os.listdir(sys.argv[1])), kept=kept)))
"""


@pytest.mark.parametrize('disk', ['tmpfs', 'patched'])
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, disk):
    from lsvision.train.checkpoint import CheckpointWriteError, save_atomic
    folder = tmp_path / 'run'
    folder.mkdir()
    if disk == 'tmpfs':  # a real full disk: a 256 KiB tmpfs in a user and mount namespace of its own
        if not _can_mount_tmpfs():
            pytest.skip('no user namespaces here (unshare -rm) to mount a small tmpfs')
        script = tmp_path / 'fill.py'
        script.write_text(_FULL_DISK_SCRIPT)
        proc = subprocess.run(
            ['unshare', '-rm', 'sh', '-c', 'mount -t tmpfs -o size=256k tmpfs "$1" && "$2" "$3" "$1"', 'sh',
             str(folder), sys.executable, str(script)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 0 and proc.stdout, proc.stderr[-3000:]
        out = json.loads(proc.stdout)
        message, files, kept = out['message'], out['files'], out['kept']
    else:  # what torch raises when a write comes up short, after half a file
        path = folder / 'last.pth.tar'
        save_atomic({'x': torch.arange(10)}, str(path))
        real_save = torch.save

        def short_save(obj, f):
            real_save({'partial': torch.zeros(3)}, f)
            raise RuntimeError(_TORCH_SHORT_WRITE)
        monkeypatch.setattr(torch, 'save', short_save)
        with pytest.raises(CheckpointWriteError) as e:
            save_atomic({'x': torch.zeros(2 ** 18)}, str(path))
        monkeypatch.undo()
        message, files, kept = str(e.value), sorted(os.listdir(folder)), load_checkpoint(str(path))['x'].tolist()
    assert message.startswith(f'cannot write checkpoint {folder / "last.pth.tar"}: the disk holding {folder} is '
                              'full or over quota'), message
    assert 'unexpected pos' in message and 'the previous last.pth.tar is intact' in message
    assert '--output' in message
    assert files == ['last.pth.tar'] and kept == list(range(10))  # no temporary file left, the old one whole


@pytest.mark.parametrize('tool', ['validate.py', 'robustness.py'])
def test_tool_help_shows_its_examples_as_written(tool, capsys):
    module = load_tool(tool[:-3])
    with pytest.raises(SystemExit) as e:
        module.parse_args(['--help'])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    examples = [line for line in help_text.splitlines() if 'python tools/' in line]
    assert examples and all(line.lstrip().startswith('python tools/') for line in examples), examples
    for line in examples:  # a shell line continuation kept, not glued to the next line
        assert '  --' not in line.strip(), line
    assert 'd.pth --imagenet' not in help_text



def _config_keys_in_use() -> dict:
    """Each key that some configs/*.yaml sets, with the first such config (by name) and its value there."""
    keys = {}
    for path in sorted((ROOT / 'configs').glob('*.yaml')):
        for key, value in yaml.safe_load(path.read_text()).items():
            keys.setdefault(key, (path, value))
    return keys


def _flag_beating(action, value):
    """A command line for `action` that gives another value than the config's `value`, and the value expected."""
    from lsvision.train.args import Flag, MergeKwargs
    option = max(action.option_strings, key=len)  # the long name (-b -> --batch-size)
    if isinstance(action, Flag):
        names = [o for o in action.option_strings if (o in action.negations) == bool(value)]
        return [names[0]], not value
    if isinstance(action, MergeKwargs):
        key = next(iter(value))
        return [option, f'{key}=(2,2,2)'], dict(value, **{key: (2, 2, 2)})
    if action.choices is not None:
        other = next(c for c in action.choices if c != value)
        return [option, str(other)], other

    def other(v):
        return v + 1 if action.type is int else v / 2 + 0.125 if action.type is float else f'{v}_x'
    if isinstance(value, list):
        new = [other(v) for v in value]
        return [option, *map(str, new)], new
    return [option, str(other(value))], other(value)


@pytest.mark.parametrize('key', sorted(_config_keys_in_use()))
def test_every_flag_beats_the_config_key_it_sets(key):
    path, value = _config_keys_in_use()[key]
    actions = {a.dest: a for a in build_parser()._actions}
    assert value is not None and key in actions
    assert getattr(parse_args(['-c', str(path)]), key) == value
    argv, expected = _flag_beating(actions[key], value)
    assert getattr(parse_args(['-c', str(path), *argv]), key) == expected, argv


@pytest.mark.parametrize('cfg, argv, expected', [
    # timm reads input_size before img_size and in_chans: a flag of either must change input_size itself
    (dict(input_size=[3, 224, 224]), ['--img-size', '64'], dict(input_size=[3, 64, 64], img_size=64)),
    (dict(input_size=[3, 224, 224]), ['--in-chans', '1'], dict(input_size=[1, 224, 224], in_chans=1)),
    (dict(img_size=224, in_chans=1), ['--input-size', '3', '32', '48'], dict(input_size=[3, 32, 48], img_size=None,
                                                                             in_chans=None)),
    (dict(input_size=[3, 224, 224], model_kwargs=dict(img_size=224, depths=[1, 1, 1])), ['--img-size', '64'],
     dict(input_size=[3, 64, 64], model_kwargs=dict(img_size=64, depths=[1, 1, 1]))),
    (dict(input_size=[3, 224, 224]), ['--model-kwargs', 'img_size=96'],
     dict(input_size=[3, 96, 96], img_size=96, model_kwargs=dict(img_size=96))),
    # the positional data dir and --data-dir
    (dict(data_dir='/old'), ['/new'], dict(data='/new', data_dir='/new')),
    (dict(data='/old'), ['--data-dir', '/new'], dict(data='/new', data_dir='/new')),
    # a config's lr (args.yaml records the lr used) vs the settings it is derived from
    (dict(lr=0.004, lr_base=5e-4), ['--lr-base', '1e-3'], dict(lr=None, lr_base=1e-3)),
    (dict(lr=0.004), ['--lr-base-size', '1024'], dict(lr=None, lr_base_size=1024)),
    (dict(lr=0.004), ['--batch-size', '64'], dict(lr=0.004, batch_size=64)),  # the lr given stays
    (dict(lr_base=5e-4), ['--lr', '0.01'], dict(lr=0.01)),
    # create_model arguments in --model-kwargs and their flags: the command line's wins, create_model gets it once
    (dict(model_kwargs=dict(drop_path_rate=0.3, depths=[1, 1, 1])), ['--drop-path', '0.05'],
     dict(drop_path=0.05, model_kwargs=dict(depths=[1, 1, 1]))),
    (dict(drop_path=0.1), ['--model-kwargs', 'drop_path_rate=0.2'], dict(drop_path=0.2, model_kwargs={})),
    (dict(model_kwargs=dict(num_classes=10)), ['--num-classes', '5'], dict(num_classes=5, model_kwargs={})),
    (dict(model_kwargs=dict(grc_sync_cache=True)), ['--no-grc-sync-cache'], dict(grc_sync_cache=False,
                                                                                   model_kwargs={})),
    # --pretrained-path means load it, unless pretrained is given
    (dict(), ['--pretrained-path', 'w.pth'], dict(pretrained=True, pretrained_path='w.pth')),
    (dict(pretrained=False), ['--pretrained-path', 'w.pth'], dict(pretrained=False)),
    (dict(pretrained_path='w.pth'), ['--no-pretrained'], dict(pretrained=False)),
])
def test_a_flag_beats_the_config_value_of_another_dest_for_the_same_setting(tmp_path, cfg, argv, expected):
    path = tmp_path / 'c.yaml'
    path.write_text(yaml.safe_dump(dict(model='cvt_ls_13', **cfg)))
    args = parse_args(['-c', str(path), *argv])
    assert {k: getattr(args, k) for k in expected} == expected


@pytest.mark.parametrize('argv, message', [
    (['--img-size', '64', '--input-size', '3', '96', '96'], 'the input size is given twice, with two values: '
                                                           '--input-size 3 96 96, --img-size 64; give one'),
    (['--in-chans', '1', '--input-size', '3', '96', '96'], '--in-chans 1'),
    (['/a', '--data-dir', '/b'], 'the data dir is given twice: /a and --data-dir /b'),
    (['--drop-path', '0.1', '--model-kwargs', 'drop_path_rate=0.2'], '--model-kwargs drop_path_rate=0.2 and '
                                                                     '--drop-path 0.1 disagree'),
])
def test_one_setting_given_twice_with_two_values_is_an_error(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(['--model', 'cvt_ls_13', *argv])
    agreeing = parse_args(['--model', 'cvt_ls_13', '--img-size', '96', '--input-size', '3', '96', '96'])
    assert agreeing.input_size == [3, 96, 96]


def test_img_size_and_no_amp_flags_beat_the_config_in_a_run_and_in_args_yaml(image_root, tmp_path, caplog):
    # a model config as tools/make_configs.py writes them (input_size 224, amp on), with the tiny model's kwargs
    cfg = load_config(str(ROOT / 'configs' / 'cvt_ls_13.yaml'))
    assert cfg['input_size'] == [3, 224, 224] and cfg['amp'] is True
    tiny = _train_args(image_root, tmp_path, '--epochs', '1', '-b', '8', '-j', '0', '--mixup', '0', '--cutmix', '0',
                       '--aa', '', '--reprob', '0')
    i = tiny.index('--input-size')
    del tiny[i:i + 4]
    with caplog.at_level(logging.INFO):
        result = run(parse_args(['-c', str(ROOT / 'configs' / 'cvt_ls_13.yaml'), *tiny, '--img-size', '16',
                                 '--no-amp']))
    assert math.isfinite(result['eval_loss'])
    assert 'input_size: (3, 16, 16)' in caplog.text  # timm's data config: what the loaders use
    assert 'AMP:' not in caplog.text
    recorded = yaml.safe_load((tmp_path / 'run' / 'args.yaml').read_text())
    assert (recorded['input_size'], recorded['img_size'], recorded['amp']) == ([3, 16, 16], 16, False)
    assert load_checkpoint(result['last_checkpoint'])['args']['input_size'] == [3, 16, 16]
    replay = parse_args(['-c', str(tmp_path / 'run' / 'args.yaml')])  # replays at the size used
    assert (replay.input_size, replay.img_size, replay.amp) == ([3, 16, 16], 16, False)


def test_epochs_are_counted_from_0_in_the_log_files_and_result(image_root, tmp_path, caplog, capsys):
    args = _train_args(image_root, tmp_path, '--epochs', '2', '-b', '4', '-j', '0', '--log-interval', '3')
    with caplog.at_level(logging.INFO):
        assert load_tool('train').main(args) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('epoch ')]
    progress = [line.split(' [')[0] for line in lines if ' [' in line]  # at batches 3 and 6 of 6
    assert progress == ['epoch 0 (1 of 2)'] * 2 + ['epoch 1 (2 of 2)'] * 2
    ends = [line.split(':')[0] for line in lines if ': train loss' in line]
    assert ends == ['epoch 0 (1 of 2)', 'epoch 1 (2 of 2)']
    run_dir = tmp_path / 'run'
    rows = _final_rows(run_dir / 'summary.csv')
    assert [int(r['epoch']) for r in rows] == [0, 1]
    assert sorted(p.name for p in run_dir.glob('checkpoint-*.pth.tar')) == ['checkpoint-0.pth.tar',
                                                                           'checkpoint-1.pth.tar']
    for epoch in (0, 1):  # checkpoint-<epoch> holds the state after that epoch (timm's 'epoch' field)
        state = load_checkpoint(str(run_dir / f'checkpoint-{epoch}.pth.tar'))
        assert (state['epoch'], state['next_epoch'], state['next_batch']) == (epoch, epoch + 1, 0)
    result = json.loads((run_dir / 'result.json').read_text())
    top1 = [float(r['eval_top1']) for r in rows]
    assert result['best_epoch'] == top1.index(max(top1))  # the first epoch with the best top-1
    best = run_dir / f'checkpoint-{result["best_epoch"]}.pth.tar'
    assert (run_dir / 'model_best.pth.tar').stat().st_ino == best.stat().st_ino
    out = capsys.readouterr().out
    assert 'after 2 epoch(s)' in out
    if result['best_epoch'] == 0:  # the tool names the best epoch when it is not the last
        assert f'best: epoch 0 (top1 {max(top1):.4g}): {run_dir / "model_best.pth.tar"}' in out


def test_pretrained_path_and_initial_checkpoint_say_what_they_loaded(one_epoch_run, image_root, tmp_path, caplog):
    last = one_epoch_run / 'last.pth.tar'
    n = len(load_checkpoint(str(last))['state_dict'])
    three = tmp_path / 'three_classes'  # the folder's classes set the head: a third class folder in each split
    shutil.copytree(image_root, three)
    for split in ('train', 'val'):
        shutil.copytree(three / split / 'class1', three / split / 'class2')
    out = tmp_path / 'out'

    def loaded_lines(*flags, classes='2'):
        caplog.clear()
        argv = _train_args(three if classes == '3' else image_root, out, '--epochs', '1', '-b', '8', '-j', '0')
        argv[argv.index('--num-classes') + 1] = classes
        with caplog.at_level(logging.INFO):
            run(parse_args([*argv, '--experiment', f'run{len(list(out.glob("run*")))}', *flags]))
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith('loaded ')]

    # a head of another class count: left out of the file, new in the model (--pretrained-path implies --pretrained)
    (line,) = loaded_lines('--pretrained-path', str(last), classes='3')
    assert line == (f'loaded pretrained weights from {last}: {n - 2} tensors; new (not in the file): head.weight, '
                    'head.bias; left out of the file: head.weight [2, 32] (the model: [3, 32]), head.bias [2] (the '
                    'model: [3])')
    # the same class count: the head loads too (timm would drop it: its cfg says 1000 classes)
    (line,) = loaded_lines('--pretrained-path', str(last))
    assert line == (f"loaded pretrained weights from {last}: {n} tensors, all of the model's; nothing new, nothing "
                    'left out')
    # --initial-checkpoint takes the EMA weights when the file has them, and says so
    state = load_checkpoint(str(last))
    ema = tmp_path / 'ema.pth.tar'
    torch.save({'state_dict': state['state_dict'], 'state_dict_ema': state['state_dict']}, ema)
    (line,) = loaded_lines('--initial-checkpoint', str(ema))
    assert line == (f"loaded initial checkpoint from {ema} (its EMA weights): {n} tensors, all of the model's; "
                    'nothing new, nothing left out')


@pytest.mark.parametrize('torchcompile, graphs', [('eager', 1), (None, 2)])
def test_compiled_validation_takes_every_batch_size_with_one_graph(torchcompile, graphs):
    # 10 images in batches of 4: the last batch of 2 would compile a second graph (torch's default shapes); train.py
    # marks the batch dim of validation inputs dynamic when it compiles. Dynamo's guards decide, so the 'eager'
    # backend (no code generation) shows it in a second.
    from argparse import Namespace

    from lsvision.train.engine import validate
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1),
                                              torch.nn.Flatten(), torch.nn.Linear(4, 2)), backend='eager')
    loader = [(torch.randn(n, 3, 8, 8), torch.zeros(n, dtype=torch.long)) for n in (4, 4, 2)]
    before = torch._dynamo.utils.counters['stats']['unique_graphs']
    args = Namespace(torchcompile=torchcompile, channels_last=False, distributed=False)
    metrics = validate(model, loader, args, torch.device('cpu'), contextlib.nullcontext)
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] - before == graphs
    assert math.isfinite(metrics['loss'])
    torch._dynamo.reset()


def test_compile_times_tool_runs_and_tabulates(tmp_path):
    # eager only (a compile takes minutes on a CPU): the fresh process, the three first calls, the table
    out = tmp_path / 'times.json'
    proc = run_script(
        [sys.executable, str(ROOT / 'tools' / 'compile_times.py'), '--model', 'cvt_ls_13', '--model-kwargs',
         'embed_dims=(16,32,32)', 'num_heads=(1,1,1)', 'depths=(1,1,1)', '--sizes', '32', '48', '--threads', '1',
         '--iters', '2', '--modes', 'eager', '--steps', 'infer', '--out', str(out)],
        timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row['points'] == [[2, 32], [2, 48], [3, 32]] and row['graphs_final'] == 0
    assert set(row['steady_s']) == set(row['ratio']) == {'32', '48'}
    assert '| infer | eager |' in proc.stdout and 'first call b3 32 px (s)' in proc.stdout
