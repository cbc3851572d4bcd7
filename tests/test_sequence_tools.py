"""Smoke tests of the sequence demos (tools/demo_listops.py, demo_bytelm.py; the benchmark is in test_bench_tools.py).

Tiny budgets: they check that every code path runs and that the reports have their rows, not the numbers.
"""
import json

import pytest
from _helpers import load_tool

from lsvision.sequence.budget_train import lr_factor


def test_demo_listops(tmp_path, capsys):
    out = tmp_path / 'listops.json'
    tool = load_tool('demo_listops')
    assert tool.main(['--budget', '1', '--threads', '1', '--num-train', '2000', '--out', str(out)]) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    assert 'ListOps-mini: 2000 train / 1000 test samples' in captured.err
    assert '| long-short (w 8, r 8) | 86,954 |' in stdout and '| full (SDPA) | 84,362 |' in stdout
    report = json.loads(out.read_text())
    assert '| full + GRC cache | 106,318 |' in stdout and '| long-short (w 8, r 8) + GRC cache | 108,910 |' in stdout
    assert [r['model'] for r in report['results']] == ['full', 'grc', 'ls', 'ls_grc']
    assert all(0 <= r['test_acc'] <= 1 and r['steps'] >= 1 for r in report['results'])
    assert 0.05 < report['majority'] < 0.2
    with pytest.raises(SystemExit):
        tool.parse_args(['--num-train', '8'])  # fewer than a batch of 64
    assert 'smaller than a batch (--batch-size 64)' in capsys.readouterr().err


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
