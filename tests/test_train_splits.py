"""tools/train.py checks its image-folder splits before the first step: the validation split is scored under the
training split's classes, a mismatch of class folders, an empty class folder or a wrong num_classes is an error that
names the folders and says how to fix it (each hint followed here: the run then starts); the log counts the images
of each split and class and what an epoch leaves out; an unreadable validation image is left out and named."""
import logging
import math
import os
import shutil
from argparse import Namespace
from pathlib import Path

import pytest
from _helpers import load_tool, write_two_class_images
from test_train import TINY_MODEL

from lsvision.train import TrainSetupError, engine, parse_args, run

# the tiny CvT-LS of test_train, its class count taken from the folder
_NUM_CLASSES = TINY_MODEL.index('--num-classes')
TINY = TINY_MODEL[:_NUM_CLASSES] + TINY_MODEL[_NUM_CLASSES + 2:]


@pytest.fixture()
def folder(tmp_path) -> Path:
    """class0 / class1, 12 training and 4 validation images each (16x16 PNGs)."""
    write_two_class_images(tmp_path / 'data')
    return tmp_path / 'data'


def _args(root: Path, *extra: str):
    return parse_args([str(root), '--output', str(root.parent / 'out'), '--experiment', 'run', *TINY, '--epochs', '1',
                       '-b', '4', '-j', '0', *extra])


def _starts(root: Path, *extra: str) -> dict:
    """The run starts (and here ends) once the data agree."""
    result = run(_args(root, *extra))
    assert result['epochs_done'] == 1 and math.isfinite(result['top1'])
    shutil.rmtree(root.parent / 'out')
    return result


def _refused(root: Path, *extra: str) -> str:
    with pytest.raises(TrainSetupError) as e:
        run(_args(root, *extra))
    assert not (root.parent / 'out').exists()  # before anything is written
    return str(e.value)


def test_validation_folder_unknown_to_training_is_refused_and_the_hints_lead_to_a_run(folder, tmp_path):
    val = folder / 'val'
    (val / 'class1').rename(val / 'klass1')  # a renamed folder: timm would score class1's images as another label
    message = _refused(folder)
    assert f"validation class folder(s) klass1 in {val} have no training folder in {folder / 'train'}" in message
    assert f'training class(es) class1 have no validation folder in {val}' in message
    assert f'move the folder(s) out of {val}' in message and f'as {val}/<class>/' in message
    shutil.move(val / 'klass1', tmp_path / 'klass1')  # hint 1: move it out of val
    message = _refused(folder)
    assert 'klass1' not in message and 'training class(es) class1 have no validation folder' in message
    shutil.move(tmp_path / 'klass1', val / 'class1')  # hint 2: held-out images of class1 as val/class1/
    _starts(folder)


def test_training_class_without_validation_folder_is_refused(folder, tmp_path):
    shutil.copytree(folder / 'train' / 'class1', folder / 'train' / 'class2')
    message = _refused(folder)
    assert f"training class(es) class2 have no validation folder in {folder / 'val'}" in message
    shutil.move(folder / 'train' / 'class2', tmp_path / 'class2')  # the other hint: move the training folder out
    _starts(folder)


@pytest.mark.parametrize('split', ['train', 'val'])
def test_empty_class_folder_is_refused_naming_it(folder, split):
    for s in ('train', 'val'):
        shutil.copytree(folder / s / 'class1', folder / s / 'class2')
    for png in (folder / split / 'class2').iterdir():
        png.unlink()
    message = _refused(folder)
    assert f'empty class folder(s) {folder / split / "class2"}: no image in them, so timm would drop' in message
    assert f"remove the class from both splits (the folder of that name in {folder / 'train'} and in " \
           f"{folder / 'val'})" in message
    assert 'have no' not in message  # the empty folder is the one problem named, not the mismatch it causes
    for s in ('train', 'val'):  # the hint: remove the class from both splits
        shutil.rmtree(folder / s / 'class2')
    _starts(folder)


def test_num_classes_other_than_the_folders_is_refused_and_the_tool_exits_2(folder, tmp_path, caplog):
    config = tmp_path / 'ten.yaml'
    config.write_text('num_classes: 10\n')  # a config for another dataset
    message = _refused(folder, '-c', str(config))
    assert f'num_classes 10 (from --num-classes or the config) but the dataset {folder} has 2 classes (class0, ' \
           'class1)' in message
    assert 'Pass --num-classes 2, or leave num_classes unset' in message
    with caplog.at_level(logging.ERROR):
        assert load_tool('train').main([str(folder), '--output', str(tmp_path / 'o'), *TINY, '-c', str(config)]) == 2
    assert 'Pass --num-classes 2' in caplog.text
    assert _starts(folder, '-c', str(config), '--num-classes', '2')['model'] == 'cvt_ls_13'  # the hint


def test_validation_uses_the_training_class_map(folder, tmp_path):
    order = tmp_path / 'classes.txt'
    order.write_text('class1\nclass0\n')  # not the sorted order a split would build on its own
    args = _args(folder, '--class-map', str(order))
    engine._setup(args)
    train, val, names = engine._datasets(args, primary=True)
    assert names == ['class1', 'class0'] and args.num_classes == 2
    assert val.reader.class_to_idx == train.reader.class_to_idx == {'class1': 0, 'class0': 1}
    assert {Path(p).parent.name: t for p, t in val.reader.samples} == {'class1': 0, 'class0': 1}
    (folder / 'val' / 'class2').mkdir()  # a folder the class map does not name would be dropped silently
    (folder / 'val' / 'class0' / '000.png').rename(folder / 'val' / 'class2' / '000.png')
    message = _refused(folder, '--class-map', str(order))
    assert f"class folder(s) class2 in {folder / 'val'} are not in --class-map {order}" in message
    assert _refused(folder, '--class-map', 'nothing.txt') == (
        f'--class-map nothing.txt: no such file (nor in {folder / "train"}); give a .txt file with one class folder '
        'name a line, in label order')


@pytest.mark.parametrize('class_order', ['', 'class1\nclass0\n'])
def test_each_split_is_walked_once_into_the_datasets_timm_would_build(folder, tmp_path, monkeypatch, class_order):
    from timm.data import create_dataset
    extra = []
    if class_order:
        (tmp_path / 'classes.txt').write_text(class_order)
        extra = ['--class-map', str(tmp_path / 'classes.txt')]
    args = _args(folder, *extra)
    engine._setup(args)
    walked, walk = [], os.walk
    monkeypatch.setattr(os, 'walk', lambda top, *a, **k: walked.append(os.path.abspath(top)) or walk(top, *a, **k))
    train, val, names = engine._datasets(args, primary=True)
    assert sorted(walked) == [str(folder / 'train'), str(folder / 'val')]  # once each (timm's datasets: twice)
    monkeypatch.setattr(os, 'walk', walk)
    timm_train = create_dataset('', root=str(folder), split='train', class_map=extra[1] if extra else '')
    timm_val = create_dataset('', root=str(folder), split='val', class_map=dict(timm_train.reader.class_to_idx))
    assert train.reader.class_to_idx == val.reader.class_to_idx == timm_train.reader.class_to_idx
    assert train.reader.samples == timm_train.reader.samples and val.reader.samples == timm_val.reader.samples
    assert len(train) == 24 and train.input_img_mode == timm_train.input_img_mode
    assert names == (['class1', 'class0'] if class_order else ['class0', 'class1'])


def test_log_counts_each_split_per_class_and_what_an_epoch_leaves_out(folder, caplog):
    (folder / 'train' / 'class1' / '000.png').unlink()  # 12 + 11 = 23 training images
    # stray files are named (as validate.py names them); hidden ones (a Mac's .DS_Store) are never data
    for stray in ('class0/notes.txt', 'class1/000.png.bak', 'Thumbs.db', 'class0/.DS_Store'):
        (folder / 'train' / stray).write_text('not an image')
    with caplog.at_level(logging.INFO):
        dropped = run(_args(folder, '-b', '5'))
    assert f"training split {folder / 'train'}: 23 images in 2 classes (class0 12, class1 11)" in caplog.text
    assert f"validation split {folder / 'val'}: 8 images in 2 classes (class0 4, class1 4)" in caplog.text
    train = folder / 'train'
    assert (f"3 file(s) in {train} are not .png/.jpg/.jpeg images and are skipped: {train / 'class0' / 'notes.txt'}, "
            f"{train / 'class1' / '000.png.bak'}, {train / 'Thumbs.db'}") in caplog.text  # timm's natural order
    assert 'DS_Store' not in caplog.text and f'in {folder / "val"} are not' not in caplog.text
    assert 'each epoch: 4 batches of up to 5, 20 of 23 training images; 3 left out (drop_last drops the partial ' \
           'last batch; --no-drop-last keeps it), different ones each epoch' in caplog.text
    assert dropped['num_updates'] == 4 and dropped['samples_seen'] == 20
    caplog.clear()
    shutil.rmtree(folder.parent / 'out')
    with caplog.at_level(logging.INFO):
        kept = run(_args(folder, '-b', '5', '--no-drop-last'))
    assert 'each epoch: 5 batches of up to 5, 23 of 23 training images (none left out)' in caplog.text
    assert kept['num_updates'] == 5 and kept['samples_seen'] == 23
    shutil.rmtree(folder.parent / 'out')
    with caplog.at_level(logging.INFO):  # Mixup pairs images within a batch: the last batch of 5 is cut to 4
        mixed = run(_args(folder, '-b', '6', '--no-drop-last', '--mixup', '0.2'))
    assert '22 of 23 training images; 1 left out (Mixup / CutMix need an even last batch)' in caplog.text
    assert mixed['num_updates'] == 4 and mixed['samples_seen'] == 22


def test_batch_larger_than_the_folder_is_refused_and_no_drop_last_trains_it(folder):
    message = _refused(folder, '-b', '32')
    assert 'fewer than one batch of 32; lower --batch-size, or --no-drop-last' in message
    assert _starts(folder, '-b', '32', '--no-drop-last')['num_updates'] == 1


def test_unreadable_validation_image_is_left_out_and_named_not_replaced(folder, caplog):
    bad = folder / 'val' / 'class1' / '002.png'
    bad.write_bytes(b'not a png')
    with caplog.at_level(logging.INFO):
        result = run(_args(folder))
    assert f'validation: 7 images scored; 1 unreadable left out: {bad} (UnidentifiedImageError' in caplog.text
    hits = result['top1'] * 7 / 100  # a count out of 7, not 8
    assert math.isclose(hits, round(hits), abs_tol=1e-9)


def test_warmup_in_updates(folder, caplog):
    message = _refused(folder, '--warmup-steps', '3')
    assert message == ('--warmup-steps 3 counts optimizer updates, so the schedule must step on updates: add '
                       '--sched-on-updates (or use --warmup-epochs)')
    with caplog.at_level(logging.INFO):  # 6 updates, lr 1e-3 after 3 of warmup from 1e-5, cosine to 0 after
        run(_args(folder, '--warmup-steps', '3', '--sched-on-updates', '--warmup-lr', '1e-5', '--log-interval', '1'))
    assert "lr warmup: 3 updates (3 of the run's 6 updates) from 1e-05 to 0.001" in caplog.text
    lrs = [r.getMessage().split(' lr ')[1].split()[0] for r in caplog.records if '] loss ' in r.getMessage()]
    assert lrs == ['1e-05', '0.00034', '0.00067', '0.0005', '0.00025', '6.7e-05']


def test_loader_workers_are_capped_at_the_usable_cores(caplog):
    cores = engine.usable_cores()
    with caplog.at_level(logging.INFO):
        assert engine._workers(Namespace(workers=cores + 3), primary=True) == cores
    assert f'loader workers: {cores} (--workers {cores + 3} capped at the {cores} usable CPU cores)' in caplog.text
    assert engine._workers(Namespace(workers=cores), primary=True) == cores


def test_many_classes_are_counted_by_range_and_fewest():
    from lsvision.train.data import SplitScan, class_counts_text
    scan = SplitScan('/d/train', {f'n{i:02d}': 10 + i for i in range(25)})
    assert class_counts_text(scan) == ('550 images in 25 classes, 10-34 a class (fewest: n00 10, n01 11, n02 12, n03 '
                                       '13, n04 14)')
