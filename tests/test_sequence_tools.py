"""Smoke tests of the sequence demos and benchmark (tools/demo_listops.py, demo_bytelm.py, bench_sequence.py).

Tiny budgets: they check that every code path runs and that the reports have their rows, not the numbers.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lsvision.sequence.budget_train import lr_factor

TOOLS = Path(__file__).resolve().parents[1] / 'tools'


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_listops(tmp_path, capsys):
    out = tmp_path / 'listops.json'
    assert load_tool('demo_listops').main(['--budget', '1', '--threads', '1', '--out', str(out)]) == 0
    stdout = capsys.readouterr().out
    assert '| long-short (w 8, r 8) | 86,954 |' in stdout and '| full (SDPA) | 84,362 |' in stdout
    report = json.loads(out.read_text())
    assert [r['model'] for r in report['results']] == ['ls', 'full']
    assert all(0 <= r['test_acc'] <= 1 and r['steps'] >= 1 for r in report['results'])
    assert 0.05 < report['majority'] < 0.2


def test_demo_bytelm(tmp_path, capsys):
    out = tmp_path / 'bytelm.json'
    tool = load_tool('demo_bytelm')
    assert tool.main(['--budget', '1', '--threads', '1', '--eval-windows', '8', '--out', str(out)]) == 0
    stdout = capsys.readouterr().out
    assert '| causal long-short (W 64, l 8, r 1) | 497,160 |' in stdout
    report = json.loads(out.read_text())
    assert all(0 < r['val_bits_per_byte'] < 9 for r in report['results'])
    assert lr_factor(0, 0.) == pytest.approx(1 / 30) and lr_factor(100, 0.5) == 1.
    assert lr_factor(100, 0.8) == pytest.approx(0.5) and lr_factor(100, 1.) == 0.02


def test_bench_sequence(tmp_path, capsys):
    stem = tmp_path / 'bench'
    assert load_tool('bench_sequence').main(['--lengths', '256', '512', '--threads', '1', '--budget', '0',
                                             '--out', str(stem)]) == 0
    report = json.loads(stem.with_suffix('.json').read_text())
    names = {r['name'] for r in report['rows']}
    assert {'sdpa_full', 'ls_bidir_w8_r32', 'sdpa_causal', 'ls_causal_blocked', 'ls_causal_official',
            'lra_ls', 'lra_full', 'lm_ls_causal', 'lm_sdpa_causal'} == names
    assert all(r['time_s'] > 0 for r in report['rows'])
    assert 'ls_causal_blocked/sdpa_causal time @512' in report['ratios']
    assert stem.with_suffix('.png').stat().st_size > 1000
    assert '| layer | ls_causal_blocked |' in stem.with_suffix('.md').read_text()


def test_bench_sequence_reusing_allocator(tmp_path):
    # the tool restarts itself with the allocator settings and says so in its report
    stem = tmp_path / 'bench'
    proc = subprocess.run(
        [sys.executable, str(TOOLS / 'bench_sequence.py'), '--lengths', '256', '--only', 'layer', '--names',
         'ls_bidir_w8_r32', '--budget', '0', '--allocator', 'reuse', '--out', str(stem)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(stem.with_suffix('.json').read_text())
    assert report['allocator'] == 'reuse' and [r['name'] for r in report['rows']] == ['ls_bidir_w8_r32']
    assert 'allocator reuse' in proc.stdout
    with pytest.raises(SystemExit):  # in-process calls cannot restart the interpreter
        load_tool('bench_sequence').main(['--lengths', '256', '--allocator', 'reuse', '--out', str(stem)])
