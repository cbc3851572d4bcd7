"""Tests of the benchmark tool's machinery and suites (tools/benchmark.py, tools/_bench_cpu.py,
tools/_bench_suites.py) at the tiniest settings that run every code path.

The tool runs as a subprocess (its measurements run in fresh processes of their own), with 1-2 timed passes and
``--out`` under ``tmp_path``; the tests check the exit code, the tables, and the keys and rows of the reports. The
numbers themselves are not checked (timings on a shared machine are noise at these settings). All run with
``--threads 1``: with 2 threads on 2 busy cores, OpenMP synchronization can slow each op to milliseconds. Every fresh
process pays for importing torch and timm (several seconds on a busy machine), so the tests start as few as they can.
"""
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / 'tools'
TOOL = TOOLS / 'benchmark.py'


def load_tool(name: str):
    """Imports a tool script as a module (tools/ is not a package)."""
    sys.path.insert(0, str(TOOLS))  # the tools import their helper modules (tools/_bench_*.py) by name
    spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """Runs tools/benchmark.py with one thread; asserts it succeeded."""
    proc = subprocess.run([sys.executable, str(TOOL), *args, '--threads', '1'],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def run_suite(tmp_path: Path, name: str, *args: str) -> Tuple[str, Dict[str, Any]]:
    """Runs ``--suite name`` into ``tmp_path``; returns its stdout and the JSON report it wrote."""
    proc = run_benchmark(tmp_path, '--suite', name, '--out', str(tmp_path), *args)
    assert f'Wrote {tmp_path / name}.' in proc.stderr
    assert (tmp_path / f'{name}.png').stat().st_size > 1000 and (tmp_path / f'{name}.md').exists()
    return proc.stdout, json.loads((tmp_path / f'{name}.json').read_text())


# --------------------------------------------------------------------------------------------------------------------
# machinery for a shared CPU (tools/_bench_cpu.py)


class Named(nn.Module):
    """Records its name in a shared log on each forward."""

    def __init__(self, name: str, log: List[str]):
        super().__init__()
        self.name, self.log = name, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return x


class Sleeper(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time
        time.sleep(self.seconds)
        return x


def test_time_forward_interleaved_alternates():
    cpu = load_tool('_bench_cpu')
    log: List[str] = []
    results = cpu.time_forward_interleaved([Named('a', log), Named('b', log)], (4,), batch_size=2, warmup=1, iters=3)
    # one warm-up round, then timed rounds in the order a b, b a, a b (ABBA)
    assert ''.join(log) == 'ab' + 'ab' + 'ba' + 'ab'
    assert [r.iters for r in results] == [3, 3] and all(r.warmup == 1 and r.batch_size == 2 for r in results)
    assert all(len(r.cpu_times_s) == 3 for r in results)
    # a slow model measures slow, whatever its position
    fast, slow = cpu.time_forward_interleaved([Named('c', []), Sleeper(0.02)], (1,), warmup=0, iters=2)
    assert slow.min_s >= 0.02 > fast.max_s
    # the budget cuts rounds short but always runs one
    results = cpu.time_forward_interleaved([Sleeper(0.02), Sleeper(0.02)], (1,), warmup=5, iters=50, max_time_s=1e-3)
    assert [(r.warmup, r.iters) for r in results] == [(1, 1), (1, 1)]
    with pytest.raises(ValueError):
        cpu.time_forward_interleaved([], (1,))


def allocate_per_batch(job: Dict[str, Any]) -> Dict[str, Any]:
    """Allocates (batch - 1) x 64 TiB: a real failed CPU allocation above batch 1, nothing at batch 1."""
    torch.empty((job['batch_size'] - 1) * 2 ** 46, dtype=torch.uint8)
    return {'batch_size': job['batch_size'], 'pid': os.getpid()}


def test_out_of_memory_is_retried_at_smaller_batches():
    cpu = load_tool('_bench_cpu')
    lines: List[str] = []
    result, batch = cpu.retry_smaller_batch(lambda b: allocate_per_batch({'batch_size': b}), 8, log=lines.append)
    # timm's decay_batch_step: 8, 6, 4, 3, 2, 1
    assert batch == 1 and result['batch_size'] == 1
    assert [line.split('retrying at batch ')[1] for line in lines] == ['6', '4', '3', '2', '1']
    assert "can't allocate memory" in lines[0]
    with pytest.raises(RuntimeError, match="can't allocate memory"):  # --no-retry
        cpu.retry_smaller_batch(lambda b: allocate_per_batch({'batch_size': b}), 8, retry=False)
    with pytest.raises(ValueError):  # other errors are not retried
        cpu.retry_smaller_batch(lambda b: int('x'), 8)
    # across a process: the child's failed allocation comes back as an error that says so, and is retried
    with pytest.raises(RuntimeError, match="can't allocate memory") as failure:
        cpu.run_isolated(allocate_per_batch, {'label': 'alloc', 'batch_size': 2}, timeout_s=300)
    assert cpu.is_out_of_memory(failure.value) and str(failure.value).startswith('alloc: error: ')


# --------------------------------------------------------------------------------------------------------------------
# the model benchmark: fresh processes, alternating order, ratios to a baseline


def test_train_benchmark_runs_each_model_in_fresh_processes_in_alternating_order(tmp_path):
    # two tiny timm models, two repeats: every measurement in a process of its own, the order A B then B A, so that no
    # model is measured in a process another model warmed up, or always first
    out = tmp_path / 'bench.json'
    proc = run_benchmark(tmp_path, '--bench', 'train', '--models', 'test_vit', '--baseline', 'test_resnet',
                         '--batch-size', '2', '--repeats', '2', '--num-warm-iter', '1', '--num-bench-iter', '2',
                         '--no-flops', '--results-file', str(out))
    rows = json.loads(out.read_text())['rows']
    assert [r['model'] for r in rows] == ['test_vit', 'test_resnet']  # the baseline is added to the models
    pids = [pid for r in rows for pid in r['pids']['train']]
    assert len(pids) == 4 and len(set(pids)) == 4 and os.getpid() not in pids
    runs = [line.split('] ')[1].split(' b')[0] for line in proc.stderr.splitlines() if line.startswith('  [')]
    assert runs == ['test_vit', 'test_resnet', 'test_resnet', 'test_vit']
    vit, resnet = rows
    for r in rows:
        assert r['repeats'] == 2 and r['train_timing']['iters'] == 4  # the timed steps of both processes, pooled
        assert 0 < r['train_step_p10_ms'] <= r['train_step_ms'] <= r['train_step_p90_ms']
        assert r['train_memory_mib'] > 0 and r['latency_ms'] is None  # train only
    assert resnet['train_step_ratio'] == resnet['train_memory_ratio'] == 1.0
    assert vit['train_step_ratio'] == pytest.approx(vit['train_step_ms'] / resnet['train_step_ms'])
    # paired: each round's ratio from its two processes (each process's median step), then their median
    for r in rows:  # the pooled median lies between the two processes' medians
        assert len(r['train_step_runs_ms']) == 2
        assert min(r['train_step_runs_ms']) <= r['train_step_ms'] <= max(r['train_step_runs_ms'])
    rounds = [v / b for v, b in zip(vit['train_step_runs_ms'], resnet['train_step_runs_ms'])]
    assert vit['train_step_ratio_rounds'] == pytest.approx(rounds)
    assert vit['train_step_ratio_paired'] == pytest.approx(statistics.median(rounds))
    assert resnet['train_step_ratio_rounds'] == [1.0, 1.0] and resnet['train_step_ratio_paired'] == 1.0
    assert vit['train_memory_ratio'] == pytest.approx(vit['train_memory_mib'] / resnet['train_memory_mib'])
    header = ('| train step ms (p10-p90) | train img/s | train act. MiB | train time / baseline '
              '| train mem. / baseline | train time / baseline, paired |')
    assert header in proc.stdout and 'latency' not in proc.stdout
    paired = f"{vit['train_step_ratio_paired']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) |"
    assert paired in proc.stdout and 'paired: the median (and range)' in proc.stdout
    assert 'Ratios to test_resnet' in proc.stdout


def test_paired_ratios_are_per_round_per_image_and_need_two_rounds():
    tool = load_tool('benchmark')
    row = {'train_step_runs_ms': [300., 500.], 'train_batch_size': 4}
    base = {'train_step_runs_ms': [100., 200.], 'train_batch_size': 2}  # e.g. the baseline retried at a smaller batch
    assert tool._round_ratios(row, base, 'train_step_runs_ms', 'train_batch_size') == [1.5, 1.25]
    assert tool._round_ratios({**row, 'train_step_runs_ms': [300.]}, {**base, 'train_step_runs_ms': [100.]},
                              'train_step_runs_ms', 'train_batch_size') == []  # one round: nothing to pair
    assert tool._round_ratios(row, None, 'train_step_runs_ms', 'train_batch_size') == []
    rows = [dict(row, spec='a', point=[64, 4]), dict(base, spec='b', point=[64, 4])]
    tool.add_ratios(rows, 'b')
    assert rows[0]['train_step_ratio_paired'] == pytest.approx(1.375)
    assert rows[0]['latency_ratio_paired'] is None  # not measured


def test_points_and_bad_input(tmp_path, capsys):
    tool = load_tool('benchmark')
    assert tool.resolve_points([224, 384, 768], [8, 2, 1], None) == [(224, 8), (384, 2), (768, 1)]
    assert tool.resolve_points([224, 384], [4], None) == [(224, 4), (384, 4)]
    assert tool.resolve_points(None, [1, 8], None) == [(None, 1), (None, 8)]
    assert tool.resolve_points(None, None, [(384, 2), (768, 1)]) == [(384, 2), (768, 1)]
    assert tool.parse_args(['--points', '384x2', '768X1', '--models', 'cvt_13']).points == [(384, 2), (768, 1)]
    assert tool.parse_args(['--models', 'cvt_13']).bench == 'inference'
    assert tool.parse_args(['run', '--train', '--models', 'cvt_13']).bench == 'both'  # the earlier spelling
    args = tool.parse_args(['--models', 'cvt_13', '--amp', '--amp-dtype', 'bfloat16', '--torchcompile'])
    config = tool.bench_config(args, 64, 2, 'train')
    assert (config.amp, config.compile, config.bench, config.img_size) == ('bfloat16', 'default', 'train', 64)
    assert tool.parse_args(['--models', 'm', '--torchcompile', 'max-autotune']).torchcompile == 'max-autotune'
    expected_device = 'cuda' if torch.cuda.is_available() else 'cpu'
    assert tool.parse_args(['--models', 'cvt_13']).device == expected_device
    with pytest.raises(SystemExit):
        tool.parse_args(['--points', '384'])
    for argv, message in [
        (['--models', 'cvt_13', '--img-size', '224', '384', '--batch-size', '8', '2', '1'], 'as many batch sizes'),
        (['--models', 'cvt_13', '--points', '64x1', '--img-size', '64'], 'either --points'),
        (['--models', 'no_such_model*'], "'no_such_model*' matches no model"),
        (['--models', 'cvt_13', '--results-file', str(tmp_path / 'r.txt')], 'must be .csv, .json or .md'),
        (['--img-size', '64'], 'name the models'),
        (['--suite', 'grc', '--models', 'pvt_v2_b0'], 'matches no GRC model'),
    ]:
        assert tool.main(argv) == 2
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


# --------------------------------------------------------------------------------------------------------------------
# suites


def test_suite_cvt_ls(tmp_path):
    stdout, res = run_suite(tmp_path, 'cvt_ls', '--bench', 'inference', '--points', '64x1', '--repeats', '1',
                            '--num-warm-iter', '0', '--num-bench-iter', '1')
    assert '## CvT-LS (long-short attention) vs CvT (full attention) against input size' in stdout
    assert '| model | input | batch | params (M) | GFLOPs/img |' in stdout and '| latency / baseline |' in stdout
    assert [(r['model'], r['input_size'], r['batch_size']) for r in res['rows']] == [
        ('cvt_ls_13', [3, 64, 64], 1), ('cvt_13', [3, 64, 64], 1)]
    assert [r['latency_ratio'] for r in res['rows']][1] == 1.0 and res['rows'][0]['latency_ratio'] > 0
    assert all(r['gflops'] > 0 and r['peak_mib'] is not None for r in res['rows'])
    assert (tmp_path / 'cvt_ls.csv').read_text().startswith('model,input_size,batch_size,')


def test_suite_vil_ls_full_attention_counterpart(tmp_path):
    stdout, res = run_suite(tmp_path, 'vil_ls', '--bench', 'inference', '--models', 'vil_ls_medium',
                            'vil_ls_medium@full', '--baseline', 'vil_ls_medium@full', '--points', '224x1',
                            '--repeats', '1', '--num-warm-iter', '0', '--num-bench-iter', '1', '--no-memory')
    assert [(r['label'], r['spec']) for r in res['rows']] == [
        ('vil_ls_medium', 'vil_ls_medium'), ('vil_ls_medium (full attention)', 'vil_ls_medium@full')]
    ls, full = res['rows']
    assert full['gflops'] > ls['gflops'] and full['latency_ratio'] == 1.0
    assert '| vil_ls_medium (full attention) | 224x224 |' in stdout


def test_suite_grc_pairs_each_model_with_its_base(tmp_path):
    tool = load_tool('benchmark')
    assert tool.grc_pairs(['pvt_v2_b[01]_grc', 'pvt_v2_b0_grc']) == [
        ('pvt_v2_b0', 'pvt_v2_b0_grc'), ('pvt_v2_b1', 'pvt_v2_b1_grc')]
    assert len(tool.grc_pairs(['*_grc'])) == 16
    stdout, res = run_suite(tmp_path, 'grc', '--models', 'pvt_v2_b0_grc', '--batch-size', '1', '--repeats', '1',
                            '--num-warm-iter', '0', '--num-bench-iter', '1', '--no-memory')
    base, grc = res['rows']
    assert (base['model'], grc['model'], grc['baseline']) == ('pvt_v2_b0', 'pvt_v2_b0_grc', 'pvt_v2_b0')
    assert grc['params'] > base['params'] and grc['gflops'] > base['gflops'] > 0
    assert grc['latency_ratio'] == pytest.approx(grc['latency_ms'] / base['latency_ms'])
    assert 'at most 1.25x' in stdout


def test_suite_sequence(tmp_path, capsys):
    tool = load_tool('benchmark')
    assert tool.main(['--suite', 'sequence', '--lengths', '256', '512', '--threads', '1', '--budget-s', '0',
                      '--out', str(tmp_path)]) == 0
    report = json.loads((tmp_path / 'sequence.json').read_text())
    assert {r['name'] for r in report['rows']} == {
        'sdpa_full', 'ls_bidir_w8_r32', 'sdpa_causal', 'ls_causal_blocked', 'ls_causal_official', 'lra_ls',
        'lra_full', 'lm_ls_causal', 'lm_sdpa_causal'}
    assert all(r['time_s'] > 0 and r['peak_mb'] is not None for r in report['rows'])
    assert 'ls_causal_blocked/sdpa_causal time @512' in report['ratios']
    assert (tmp_path / 'sequence.png').stat().st_size > 1000
    assert '| layer | ls_causal_blocked |' in (tmp_path / 'sequence.md').read_text()
    # in-process calls cannot restart the interpreter with other allocator settings
    assert tool.main(['--suite', 'sequence', '--allocator', 'reuse', '--out', str(tmp_path)]) == 2
    assert 'restarts the process' in capsys.readouterr().err


def test_suite_sequence_reusing_allocator(tmp_path):
    # the tool restarts itself with the allocator settings and says so in its report
    proc = run_benchmark(tmp_path, '--suite', 'sequence', '--lengths', '256', '--only', 'layer', '--names',
                         'ls_bidir_w8_r32', '--budget-s', '0', '--allocator', 'reuse', '--out', str(tmp_path))
    report = json.loads((tmp_path / 'sequence.json').read_text())
    assert report['allocator'] == 'reuse' and [r['name'] for r in report['rows']] == ['ls_bidir_w8_r32']
    assert 'allocator reuse' in proc.stdout


def test_suite_hsw(tmp_path):
    tool = load_tool('benchmark')
    assert tool.main(['--suite', 'hsw', '--lengths', '256', '512', '--budget-s', '1', '--num-bench-iter', '1',
                      '--flat-full-max', '256', '--out', str(tmp_path)]) == 0
    report = json.loads((tmp_path / 'hsw.json').read_text())
    assert [(r['tokens'], r['model']) for r in report['rows']] == [
        (n, m) for n in (256, 512) for m in ('HSW', 'HSW-LS', 'flat')]
    flat512 = report['rows'][-1]
    assert flat512['blocks_timed'] == '1 of 8, time x 8' and flat512['params'] == report['rows'][2]['params'] + 256 * 96
    assert all(r['median_s'] > 0 for r in report['rows'])
    assert (tmp_path / 'hsw.png').stat().st_size > 0 and '| 512 |' in (tmp_path / 'hsw.md').read_text()
