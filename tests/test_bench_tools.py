"""Tests of tools/benchmark.py (the command line over lsvision.bench) at the tiniest settings that run every path:
the model benchmark against a baseline, ``--reparam``, the suites, the sweep and the cards.

Every measurement runs in a fresh process that imports torch and timm (seconds on a busy machine), so the tests
start as few as they can; the numbers are not checked (timings on a shared machine are noise at these settings),
their consistency is (ratios from the rows, pooled medians between the runs' medians).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch

from lsvision.sequence import create_model

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / 'tools' / 'benchmark.py'
QUICK = ('--threads', '1', '--num-warm-iter', '0', '--budget-s', '0')


def load_tool():
    spec = importlib.util.spec_from_file_location('benchmark_tool', TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=900,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def run_suite(tmp_path: Path, name: str, *args: str) -> Tuple[str, Dict[str, Any]]:
    """Runs ``--suite name`` into ``tmp_path``; returns its stdout and the JSON report it wrote."""
    proc = run_benchmark(tmp_path, '--suite', name, '--out', str(tmp_path), '--repeats', '1', *QUICK, *args)
    assert f'Wrote {tmp_path / name}.' in proc.stderr
    assert (tmp_path / f'{name}.png').stat().st_size > 1000 and (tmp_path / f'{name}.csv').exists()
    return proc.stdout, json.loads((tmp_path / f'{name}.json').read_text())


def test_train_benchmark_against_a_baseline_in_fresh_processes(tmp_path):
    out = tmp_path / 'bench.json'
    proc = run_benchmark(tmp_path, '--bench', 'train', '--models', 'test_vit', '--baseline', 'test_resnet',
                         '--batch-size', '2', '--repeats', '2', '--no-flops', '--results-file', str(out), *QUICK)
    rows = json.loads(out.read_text())['rows']
    assert [r['spec'] for r in rows] == ['test_vit', 'test_resnet']  # the baseline is added to the models
    pids = [pid for r in rows for pid in r['pids']['train']]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    runs = [line.split('] ')[1].split(' ')[0] for line in proc.stderr.splitlines() if line.startswith('  [')]
    assert runs == ['test_vit', 'test_resnet', 'test_resnet', 'test_vit']  # alternating order
    vit, resnet = rows
    for r in rows:
        assert min(r['train_step_runs_ms']) <= r['train_step_ms'] <= max(r['train_step_runs_ms'])
        assert r['train_memory_mib'] > 0 and 'latency_ms' not in r  # train only
    assert vit['train_step_ratio'] == pytest.approx(vit['train_step_ms'] / resnet['train_step_ms'])
    rounds = [v / b for v, b in zip(vit['train_step_runs_ms'], resnet['train_step_runs_ms'])]
    assert vit['train_step_ratio_rounds'] == pytest.approx(rounds)
    assert f"{vit['train_step_ratio_paired']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) |" in proc.stdout
    assert '| train time / baseline, paired |' in proc.stdout and 'latency' not in proc.stdout


def test_run_train_reparam(tmp_path):
    # the earlier spelling `run`, with --reparam: NAME@reparam beside NAME, with its ratio to NAME
    run_benchmark(tmp_path, 'run', '--models', 'test_resnet', '--img-size', '64', '--reparam', '--repeats', '1',
                  '--out', str(tmp_path), *QUICK)
    plain, folded = json.loads((tmp_path / 'results.json').read_text())['rows']
    assert (plain['spec'], folded['spec'], folded['label']) == (
        'test_resnet', 'test_resnet@reparam', 'test_resnet (reparameterized)')
    assert folded['baseline'] == 'test_resnet' and folded['latency_ratio'] > 0
    assert 0 < folded['gflops'] <= plain['gflops']  # folding never adds FLOPs
    assert plain['input_size'] == [3, 64, 64] and plain['peak_mib'] is not None
    assert (tmp_path / 'results.csv').read_text().startswith('label,')
    assert '| test_resnet (reparameterized) | 64x64 |' in (tmp_path / 'results.md').read_text()


def test_points_and_bad_input(tmp_path, capsys):
    tool = load_tool()
    assert tool.resolve_points([224, 384, 768], [8, 2, 1], None) == [(224, 8), (384, 2), (768, 1)]
    assert tool.resolve_points([224, 384], [4], None) == [(224, 4), (384, 4)]
    assert tool.resolve_points(None, [1, 8], None) == [(None, 1), (None, 8)]
    assert tool.parse_args(['--points', '384x2', '768X1', '--models', 'cvt_13']).points == [(384, 2), (768, 1)]
    assert tool.parse_args(['--models', 'cvt_13']).bench == 'inference'
    assert tool.parse_args(['run', '--train', '--models', 'cvt_13']).bench == 'both'
    args = tool.parse_args(['--models', 'cvt_13', '--amp', '--amp-dtype', 'bfloat16', '--torchcompile'])
    job = tool.job_of('cvt_13', args, 64, 2, 'train')
    assert (job.amp, job.compile, job.kind, job.img_size, job.batch_size) == ('bfloat16', 'default', 'train', 64, 2)
    assert args.device == ('cuda' if torch.cuda.is_available() else 'cpu')
    with pytest.raises(SystemExit):
        tool.parse_args(['--points', '384'])
    for argv, message in [
        (['--models', 'cvt_13', '--img-size', '224', '384', '--batch-size', '8', '2', '1'], 'as many batch sizes'),
        (['--models', 'cvt_13', '--points', '64x1', '--img-size', '64'], 'either --points'),
        (['--models', 'no_such_model*'], "'no_such_model*' matches no model"),
        (['--models', 'cvt_13', '--results-file', str(tmp_path / 'r.txt')], 'must be .csv, .json or .md'),
        (['--img-size', '64'], 'name the models'),
        (['--suite', 'grc', '--models', 'pvt_v2_b0'], 'needs GRC models'),
        (['--suite', 'hsw', '--names', 'nope'], 'unknown --names'),
        (['sweep', '--models', 'cvt_ls_13@full'], 'full-attention switch'),
        (['cards', '--models', 'resnet18', '--cards-dir', str(tmp_path)], 'not registered lsvision models'),
    ]:
        assert tool.main(argv) == 2
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_suite_cvt_ls(tmp_path):
    stdout, res = run_suite(tmp_path, 'cvt_ls', '--bench', 'inference', '--points', '64x1')
    assert '## CvT-LS (long-short attention) vs CvT (full attention) against input size' in stdout
    assert '| model | input | batch | params (M) | GFLOPs/img |' in stdout and '| latency / baseline |' in stdout
    assert [(r['spec'], r['input_size'], r['batch_size']) for r in res['rows']] == [
        ('cvt_ls_13', [3, 64, 64], 1), ('cvt_13', [3, 64, 64], 1)]
    assert res['rows'][1]['latency_ratio'] == 1.0 and res['rows'][0]['latency_ratio'] > 0
    assert all(r['gflops'] > 0 and r['peak_mib'] is not None for r in res['rows'])


def test_suite_grc_pairs_each_model_with_its_base(tmp_path):
    stdout, res = run_suite(tmp_path, 'grc', '--models', 'pvt_v2_b0_grc', '--batch-size', '1', '--no-memory')
    base, grc = res['rows']
    assert (base['spec'], grc['spec'], grc['baseline']) == ('pvt_v2_b0', 'pvt_v2_b0_grc', 'pvt_v2_b0')
    assert grc['params'] > base['params'] and grc['gflops'] > base['gflops'] > 0
    assert grc['latency_ratio'] == pytest.approx(grc['latency_ms'] / base['latency_ms'])
    assert 'at most 1.25x' in stdout


def test_suite_sequence(tmp_path):
    _, res = run_suite(tmp_path, 'sequence', '--lengths', '64', '--names', 'ls_causal_blocked', 'lm_ls_causal')
    assert [(r['kind'], r['name'], r['n']) for r in res['rows']] == [
        ('layer', 'ls_causal_blocked', 64), ('model', 'lm_ls_causal', 64)]
    assert all(r['train_step_ms'] > 0 and r['train_memory_mib'] is not None for r in res['rows'])
    assert '| layer | ls_causal_blocked | ' in (tmp_path / 'sequence.md').read_text()


def test_suite_hsw(tmp_path):
    _, res = run_suite(tmp_path, 'hsw', '--lengths', '128', '--names', 'HSW', 'flat', '--flat-full-max', '64')
    assert [(r['tokens'], r['label'], r['time_scale']) for r in res['rows']] == [(128, 'HSW', 1), (128, 'flat', 8)]
    hsw, flat = res['rows']
    assert flat['params'] == sum(p.numel() for p in create_model('hsw_flat_tiny', max_len=128).parameters())
    assert flat['latency_ms'] == pytest.approx(8e3 * flat['inference_timing']['median_s'])  # 1 block of 8, x 8
    assert flat['latency_ratio'] == pytest.approx(flat['latency_ms'] / hsw['latency_ms'])
    assert '| 128 | ' in (tmp_path / 'hsw.md').read_text()


def test_sweep_until_the_budget_and_refit(tmp_path):
    tool = load_tool()
    args = ['sweep', '--models', 'cvt_ls_13', '--sizes', '64', '32', '--num-warm-iter', '0', '--budget-s', '0',
            '--out', str(tmp_path), '--name', 's', '--fit-min', '32']
    assert tool.main(args + ['--time-budget', '100']) == 0
    result = json.loads((tmp_path / 's.json').read_text())
    assert [(r['input_size'], r['exceeded']) for r in result['rows']] == [([3, 32, 32], []), ([3, 64, 64], [])]
    assert 0.9 < result['exponents']['cvt_ls_13']['flops'] < 1.1  # long-short attention: linear in the pixels
    md = (tmp_path / 's.md').read_text()
    assert '| cvt_ls_13 | 64x64 | 1 |' in md and '| no |' in md and (tmp_path / 's.png').exists()
    assert tool.main(['sweep', '--refit', str(tmp_path / 's.json'), '--fit-min', '64']) == 0
    assert json.loads((tmp_path / 's.json').read_text())['exponents']['cvt_ls_13']['sizes'] == [64]
    # a budget no pass meets: the curve ends at its first size, which is kept and marked
    assert tool.main(args + ['--time-budget', '1e-9', '--no-flops']) == 0
    (row,) = json.loads((tmp_path / 's.json').read_text())['rows']
    assert row['input_size'] == [3, 32, 32] and row['exceeded'][0].startswith('cpu time')


def test_cards_reuse_renders_the_stored_measurements(tmp_path):
    shutil.copytree(ROOT / 'model_cards', tmp_path / 'model_cards')
    shutil.copy(ROOT / 'README.md', tmp_path / 'README.md')
    (tmp_path / 'model_cards' / 'cvt_13.md').write_text('edited by hand')
    tool = load_tool()
    assert tool.main(['cards', '--reuse', '--cards-dir', str(tmp_path / 'model_cards'),
                      '--readme', str(tmp_path / 'README.md')]) == 0
    for card in (ROOT / 'model_cards').glob('*.md'):
        assert (tmp_path / 'model_cards' / card.name).read_text() == card.read_text()
    assert (tmp_path / 'README.md').read_text() == (ROOT / 'README.md').read_text()
