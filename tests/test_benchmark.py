"""Tests of lsvision.bench: one measurement in this process, fresh processes in alternating order, out-of-memory
retries and time-outs, pooled rows and paired ratios, model specs and floors, reports and the exponent fit.

Fresh processes are forked from a server that imports torch, timm and lsvision once (seconds on a busy machine),
then each builds its model: the tests start as few as they can.
"""
import functools
import json
import os
import time

import pytest
import torch
import torch.nn as nn

from lsvision.bench import (
    Job,
    NoOpAttention,
    ProjectionsOnly,
    add_ratios,
    benchmark_table,
    combine,
    create_model,
    is_out_of_memory,
    measure,
    resolve_specs,
    run_fresh,
    run_jobs,
    spec_label,
    timing_stats,
)
from lsvision.flops import count_flops
from lsvision.layers import LongShortAttention2d
from lsvision.reports import csv_text, markdown_table, plot, write_reports

TINY_CVT_LS = dict(embed_dims=(16, 32, 32), num_heads=(1, 1, 2), depths=(1, 1, 1), num_classes=3)


class OutOfMemoryAbove(nn.Module):
    """Fails like a failed allocation when the batch is larger than ``limit`` (importable by the spawned child)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise MemoryError(f'out of memory at batch {x.shape[0]}')
        return self.linear(x)


class Sleeper(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def tiny_job(kind: str, **kwargs) -> Job:
    build = functools.partial(create_model, 'cvt_ls_13', **TINY_CVT_LS)
    return Job('tiny', build, img_size=32, batch_size=2, kind=kind, warmup=1, budget_s=0.05, threads=1, **kwargs)


@pytest.mark.parametrize('kind', ['inference', 'train'])
def test_measure_one_job(kind):
    row = measure(tiny_job(kind, flops=True))
    model = create_model('cvt_ls_13', **TINY_CVT_LS)
    assert row['params'] == sum(p.numel() for p in model.parameters())
    assert row['gflops'] == count_flops(model, (3, 32, 32)).gflops and row['mactivations'] > 0
    assert row['input_size'] == [3, 32, 32] and row['batch_size'] == 2 and row['pid'] == os.getpid()
    t = row['timing']
    assert t['passes'] >= 1 and len(t['times_s']) >= 1 and t['cpu_per_pass_s'] > 0
    assert 0 < t['p10_s'] <= t['median_s'] <= t['p90_s'] and t['iqr_s'] >= 0
    assert row['peak_mib'] is not None and row['peak_mib'] >= 0


def test_timing_stats_and_budget():
    stats = timing_stats([4., 1., 3., 2.], passes=4)
    assert (stats['median_s'], stats['p10_s'], stats['p90_s'], stats['iqr_s']) == pytest.approx((2.5, 1.3, 3.7, 1.5))
    # blocked_autorange runs for about budget_s: a 20 ms pass over a 0.2 s budget is timed some 10 times, not once
    job = Job('sleep', functools.partial(Sleeper, 0.02), [((8,), None)], warmup=0, budget_s=0.2, memory=False)
    t = measure(job)['timing']
    assert 5 <= t['passes'] <= 20 and 0.02 <= t['median_s'] < 0.1


def test_fresh_processes_alternate_and_retry_out_of_memory():
    sleep = Job('sleep', functools.partial(Sleeper, 0.0), [((8,), None)], warmup=0, budget_s=0.0)
    oom = Job('oom', functools.partial(OutOfMemoryAbove, 2), [((8,), None)], batch_size=3, warmup=0, budget_s=0.0)
    logged = []
    runs = run_jobs([sleep, oom], repeats=2, log=logged.append)
    pids = [r['pid'] for job_runs in runs for r in job_runs]
    assert len(set(pids)) == 4 and os.getpid() not in pids  # each run in a process of its own
    order = [line.split('] ')[1].split(' ')[0] for line in logged if line.startswith('  [')]
    assert order == ['sleep', 'oom', 'oom', 'sleep']  # A B, then B A
    assert any('oom: out of memory; retrying at batch 2' in line for line in logged)
    assert [r['batch_size'] for r in runs[1]] == [2, 2]  # the later run keeps the smaller batch
    with pytest.raises(RuntimeError, match='out of memory'):
        run_jobs([oom], retry=False)


def test_a_process_over_its_timeout_is_stopped():
    job = Job('slow', functools.partial(Sleeper, 30.0), [((8,), None)], warmup=0, budget_s=0.0, timeout_s=1)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match='died.*time-out of 1 s'):
        run_fresh(job)
    assert time.perf_counter() - t0 < 30
    assert is_out_of_memory(RuntimeError('x: the measuring process died (killed for memory, or over ...)'))
    assert not is_out_of_memory(RuntimeError('shape mismatch'))


def _run(pid: int, times, batch: int = 2, peak: float = 10.0):
    return dict(label='m', params=1, input_size=[3, 8, 8], batch_size=batch, pid=pid, peak_mib=peak,
                timing=dict(timing_stats(times, len(times)), cpu_per_pass_s=0.1))


def test_combine_pools_runs_and_ratios_are_per_image_and_paired():
    row = combine({'train': [_run(1, [0.3, 0.3]), _run(2, [0.5])]})
    assert row['train_step_ms'] == pytest.approx(300) and row['train_step_runs_ms'] == pytest.approx([300, 500])
    assert row['train_timing']['passes'] == 3 and row['pids'] == {'train': [1, 2]}
    assert row['train_memory_mib'] == 10.0 and row['train_images_per_s'] == pytest.approx(2 / 0.3)
    base = combine({'train': [_run(3, [0.1], batch=1), _run(4, [0.2], batch=1)]})  # e.g. retried at batch 1
    rows = [dict(row, spec='a', point=[8, 2], baseline='b'), dict(base, spec='b', point=[8, 2], baseline='b')]
    add_ratios(rows)
    a, b = rows
    # per image: a's 0.3 s for 2 images against b's 0.15 s for 1 (pooled), 0.15/0.1 and 0.25/0.2 (paired rounds)
    assert a['train_step_ratio'] == pytest.approx(0.3 / 2 / 0.15)
    assert a['train_step_ratio_rounds'] == pytest.approx([1.5, 1.25])
    assert a['train_step_ratio_paired'] == pytest.approx(1.375)
    assert 'train_memory_ratio' not in a  # different batches: no memory ratio
    assert b['train_step_ratio'] == 1.0 and b['train_step_ratio_paired'] == 1.0
    one_round = [dict(combine({'train': [_run(1, [0.3])]}), spec=s, point=[8, 2], baseline='b') for s in 'ab']
    add_ratios(one_round)
    assert 'train_step_ratio_paired' not in one_round[0] and one_round[0]['train_step_ratio'] == 1.0
    table = benchmark_table(rows)
    assert '| train time / baseline, paired |' in table and '| 1.38x (1.25-1.50) |' in table
    assert 'latency' not in table  # a column no row measured is left out


def test_reports_and_plot(tmp_path):
    row = dict(combine({'inference': [_run(1, [0.1, 0.2])]}), spec='m', point=[8, 2])
    paths = write_reports([row], tmp_path / 'r', '## table\n', {'repeats': 1})
    assert [p.name for p in paths] == ['r.json', 'r.csv', 'r.md']
    stored = json.loads((tmp_path / 'r.json').read_text())
    assert 'load average' in stored['machine'] and stored['rows'][0]['latency_ms'] == pytest.approx(150)
    header, values = csv_text([row]).splitlines()
    assert header.startswith('label,params,input_size,batch_size') and '3x8x8' in values
    png = plot({'m, inference': [(8, 150.0, 10.0), (16, 400.0, None)]}, tmp_path / 'p.png', 'title')
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert markdown_table(['a', 'b'], [['x', '1']]) == '| a | b |\n| --- | ---: |\n| x | 1 |'


def test_specs():
    assert resolve_specs(['cvt_ls_13', 'cvt_ls_1[37]', 'vil_ls_medium@full']) == [
        'cvt_ls_13', 'cvt_ls_17', 'vil_ls_medium@full']
    assert resolve_specs(['resnet18']) == ['resnet18']  # any timm model
    assert spec_label('vil_ls_medium@full') == 'vil_ls_medium (full attention)'
    assert spec_label('cvt_ls_13@projonly') == 'cvt_ls_13 (projections only)'
    with pytest.raises(ValueError, match='matches no model'):
        resolve_specs(['no_such_model*'])
    with pytest.raises(ValueError, match='full-attention switch'):
        spec_label('cvt_ls_13@full')
    tiny = dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 1, 1, 1), num_classes=3)
    long_short = [sum(isinstance(m, LongShortAttention2d) for m in create_model(spec, **tiny).modules())
                  for spec in ('vil_ls_medium', 'vil_ls_medium@full')]
    assert long_short == [2, 0]  # stages 1-2 long-short, or full attention in every stage


def test_floor_models():
    """``@noattn``: every attention a no-op; ``@projonly``: each attention runs its projections (with their backward)
    but none of the attention math; other attentions are refused, naming what works."""
    noattn = create_model('cvt_ls_13@noattn', **TINY_CVT_LS)
    full = create_model('cvt_ls_13', **TINY_CVT_LS)
    attns = [m.attn for m in noattn.modules() if hasattr(m, 'attn')]
    assert len(attns) == 3 and all(isinstance(a, NoOpAttention) for a in attns)
    assert sum(p.numel() for p in noattn.parameters()) < sum(p.numel() for p in full.parameters())
    for name in ('cvt_ls_13', 'cvt_13'):
        model = create_model(name + '@projonly', **TINY_CVT_LS).train()
        floors = [m.attn for m in model.modules() if isinstance(getattr(m, 'attn', None), ProjectionsOnly)]
        assert len(floors) == 3
        assert sum(p.numel() for p in model.parameters()) == sum(
            p.numel() for p in create_model(name, **TINY_CVT_LS).parameters())
        model(torch.randn(2, 3, 64, 64)).square().sum().backward()
        last = floors[-1].attn
        projections = ([last.qkv.k.dw.weight, last.qkv.v.pw.weight, last.dynamic_proj.pw.weight]
                       if name == 'cvt_ls_13' else [last.conv_proj_k.conv.weight, last.proj_v.weight])
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projections + [last.proj.weight])
        if name == 'cvt_ls_13':  # the attention math (DualLN onwards) did not run
            assert last.norm_local.weight.grad is None and last.norm_global.weight.grad is None
    with pytest.raises(ValueError, match='no projections-only floor.*@noattn'):
        create_model('swin_tiny_patch4_window7_224@projonly', embed_dim=16, depths=(1, 1, 1, 1),
                     num_heads=(1, 1, 1, 1), num_classes=3)
    with pytest.raises(ValueError, match='no block'):
        create_model('resnet18@noattn', num_classes=3)
