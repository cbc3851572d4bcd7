"""tools/validate.py on any image folder (suite `folder`) with a tools/train.py checkpoint, checked against an
evaluation written here with torchvision's ImageFolder and timm's transform (not lsvision's runner)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import load_tool
from PIL import Image
from torchvision.datasets import ImageFolder

import timm
from timm.data import create_transform, resolve_data_config

import lsvision  # noqa: F401  (registers the models)
from lsvision.train import parse_args, run

CLASSES = ('circle', 'square', 'triangle')
TINY = ['--model-kwargs', 'embed_dims=(16,32,32)', 'num_heads=(1,1,1)', 'depths=(1,1,1)']


def _validate_tool():
    return load_tool('validate')


def write_folder(root: Path, classes=CLASSES, per_class=(8, 3), size: int = 32) -> Path:
    """`root/train/<class>/*.png` and `root/val/<class>/*.png`: a bright square whose place tells the class."""
    rng = np.random.RandomState(0)
    for split, n in zip(('train', 'val'), per_class):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = rng.randint(0, 60, (size, size, 3)).astype(np.uint8)
                img[4:14, 4 + 6 * c:14 + 6 * c] = 230
                Image.fromarray(img).save(folder / f'{i:03d}.png')
    return root


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A 3-class folder and a 2-epoch tools/train.py run of a tiny cvt_ls_13 at 32 px on it."""
    root = tmp_path_factory.mktemp('folder_eval')
    data = write_folder(root / 'data')
    result = run(parse_args([str(data), '--model', 'cvt_ls_13', '--img-size', '32', '--epochs', '2', '-b', '8',
                             '-j', '0', '--lr', '2e-3', '--warmup-epochs', '0', '--seed', '1', '--output',
                             str(root / 'out'), '--experiment', 'run', '--progress', 'log', *TINY]))
    return data, Path(result['output_dir'])


def independent_top1(run_dir: Path, checkpoint: Path, val: Path):
    """Top-1 and per-class hits of the checkpoint on `val`: the model built from the run's args.yaml by hand,
    timm's load_checkpoint, torchvision's ImageFolder with timm's eval transform of the run's settings."""
    import yaml
    args = yaml.safe_load((run_dir / 'args.yaml').read_text())
    model = timm.create_model(args['model'], num_classes=args['num_classes'], **args['model_kwargs'])
    timm.models.load_checkpoint(model, str(checkpoint), use_ema=False)
    model.eval()
    transform = create_transform(**resolve_data_config(args, model=model), is_training=False)
    dataset = ImageFolder(str(val), transform=transform)
    assert dataset.classes == list(CLASSES)
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        predicted = model(images).argmax(1)
    targets = torch.tensor(dataset.targets)
    hits = predicted == targets
    return 100.0 * int(hits.sum()) / len(hits), {c: int(hits[targets == i].sum()) for i, c in enumerate(CLASSES)}


def test_folder_suite_counts_every_image_and_equals_an_independent_evaluation(trained, tmp_path, capsys):
    data, run_dir = trained
    last = run_dir / 'last.pth.tar'
    out = tmp_path / 'val'
    argv = ['--data-dir', str(data / 'val'), '--model', 'cvt_ls_13', '--checkpoint', str(last), '--workers', '0',
            '--out-dir', str(out), '--no-progress']
    assert _validate_tool().main(argv) == 0  # nothing but the data, the model and the checkpoint
    result = json.loads((out / 'results.json').read_text())
    (model,) = result['models']
    folder = model['suites']['folder']
    assert folder['count'] == 9 and folder['images'] == 9 and not folder['skipped']
    assert folder['classes'] == list(CLASSES) and model['num_classes'] == 3
    assert folder['protocol']['input_size'] == [3, 32, 32]  # the run's size, not the model's default 224
    top1, hits = independent_top1(run_dir, last, data / 'val')
    assert folder['top1'] == pytest.approx(top1)
    assert {c: r['count'] for c, r in folder['per_class'].items()} == {c: 3 for c in CLASSES}
    assert {c: round(r['top1'] * 3 / 100) for c, r in folder['per_class'].items()} == hits
    assert 'is not loaded' not in capsys.readouterr().err  # the head is the checkpoint's
    md = (out / 'results.md').read_text()
    assert '| circle | 3 |' in md
    assert '## Summary (accuracy in %)' in md and 'mCE' not in md  # said only where mCE is reported


def test_folder_of_other_classes_is_an_error_naming_both_lists(trained, tmp_path, capsys):
    data, run_dir = trained
    other = write_folder(tmp_path / 'other', classes=('circle', 'square', 'star'), per_class=(0, 2))
    argv = ['--data-dir', str(other / 'val'), '--model', 'cvt_ls_13', '--checkpoint', str(run_dir / 'last.pth.tar'),
            '--workers', '0', '--out-dir', str(tmp_path / 'val'), '--no-progress']
    assert _validate_tool().main(argv) == 2
    err = capsys.readouterr().err
    assert "['circle', 'square', 'star']" in err and "['circle', 'square', 'triangle']" in err
    assert "not classes of the model: ['star']" in err and "classes without a folder: ['triangle']" in err


def test_class_map_names_the_classes_of_a_checkpoint_without_a_run(trained, tmp_path, capsys):
    """A bare state dict (no run beside it): --model-kwargs and --class-map give what the run would."""
    data, run_dir = trained
    bare = tmp_path / 'weights.pth'
    torch.save(torch.load(run_dir / 'last.pth.tar', weights_only=True)['state_dict'], bare)
    common = ['--data-dir', str(data / 'val'), '--model', 'cvt_ls_13', '--checkpoint', str(bare), '--workers', '0',
              '--out-dir', str(tmp_path / 'val'), '--no-progress', '--img-size', '32']
    assert _validate_tool().main(common + TINY + ['num_classes=3']) == 2
    assert '--class-map' in capsys.readouterr().err
    class_map = tmp_path / 'classes.txt'
    class_map.write_text('\n'.join(CLASSES) + '\n')
    assert _validate_tool().main(common + TINY + ['--num-classes', '3', '--class-map', str(class_map)]) == 0
    folder = json.loads((tmp_path / 'val' / 'results.json').read_text())['models'][0]['suites']['folder']
    assert folder['count'] == 9
    capsys.readouterr()
    # another class count (the model's default 1000, or one given): one message, in the tool's flags, with the
    # checkpoint's own count; no 'a new head starts from scratch' before the stop
    for extra in ([], ['--num-classes', '5'], ['num_classes=5']):
        flags = TINY + extra if extra[:1] != ['--num-classes'] else TINY + ['--class-map', str(class_map)] + extra
        assert _validate_tool().main(common + flags) == 2
        err = capsys.readouterr().err
        assert f'{bare} holds a 3-class head (head.weight) and the model was built for ' in err
        assert err.rstrip().endswith('give --num-classes 3') and 'from scratch' not in err and 'create_model' not in err
    assert _validate_tool().main(common + TINY + ['num_classes=5', '--num-classes', '3']) == 2
    assert 'disagree' in capsys.readouterr().err


def test_model_and_models_are_one_choice(tmp_path):
    with pytest.raises(SystemExit):
        _validate_tool().parse_args(['--data-dir', str(tmp_path), '--model', 'cvt_13', '--models', 'cvt_21'])
    with pytest.raises(SystemExit):
        _validate_tool().parse_args(['--data-dir', str(tmp_path)])


def test_classes_come_from_the_checkpoint_when_the_training_folder_is_gone(trained, tmp_path, capsys):
    """The run records its classes (checkpoint `class_names`, run folder `class_names.txt`): validating needs
    neither the training folder nor a class map."""
    data, run_dir = trained
    assert (run_dir / 'class_names.txt').read_text().split() == list(CLASSES)
    checkpoint = torch.load(run_dir / 'last.pth.tar', weights_only=True)
    assert checkpoint['class_names'] == list(CLASSES)
    checkpoint['args']['data_dir'] = str(tmp_path / 'moved_away')
    moved = tmp_path / 'run' / 'last.pth.tar'
    moved.parent.mkdir()
    torch.save(checkpoint, moved)
    argv = ['--data-dir', str(data / 'val'), '--model', 'cvt_ls_13', '--checkpoint', str(moved), '--workers', '0',
            '--out-dir', str(tmp_path / 'val'), '--no-progress']
    assert _validate_tool().main(argv) == 0
    assert json.loads((tmp_path / 'val' / 'results.json').read_text())['models'][0]['suites']['folder']['count'] == 9
    del checkpoint['class_names']
    torch.save(checkpoint, moved)
    assert _validate_tool().main(argv) == 2  # nothing says what the logits mean
    assert '--class-map' in capsys.readouterr().err
