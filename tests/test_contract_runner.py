"""contract/run.py: timm's own model tests run on the models a package registers, and a broken model is caught.

The runner runs as a script (``run_script``: a process from the tests' forkserver, torch and timm imported) on two
tiny ResNets (tests/contract_fixture_models.py), the second of which ignores ``num_classes``. A few seconds each,
timm's test collection most of it; ``--jobs 2`` starts two new interpreters (about 20 s on an idle machine). The
first run also fetches timm's test file from the sdist into contract/.cache.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import run_script

import timm

TESTS = Path(__file__).resolve().parent
RUNNER = TESTS.parent / 'contract' / 'run.py'


def _run_contract(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python contract/run.py --packages contract_fixture_models ARGS`` (from the tests' forkserver; the jobs of
    ``--jobs`` are new interpreters, which find the fixture package through PYTHONPATH)."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get('PYTHONPATH')])]))
    return run_script([sys.executable, str(RUNNER), '--packages', 'contract_fixture_models', *args],
                      cwd=cwd, env=env, timeout=900)


@pytest.fixture
def contract_run(monkeypatch):
    """contract/run.py as a module (its folder on sys.path for this test only)."""
    monkeypatch.syspath_prepend(str(RUNNER.parent))
    import run
    return run


def test_fetch_uses_the_cached_test_file_without_pip(contract_run, tmp_path, monkeypatch):
    monkeypatch.setenv('PIP_NO_INDEX', '1')  # pip would fail: the file must come from the cache
    cached = tmp_path / 'timm-0.0.0' / 'test_models.py'
    cached.parent.mkdir()
    cached.write_text('def test_nothing(): pass\n')
    assert contract_run.fetch_timm_tests('0.0.0', tmp_path) == cached


def test_fetch_without_the_sdist_says_what_to_do(contract_run, tmp_path, monkeypatch):
    monkeypatch.setenv('PIP_NO_INDEX', '1')  # offline: pip finds no timm 0.0.0 sdist
    with pytest.raises(RuntimeError, match=r"could not download the timm 0\.0\.0 sdist(.|\n)*put timm 0\.0\.0's "
                                           r'tests/test_models\.py at'):
        contract_run.fetch_timm_tests('0.0.0', tmp_path)
    assert not any(tmp_path.rglob('*')), 'a failed fetch leaves nothing in the cache'


def test_contract_catches_a_model_that_ignores_num_classes(tmp_path):
    """Run as `make contract` runs it, in two jobs that share out the tests: the merged report and matrix hold both
    models, each test run once."""
    report = tmp_path / 'report.json'
    proc = _run_contract('--models', '*', '--report', str(report), '--jobs', '2', cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log[-4000:]

    data = json.loads(report.read_text())
    assert f'timm-{timm.__version__}' in data['tests_source']  # the test file of the installed timm
    assert data['models'] == ['contract_tiny_resnet', 'contract_tiny_resnet_no_num_classes']
    good, broken = (data['outcomes'][m] for m in data['models'])
    # timm's per-model tests ran on the package models (and nothing else did)
    assert {'test_model_forward', 'test_model_backward', 'test_model_default_cfgs', 'test_model_forward_features',
            'test_model_forward_intermediates', 'test_model_forward_torchscript', 'test_model_forward_fx'} <= set(good)
    assert set(good.values()) == {'passed'}, good
    # asking for 42 classes (backward test) or 0 (default-cfgs test) gets 1000 logits
    assert broken['test_model_backward'] == 'failed' and broken['test_model_default_cfgs'] == 'failed', broken
    assert broken['test_model_forward'] == 'passed'
    assert 'assert 1000 == 42' in log
    # the matrix names the broken model's failures
    merged = proc.stdout.split('2 jobs =====')[1]  # after each job's own output
    row = next(line for line in merged.splitlines() if line.strip().startswith('contract_tiny_resnet_no_num'))
    assert row.split()[1:].count('F') == sum(o == 'failed' for o in broken.values()) >= 2
    assert next(line for line in merged.splitlines() if line.strip().startswith('contract_tiny_resnet ')).split()[1:]
    assert data['exitstatus'] == 1
    # each test ran in exactly one job: the jobs' own counts add up to the merged outcomes, and both jobs worked
    ran = [sum(int(n) for n, what in re.findall(r'(\d+) (passed|failed)', line))
           for line in proc.stdout.splitlines() if re.match(r'=+ .*\d+ (passed|failed).* in [\d.]+s', line)]
    assert len(ran) == 2 and min(ran) > 0, ran
    assert sum(ran) == sum(o in ('passed', 'failed') for m in data['models'] for o in data['outcomes'][m].values())


def test_contract_names_the_models_when_a_pattern_matches_none(tmp_path):
    proc = _run_contract('--models', 'cvt_*', cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no model of ['contract_fixture_models'] matches --models 'cvt_*'" in proc.stderr
    assert 'contract_tiny_resnet, contract_tiny_resnet_no_num_classes' in proc.stderr


def test_contract_non_std_models_get_timms_token_output_tests(tmp_path):
    proc = _run_contract('--models', 'contract_tiny_resnet', '--non-std', 'contract_tiny_resnet', '--collect-only',
                         '-q', cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    collected = {line.split('::')[1].split('[')[0] for line in proc.stdout.splitlines() if '::' in line}
    assert 'test_model_default_cfgs_non_std' in collected and 'test_model_forward' in collected
    assert not collected & {'test_model_default_cfgs', 'test_model_forward_features'}
