"""The model table (tools/demo.py, `make models`) and lsvision's model listing."""
import json
import subprocess
import sys
from pathlib import Path

import timm

import lsvision

ROOT = Path(__file__).resolve().parents[1]


def test_list_models_only_lists_lsvision_models():
    names = lsvision.models.list_models()
    assert 'cvt_ls_13' in names and 'cvt_13' in names
    assert 'resnet50' not in names and 'resnet50' in timm.list_models('resnet50')
    assert lsvision.models.list_models('cvt_ls_13*') == ['cvt_ls_13', 'cvt_ls_13_384', 'cvt_ls_13_448']


def test_demo_prints_table_and_json(tmp_path):
    out = tmp_path / 'demo.json'
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'demo.py'), '--models', 'cvt_13', '--out', str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert '| cvt_13 | 224x224 | 19,997,480 | 4.585 | (1, 1000) |' in proc.stdout
    report = json.loads(out.read_text())
    assert report['models'][0]['params'] == 19_997_480


def test_demo_unknown_model_is_explained(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'tools' / 'demo.py'), '--models', 'no_such_model'],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert "no lsvision model matches ['no_such_model']; known: " in proc.stderr
