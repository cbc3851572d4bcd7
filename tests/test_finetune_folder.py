"""README's "Fine-tune on your own folder": its commands (train, resume, evaluate, and the offline train line) as
written, on a tiny 3-class folder, each run as a script (``run_script``) without network (HF_HUB_OFFLINE=1). The
weights file is a tiny cvt_13 configuration's, saved as a plain state dict with an ImageNet head (as a released file);
only the data path, the output root, the file name, the epochs (10 -> 1, 20 -> 2), the size (32 px) and the model's
width are changed for a CPU test. The config is the real configs/finetune.yaml."""
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from _helpers import TINY_FAMILIES, load_tool, model_kwargs_args, run_script
from test_folder_eval import CLASSES, independent_top1, write_folder

import timm

ROOT = Path(__file__).resolve().parents[1]
TINY_CVT = TINY_FAMILIES['cvt_13']
SMALL_RUN = ['-j', '0', '--progress', 'log', '--img-size', '32', '--model-kwargs', *model_kwargs_args(TINY_CVT)]


def _readme_commands():
    section = (ROOT / 'README.md').read_text().split('## Fine-tune on your own folder', 1)
    assert len(section) == 2, 'README.md lost its "## Fine-tune on your own folder" section'
    section = section[1].split('\n## ', 1)[0]
    blocks = re.findall(r'```bash\n(.*?)```', section, flags=re.S)
    commands = [shlex.split(line) for block in blocks for line in block.splitlines()
                if line.strip() and not line.startswith('#')]
    assert [c[1] for c in commands] == ['tools/train.py'] * 2 + ['tools/validate.py', 'tools/train.py'], commands
    return commands


def _adapted(command, data: Path, out: Path, weights: Path):
    """The README's command with this test's data, output and weights places, and a short run."""
    replace = {'my_data': str(data), 'my_data/val': str(data / 'val'), 'output/train': str(out), '20': '2',
               'cvt_13.bin': str(weights)}
    args = [replace.get(a, a) for a in command[1:]]
    args = [a.replace('output/train/', f'{out}/') for a in args]
    if command[1] == 'tools/train.py':
        args += SMALL_RUN + ([] if '--epochs' in args else ['--epochs', '1'])
    else:
        args += ['--workers', '0', '--no-progress', '--out-dir', str(out / 'eval')]
    return [sys.executable, *args]


def _run(command):
    done = run_script(command, cwd=ROOT, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE='1', PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, (command, done.stderr[-3000:])
    return done


def test_readme_fine_tune_commands_train_resume_and_evaluate_offline(tmp_path):
    data = write_folder(tmp_path / 'my_data', per_class=(6, 3))
    out = tmp_path / 'output' / 'train'
    weights = tmp_path / 'cvt_13.bin'
    torch.save(timm.create_model('cvt_13', **TINY_CVT).state_dict(), weights)  # 1000 classes, as released
    online, resume, validate, offline = _readme_commands()
    # the download line is the offline line without its file: the test (no network) runs the offline one
    at = offline.index('--pretrained-path')
    assert online == offline[:at] + offline[at + 2:]
    start = time.time()
    trained = _run(_adapted(offline, data, out, weights))
    assert time.time() - start < 120  # no hub retries: the file is read, nothing is downloaded
    assert f'loaded pretrained weights from {weights}' in trained.stderr
    assert 'new (not in the file): head.weight, head.bias; left out of the file: head.weight [1000, 64]' in \
        trained.stderr
    assert f"training split {data / 'train'}: 18 images in 3 classes (circle 6, square 6, triangle 6)" in \
        trained.stderr
    assert 'each epoch: 1 batches of up to 32, 18 of 18 training images (none left out)' in trained.stderr
    _run(_adapted(resume, data, out, weights))
    _run(_adapted(validate, data, out, weights))
    run_dir = out / 'my_run'
    args = yaml.safe_load((run_dir / 'args.yaml').read_text())
    assert args['img_size'] == 32 and args['model'] == 'cvt_13' and args['pretrained']
    assert args['epochs'] == 2 and args['layer_decay'] == 0.65 and args['mixup'] == 0  # the rest is the config's
    last = torch.load(run_dir / 'last.pth.tar', weights_only=True)
    assert last['args']['epochs'] == 2 and last['next_epoch'] == 2  # resumed: the second epoch ran
    with open(run_dir / 'summary.csv') as f:
        assert len(f.read().strip().splitlines()) == 1 + 2  # header + one row per epoch, across the resume
    (model,) = json.loads((out / 'eval' / 'results.json').read_text())['models']
    folder = model['suites']['folder']
    assert folder['count'] == 3 * len(CLASSES) and folder['classes'] == list(CLASSES)
    assert folder['protocol']['input_size'] == [3, 32, 32]
    top1, _ = independent_top1(run_dir, run_dir / 'last.pth.tar', data / 'val')
    assert folder['top1'] == top1
    # one number per checkpoint: training's last validation (float32, as the recipe trains) is validate.py's
    assert json.loads((run_dir / 'result.json').read_text())['top1'] == pytest.approx(top1, abs=1e-9)


def test_weights_errors_give_the_fix_in_train_flags(tmp_path, caches, caplog):
    """The README's download line offline (empty caches), and a model without released weights under the same
    config: no traceback, the fix in train.py's flags first, then the Python route; --no-pretrained, followed,
    trains."""
    data = write_folder(tmp_path / 'my_data', per_class=(2, 1))
    train = load_tool('train')
    online = _adapted(_readme_commands()[0], data, tmp_path / 'out', tmp_path / 'unused')[2:]  # no python, tool
    assert train.main(online) == 2
    log = caplog.text
    assert 'the released weights of cvt_13 could not be downloaded' in log and 'Traceback' not in log
    assert log.index('Fix: give a weights file of cvt_13, --pretrained-path FILE') < log.index(
        'or train from random weights, --no-pretrained') < log.index('In Python (library users): could not fetch')
    caplog.clear()
    unreleased = online + ['--model', 'cvt_ls_13', '--model-kwargs', *model_kwargs_args(TINY_FAMILIES['cvt_ls_13'])]
    assert train.main(unreleased) == 2
    assert 'cvt_ls_13 has no released weights. Fix: give a weights file of cvt_ls_13, --pretrained-path FILE' in \
        caplog.text and 'NoPretrainedWeightsError' not in caplog.text
    assert train.main(unreleased + ['--no-pretrained', '--experiment', 'scratch']) == 0  # the hint, followed


def test_scripts_here_run_offline_as_a_new_interpreter_would(tmp_path):
    """huggingface_hub read HF_HUB_OFFLINE when the forkserver imported it: run_script's script sees the value of its
    own environment, as the README's commands in a new interpreter would."""
    script = tmp_path / 'offline.py'
    script.write_text('import huggingface_hub.constants as c\nprint(c.HF_HUB_OFFLINE)\n')
    env = {k: v for k, v in os.environ.items() if k not in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE')}
    for value, offline in (('1', 'True'), (None, 'False')):
        done = run_script([sys.executable, str(script)], env=env if value is None else dict(env, HF_HUB_OFFLINE=value))
        assert done.returncode == 0 and done.stdout.strip() == offline, done.stderr[-2000:]
