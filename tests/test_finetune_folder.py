"""README's "Fine-tune on your own folder": its three commands (train, resume, evaluate) as written, on a tiny
3-class folder, in fresh processes. Only the data path, the output root, the epochs (10 -> 1, 20 -> 2), the size
(64 -> 32 px) and a tiny model width are changed for a CPU test; the config is the real configs/cvt_ls_13.yaml."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from test_folder_eval import CLASSES, TINY, independent_top1, write_folder

ROOT = Path(__file__).resolve().parents[1]
SMALL_RUN = ['-b', '6', '-j', '0', '--progress', 'log', *TINY]


def _readme_commands():
    section = (ROOT / 'README.md').read_text().split('## Fine-tune on your own folder', 1)
    assert len(section) == 2, 'README.md lost its "## Fine-tune on your own folder" section'
    block = re.search(r'```bash\n(.*?)```', section[1], flags=re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith('#')]
    assert [c[1] for c in commands] == ['tools/train.py', 'tools/train.py', 'tools/validate.py'], commands
    return commands


def _adapted(command, data: Path, out: Path):
    """The README's command with this test's data and output places, and a short run."""
    replace = {'my_data': str(data), 'my_data/val': str(data / 'val'), 'output/train': str(out), '64': '32',
               '10': '1', '20': '2'}
    args = [replace.get(a, a) for a in command[1:]]
    args = [a.replace('output/train/', f'{out}/') for a in args]
    if command[1] == 'tools/train.py':
        args += SMALL_RUN
    else:
        args += ['--workers', '0', '--no-progress', '--out-dir', str(out / 'eval')]
    return [sys.executable, *args]


def test_readme_fine_tune_commands_train_resume_and_evaluate(tmp_path):
    data = write_folder(tmp_path / 'my_data', per_class=(6, 3))
    out = tmp_path / 'output' / 'train'
    train, resume, validate = (_adapted(c, data, out) for c in _readme_commands())
    for command in (train, resume, validate):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stderr[-3000:])
    run_dir = out / 'my_run'
    args = yaml.safe_load((run_dir / 'args.yaml').read_text())
    assert args['img_size'] == 32 and args['input_size'] in (None, [3, 32, 32])  # the flag beat the config
    assert args['epochs'] == 2 and args['aa'] and args['mixup'] == 0.8  # the rest is the config's
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
