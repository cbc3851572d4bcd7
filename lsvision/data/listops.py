"""ListOps generated locally by the public Long Range Arena rules (`lra_benchmarks/data/listops.py`).

A node at depth d (root d = 1) is an operator with probability 0.25 if d < max_depth, else a digit 0-9. Operators
MIN, MAX, MED (int of the median), SM (sum mod 10) take 2..max_args independent sub-trees. The length of a tree is 1
per digit and 2 + the lengths of its arguments per operator (operator + "]"). Samples with min_length < length <
max_length are kept, duplicates dropped. The LRA tokenizer keeps alphanumeric tokens only (no brackets:
`tokenize='lra'`); `'keep_close'` keeps the "]" that closes each operator.

Written for lsvision, Apache-2.0.
"""
import random
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple, Union

import torch

__all__ = ['ListOpsConfig', 'LISTOPS_LRA', 'LISTOPS_MINI', 'generate_listops', 'listops_value', 'listops_vocab',
           'listops_text']

OPERATORS = ('MIN', 'MAX', 'MED', 'SM')
Tree = Union[int, Tuple[str, list]]


@dataclass(frozen=True)
class ListOpsConfig:
    """Generator and tokenizer settings. Defaults: the LRA `listops-1000` data (96k / 2k / 2k, seq 2000)."""
    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500  # exclusive
    max_length: int = 2000  # exclusive
    num_train: int = 96_000
    num_val: int = 2_000
    num_test: int = 2_000
    tokenize: str = 'lra'  # or 'keep_close'
    seq_len: int = 2000  # ids are truncated / padded (0) to this length


LISTOPS_LRA = ListOpsConfig()
# the <= 3 min demo: shallow trees, short sequences, "]" kept (spec sequence.md §8)
LISTOPS_MINI = ListOpsConfig(max_depth=6, max_args=5, min_length=20, max_length=100, num_train=20_000,
                             num_val=1_000, num_test=1_000, tokenize='keep_close', seq_len=104)


def listops_vocab(tokenize: str = 'lra') -> Dict[str, int]:
    """Token -> id; 0 is padding. 'lra': digits and operators (ids 1-14); 'keep_close' adds "]" (id 15)."""
    if tokenize not in ('lra', 'keep_close'):
        raise ValueError(f"tokenize must be 'lra' or 'keep_close', got {tokenize!r}")
    tokens = [str(i) for i in range(10)] + list(OPERATORS) + ([']'] if tokenize == 'keep_close' else [])
    return {t: i + 1 for i, t in enumerate(tokens)}


def _tree(depth: int, cfg: ListOpsConfig, rng: random.Random) -> Tuple[Tree, int]:
    if depth < cfg.max_depth and rng.random() <= 0.25:
        num_args = rng.randint(2, cfg.max_args)
        args, length = [], 2
        for _ in range(num_args):
            sub, sub_len = _tree(depth + 1, cfg, rng)
            args.append(sub)
            length += sub_len
        return (rng.choice(OPERATORS), args), length
    return rng.randint(0, 9), 1


def listops_value(tree: Tree) -> int:
    """The value of a tree (MED: int of the median, mean of the middle two for an even count)."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = [listops_value(a) for a in args]
    if op == 'MIN':
        return min(vals)
    if op == 'MAX':
        return max(vals)
    if op == 'SM':
        return sum(vals) % 10
    s = sorted(vals)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else int((s[mid - 1] + s[mid]) / 2)


def listops_text(tree: Tree) -> str:
    """The LRA TSV text: each operator as left-nested pairs "( x y )", e.g. `( ( ( [MIN 4 ) 7 ) ] )`."""
    if isinstance(tree, int):
        return str(tree)
    op, args = tree
    text = f'( [{op} {listops_text(args[0])} )'
    for a in args[1:]:
        text = f'( {text} {listops_text(a)} )'
    return f'( {text} ] )'


def _tokens(tree: Tree, keep_close: bool, out: List[str]) -> None:
    if isinstance(tree, int):
        out.append(str(tree))
        return
    out.append(tree[0])
    for a in tree[1]:
        _tokens(a, keep_close, out)
    if keep_close:
        out.append(']')


def generate_listops(cfg: ListOpsConfig = LISTOPS_MINI, seed: int = 0, return_trees: bool = False
                     ) -> Dict[str, Union[Tuple[torch.Tensor, torch.Tensor], List[Tree]]]:
    """Generates the train / val / test splits (in that order from one stream of unique samples).

    Returns:
        {'train': (ids (N, seq_len) int64, labels (N,) int64), 'val': ..., 'test': ...}; with `return_trees`,
        also 'trees': the list of all trees in split order.
    """
    rng = random.Random(seed)
    vocab = listops_vocab(cfg.tokenize)
    keep_close = cfg.tokenize == 'keep_close'
    total = cfg.num_train + cfg.num_val + cfg.num_test
    seen, trees = set(), []
    while len(trees) < total:
        tree, length = _tree(1, cfg, rng)
        if not cfg.min_length < length < cfg.max_length:
            continue
        key = listops_text(tree)
        if key in seen:
            continue
        seen.add(key)
        trees.append(tree)
    ids = torch.zeros(total, cfg.seq_len, dtype=torch.long)
    labels = torch.empty(total, dtype=torch.long)
    for i, tree in enumerate(trees):
        toks: List[str] = []
        _tokens(tree, keep_close, toks)
        toks = toks[:cfg.seq_len]
        ids[i, :len(toks)] = torch.tensor([vocab[t] for t in toks])
        labels[i] = listops_value(tree)
    out: Dict = {}
    start = 0
    for name, n in (('train', cfg.num_train), ('val', cfg.num_val), ('test', cfg.num_test)):
        out[name] = (ids[start:start + n], labels[start:start + n])
        start += n
    if return_trees:
        out['trees'] = trees
    return out


def small(cfg: ListOpsConfig, num_train: int, num_val: int = 0, num_test: int = 0) -> ListOpsConfig:
    """The same generator with other split sizes (e.g. for tests)."""
    return replace(cfg, num_train=num_train, num_val=num_val, num_test=num_test)
