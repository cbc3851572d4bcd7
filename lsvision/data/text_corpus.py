"""Word-level language-model corpora: WikiText-103's files or any text file -> a vocabulary and token streams.

Tokenization and vocabulary follow Transformer-XL's `data_utils.py` for WikiText-103: each line is split on
whitespace and ends with `<eos>` (a blank line is one `<eos>`); the vocabulary is `<eos>` first, then the words of
the training file by decreasing count (ties in order of first appearance), so that the adaptive softmax's head holds
the frequent words. WikiText-103 has its own `<unk>` in the text (267,735 words with `<eos>`); for other text, words
seen fewer than `min_freq` times or beyond `max_size` map to an added `<unk>`.

`stdlib_docstrings` builds a local corpus with no download: the docstrings of the Python standard library, one
paragraph a line, words and punctuation split apart (as WikiText's text is), split into train / valid / test by file.

Batching for a language model over streams (`stream_batches`, `eval_streams`, `authors_eval_streams`) is here too:
the contiguous streams that Transformer-XL trains on, an evaluation layout that scores every token but the first
exactly once, and the authors' evaluation layout (their eval.py).
"""
import ast
import logging
import re
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from .stdlib_docs import package_files, stdlib_root

__all__ = ['EOS', 'UNK', 'WIKITEXT_FILES', 'Vocab', 'WordCorpus', 'tokenize_line', 'build_vocab', 'encode_lines',
           'load_wikitext', 'load_text_files', 'stdlib_docstrings', 'stream_batches', 'eval_streams',
           'authors_eval_streams', 'StreamSegment']

EOS = '<eos>'
UNK = '<unk>'
WIKITEXT_FILES = {'train': 'wiki.train.tokens', 'valid': 'wiki.valid.tokens', 'test': 'wiki.test.tokens'}
PathLike = Union[str, Path]
_logger = logging.getLogger(__name__)


def tokenize_line(line: str) -> List[str]:
    """Transformer-XL's tokenization: whitespace split, then `<eos>`."""
    return line.split() + [EOS]


@dataclass
class Vocab:
    """Words by id; `unk` is the id unknown words map to (None: every word must be known)."""
    symbols: List[str]
    unk: Optional[int]

    def __post_init__(self) -> None:
        self.index: Dict[str, int] = {s: i for i, s in enumerate(self.symbols)}

    def __len__(self) -> int:
        return len(self.symbols)

    @property
    def eos(self) -> int:
        return self.index[EOS]


def _lines(path: PathLike) -> Iterator[str]:
    with open(path, encoding='utf-8') as f:
        yield from f


def build_vocab(lines: Iterable[str], min_freq: int = 1, max_size: Optional[int] = None) -> Vocab:
    """`<eos>`, then the words by decreasing count (ties: first appearance); `<unk>` is added when some word is cut
    (`min_freq`, `max_size`), and kept at its rank when the text has its own (WikiText)."""
    counter: Counter = Counter()
    for line in lines:
        counter.update(line.split())
    counter.pop(EOS, None)
    words = [w for w, c in counter.most_common() if c >= min_freq]
    cut = len(words) < len(counter) or (max_size is not None and len(words) > max_size)
    if max_size is not None:
        words = words[:max_size]
    if cut and UNK not in words:
        words.append(UNK)
    symbols = [EOS] + words
    return Vocab(symbols, symbols.index(UNK) if UNK in symbols else None)


def encode_lines(lines: Iterable[str], vocab: Vocab) -> Tuple[torch.Tensor, int]:
    """Token ids (int32, one stream) of the lines, and how many words were not in the vocabulary.

    Raises:
        ValueError: An unknown word and a vocabulary without `<unk>` (the message names it).
    """
    ids = array('i')  # 4 bytes a token (a list of Python ints would take ~36: 3.7 GB for WikiText-103's train)
    unknown = 0
    index, unk = vocab.index, vocab.unk
    for line in lines:
        for w in tokenize_line(line):
            i = index.get(w)
            if i is None:
                if unk is None:
                    raise ValueError(f'word {w!r} is not in the vocabulary, which has no {UNK}: build it with '
                                     'min_freq >= 2 or max_size (rare words become <unk>), or from a text that has '
                                     'every word')
                i = unk
                unknown += 1
            ids.append(i)
    return (torch.frombuffer(ids, dtype=torch.int32).clone() if ids else torch.zeros(0, dtype=torch.int32)), unknown


@dataclass
class WordCorpus:
    """A vocabulary and the train / valid / test streams (int32 ids), with the out-of-vocabulary counts."""
    vocab: Vocab
    train: torch.Tensor
    valid: torch.Tensor
    test: torch.Tensor
    unknown: Dict[str, int]
    source: str

    def summary(self) -> str:
        return (f'{self.source}: {len(self.vocab):,} words in the vocabulary; tokens train {len(self.train):,}, '
                f'valid {len(self.valid):,}, test {len(self.test):,}')


def _from_lines(splits: Dict[str, Callable[[], Iterable[str]]], source: str, min_freq: int,
                max_size: Optional[int]) -> WordCorpus:
    """The vocabulary of the train split, then each split encoded; each split is read again from its callable (a
    file is streamed twice instead of held in memory)."""
    _logger.info(f'{source}: counting the training words')
    vocab = build_vocab(splits['train'](), min_freq, max_size)
    encoded = {}
    for k, lines in splits.items():
        _logger.info(f'{source}: encoding {k} ({len(vocab):,} words in the vocabulary)')
        encoded[k] = encode_lines(lines(), vocab)
    return WordCorpus(vocab, encoded['train'][0], encoded['valid'][0], encoded['test'][0],
                      {k: v[1] for k, v in encoded.items()}, source)


def load_wikitext(folder: PathLike, min_freq: int = 1, max_size: Optional[int] = None) -> WordCorpus:
    """WikiText-103 (or -2) in its word-level release: `wiki.train.tokens`, `wiki.valid.tokens`, `wiki.test.tokens`.

    Raises:
        FileNotFoundError: A file is missing (the message lists what the folder holds and the alternative).
    """
    folder = Path(folder)
    paths = {k: folder / name for k, name in WIKITEXT_FILES.items()}
    missing = [p.name for p in paths.values() if not p.is_file()]
    if missing:
        held = sorted(p.name for p in folder.iterdir())[:10] if folder.is_dir() else 'no such folder'
        raise FileNotFoundError(
            f'{folder} lacks {", ".join(missing)} (it holds: {held}); pass the folder of the word-level WikiText '
            'release (wikitext-103/ with wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens), or train on any '
            'text with --train-file (and --valid-file / --test-file)')
    return _from_lines({k: (lambda p=p: _lines(p)) for k, p in paths.items()}, f'WikiText ({folder})', min_freq,
                       max_size)


def load_text_files(train: PathLike, valid: Optional[PathLike] = None, test: Optional[PathLike] = None,
                    min_freq: int = 1, max_size: Optional[int] = None, held_out: float = 0.05) -> WordCorpus:
    """Any UTF-8 text files, one stream each. Without `valid` / `test`, the last 2 x `held_out` of the train file's
    lines become valid then test."""
    for p in (train, valid, test):
        if p is not None and not Path(p).is_file():
            raise FileNotFoundError(f'text file {p} does not exist')
    lines = list(_lines(train))
    splits = {'train': lines, 'valid': list(_lines(valid)) if valid else [], 'test': list(_lines(test)) if test
              else []}
    n = max(1, int(len(lines) * held_out))
    if not valid or not test:
        if len(lines) < 4 * n or len(lines) < 4:
            raise ValueError(f'{train} has {len(lines)} lines, too few to hold out valid and test lines from; pass '
                             '--valid-file and --test-file')
        if not test:
            splits['test'], lines = lines[-n:], lines[:-n]
        if not valid:
            splits['valid'], lines = lines[-n:], lines[:-n]
        splits['train'] = lines
    return _from_lines({k: (lambda v=v: v) for k, v in splits.items()}, f'text ({train})', min_freq, max_size)


_WORD = re.compile(r"\w+(?:'\w+)?|[^\w\s]")


def _docstring_paragraphs(source: str) -> List[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                for para in re.split(r'\n\s*\n', doc):
                    words = _WORD.findall(para)
                    if words:
                        out.append(' '.join(words))
    return out


def stdlib_docstrings(root: Optional[PathLike] = None, held_out: float = 0.05, min_freq: int = 3,
                      max_size: Optional[int] = 10000) -> WordCorpus:
    """The docstrings of the standard library's packages (the `.py` files `stdlib_docs.package_files` lists, tests
    left out), one paragraph a line, words and punctuation split apart. Files go to test, then valid (in a fixed
    order by CRC32 of their path) until each holds `held_out` of the paragraphs; the rest is train. Words seen fewer
    than `min_freq` times in train, or beyond the `max_size` most frequent, become `<unk>`."""
    root = Path(root) if root is not None else stdlib_root()
    files = sorted((f for fs in package_files(root).values() for f in fs),
                   key=lambda f: (zlib.crc32(str(f.relative_to(root)).encode()), str(f)))
    per_file = [_docstring_paragraphs(f.read_text(encoding='utf-8', errors='replace')) for f in files]
    total = sum(len(p) for p in per_file)
    if total < 100:
        raise ValueError(f'only {total} docstring paragraphs under {root}; pass the folder that holds os.py')
    splits: Dict[str, List[str]] = {'test': [], 'valid': [], 'train': []}
    for paras in per_file:
        part = 'test' if len(splits['test']) < held_out * total else \
            'valid' if len(splits['valid']) < held_out * total else 'train'
        splits[part] += paras
    return _from_lines({k: (lambda v=v: v) for k, v in splits.items()}, f'stdlib docstrings ({root})', min_freq,
                       max_size)


def stream_batches(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Transformer-XL's training layout: the stream cut into `batch_size` contiguous rows (B, N // B); the tail that
    does not fill a row is left out."""
    n = len(data) // batch_size
    if n < 2:
        raise ValueError(f'{len(data)} tokens cannot make {batch_size} streams of 2 or more tokens; lower the batch '
                         'size or use more text')
    return data[:n * batch_size].view(batch_size, n)


@dataclass
class StreamSegment:
    """One segment of a batch of streams: inputs and targets (B, L) int64, `mask` (B, L) bool on scored tokens."""
    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def authors_eval_streams(data: torch.Tensor, batch_size: int, tgt_len: int) -> List[StreamSegment]:
    """Transformer-XL's evaluation layout (eval.py's `LMOrderedIterator`, ext_len 0): the split cut into
    `batch_size` contiguous rows of n = N // B tokens (the last N mod B tokens left out), each row read in segments
    of `tgt_len` and predicting its own tokens 2 ... n: B * (n - 1) targets, every segment full width (no mask).
    eval.py's default --batch_size is 10 (run_wt103_base.sh and run_wt103_large.sh keep it).
    """
    rows = stream_batches(data, batch_size).long()
    n = rows.shape[1]
    out = []
    for i in range(0, n - 1, tgt_len):
        L = min(tgt_len, n - 1 - i)
        out.append(StreamSegment(rows[:, i:i + L], rows[:, i + 1:i + 1 + L],
                                 torch.ones(rows.shape[0], L, dtype=torch.bool)))
    return out


def eval_streams(data: torch.Tensor, batch_size: int, tgt_len: int) -> List[StreamSegment]:
    """Segments that score every token of `data` but the first exactly once: `batch_size` rows cut it into as many
    streams, each starting afresh (1: one stream carried over the whole split). Not the authors' layout
    (`authors_eval_streams`), which leaves out the first token of each row and the last N mod B tokens.

    Row b reads tokens b*S ... (b+1)*S and predicts b*S+1 ... (b+1)*S, S = ceil((N-1)/B); the last row is padded.
    """
    n = len(data) - 1
    if n < 1:
        raise ValueError('an evaluation stream needs at least 2 tokens')
    rows = min(batch_size, n)
    S = -(-n // rows)
    streams = torch.zeros(rows, S + 1, dtype=torch.long)
    counts = torch.zeros(rows, dtype=torch.long)
    for b in range(rows):
        part = data[b * S:min((b + 1) * S, n) + 1].long()
        streams[b, :len(part)] = part
        counts[b] = max(0, len(part) - 1)
    keep = counts > 0
    streams, counts = streams[keep], counts[keep]
    out = []
    for i in range(0, S, tgt_len):
        L = min(tgt_len, S - i)
        mask = (i + torch.arange(L))[None] < counts[:, None]
        out.append(StreamSegment(streams[:, i:i + L], streams[:, i + 1:i + 1 + L], mask))
    return out
