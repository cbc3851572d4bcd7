"""The HSW demo's parts: stdlib byte documents (on a small fake stdlib), time-budgeted training and the metrics."""
import json
import sys
from pathlib import Path

import pytest
import torch
from _helpers import run_script

from lsvision.data.stdlib_docs import PAD_ID, build_stdlib_docs, package_files
from lsvision.sequence.budget_train import (
    accuracy,
    evaluate_for_seconds,
    macro_f1,
    stratified_order,
    train_for_seconds,
)
from lsvision.sequence.hsw import BagOfTokens

ROOT = Path(__file__).resolve().parents[1]


def _fake_stdlib(root: Path, packages: int = 8, files: int = 6) -> Path:
    """Packages pkg0..pkgN, each with `files` modules of distinct sizes, plus test folders that must be ignored."""
    gen = torch.Generator().manual_seed(0)
    for p in range(packages):
        pkg = root / f'pkg{p}'
        (pkg / 'sub').mkdir(parents=True)
        (pkg / 'tests').mkdir()
        (pkg / '__init__.py').write_bytes(b'# init\n' * 200)
        for f in range(files):
            size = 300 + int(torch.randint(0, 900, (1,), generator=gen))
            (pkg / 'sub' / f'mod{f}.py').write_bytes(bytes([97 + p]) * size)  # one letter per package
        (pkg / 'tests' / 'test_x.py').write_bytes(b'z' * 5000)
        (pkg / 'test_y.py').write_bytes(b'z' * 5000)
    (root / 'test').mkdir()
    (root / 'test' / '__init__.py').write_bytes(b'z' * 5000)
    (root / 'notapackage').mkdir()
    (root / 'notapackage' / 'x.py').write_bytes(b'z' * 5000)
    return root


def test_stdlib_docs_split_by_file(tmp_path):
    root = _fake_stdlib(tmp_path)
    files = package_files(root)
    assert sorted(files) == [f'pkg{p}' for p in range(8)]
    assert all('test' not in str(f.relative_to(root / name)) for name, fs in files.items() for f in fs)
    train, test = build_stdlib_docs(root, doc_len=256, min_doc_len=64, min_files=6, min_docs=10,
                                    max_train_per_class=None, max_test_per_class=None)
    assert train.classes == test.classes == [f'pkg{p}' for p in range(8)]
    assert not set(train.files) & set(test.files)
    assert all(c > 0 for c in train.class_counts()) and all(c > 0 for c in test.class_counts())
    # every byte of a document is its package's letter (or the __init__ text), padding after its length
    for docs in (train, test):
        assert docs.tokens.shape[1] == 256 and (docs.lengths >= 64).all()
        for tokens, length, label, name in zip(docs.tokens, docs.lengths, docs.labels, docs.files):
            assert name.startswith(docs.classes[label] + '/')
            assert (tokens[length:] == PAD_ID).all() and (tokens[:length] < 256).all()
            if 'mod' in name:
                assert (tokens[:length] == 97 + int(label)).all()
    capped, _ = build_stdlib_docs(root, doc_len=256, min_doc_len=64, min_files=6, min_docs=10,
                                  max_train_per_class=3, max_test_per_class=2)
    assert max(capped.class_counts()) == 3
    with pytest.raises(ValueError, match='only 8 stdlib packages'):
        build_stdlib_docs(root, doc_len=256, min_doc_len=64, min_files=6, min_docs=10, min_classes=9)


def test_metrics_and_stratified_order():
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    preds = torch.tensor([0, 1, 1, 1, 2, 0])
    assert accuracy(preds, labels) == pytest.approx(4 / 6)
    # F1: class 0: tp 1 fp 1 fn 1 -> 0.5; class 1: tp 2 fp 1 fn 0 -> 0.8; class 2: tp 1 fp 0 fn 1 -> 2/3
    assert macro_f1(preds, labels, 4) == pytest.approx((0.5 + 0.8 + 2 / 3) / 3)
    order = stratified_order(torch.tensor([0] * 5 + [1] * 2 + [2] * 3))
    assert sorted(order.tolist()) == list(range(10))
    assert sorted(torch.tensor([0] * 5 + [1] * 2 + [2] * 3)[order[:3]].tolist()) == [0, 1, 2]


def test_budgeted_training_learns_and_stops():
    torch.manual_seed(0)
    # class = which of 4 token ranges a sequence draws from: a bag of tokens separates them
    labels = torch.arange(64) % 4
    x = torch.randint(0, 10, (64, 50)) + 10 * labels[:, None]
    model = BagOfTokens(41, 4, pad_token_id=40)
    # no warm-up: the schedule follows wall time, and 60 fast steps would all fall in a time-based warm-up
    fit = train_for_seconds(model, x, labels, seconds=30., batch_size=16, lr=5e-2, max_steps=60, warmup_fraction=0.)
    assert fit.steps == 60 and fit.seconds < 30.
    ev = evaluate_for_seconds(model, x, torch.arange(64), None, batch_size=16)
    assert accuracy(ev.predictions, labels) == 1.0
    ev = evaluate_for_seconds(model, x, torch.arange(64), 0., batch_size=16)
    assert len(ev.index) == 16  # a spent budget still evaluates one batch


def test_demo_runs_small(tmp_path):
    out = tmp_path / 'demo.json'
    proc = run_script(
        [sys.executable, str(ROOT / 'tools' / 'demo_hsw.py'), '--doc-len', '512', '--train-seconds', '1',
         '--eval-seconds', '1', '--max-train-per-class', '8', '--max-test-per-class', '2', '--threads', '1',
         '--out', str(out)], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert '| class | train docs | test docs |' in proc.stdout and '| bag of bytes |' in proc.stdout
    report = json.loads(out.read_text())
    assert set(report['models']) == {'hsw', 'hsw_ls', 'flat', 'bag'}
    assert len(report['classes']) >= 8
    assert all(0 <= r['accuracy'] <= 1 and r['train_steps'] >= 1 for r in report['models'].values())


def test_random_crop_stays_within_real_tokens_and_balanced_batches():
    from lsvision.sequence.budget_train import random_crop
    gen = torch.Generator().manual_seed(0)
    x = torch.arange(3 * 100).reshape(3, 100)
    mask = torch.arange(100)[None] < torch.tensor([100, 60, 20])[:, None]
    for _ in range(20):
        cx, cm = random_crop(x, mask, 30, gen)
        assert cx.shape == cm.shape == (3, 30)
        assert (cx[:, 1:] - cx[:, :-1] == 1).all()  # contiguous windows
        assert cm[:2].all() and cm[2].sum() == 20  # inside the real tokens; a short row keeps all of them
    # class-balanced training on a 1:9 imbalanced set still learns the rare class
    labels = torch.tensor([0] * 4 + [1] * 36)
    x = torch.randint(0, 10, (40, 50)) + 10 * labels[:, None]
    model = BagOfTokens(21, 2)
    fit = train_for_seconds(model, x, labels, seconds=30., batch_size=8, lr=5e-2, max_steps=40, warmup_fraction=0.,
                            crop=25, class_balanced=True)
    assert fit.steps == 40
    ev = evaluate_for_seconds(model, x, torch.arange(40), None, batch_size=40)
    assert accuracy(ev.predictions, labels) == 1.0
