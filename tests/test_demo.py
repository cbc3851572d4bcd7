"""The model table (tools/demo.py, `make models`), the model listing, and `make demo` against its recorded run."""
import json
import sys
from pathlib import Path

from _helpers import load_tool, run_script

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
    proc = run_script([sys.executable, str(ROOT / 'tools' / 'demo.py'), '--models', 'cvt_13', '--out', str(out)],
                      cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert '| cvt_13 | 224x224 | 19,997,480 | 4.585 | (1, 1000) |' in proc.stdout
    report = json.loads(out.read_text())
    assert report['models'][0]['params'] == 19_997_480


def test_demo_unknown_model_is_explained(capsys):
    # in this process (test_demo_prints_table_and_json runs the command)
    assert load_tool('demo').main(['--models', 'no_such_model']) == 2
    assert "no lsvision model matches ['no_such_model']; known: " in capsys.readouterr().err


# `make demo` (tools/train.py with configs/digits_demo.yaml) and the numbers README.md and docs/training.md quote from
# its recorded run (docs/benchmarks/digits_demo.json, written by tools/record_demo.py)

RECORD = ROOT / 'docs' / 'benchmarks' / 'digits_demo.json'
VAL_IMAGES = 359  # the digits demo's validation split


def _record() -> dict:
    return json.loads(RECORD.read_text())


def _cpu(machine: str) -> str:
    return machine.split(', ')[0]


def test_the_demo_gives_its_recorded_numbers(tmp_path):
    """The whole demo (its 8 epochs: --time-budget 0, so that a busy machine does not cut it short) gets the recorded
    number of validation images right on the recording's CPU model; elsewhere float rounding may move one or two."""
    from lsvision.reports import machine_description
    record = _record()
    proc = run_script([sys.executable, str(ROOT / 'tools' / 'train.py'), '--output', str(tmp_path),
                       '--time-budget', '0'], cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / 'digits_demo' / 'result.json').read_text())
    for key in ('model', 'model_kwargs', 'params', 'epochs_done', 'num_updates', 'metrics_of'):
        assert result[key] == record[key], key
    same_cpu = _cpu(machine_description()) == _cpu(record['machine'])
    correct, recorded = (round(top1 * VAL_IMAGES / 100) for top1 in (result['top1'], record['top1']))
    assert correct == recorded if same_cpu else abs(correct - recorded) <= 2, (correct, recorded)
    printed = proc.stdout.strip().splitlines()[0]
    if same_cpu:  # the printed line up to its time, which the machine's load decides
        assert printed.rsplit(', ', 1)[0] == record['printed'].rsplit(', ', 1)[0]
    assert printed.startswith("a CvT-LS built by cvt_ls_13's constructor with the run's model_kwargs (0.")


def test_readme_and_training_doc_quote_the_recorded_demo():
    record = _record()
    measured = json.loads((ROOT / 'model_cards' / 'measurements.json').read_text())['models']['cvt_ls_13']
    readme = ' '.join((ROOT / 'README.md').read_text().split('\n## ', 1)[0].split())  # the opening, one line
    training = ' '.join((ROOT / 'docs' / 'training.md').read_text().split())
    numbers = f"{record['top1']:.2f} % top-1 after {record['train_seconds']:.0f} s of training on 2 CPU cores"
    size = f"{record['params'] / 1e6:.2f}M parameters"
    assert numbers in readme and size in readme  # the README names no load (the recorded run does)
    assert f"where the registered cvt_ls_13 has {measured['params'] / 1e6:.2f}M" in readme
    assert '[recorded run](docs/benchmarks/digits_demo.md)' in readme
    assert f"{numbers} at load average {record['load_average']}," in training and size in training
    assert '(benchmarks/digits_demo.md)' in training
    assert record['command'] == 'python tools/train.py' and not record['stopped_by_time_budget']  # make demo's run
