"""Tests of tools/benchmark.py (the command line over lsvision.bench) at the tiniest settings that run every path:
the model benchmark against a baseline, ``--reparam``, the suites, the sweep and the cards; the reports committed in
docs/benchmarks/ and every documented command line against the current tool.

Every measurement runs in a fresh process (forked from a server that imports torch, timm and lsvision once, seconds
on a busy machine), so the tests run the tool in this process and start as few measurements as they can; the numbers
are not checked (timings on a shared machine are noise at these settings), their consistency is (ratios from the
rows, pooled medians between the runs' medians).
"""
import ast
import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from _helpers import load_tool

from lsvision import bench
from lsvision.sequence import create_model

ROOT = Path(__file__).resolve().parents[1]
QUICK = ('--threads', '1', '--num-warm-iter', '0', '--budget-s', '0')
REMOVED_FLAGS = ('--num-bench-iter', '--allocator')
"""Flags of the tool before its rewrite on torch.utils.benchmark, each with one value: docs/benchmarks/README.md says
that the commands with them are records of runs of that tool."""


@pytest.fixture(scope='module')
def tool():
    return load_tool('benchmark')


def run_tool(tool, capsys, *argv: str) -> Tuple[str, str]:
    """Runs the tool in this process (its measurements in fresh ones); returns its stdout and stderr."""
    assert tool.main(list(argv)) == 0, capsys.readouterr().err[-4000:]
    captured = capsys.readouterr()
    return captured.out, captured.err


def run_suite(tool, capsys, tmp_path: Path, name: str, *args: str) -> Tuple[str, Dict[str, Any]]:
    """Runs ``--suite name`` into ``tmp_path``; returns its stdout and the JSON report it wrote."""
    out, err = run_tool(tool, capsys, '--suite', name, '--out', str(tmp_path), '--repeats', '1', *QUICK, *args)
    assert f'Wrote {tmp_path / name}.' in err
    assert (tmp_path / f'{name}.png').stat().st_size > 1000 and (tmp_path / f'{name}.csv').exists()
    return out, bench.read_report(tmp_path / f'{name}.json')


def test_train_benchmark_against_a_baseline_in_fresh_processes(tool, capsys, tmp_path):
    out = tmp_path / 'bench.json'
    stdout, stderr = run_tool(tool, capsys, '--bench', 'train', '--models', 'test_vit', '--baseline', 'test_resnet',
                              '--batch-size', '2', '--repeats', '2', '--no-flops', '--results-file', str(out), *QUICK)
    rows = bench.read_report(out)['rows']
    assert [r['spec'] for r in rows] == ['test_vit', 'test_resnet']  # the baseline is added to the models
    pids = [pid for r in rows for pid in r['pids']['train']]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    runs = [line.split('] ')[1].split(' ')[0] for line in stderr.splitlines() if line.startswith('  [')]
    assert runs == ['test_vit', 'test_resnet', 'test_resnet', 'test_vit']  # alternating order
    vit, resnet = rows
    for r in rows:
        assert min(r['train_step_runs_ms']) <= r['train_step_ms'] <= max(r['train_step_runs_ms'])
        assert r['train_memory_mib'] > 0 and 'latency_ms' not in r  # train only
    assert vit['train_step_ratio'] == pytest.approx(vit['train_step_ms'] / resnet['train_step_ms'])
    rounds = [v / b for v, b in zip(vit['train_step_runs_ms'], resnet['train_step_runs_ms'])]
    assert vit['train_step_ratio_rounds'] == pytest.approx(rounds)
    assert f"{vit['train_step_ratio_paired']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}) |" in stdout
    assert '| train time / baseline, paired |' in stdout and 'latency' not in stdout


def test_run_reparam(tool, capsys, tmp_path):
    # the earlier spelling `run`, with --reparam: NAME@reparam beside NAME, with its ratio to NAME
    run_tool(tool, capsys, 'run', '--models', 'test_resnet', '--img-size', '64', '--reparam', '--repeats', '1',
             '--out', str(tmp_path), *QUICK)
    plain, folded = bench.read_report(tmp_path / 'results.json')['rows']
    assert (plain['spec'], folded['spec'], folded['label']) == (
        'test_resnet', 'test_resnet@reparam', 'test_resnet (reparameterized)')
    assert folded['baseline'] == 'test_resnet' and folded['latency_ratio'] > 0
    assert 0 < folded['gflops'] <= plain['gflops']  # folding never adds FLOPs
    assert plain['input_size'] == [3, 64, 64] and plain['peak_mib'] is not None
    assert (tmp_path / 'results.csv').read_text().startswith('label,')
    assert '| test_resnet (reparameterized) | 64x64 |' in (tmp_path / 'results.md').read_text()


def test_points_and_bad_input(tool, tmp_path, capsys):
    assert tool.resolve_points([224, 384, 768], [8, 2, 1], None) == [(224, 8), (384, 2), (768, 1)]
    assert tool.resolve_points([224, 384], [4], None) == [(224, 4), (384, 4)]
    assert tool.resolve_points(None, [1, 8], None) == [(None, 1), (None, 8)]
    assert tool.parse_args(['--points', '384x2', '768X1', '--models', 'cvt_13']).points == [(384, 2), (768, 1)]
    assert tool.parse_args(['--models', 'cvt_13']).bench == 'inference'
    assert tool.parse_args(['run', '--bench', 'both', '--models', 'cvt_13']).bench == 'both'
    args = tool.parse_args(['--models', 'cvt_13', '--amp', '--amp-dtype', 'bfloat16', '--torchcompile'])
    job = tool.model_job('cvt_13', args, 64, 2, 'train')
    assert (job.amp, job.compile, job.kind, job.img_size, job.batch_size) == ('bfloat16', 'default', 'train', 64, 2)
    assert (job.warmup, job.budget_s, job.timeout_s) == (3, 10.0, 1800.0)
    assert args.device == ('cuda' if torch.cuda.is_available() else 'cpu')
    with pytest.raises(SystemExit):
        tool.parse_args(['--points', '384'])
    old = tmp_path / 'old.json'
    old.write_text(json.dumps({'machine': 'm', 'points': []}))
    for argv, message in [
        (['--models', 'cvt_13', '--img-size', '224', '384', '--batch-size', '8', '2', '1'], 'as many batch sizes'),
        (['--models', 'cvt_13', '--points', '64x1', '--img-size', '64'], 'either --points'),
        (['--models', 'no_such_model*'], "'no_such_model*' matches no model"),
        (['--models', 'cvt_13', '--results-file', str(tmp_path / 'r.txt')], 'must be .csv, .json or .md'),
        (['--img-size', '64'], 'name the models'),
        (['--suite', 'grc', '--models', 'pvt_v2_b0'], 'needs GRC models'),
        (['--suite', 'hsw', '--names', 'nope'], 'unknown --names'),
        (['sweep', '--models', 'cvt_ls_13@full'], 'full-attention switch'),
        (['sweep', '--refit', str(old)], 'lacks settings, rows, command, budget, fit_min'),
        (['cards', '--models', 'resnet18', '--cards-dir', str(tmp_path)], 'not registered lsvision models'),
    ]:
        assert tool.main(argv) == 2
        assert message in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ['old.json']  # nothing written


def test_suite_cvt_ls(tool, capsys, tmp_path):
    stdout, res = run_suite(tool, capsys, tmp_path, 'cvt_ls', '--bench', 'inference', '--points', '64x1', '--no-flops')
    assert '## CvT-LS (long-short attention) vs CvT (full attention) against input size' in stdout
    assert '| model | input | batch | params (M) | latency ms (p10-p90) |' in stdout
    assert [(r['spec'], r['input_size'], r['batch_size']) for r in res['rows']] == [
        ('cvt_ls_13', [3, 64, 64], 1), ('cvt_13', [3, 64, 64], 1)]  # Swin-T only at 224
    assert res['rows'][1]['latency_ratio'] == 1.0 and res['rows'][0]['latency_ratio'] > 0
    assert all(r['peak_mib'] is not None and 'gflops' not in r for r in res['rows'])


def test_suite_grc_pairs_each_model_with_its_base(tool, capsys, tmp_path):
    stdout, res = run_suite(tool, capsys, tmp_path, 'grc', '--models', 'pvt_v2_b0_grc', '--batch-size', '1',
                            '--no-memory')
    base, grc = res['rows']
    assert (base['spec'], grc['spec'], grc['baseline']) == ('pvt_v2_b0', 'pvt_v2_b0_grc', 'pvt_v2_b0')
    assert grc['params'] > base['params'] and grc['gflops'] > base['gflops'] > 0
    assert grc['latency_ratio'] == pytest.approx(grc['latency_ms'] / base['latency_ms'])
    assert 'at most 1.25x' in stdout


def test_suite_sequence(tool, capsys, tmp_path):
    _, res = run_suite(tool, capsys, tmp_path, 'sequence', '--lengths', '64',
                       '--names', 'ls_causal_blocked', 'lm_ls_causal')
    assert [(r['kind'], r['name'], r['n'], r['input_size']) for r in res['rows']] == [
        ('layer', 'ls_causal_blocked', 64, [64, 256]), ('model', 'lm_ls_causal', 64, [64])]
    assert all(r['train_step_ms'] > 0 and r['train_memory_mib'] is not None for r in res['rows'])
    assert '| layer: ls_causal_blocked | 64x256 | 1 |' in (tmp_path / 'sequence.md').read_text()


def test_suite_hsw_times_one_flat_block_of_eight(tool, capsys, tmp_path):
    _, res = run_suite(tool, capsys, tmp_path, 'hsw', '--lengths', '128', '--names', 'flat', '--flat-full-max', '64')
    (flat,) = res['rows']
    assert (flat['tokens'], flat['label'], flat['time_scale']) == (128, 'flat', 8)
    assert flat['params'] == sum(p.numel() for p in create_model('hsw_flat_tiny', max_len=128).parameters())
    assert flat['latency_ms'] == pytest.approx(8e3 * flat['inference_timing']['median_s'])  # 1 block of 8, x 8
    assert '| 128 | ' in (tmp_path / 'hsw.md').read_text()


def test_sweep_ends_a_curve_at_the_budget(tool, capsys, tmp_path):
    # a budget no pass meets: the curve ends at its first size, which is kept and marked
    run_tool(tool, capsys, 'sweep', '--models', 'cvt_ls_13', '--sizes', '64', '32', '--num-warm-iter', '0',
             '--budget-s', '0', '--out', str(tmp_path), '--name', 's', '--time-budget', '1e-9', '--no-flops')
    (row,) = bench.read_report(tmp_path / 's.json', sweep=True)['rows']
    assert row['input_size'] == [3, 32, 32] and row['exceeded'][0].startswith('cpu time')
    assert '| cvt_ls_13 | 32x32 | 1 |' in (tmp_path / 's.md').read_text() and (tmp_path / 's.png').exists()


def test_sweep_exponents(tool):
    rows = [dict(label='m', input_size=[3, s, s], latency_ms=2 * s ** 3, peak_mib=s * s, gflops=7.0)
            for s in (8, 16, 32)]
    rows.append(dict(label='one', input_size=[3, 32, 32], latency_ms=1.0, peak_mib=None))
    fits = tool.sweep_exponents(rows, fit_min=16)  # y = c * pixels ** k: time 1.5, memory 1, FLOPs 0
    assert (fits['m']['sizes'], fits['m']['cpu_time']) == ([16, 32], None)
    assert [fits['m'][k] for k in ('time', 'memory', 'flops')] == pytest.approx([1.5, 1.0, 0.0])
    assert fits['one'] == dict(time=None, cpu_time=None, memory=None, flops=None, sizes=[32])  # one size: no fit


@pytest.mark.parametrize('path', sorted(p for p in (ROOT / 'docs' / 'benchmarks').glob('*.json')
                                   # the own formats of gpu_check.py, record_demo.py (make demo's run) and cuda-count
                                   if p.name not in ('gpu.json', 'digits_demo.json')
                                   and not p.name.startswith('cuda_counts')), ids=lambda p: p.name)
def test_committed_reports_are_read_by_the_tool(tool, capsys, path, tmp_path):
    data = json.loads(path.read_text())
    report = bench.read_report(path, sweep='fit_min' in data)
    assert bench.benchmark_table([r for r in report['rows'] if 'skipped' not in r]).count('\n') >= 3
    if 'fit_min' in data:  # a sweep: refitting it at its own fit_min gives its stored exponents
        shutil.copy(path, tmp_path / path.name)
        run_tool(tool, capsys, 'sweep', '--refit', str(tmp_path / path.name), '--fit-min', str(data['fit_min']))
        refit = json.loads((tmp_path / path.name).read_text())['exponents']
        for label, stored in data['exponents'].items():
            assert refit[label].pop('sizes') == stored.pop('sizes')
            assert refit[label] == pytest.approx(stored)


def documented_commands() -> List[Tuple[str, str]]:
    """Every ``tools/benchmark.py ...`` command line of README.md, the Makefile, docs/ and model_cards/README.md."""
    paths = [ROOT / 'README.md', ROOT / 'Makefile', ROOT / 'model_cards' / 'README.md', *ROOT.glob('docs/**/*.md')]
    commands = []
    for path in paths:
        text = re.sub(r'\\\n\s*', ' ', path.read_text())  # continued lines
        text = re.sub(r'`[^`\n][^`]*`', lambda m: m.group(0).replace('\n', ' '), text)  # code spans over lines
        commands += [(path.name, m.group(1)) for m in re.finditer(r'tools/benchmark\.py([^`\n]*)', text)]
    return commands


def test_documented_commands_parse(tool):
    commands = documented_commands()
    assert len(commands) > 20
    for flag in REMOVED_FLAGS:
        with pytest.raises(SystemExit):
            tool.parse_args([flag, '1'])
    for where, line in commands:
        argv = shlex.split(line.replace('--suite NAME', '--suite cvt_ls'))  # the docs' placeholder for a suite
        for flag in REMOVED_FLAGS:  # a record of a run of the earlier tool: the rest must still parse
            if flag in argv:
                del argv[argv.index(flag):argv.index(flag) + 2]
        if '--help' not in argv:
            try:
                tool.parse_args(argv)
            except SystemExit:
                pytest.fail(f'{where}: `tools/benchmark.py{line}` does not parse with the current tool')


def test_cards_reuse_renders_the_stored_measurements(tool, tmp_path):
    shutil.copytree(ROOT / 'model_cards', tmp_path / 'model_cards')
    shutil.copy(ROOT / 'README.md', tmp_path / 'README.md')
    (tmp_path / 'model_cards' / 'cvt_13.md').write_text('edited by hand')
    assert tool.main(['cards', '--reuse', '--cards-dir', str(tmp_path / 'model_cards'),
                      '--readme', str(tmp_path / 'README.md')]) == 0
    for card in (ROOT / 'model_cards').glob('*.md'):
        assert (tmp_path / 'model_cards' / card.name).read_text() == card.read_text()
    assert (tmp_path / 'README.md').read_text() == (ROOT / 'README.md').read_text()


MEASURING_NAMES = ('bench', 'measure', 'flops', 'zoo', 'card', 'profil')


def test_one_benchmark_tool_and_a_thin_measuring_layer():
    """The architecture's measuring layer: every benchmark is a sub-command of tools/benchmark.py (no other tool
    named bench), and the files named for measuring (bench, measure, flops, zoo, card, profil) under lsvision/
    and tools/ come to at most 1,800 lines together. Report files have one home, lsvision/reports.py, a low layer that
    imports no other lsvision module (evaluation, training, detection and the measuring code write through it)."""
    assert [p.name for p in (ROOT / 'tools').glob('*.py') if 'bench' in p.name] == ['benchmark.py']
    lines = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for folder in ('lsvision', 'tools')
             for path in (ROOT / folder).rglob('*.py') if any(n in path.name for n in MEASURING_NAMES)}
    assert 'lsvision/bench.py' in lines and 'tools/benchmark.py' in lines
    assert sum(lines.values()) <= 1800, f'{sum(lines.values())} lines of measuring code: {lines}'
    tree = ast.parse((ROOT / 'lsvision' / 'reports.py').read_text())
    imported = [n.module or '' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported and not [m for m in imported if m.startswith('lsvision') or m == ''], imported
