"""Smoke tests of the benchmark command lines (tools/bench_*.py) at the tiniest settings that run every code path.

Each tool runs as a subprocess with 1-2 timed passes and ``--out`` under ``tmp_path``; the tests check the exit code,
the markdown table headers on stdout and the keys and rows of the JSON. The numbers themselves are not checked
(timings on a shared machine are noise at these settings). All run with ``--threads 1``: with 2 threads on 2
busy cores, OpenMP synchronization can slow each op to milliseconds (cvt_ls_13 at 64x64: 3.5 s a pass against
0.06 s with 1 thread while another process kept both cores busy). ``bench_vil_ls.py`` only offers 224 and 384 (one
registered model each), so it runs vil_ls_medium at 224, the smaller of the two.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / 'tools'


def run_tool(script: str, tmp_path: Path, *args: str) -> Tuple[str, Dict[str, Any]]:
    """Runs a tool with ``--out`` into ``tmp_path``; returns its stdout and the JSON it wrote."""
    out = tmp_path / 'results.json'
    proc = subprocess.run(
        [sys.executable, str(TOOLS / script), *args, '--threads', '1', '--out', str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f'Wrote {out}' in proc.stderr
    return proc.stdout, json.loads(out.read_text())


def load_tool(name: str):
    """Imports a tool script as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_grc(tmp_path):
    stdout, res = run_tool(
        'bench_grc.py', tmp_path, '--models', 'pvt_v2_b0_grc', '--batch-size', '1', '2', '--warmup', '1',
        '--iters', '2', '--budget', '20', '--floor')
    assert '| GRC model | base | batch | params base | params GRC | GFLOPs base | GFLOPs GRC | ΔFLOPs | ' \
           'ms/img base | ms/img GRC | img/s base | img/s GRC | slowdown | ≤ 1.25x | floor: matmuls | ' \
           'floor: + memory attention |' in stdout
    assert set(res) == {'machine', 'machine_info', 'settings', 'rows', 'wall_time_s'}
    assert res['settings']['pairs'] == [['pvt_v2_b0', 'pvt_v2_b0_grc']]
    assert [(r['model'], r['base'], r['batch_size']) for r in res['rows']] == [
        ('pvt_v2_b0_grc', 'pvt_v2_b0', 1), ('pvt_v2_b0_grc', 'pvt_v2_b0', 2)]
    for r in res['rows']:
        assert r['rounds'] == 2 and r['timing_base']['iters'] == r['timing_grc']['iters'] == 2
        assert r['timing_base']['batch_size'] == r['timing_grc']['batch_size'] == r['batch_size']
        assert r['params_grc'] > r['params_base'] and r['gflops_grc'] > r['gflops_base'] > 0
        assert r['slowdown'] == pytest.approx(r['ms_per_image_grc'] / r['ms_per_image_base'])
        assert r['images_per_s_grc'] == pytest.approx(1e3 / r['ms_per_image_grc'])
        assert r['meets_target'] == (r['slowdown'] <= 1.25)
        assert r['paired_slowdown'] > 0 and r['floor_matmul_slowdown'] > 0 and r['floor_attention_slowdown'] > 0
        assert f"| pvt_v2_b0_grc | pvt_v2_b0 | {r['batch_size']} | " in stdout


def test_bench_grc_model_selection():
    tool = load_tool('bench_grc')
    assert tool.parse_args([]).pairs == [
        ('pvt_v2_b2', 'pvt_v2_b2_grc'), ('swin_tiny_patch4_window7_224', 'swin_tiny_patch4_window7_224_grc'),
        ('deit_small_patch16_224', 'deit_small_patch16_224_grc')]
    assert tool.resolve_pairs(['pvt_v2_b[01]_grc', 'pvt_v2_b0_grc']) == [
        ('pvt_v2_b0', 'pvt_v2_b0_grc'), ('pvt_v2_b1', 'pvt_v2_b1_grc')]
    all_pairs = tool.parse_args(['--all']).pairs
    assert len(all_pairs) == 16 and all(grc == base + '_grc' for base, grc in all_pairs)
    with pytest.raises(SystemExit):
        tool.parse_args(['--models', 'pvt_v2_b0'])  # a base model, not a GRC model


def test_bench_cvt_ls(tmp_path):
    stdout, res = run_tool(
        'bench_cvt_ls.py', tmp_path, '--models', 'cvt_ls_13', 'cvt_13', '--sizes', '64', '--baselines',
        '--throughput-size', '64', '--fit-min', '64', '--warmup', '0', '--iters', '1', '--budget', '20')
    assert '| size | cvt_ls_13 ms/img | cvt_ls_13 GFLOPs | cvt_ls_13 peak MiB | cvt_13 ms/img | cvt_13 GFLOPs | ' \
           'cvt_13 peak MiB | cvt_13 / cvt_ls_13 time |' in stdout
    assert '| model | time exponent | FLOPs exponent | sizes fitted |' in stdout
    assert '| model | batch | GFLOPs/img | ms/img | img/s | GFLOP/s |' in stdout
    assert set(res) == {'machine', 'machine_info', 'settings', 'size_sweep', 'ratios_to_first_model', 'exponents',
                        'throughput', 'wall_time_s'}
    assert [(r['model'], r['size']) for r in res['size_sweep']] == [('cvt_ls_13', 64), ('cvt_13', 64)]
    assert [(r['model'], r['size'], r['batch_size']) for r in res['throughput']] == [
        ('cvt_ls_13', 64, 1), ('cvt_13', 64, 1)]
    assert set(res['ratios_to_first_model']) == {'cvt_13'}
    assert set(res['exponents']) == {'cvt_ls_13', 'cvt_13'}
    assert res['exponents']['cvt_13']['time_vs_pixels'] is None  # one size: nothing to fit
    assert all(r['gflops_per_image'] > 0 and r['peak_mib'] is not None for r in res['size_sweep'])


def test_bench_cvt_ls_isolated(tmp_path):
    # --isolated: the GFLOP/s table times each model in its own process(es)
    stdout, res = run_tool(
        'bench_cvt_ls.py', tmp_path, '--models', 'cvt_ls_13', '--sizes', '64', '--baselines', '--throughput-size',
        '64', '--warmup', '0', '--iters', '1', '--budget', '20', '--no-memory', '--isolated', '2')
    assert 'each model alone in 2 fresh processes, in alternating order' in stdout
    [row] = res['throughput']
    assert row['model'] == 'cvt_ls_13' and row['timing']['iters'] == 2 and row['achieved_gflop_per_s'] > 0


def test_bench_vil_ls(tmp_path):
    stdout, res = run_tool(
        'bench_vil_ls.py', tmp_path, '--sizes', '224', '--warmup', '0', '--iters', '1', '--budget', '1')
    assert '| size | model | attention in stages 1-2 | params | GFLOPs | images/s | ms/image |' in stdout
    assert '| size | speed-up of long-short (time full / time LS) | FLOPs full / LS |' in stdout
    assert set(res) == {'machine', 'machine_info', 'settings', 'rows', 'ratios'}
    assert [(r['model'], r['size'], r['attn']) for r in res['rows']] == [
        ('vil_ls_medium', 224, 'long-short'), ('vil_ls_medium (full attention)', 224, 'full')]
    assert [r['size'] for r in res['ratios']] == [224]
    assert res['ratios'][0]['flops_ratio'] > 1
