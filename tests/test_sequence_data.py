"""Embedded demo data: ListOps by the LRA rules (spec sequence.md §6.16, §8) and the stdlib byte corpus."""
import statistics

import torch

from lsvision.data import LISTOPS_LRA, LISTOPS_MINI, generate_listops, listops_vocab, stdlib_bytes
from lsvision.data.listops import listops_text, small


def _evaluate_text(text: str) -> int:
    """An independent evaluator of the LRA TSV text: a stack machine over its tokens."""
    stack = [[]]
    for tok in text.split():
        if tok.startswith('['):
            stack.append([tok[1:]])
        elif tok == ']':
            op, *vals = stack.pop()
            if op == 'MIN':
                v = min(vals)
            elif op == 'MAX':
                v = max(vals)
            elif op == 'SM':
                v = sum(vals) % 10
            else:
                v = int(statistics.median(vals))
            stack[-1].append(v)
        elif tok.isdigit():
            stack[-1].append(int(tok))
    (value,) = stack[0]
    return value


def test_listops_text_format():
    tree = ('MAX', [2, 9, ('MIN', [4, 7]), 0])
    assert listops_text(tree) == '( ( ( ( ( [MAX 2 ) 9 ) ( ( ( [MIN 4 ) 7 ) ] ) ) 0 ) ] )'
    assert _evaluate_text(listops_text(tree)) == 9


def test_listops_lra_statistics():
    data = generate_listops(small(LISTOPS_LRA, 600), seed=1, return_trees=True)  # enough for the mean and std bands
    ids, labels = data['train']
    trees = data['trees']
    lengths = [len(listops_text(t).replace('(', '').replace(')', '').split()) for t in trees]  # digits, ops, ]
    assert all(500 < n < 2000 for n in lengths)
    assert [_evaluate_text(listops_text(t)) for t in trees] == labels.tolist()
    alnum = (ids != 0).sum(1).float()  # the LRA tokenizer keeps digits and operators only
    assert 850 <= alnum.mean() <= 960 and 300 <= alnum.std() <= 380
    assert labels.bincount(minlength=10).max() / len(labels) <= 0.2
    assert ids.max() <= 14 and ids.shape == (600, 2000)


def test_listops_mini_preset():
    data = generate_listops(small(LISTOPS_MINI, 3000, 100, 100), seed=0)
    ids, labels = data['train']
    assert ids.shape == (3000, 104) and data['test'][0].shape == (100, 104)
    n = (ids != 0).sum(1).float()
    assert n.min() > 20 and n.max() < 100 and 30 < n.mean() < 50
    assert ids.max() == len(listops_vocab('keep_close'))  # "]" kept
    assert labels.bincount(minlength=10).max() / len(labels) < 0.2
    # splits do not overlap
    all_rows = {tuple(r.tolist()) for r in torch.cat([ids, data['val'][0], data['test'][0]])}
    assert len(all_rows) == 3200


def test_stdlib_bytes(tmp_path):
    (tmp_path / 'a.py').write_bytes(b'x = 1\n' * 10)
    (tmp_path / 'b.py').write_bytes(b'y = 2\n' * 10)
    train, val = stdlib_bytes(root=str(tmp_path))
    assert len(train) == 108 and len(val) == 12 and train.dtype == torch.uint8
    assert bytes(train[:6].tolist()) == b'x = 1\n' and bytes(val[-6:].tolist()) == b'y = 2\n'
    real_train, real_val = stdlib_bytes()
    assert len(real_train) > 1_000_000 and abs(len(real_val) / (len(real_train) + len(real_val)) - 0.1) < 1e-3
