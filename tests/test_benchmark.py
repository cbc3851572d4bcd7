"""Tests for lsvision.benchmark and tools/benchmark.py: one model, reports, sweeps with budgets, exponent fits, curve
specs.

Everything runs a real model (cvt_ls_13) at tiny inputs with one thread; timings are only checked for consistency
(positive, throughput = batch / latency), never against values, since the machine is shared.
"""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bench_tools import load_tool

from lsvision.benchmark import (
    BenchmarkConfig,
    SweepBudget,
    SweepConfig,
    benchmark_model,
    fit_exponent,
    markdown_table,
    parse_curve,
    plot_sweep,
    resolution_sweep,
    resolve_model_names,
    sweep_exponents,
    sweep_markdown,
)
from lsvision.models import list_models

ROOT = Path(__file__).resolve().parents[1]
CVT_LS_13_PARAMS = 20_185_464  # specs/long_short.md §5


def test_benchmark_model_inference_and_train():
    config = BenchmarkConfig(img_size=64, batch_size=2, warmup=1, iters=2, bench='both')
    row = benchmark_model('cvt_ls_13', config)
    assert row['model'] == 'cvt_ls_13' and row['input_size'] == [3, 64, 64] and row['batch_size'] == 2
    assert row['params'] == CVT_LS_13_PARAMS
    assert 0.2 < row['gflops'] < 1.0  # 4.95 GFLOPs at 224, about linear in pixels: ~0.4 at 64
    assert row['mactivations'] > 0 and row['unsupported_ops'] == {}
    assert row['timed_passes'] == row['timing']['iters'] == 2
    assert 0 < row['latency_p10_ms'] <= row['latency_ms'] <= row['latency_p90_ms']
    assert row['images_per_s'] == pytest.approx(2 / row['latency_ms'] * 1e3)
    assert row['ms_per_image'] == pytest.approx(row['latency_ms'] / 2)
    assert row['peak_mib'] is not None and row['peak_mib'] >= 0
    assert row['train_step_ms'] > 0 and row['train_images_per_s'] == pytest.approx(2e3 / row['train_step_ms'])
    # training keeps the activations for backward and the gradients: more than an inference pass needs
    assert row['train_memory_mib'] > row['peak_mib']
    with pytest.raises(ValueError, match='bench must be one of'):
        BenchmarkConfig(bench='training')


def test_benchmark_tool_run_train_reparam(tmp_path):
    # the earlier spelling `run --train` (= --bench both), with --reparam: inference (plain and reparameterized, in the
    # same alternating rounds) and training, each in its own process
    out = tmp_path / 'bench'
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'benchmark.py'), 'run', '--models', 'cvt_ls_13', '--img-size', '64',
         '--batch-size', '2', '--warmup', '1', '--iters', '3', '--threads', '1', '--repeats', '1', '--train',
         '--reparam', '--out', str(out), '--results-file', str(tmp_path / 'rows.csv')],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / 'results.json').read_text())
    assert {'machine', 'machine_info', 'settings', 'rows'} <= set(res)
    assert res['machine_info']['torch_threads'] == 1 and 'load average' in res['machine']
    (row,) = res['rows']
    assert row['params'] == CVT_LS_13_PARAMS and row['gflops'] > 0
    assert row['timed_passes'] == row['reparam_timing']['iters'] == 3
    assert 0 < row['reparam_latency_p10_ms'] <= row['reparam_latency_ms'] <= row['reparam_latency_p90_ms']
    assert 0 < row['reparam_gflops'] <= row['gflops']  # folding never adds FLOPs (BatchNorms go)
    assert row['reparam_ratio'] > 0 and row['train_step_ms'] > 0 and row['train_memory_mib'] > 0
    assert row['pids']['inference'] != row['pids']['train']  # each kind of bench in a fresh process
    with open(out / 'results.csv') as f:
        (csv_row,) = list(csv.DictReader(f))
    assert csv_row['model'] == 'cvt_ls_13' and csv_row['input_size'] == '3x64x64'
    assert float(csv_row['latency_ms']) == pytest.approx(row['latency_ms'])
    assert (tmp_path / 'rows.csv').read_text() == (out / 'results.csv').read_text()
    md = (out / 'results.md').read_text()
    assert '| model | input | batch | params (M) | GFLOPs/img |' in md and '| reparam / plain |' in md
    assert '| train step ms (p10-p90) |' in md and '| cvt_ls_13 | 64x64 | 2 | 20.19 |' in md
    assert 'reparameterized' in proc.stderr and f"({row['reparam_ratio']:.3f}x plain)" in proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith('| cvt_ls_13 | 64x64 |')


def test_benchmark_tool_rejects_bad_input(tmp_path, capsys):
    tool = load_tool('benchmark')
    assert tool.main(['run', '--models', 'no_such_model*', '--out', str(tmp_path)]) == 2
    assert "'no_such_model*' matches no model" in capsys.readouterr().err
    assert tool.main(['sweep', '--models', 'cvt_ls_13@full', '--out', str(tmp_path)]) == 2
    assert 'full-attention switch' in capsys.readouterr().err
    assert tool.main(['cards', '--models', 'resnet18', '--cards-dir', str(tmp_path)]) == 2
    assert 'not registered lsvision models' in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_resolve_model_names():
    assert resolve_model_names(['cvt_ls_13', 'cvt_1*', 'cvt_ls_13']) == ['cvt_ls_13', 'cvt_13', 'cvt_13_384']
    assert resolve_model_names(['resnet18']) == ['resnet18']  # any timm model
    assert resolve_model_names(['*']) == list_models()
    with pytest.raises(ValueError, match='matches no model'):
        resolve_model_names(['cvt_ls_99'])


def test_markdown_table():
    assert markdown_table(['a', 'b', 'c'], [['x', 'y', '1']], left_columns=2) == (
        '| a | b | c |\n| --- | --- | ---: |\n| x | y | 1 |')


def test_fit_exponent_synthetic():
    xs = [224 ** 2, 512 ** 2, 1024 ** 2, 1536 ** 2]
    assert fit_exponent(xs, [3e-7 * x for x in xs]) == pytest.approx(1.0)
    assert fit_exponent(xs, [2e-12 * x ** 2 + 0 for x in xs]) == pytest.approx(2.0)
    assert fit_exponent(xs, [5.0 * x ** 1.37 for x in xs]) == pytest.approx(1.37)
    # linear plus quadratic: the slope lies between and rises with the share of the quadratic term
    mixed = fit_exponent(xs, [x + 1e-6 * x ** 2 for x in xs])
    assert 1.0 < mixed < 2.0
    assert fit_exponent([4.0, 4.0], [1.0, 2.0]) is None
    with pytest.raises(ValueError):
        fit_exponent([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError):
        fit_exponent([1.0, 2.0], [1.0])


def test_sweep_exponents_use_sizes_from_fit_min():
    def point(size, seconds, over=False):
        return {'label': 'm', 'size': size, 'pixels': size * size, 'time_per_image_s': seconds,
                'cpu_time_per_image_s': seconds / 2, 'peak_mib': size * size / 1e4, 'gflops': None,
                'exceeded': ['x'] if over else []}

    # quadratic from 256 on; the 64 point (an overhead floor) is below fit_min and ignored
    points = [point(64, 1.0), point(256, 2.0), point(512, 8.0), point(1024, 32.0, over=True)]
    result = {'curves': [{'label': 'm'}], 'points': points}
    e = sweep_exponents(result, fit_min=256)['m']
    assert e['sizes'] == [256, 512, 1024]
    assert e['time'] == pytest.approx(1.0) and e['cpu_time'] == pytest.approx(1.0)  # time ∝ size², pixels ∝ size²
    assert e['memory'] == pytest.approx(1.0) and e['flops'] is None


def test_parse_curve():
    assert parse_curve('cvt_13').model_kwargs == {}
    full = parse_curve('vil_ls_medium@full')
    assert full.model == 'vil_ls_medium' and full.model_kwargs == {'attn_types': ('full',) * 4}
    assert full.label == 'vil_ls_medium (full attention)'
    with pytest.raises(ValueError, match='full-attention switch'):
        parse_curve('cvt_ls_13@full')
    with pytest.raises(ValueError, match='unknown model'):
        parse_curve('cvt_ls_99')


def test_budget_clock():
    point = {'time_per_image_s': 2.0, 'cpu_time_per_image_s': 0.5, 'peak_mib': 100.0}
    assert SweepBudget(time_per_image_s=1.0, clock='cpu').exceeded(point) == []
    assert SweepBudget(time_per_image_s=1.0, clock='wall').exceeded(point) == ['wall time 2 s/img > 1 s']
    assert SweepBudget(peak_mib=50.0).exceeded(point) == ['memory 100 MiB > 50 MiB']
    with pytest.raises(ValueError):
        SweepBudget(clock='gpu')


def test_sweep_stops_curve_over_budget(tmp_path):
    curves = [parse_curve('cvt_ls_13')]
    config = SweepConfig(threads=1, warmup=0, iters=1, flops=False, memory_limit_mib=2048)
    # a budget no pass can meet: the curve ends after its first size, which is kept and marked
    result = resolution_sweep(curves, [48, 32, 64], SweepBudget(time_per_image_s=1e-9, clock='cpu'), config)
    assert [p['size'] for p in result['points']] == [32]
    (point,) = result['points']
    assert point['status'] == 'ok' and point['exceeded'][0].startswith('cpu time')
    assert point['time_per_image_s'] > 0 and point['cpu_time_per_image_s'] > 0 and point['peak_mib'] is not None
    assert result['curves'][0]['stopped_at'] == 32
    # a point that cannot finish in time is stopped, and ends its curve as well
    config.timeout_s = 0.5
    result = resolution_sweep(curves, [32, 48], SweepBudget(time_per_image_s=100.0), config)
    assert [(p['size'], p['status']) for p in result['points']] == [(32, 'timeout')]
    assert result['curves'][0]['stopped_at'] == 32


def test_sweep_within_budget_runs_every_size(tmp_path):
    curves = [parse_curve('cvt_ls_13')]
    config = SweepConfig(threads=1, warmup=0, iters=1, isolate=False)
    result = resolution_sweep(curves, [32, 64], SweepBudget(time_per_image_s=100.0, peak_mib=1e5), config)
    assert [p['size'] for p in result['points']] == [32, 64] and result['curves'][0]['stopped_at'] is None
    assert all(not p['exceeded'] and p['gflops'] > 0 for p in result['points'])
    flops_exponent = result['exponents']['cvt_ls_13']['flops']
    assert 0.9 < flops_exponent < 1.1  # long-short attention: FLOPs linear in the pixel count
    json.dumps(result)
    md = sweep_markdown(result, command='python tools/benchmark.py sweep')
    assert '| cvt_ls_13 | 64x64 | yes | 4,096 |' in md and 'Produced by `python tools/benchmark.py sweep`' in md
    png = plot_sweep(result, tmp_path / 'sweep.png')
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert math.isfinite(result['wall_time_s'])
    # the tool fits a stored sweep again without measuring
    result['command'] = 'python tools/benchmark.py sweep'
    stored = tmp_path / 'stored.json'
    stored.write_text(json.dumps(result))
    assert load_tool('benchmark').main(['sweep', '--refit', str(stored), '--fit-min', '64']) == 0
    refit = json.loads(stored.read_text())
    assert refit['exponents']['cvt_ls_13']['sizes'] == [64] and refit['exponents']['cvt_ls_13']['flops'] is None
    assert 'fitted again from 64' in (tmp_path / 'stored.md').read_text() and (tmp_path / 'stored.png').exists()


def test_sweep_measures_floor_curves():
    """A sweep curve NAME@noattn or NAME@projonly measures that floor model, not NAME itself."""
    curves = [parse_curve(spec) for spec in ('cvt_ls_13', 'cvt_ls_13@projonly', 'cvt_ls_13@noattn')]
    config = SweepConfig(threads=1, warmup=0, iters=1, isolate=False)
    result = resolution_sweep(curves, [32], SweepBudget(time_per_image_s=100.0), config)
    gflops = {p['label']: p['gflops'] for p in result['points']}
    assert gflops['cvt_ls_13'] > gflops['cvt_ls_13 (projections only)'] > gflops['cvt_ls_13 (attention no-op)'] > 0


def test_no_attention_floor_model():
    """``NAME@noattn``: every block's attention is a no-op of the same output shape; the rest of the model runs."""
    from lsvision.benchmark import NO_ATTENTION, NoOpAttention, create_benchmark_model, parse_curve
    curve = parse_curve('cvt_ls_13@noattn')
    assert curve.floor == NO_ATTENTION and curve.model == 'cvt_ls_13'
    tiny = dict(embed_dims=(16, 32, 32), num_heads=(1, 1, 1), depths=(1, 1, 1), num_classes=3)
    model = create_benchmark_model('cvt_ls_13', 'cpu', tiny, floor=NO_ATTENTION)
    full = create_benchmark_model('cvt_ls_13', 'cpu', tiny)
    attns = [m.attn for m in model.modules() if hasattr(m, 'attn')]
    assert len(attns) == 3 and all(isinstance(a, NoOpAttention) for a in attns)
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.parameters())
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 3)
    with pytest.raises(ValueError, match='no block'):
        create_benchmark_model('resnet18', 'cpu', dict(num_classes=3), floor=NO_ATTENTION)


def test_projections_only_floor_model():
    """``NAME@projonly``: each block's attention runs its own projections (and their backward in training) but none of
    the attention math; long-short and CvT attention; other attentions are refused, naming what works."""
    from lsvision.benchmark import PROJECTIONS_ONLY, ProjectionsOnly, create_benchmark_model, parse_curve
    curve = parse_curve('cvt_ls_13@projonly')
    assert curve.floor == PROJECTIONS_ONLY and curve.label == 'cvt_ls_13 (projections only)'
    tiny = dict(embed_dims=(16, 32, 32), num_heads=(1, 1, 2), depths=(1, 1, 1), num_classes=3)
    x = torch.randn(2, 3, 64, 64)
    for name in ('cvt_ls_13', 'cvt_13'):
        model = create_benchmark_model(name, 'cpu', tiny, floor=PROJECTIONS_ONLY).train()
        full = create_benchmark_model(name, 'cpu', tiny)
        floors = [m.attn for m in model.modules() if isinstance(getattr(m, 'attn', None), ProjectionsOnly)]
        assert len(floors) == 3
        # the attention's own modules, so the same parameters
        assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in full.parameters())
        model(x).square().sum().backward()
        last = floors[-1].attn  # stage 3: a prefix (cls) token
        projections = ([last.qkv.k.dw.weight, last.qkv.v.pw.weight, last.dynamic_proj.pw.weight]
                       if name == 'cvt_ls_13' else [last.conv_proj_k.conv.weight, last.proj_v.weight])
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in projections + [last.proj.weight])
        if name == 'cvt_ls_13':  # the attention math (DualLN onwards) did not run
            assert last.norm_local.weight.grad is None and last.norm_global.weight.grad is None
    swin = dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), num_classes=3)
    with pytest.raises(ValueError, match='no projections-only floor.*@noattn'):
        create_benchmark_model('swin_tiny_patch4_window7_224', 'cpu', swin, floor=PROJECTIONS_ONLY)
    with pytest.raises(ValueError, match='no block'):
        create_benchmark_model('resnet18', 'cpu', dict(num_classes=3), floor=PROJECTIONS_ONLY)
