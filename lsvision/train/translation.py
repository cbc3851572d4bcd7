"""Translation training and evaluation behind `tools/train_mt.py`: fairseq's IWSLT recipe on parallel text files.

The recipe (fairseq's examples/translation README for transformer_iwslt_de_en): Adam (betas 0.9 / 0.98, weight decay
1e-4), learning rate 5e-4 with the inverse square root schedule (linear warm-up from 1e-7 over 4000 updates, then
lr * sqrt(4000 / update)), label-smoothed cross entropy (0.1; torch's formulation: (1 - e) NLL + e times the mean
negative log-probability over the vocabulary), batches of at most 4096 tokens of sentences of similar length, beam 5.
The GRC models train with the learning rate doubled (1e-3, Cached Transformers, Table 4) unless --lr is given, and the
paper averages the last 10 checkpoints (`average_checkpoints`, as fairseq's scripts/average_checkpoints.py: the
element-wise mean of every floating-point tensor of the state dicts, GRC caches included).

Runs under torchrun (one process per device, DDP; every process takes every world-size-th batch; with GRC caches:
DDP's broadcast of rank 0's buffers, or with `grc_sync_cache` one all-reduce of the caches per update), with autocast
(bfloat16, or float16 with a loss scaler), resumes exactly (`last.pt`: model, optimizer, scaler, the position in the
epoch's batch order, the RNG states; written atomically), logs progress, and writes `result.json` and `result.md`.
BLEU is sacrebleu's corpus BLEU on detokenized output (the SentencePiece pieces decoded to text).

Written for lsvision, Apache-2.0.
"""
import dataclasses
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lsvision.sequence as seq
from lsvision.data.parallel_text import BOS_ID, EOS_ID, PAD_ID, SubwordVocab, read_parallel, write_demo_task
from lsvision.eval.distributed import all_gather, close_eval_processes, init_eval_processes, rank_and_world, shard_range
from lsvision.layers import GatedRecurrentCache
from lsvision.reports import machine_description, markdown_table, write_json, write_text
from lsvision.runs import source_commit, unknown_name_message
from lsvision.runtime import PROGRESS_SECONDS, ProgressClock
from lsvision.sequence.translation import EncoderOut, TranslationTransformer

from .args import resumed_settings
from .checkpoint import get_rng_state, load_checkpoint, save_atomic, set_rng_state
from .engine import all_reduce_grc_caches, long_warmup_warning, optimizer_update

__all__ = [
    'MTConfig', 'run', 'beam_search', 'greedy_decode', 'translate', 'corpus_bleu', 'average_checkpoints',
    'label_smoothed_loss', 'inverse_sqrt_factor', 'token_batches', 'collate', 'load_translation_checkpoint',
    'resumed_config', 'SMALL_MODEL_KWARGS', 'SMALL_CORPUS_FLAGS',
]

_logger = logging.getLogger('train_mt')

# a recipe for a corpus of thousands of pairs (IWSLT's has 160k): tools/demo_mt.py's model size and schedule
# (docs/sequence.md, "A small corpus")
SMALL_MODEL_KWARGS = dict(dim=128, encoder_depth=2, decoder_depth=2, num_heads=4, ffn_dim=256, drop=0.1)
SMALL_CORPUS_FLAGS = ('--model-kwargs ' + ' '.join(f'{k}={v}' for k, v in SMALL_MODEL_KWARGS.items())
                      + ' --vocab-size 1000 --max-tokens 1024 --lr 2e-3 --warmup-updates 100 '
                        '--save-interval-updates 25 --average-last 5')
# a new run on fewer pairs than this with a model of more parameters than this gets the recipe above as a warning
SMALL_CORPUS_PAIRS, SMALL_CORPUS_MAX_PARAMS = 20000, 5_000_000


@dataclasses.dataclass
class MTConfig:
    """A translation run (`tools/train_mt.py`'s options; fairseq's IWSLT recipe by default).

    data_dir None: the local demo task (`lsvision.data.parallel_text.write_demo_task`) is written to `<output>/data`.
    lr None: 5e-4, doubled (1e-3) for a GRC model (Cached Transformers, Table 4). Training stops at the first of
    max_epochs, max_updates and time_budget_s (seconds of training, not counting evaluation) that is set; all three
    count the whole run, over its resumes.
    bleu_bootstrap: resamples of sacrebleu's bootstrap confidence interval of BLEU (0: none).
    save_interval_updates 0: an averaging checkpoint at the end of every epoch, else every that many updates.
    """
    output: str = 'output/train_mt/run'
    data_dir: Optional[str] = None
    source_lang: str = 'de'
    target_lang: str = 'en'
    model: str = 'transformer_iwslt_de_en_prenorm'
    model_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    vocab_size: int = 10000
    spm_model_type: str = 'unigram'
    max_tokens: int = 4096
    max_positions: int = 1024
    lr: Optional[float] = None
    warmup_updates: int = 4000
    warmup_init_lr: float = 1e-7
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    clip_norm: float = 0.
    max_epochs: Optional[int] = None
    max_updates: Optional[int] = None
    time_budget_s: Optional[float] = None
    save_interval_updates: int = 0
    average_last: int = 10
    beam: int = 5
    len_penalty: float = 1.
    max_len_a: float = 1.2
    max_len_b: int = 10
    eval_split: str = 'test'
    eval_max_sentences: Optional[int] = None
    eval_batch_sentences: int = 128
    bleu_bootstrap: int = 1000
    device: str = 'cpu'
    amp: bool = False
    amp_dtype: str = 'bfloat16'
    grc_sync_cache: bool = False
    seed: int = 1
    log_interval_s: float = 10.
    resume: Optional[str] = None

    def resolved_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-3 if 'grc' in self.model else 5e-4

    def check(self) -> None:
        """Raises ValueError for settings that cannot run, saying which flag to change."""
        names = [n for n in seq.list_models() if 'iwslt' in n]
        if self.model not in names:  # another sequence model (e.g. a language model) is no translation model either
            raise ValueError('--model: ' + unknown_name_message(self.model, names, 'translation model'))
        if self.max_epochs is None and self.max_updates is None and self.time_budget_s is None:
            raise ValueError('set when to stop: --epochs, --max-updates or --time-budget')
        if self.average_last < 1 or self.beam < 1 or self.max_tokens < 1:
            raise ValueError('--average-last, --beam and --max-tokens must be >= 1')
        if self.amp_dtype not in ('bfloat16', 'float16'):
            raise ValueError(f"--amp-dtype must be 'bfloat16' or 'float16', got {self.amp_dtype!r}")


# ---- batches and loss ----

def encode_pairs(vocab: SubwordVocab, src: Sequence[str], tgt: Sequence[str], max_positions: int
                 ) -> Tuple[List[List[int]], List[List[int]], int]:
    """Subword ids of each pair with eos appended; pairs with a side longer than `max_positions` (eos included) or an
    empty side are dropped (fairseq's filter). Returns the kept sources, targets and the number dropped."""
    s_ids, t_ids = vocab.encode(src), vocab.encode(tgt)
    keep = [i for i in range(len(s_ids)) if 0 < len(s_ids[i]) < max_positions and 0 < len(t_ids[i]) < max_positions]
    return ([s_ids[i] + [EOS_ID] for i in keep], [t_ids[i] + [EOS_ID] for i in keep], len(s_ids) - len(keep))


def token_batches(src_lens: Sequence[int], tgt_lens: Sequence[int], max_tokens: int, seed: int) -> List[List[int]]:
    """Batches of pair indices of similar length, each with batch size x its longest side <= max_tokens (a pair
    longer than max_tokens alone makes a batch of one). Pairs are sorted by (source, target) length after a seeded
    shuffle (ties in a fixed random order), as fairseq's batch_by_size."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(src_lens), generator=gen).tolist()
    order.sort(key=lambda i: (src_lens[i], tgt_lens[i]))
    batches: List[List[int]] = []
    cur: List[int] = []
    longest = 0
    for i in order:
        n = max(src_lens[i], tgt_lens[i])
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def epoch_batches(batches: List[List[int]], epoch: int, seed: int, rank: int, world_size: int) -> List[List[int]]:
    """This process's batches of `epoch`: all batches in a seeded order of the epoch, cut to a multiple of the world
    size (every process takes as many steps), every world-size-th from `rank`."""
    gen = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = torch.randperm(len(batches), generator=gen).tolist()
    order = order[:len(order) - len(order) % world_size] if world_size > 1 else order
    return [batches[i] for i in order[rank::world_size]]


def _pad(rows: Sequence[Sequence[int]], first: Optional[int] = None) -> torch.Tensor:
    rows = [([first] if first is not None else []) + list(r) for r in rows]
    out = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def collate(src: Sequence[List[int]], tgt: Sequence[List[int]], index: Sequence[int]
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source ids, decoder inputs = bos + target without its eos, target) of the pairs `index`, right-padded."""
    target = _pad([tgt[i] for i in index])
    prev = _pad([tgt[i][:-1] for i in index], first=BOS_ID)
    return _pad([src[i] for i in index]), prev, target


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, smoothing: float
                        ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(label-smoothed loss summed over the real target tokens, their summed NLL (no gradient), their number)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    tgt = target.reshape(-1)
    loss = F.cross_entropy(flat, tgt, ignore_index=PAD_ID, label_smoothing=smoothing, reduction='sum')
    with torch.no_grad():
        nll = F.cross_entropy(flat, tgt, ignore_index=PAD_ID, reduction='sum')
    return loss, nll, int((tgt != PAD_ID).sum())


def inverse_sqrt_factor(update: int, lr: float, warmup_updates: int, warmup_init_lr: float) -> float:
    """fairseq's inverse_sqrt schedule as a factor of `lr` at `update` (0-based): linear from warmup_init_lr to lr over
    the warm-up, then lr * sqrt(warmup_updates / update)."""
    step = update + 1
    if warmup_updates > 0 and step < warmup_updates:
        return (warmup_init_lr + step * (lr - warmup_init_lr) / warmup_updates) / lr
    return math.sqrt(max(warmup_updates, 1) / step)


# ---- decoding, BLEU, averaging ----

def _max_lengths(src: torch.Tensor, max_len_a: float, max_len_b: int) -> torch.Tensor:
    """Longest output (eos included) per sentence: a * source tokens + b, at least 1."""
    return ((src != PAD_ID).sum(1).float() * max_len_a + max_len_b).long().clamp(min=1)


def _next_log_probs(model: TranslationTransformer, tokens: torch.Tensor, enc: EncoderOut, state: Any,
                    incremental: bool) -> Tuple[torch.Tensor, Any]:
    if incremental:
        logits, state = model.decode(tokens[:, -1:], state=state)
    else:  # the full decoder on the whole prefix: the reference of the incremental path
        logits, _ = model.decode(tokens, enc)
    lp = F.log_softmax(logits[:, -1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    lp[:, PAD_ID] = -math.inf
    lp[:, BOS_ID] = -math.inf
    return lp, state


@torch.no_grad()
def greedy_decode(model: TranslationTransformer, src: torch.Tensor, max_len_a: float = 1.2, max_len_b: int = 10,
                  incremental: bool = True) -> List[List[int]]:
    """The most probable next token at each step until eos (or the length limit); the tokens without eos."""
    enc = model.encode(src)
    state = model.start_state(enc) if incremental else None
    limit = _max_lengths(src, max_len_a, max_len_b)
    tokens = torch.full((src.shape[0], 1), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for step in range(int(limit.max())):
        lp, state = _next_log_probs(model, tokens, enc, state, incremental)
        nxt = lp.argmax(-1)
        nxt = torch.where((step + 1 >= limit) | done, torch.full_like(nxt, EOS_ID), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        done |= nxt == EOS_ID
        if bool(done.all()):
            break
    out = []
    for row in tokens[:, 1:].tolist():
        out.append(row[:row.index(EOS_ID)] if EOS_ID in row else row)
    return out


@torch.no_grad()
def beam_search(model: TranslationTransformer, src: torch.Tensor, beam: int = 5, len_penalty: float = 1.,
                max_len_a: float = 1.2, max_len_b: int = 10, incremental: bool = True
                ) -> Tuple[List[List[int]], List[float]]:
    """Beam search as fairseq's sequence generator: at each step the 2 x beam best extensions of the live hypotheses;
    those ending in eos among the first `beam` are finished (score: log-probability / length ** len_penalty, length
    with eos), the best `beam` others continue; a sentence is done with `beam` finished hypotheses, and eos is forced
    at a + b x source length. Returns the best hypothesis of each sentence (tokens without eos) and its score.

    incremental=False runs the whole decoder on the prefix at every step instead of the incremental state (the
    reference the tests compare with).
    """
    B, K = src.shape[0], beam
    enc = model.encode(src)
    rows = torch.arange(B, device=src.device).repeat_interleave(K)
    enc = EncoderOut(enc.out[rows], enc.mask[rows])
    state = model.start_state(enc) if incremental else None
    limit = _max_lengths(src, max_len_a, max_len_b).repeat_interleave(K)
    tokens = torch.full((B * K, 1), BOS_ID, dtype=torch.long, device=src.device)
    scores = torch.full((B, K), -math.inf, device=src.device, dtype=torch.promote_types(enc.out.dtype, torch.float32))
    scores[:, 0] = 0.  # one live hypothesis at the start
    finished: List[List[Tuple[float, List[int]]]] = [[] for _ in range(B)]
    done = [False] * B
    for step in range(int(limit.max())):
        lp, state = _next_log_probs(model, tokens, enc, state, incremental)
        forced = step + 1 >= limit
        if bool(forced.any()):
            lp[forced] = torch.where(torch.arange(lp.shape[1], device=lp.device) == EOS_ID, lp[forced], -math.inf)
        V = lp.shape[1]
        cand = (scores.view(-1, 1) + lp).view(B, K * V)
        top, idx = cand.topk(2 * K, dim=1)
        src_beam, tok = idx // V, idx % V
        is_eos = tok == EOS_ID
        for b, j in (is_eos[:, :K] & torch.isfinite(top[:, :K])).nonzero().tolist():
            if not done[b] and len(finished[b]) < K:
                hyp = tokens[b * K + int(src_beam[b, j]), 1:].tolist()
                finished[b].append((float(top[b, j]) / (step + 1) ** len_penalty, hyp))
        done = [d or len(f) >= K for d, f in zip(done, finished)]
        if all(done):
            break
        keep = torch.argsort(is_eos.to(torch.uint8), dim=1, stable=True)[:, :K]  # the best K that do not end
        scores = top.gather(1, keep)
        scores[torch.tensor(done, device=src.device)] = -math.inf
        parent = (torch.arange(B, device=src.device)[:, None] * K + src_beam.gather(1, keep)).view(-1)
        tokens = torch.cat([tokens[parent], tok.gather(1, keep).view(-1, 1)], dim=1)
        if incremental:
            state = state.reorder(parent)
    best = [max(f, key=lambda sh: sh[0]) for f in finished]
    return [h for _, h in best], [s for s, _ in best]


def translate(model: TranslationTransformer, vocab: SubwordVocab, sentences: Sequence[str], beam: int = 5,
              len_penalty: float = 1., max_len_a: float = 1.2, max_len_b: int = 10, batch_sentences: int = 128,
              max_positions: int = 1024, device: str = 'cpu') -> List[str]:
    """Detokenized beam-search translations of `sentences` (in batches of similar length; input order kept). A
    source longer than max_positions subwords is cut there. The model must be in eval mode."""
    if model.training:
        raise RuntimeError('translate needs the model in eval mode (model.eval()): in train mode dropout is on and '
                           'the GRC caches would be updated')
    ids = [s[:max_positions - 1] + [EOS_ID] for s in vocab.encode(sentences)]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: List[str] = [''] * len(ids)
    clock = ProgressClock(None, PROGRESS_SECONDS)  # beam search on a CPU can take minutes: not silent that long
    for start in range(0, len(order), batch_sentences):
        chunk = order[start:start + batch_sentences]
        src = _pad([ids[i] for i in chunk]).to(device)
        hyps, _ = beam_search(model, src, beam, len_penalty, max_len_a, max_len_b)
        for i, text in zip(chunk, vocab.decode(hyps)):
            out[i] = text
        if clock.due(0) and rank_and_world()[0] == 0:
            _logger.info(f'translating: {start + len(chunk)}/{len(ids)} sentences (this process), beam {beam}')
    return out


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], n_bootstrap: int = 0
                ) -> Tuple[float, str, Optional[float]]:
    """sacrebleu's corpus BLEU of detokenized text (its default 13a tokenization), its signature, and with
    `n_bootstrap` resamples sacrebleu's bootstrap 95% confidence half-width (else None)."""
    import sacrebleu
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(list(hypotheses), [list(references)], n_bootstrap=max(n_bootstrap, 1))
    ci = getattr(score, '_ci', None) if n_bootstrap > 1 else None
    return float(score.score), str(metric.get_signature()), None if ci is None else float(ci)


def average_checkpoints(paths: Sequence[str]) -> Dict[str, torch.Tensor]:
    """The element-wise mean (in float64, cast back) of every floating-point tensor of the checkpoints' 'model' state
    dicts, as fairseq's scripts/average_checkpoints.py; other tensors are taken from the last one (they must agree).

    Raises:
        ValueError: no paths, or checkpoints whose keys or shapes differ.
    """
    if not paths:
        raise ValueError('no checkpoints to average')
    total: Dict[str, torch.Tensor] = {}
    first: Dict[str, torch.Tensor] = {}
    for p in paths:
        state = load_checkpoint(p)['model']
        if first and (state.keys() != first.keys() or any(state[k].shape != first[k].shape for k in state)):
            raise ValueError(f'{p} has other keys or shapes than {paths[0]}: average checkpoints of one model only')
        for k, v in state.items():
            if v.is_floating_point():
                total[k] = total[k] + v.double() if k in total else v.double()
            else:
                total[k] = v
        first = first or state
    return {k: (v / len(paths)).to(first[k].dtype) if first[k].is_floating_point() else v for k, v in total.items()}


# ---- the run ----

# the settings a resumed run takes from its checkpoint (what the model, the data and the optimization are); the
# others (when to stop, evaluation, logging) come from the resuming command
_RESUMED_FIELDS = ('data_dir', 'source_lang', 'target_lang', 'model', 'model_kwargs', 'vocab_size', 'spm_model_type',
                   'max_tokens', 'max_positions', 'lr', 'warmup_updates', 'warmup_init_lr', 'weight_decay',
                   'label_smoothing', 'clip_norm', 'seed', 'save_interval_updates', 'amp', 'amp_dtype',
                   'grc_sync_cache')


@dataclasses.dataclass
class _Data:
    vocab: SubwordVocab
    train: Tuple[List[List[int]], List[List[int]]]
    valid: Tuple[List[List[int]], List[List[int]]]
    eval_sources: List[str]
    eval_references: List[str]
    dropped: int


def _broadcast(obj: Any, world_size: int) -> Any:
    """rank 0's `obj` on every process."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _prepare_data(cfg: MTConfig, rank: int, world_size: int, vocab_tensor: Optional[torch.Tensor]) -> _Data:
    """Read the splits (the demo task is written first when there is no data_dir), train the SentencePiece model on
    the training split's both sides (rank 0; or take the resumed one), and encode."""
    data_dir = cfg.data_dir
    if data_dir is None:
        data_dir = os.path.join(cfg.output, 'data')
        if rank == 0 and not os.path.isfile(os.path.join(data_dir, f'test.{cfg.target_lang}')):
            write_demo_task(data_dir)
        _broadcast(None, world_size)  # a barrier: the files exist before the others read them
    langs = (cfg.source_lang, cfg.target_lang)
    train_src, train_tgt = read_parallel(data_dir, 'train', *langs)
    valid_src, valid_tgt = read_parallel(data_dir, 'valid', *langs)
    eval_src, eval_ref = read_parallel(data_dir, cfg.eval_split, *langs)
    if vocab_tensor is None:
        proto = None
        if rank == 0:
            t0 = time.perf_counter()
            proto = SubwordVocab.train(train_src + train_tgt, cfg.vocab_size, cfg.spm_model_type).model_proto
            _logger.info(f'SentencePiece {cfg.spm_model_type} vocabulary trained on {len(train_src):,} pairs in '
                         f'{time.perf_counter() - t0:.1f}s')
        vocab = SubwordVocab(_broadcast(proto, world_size))
    else:
        vocab = SubwordVocab.from_tensor(vocab_tensor)
    ts, tt, dropped = encode_pairs(vocab, train_src, train_tgt, cfg.max_positions)
    vs, vt, _ = encode_pairs(vocab, valid_src, valid_tgt, cfg.max_positions)
    n = cfg.eval_max_sentences or len(eval_src)
    return _Data(vocab, (ts, tt), (vs, vt), eval_src[:n], eval_ref[:n], dropped)


def load_translation_checkpoint(path: str, device: str = 'cpu') -> Tuple[TranslationTransformer, SubwordVocab]:
    """The model (eval mode) and vocabulary of a checkpoint written by `run` (last.pt or averaged.pt)."""
    ckpt = load_checkpoint(path)
    if 'vocab' not in ckpt or 'config' not in ckpt:
        raise ValueError(f'{path} is not a translation checkpoint of lsvision.train.translation (no vocab/config)')
    cfg = ckpt['config']
    vocab = SubwordVocab.from_tensor(ckpt['vocab'])
    model = seq.create_model(cfg['model'], src_vocab_size=len(vocab), tgt_vocab_size=len(vocab),
                             **cfg['model_kwargs'])
    model.load_state_dict(ckpt['model'])
    return model.to(device).eval(), vocab


class _Trainer:
    """One training run: the model (DDP under torchrun), optimizer, the position in the batch order, checkpoints."""

    def __init__(self, cfg: MTConfig, data: _Data, device: torch.device, rank: int, world_size: int,
                 resume: Optional[Dict[str, Any]]):
        self.cfg, self.data, self.device, self.rank, self.world_size = cfg, data, device, rank, world_size
        torch.manual_seed(cfg.seed)  # the same initial weights on every process
        model = seq.create_model(cfg.model, src_vocab_size=len(data.vocab), tgt_vocab_size=len(data.vocab),
                                 **cfg.model_kwargs)
        if not isinstance(model, TranslationTransformer):
            raise ValueError(f'{cfg.model} is not a translation model (TranslationTransformer)')
        self.model = model.to(device)
        self.grc_layers = [m for m in model.modules() if isinstance(m, GatedRecurrentCache)]
        for m in self.grc_layers:
            m.sync_cache = False  # one all-reduce per update instead (grc_sync_cache)
        self.lr = cfg.resolved_lr()
        self.opt = torch.optim.Adam(model.parameters(), lr=self.lr, betas=(0.9, 0.98), eps=1e-8,
                                    weight_decay=cfg.weight_decay)
        amp_dtype = torch.bfloat16 if cfg.amp_dtype == 'bfloat16' else torch.float16
        self.autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if cfg.amp else nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if cfg.amp and amp_dtype == torch.float16 else None
        self.ddp: nn.Module = model
        if world_size > 1:
            sync = bool(self.grc_layers) and cfg.grc_sync_cache
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == 'cuda' else None, forward_sync_buffers=not sync)
        self.batches = token_batches([len(s) for s in data.train[0]], [len(t) for t in data.train[1]],
                                     cfg.max_tokens, cfg.seed)
        self.epoch = self.pos = self.updates = 0
        self.train_seconds = 0.
        self.saved: List[str] = []  # the averaging checkpoints, oldest first
        self._warmup_checked = False
        if resume is not None:
            self._load(resume)  # the RNG states too
        else:
            torch.manual_seed(cfg.seed + 7919 * (rank + 1))  # dropout: another stream on each process

    def _load(self, ckpt: Dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt['model'])
        self.opt.load_state_dict(ckpt['optimizer'])
        if self.scaler is not None and ckpt.get('scaler') is not None:
            self.scaler.load_state_dict(ckpt['scaler'])
        self.epoch, self.pos, self.updates = ckpt['epoch'], ckpt['pos'], ckpt['updates']
        self.train_seconds = ckpt['train_seconds']
        self.saved = list(ckpt['saved'])
        rng = ckpt['rng']
        if len(rng) != self.world_size:
            raise ValueError(f'the checkpoint was written by {len(rng)} processes, this run has {self.world_size}: '
                             'resume with the same number of processes (torchrun --nproc_per_node)')
        set_rng_state(rng[self.rank])
        if self.rank == 0:
            _logger.info(f'resumed at update {self.updates} (epoch {self.epoch}, batch {self.pos} of it, '
                         f'{self.train_seconds:.0f} s trained) from {ckpt["path"]}')

    def state(self) -> Dict[str, Any]:
        """What last.pt holds: everything an exact resume needs (every process's RNG state)."""
        return dict(model=self.model.state_dict(), optimizer=self.opt.state_dict(),
                    scaler=None if self.scaler is None else self.scaler.state_dict(), epoch=self.epoch, pos=self.pos,
                    updates=self.updates, train_seconds=self.train_seconds, saved=list(self.saved),
                    rng=all_gather(get_rng_state()), vocab=self.data.vocab.to_tensor(),
                    config=dataclasses.asdict(self.cfg))

    def save(self, averaging_point: bool) -> None:
        """Write last.pt (atomically) and, at an averaging point, checkpoint_<updates>.pt (keeping the last
        average_last of them)."""
        state = self.state()  # a collective (the RNG states): every process
        if self.rank != 0:
            return
        if averaging_point and (not self.saved or not self.saved[-1].endswith(f'_{self.updates}.pt')):
            name = os.path.join(self.cfg.output, f'checkpoint_{self.updates}.pt')
            save_atomic(dict(model=state['model'], updates=self.updates, epoch=self.epoch, vocab=state['vocab'],
                             config=state['config']), name)
            self.saved.append(name)
        # the last average_last only (a resume may give a smaller --average-last than the first run's)
        for old in self.saved[:-self.cfg.average_last]:
            if os.path.exists(old):
                os.remove(old)
        self.saved = self.saved[-self.cfg.average_last:]
        state['saved'] = list(self.saved)
        save_atomic(state, os.path.join(self.cfg.output, 'last.pt'))

    def _should_stop(self, elapsed: float) -> bool:
        cfg = self.cfg
        stop = ((cfg.max_updates is not None and self.updates >= cfg.max_updates)
                or (cfg.max_epochs is not None and self.epoch >= cfg.max_epochs)
                or (cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s))
        return bool(_broadcast(stop, self.world_size)) if cfg.time_budget_s is not None else stop

    def step(self, index: List[int]) -> Tuple[float, float, int]:
        """One update on the pairs `index`: (summed smoothed loss, summed NLL, target tokens)."""
        src, prev, tgt = (t.to(self.device) for t in collate(*self.data.train, index))
        for group in self.opt.param_groups:
            group['lr'] = self.lr * inverse_sqrt_factor(self.updates, self.lr, self.cfg.warmup_updates,
                                                        self.cfg.warmup_init_lr)
        self.ddp.train()
        with self.autocast():
            logits = self.ddp(src, prev)
        loss, nll, ntok = label_smoothed_loss(logits, tgt, self.cfg.label_smoothing)
        scaled = loss / max(ntok, 1)
        (scaled if self.scaler is None else self.scaler.scale(scaled)).backward()
        optimizer_update(self.opt, self.scaler, self.model.parameters(),
                         self.cfg.clip_norm if self.cfg.clip_norm > 0 else None, 'norm')
        if self.cfg.grc_sync_cache:
            all_reduce_grc_caches(self.grc_layers)
        self.updates += 1
        return float(loss.detach()), float(nll), ntok

    def train(self) -> bool:
        """Train until a limit is reached; returns whether the time budget stopped it."""
        cfg = self.cfg
        start = time.perf_counter() - self.train_seconds
        clock = ProgressClock(None, cfg.log_interval_s)
        window = [0., 0., 0]
        self.check_warmup()
        while not self._should_stop(time.perf_counter() - start):
            batches = epoch_batches(self.batches, self.epoch, cfg.seed, self.rank, self.world_size)
            while self.pos < len(batches):
                if self._should_stop(time.perf_counter() - start):
                    self.train_seconds = time.perf_counter() - start
                    return cfg.time_budget_s is not None and self.train_seconds >= cfg.time_budget_s
                loss, nll, ntok = self.step(batches[self.pos])
                self.pos += 1
                window = [window[0] + loss, window[1] + nll, window[2] + ntok]
                self.train_seconds = time.perf_counter() - start
                if cfg.save_interval_updates and self.updates % cfg.save_interval_updates == 0:
                    self.save(averaging_point=True)
                if self.rank == 0 and clock.due(self.updates):
                    self._log(window)
                    self.check_warmup(projected=True)
                    window = [0., 0., 0]
            self.epoch, self.pos = self.epoch + 1, 0
            self.train_seconds = time.perf_counter() - start
            self.save(averaging_point=cfg.save_interval_updates == 0)
        self.train_seconds = time.perf_counter() - start  # also when a limit was reached before the first update
        return cfg.time_budget_s is not None and self.train_seconds >= cfg.time_budget_s

    def updates_per_epoch(self) -> int:
        return len(self.batches) // self.world_size

    def check_warmup(self, projected: bool = False) -> None:
        """Warn (rank 0, once) when the warm-up is not shorter than the run: its --max-updates or --epochs, or with
        only a time budget the updates it is projected to make at this run's pace (`projected`, after some)."""
        cfg = self.cfg
        if self.rank != 0 or self._warmup_checked or cfg.warmup_updates <= 0:
            return
        limits = []
        if cfg.max_updates is not None:
            limits.append((cfg.max_updates, f'--max-updates {cfg.max_updates}'))
        if cfg.max_epochs is not None:
            limits.append((cfg.max_epochs * self.updates_per_epoch(),
                           f'--epochs {cfg.max_epochs} of {self.updates_per_epoch()} updates'))
        if cfg.time_budget_s is not None:
            if not projected and not limits:
                return
            if projected and self.train_seconds > 0:
                pace = int(self.updates / self.train_seconds * cfg.time_budget_s)
                limits.append((pace, f'about {pace} in --time-budget {cfg.time_budget_s:g} at this pace'))
        if not limits:
            return
        self._warmup_checked = True
        total, note = min(limits)
        message = long_warmup_warning(
            f'--warmup-updates {cfg.warmup_updates}', cfg.warmup_updates, total, 'updates', cfg.warmup_init_lr,
            self.lr, f'(the run: {note}), e.g. to a tenth of the run. On a small corpus: {SMALL_CORPUS_FLAGS} '
                     '(docs/sequence.md)')
        if message:
            _logger.warning(message)

    def _log(self, window: List[float]) -> None:
        tok = max(window[2], 1)
        budget = f'/{self.cfg.time_budget_s:.0f}' if self.cfg.time_budget_s else ''
        _logger.info(f'epoch {self.epoch} update {self.updates} | loss {window[0] / tok:.3f} | nll '
                     f'{window[1] / tok:.3f} (ppl {math.exp(min(window[1] / tok, 50)):.2f}) | lr '
                     f'{self.opt.param_groups[0]["lr"]:.2e} | {self.train_seconds:.0f}{budget}s')


@torch.no_grad()
def _valid_nll(model: TranslationTransformer, data: _Data, cfg: MTConfig, device: torch.device) -> float:
    """NLL per target token (nats) on the valid split, every process a shard of its batches."""
    model.eval()
    src, tgt = data.valid
    batches = token_batches([len(s) for s in src], [len(t) for t in tgt], cfg.max_tokens, 0)
    total = torch.zeros(2, dtype=torch.float64)
    for i in shard_range(len(batches)):
        s, p, t = (x.to(device) for x in collate(src, tgt, batches[i]))
        _, nll, ntok = label_smoothed_loss(model(s, p), t, 0.)
        total += torch.tensor([float(nll), ntok], dtype=torch.float64)
    total = sum(all_gather(total))
    return float(total[0] / max(total[1], 1))


def _score(model: TranslationTransformer, data: _Data, cfg: MTConfig, device: torch.device, what: str
           ) -> Dict[str, Any]:
    """Valid NLL and perplexity, and the BLEU of beam search on the evaluation split (sentences sharded)."""
    t0 = time.perf_counter()
    nll = _valid_nll(model, data, cfg, device)
    part = shard_range(len(data.eval_sources))
    hyps = translate(model, data.vocab, data.eval_sources[part.start:part.stop], cfg.beam, cfg.len_penalty,
                     cfg.max_len_a, cfg.max_len_b, cfg.eval_batch_sentences, cfg.max_positions, str(device))
    hyps = [h for shard in all_gather(hyps) for h in shard]
    bleu, signature, ci = corpus_bleu(hyps, data.eval_references, cfg.bleu_bootstrap)
    _logger.info(f'{what}: valid nll {nll:.3f} (ppl {math.exp(min(nll, 50)):.2f}), {cfg.eval_split} BLEU {bleu:.2f}'
                 + ('' if ci is None else f' +- {ci:.2f} (95%, bootstrap)')
                 + f' ({len(hyps)} sentences, beam {cfg.beam}, {time.perf_counter() - t0:.0f}s)')
    examples = [dict(source=s, reference=r, hypothesis=h)
                for s, r, h in zip(data.eval_sources[:3], data.eval_references[:3], hyps[:3])]
    return dict(valid_nll=round(nll, 4), valid_ppl=round(math.exp(min(nll, 50)), 3), bleu=round(bleu, 2),
                bleu_ci95=None if ci is None else round(ci, 2), bleu_signature=signature, examples=examples)


def _report_markdown(result: Dict[str, Any]) -> str:
    rows = [[what, f"{r['valid_nll']:.3f}", f"{r['valid_ppl']:.2f}",
             f"{r['bleu']:.2f}" + ('' if r['bleu_ci95'] is None else f" +- {r['bleu_ci95']:.2f}")]
            for what, r in (('last', result['last']), (f"average of last {result['averaged_checkpoints']}",
                                                        result['averaged']))]
    return (f"# {result['model']}: translation {result['source_lang']} -> {result['target_lang']}\n\n"
            f"{result['updates']} updates, {result['epochs']} epochs, {result['train_seconds']:.0f} s of training "
            f"({'stopped by the time budget' if result['stopped_by_time_budget'] else 'to its limit'}); "
            f"{result['params']:,} parameters; lr {result['lr']:g}; commit {result['commit']}; "
            f"{result['machine']}.\n\n"
            + markdown_table(['weights', 'valid NLL', 'valid ppl', f"{result['eval_split']} BLEU"], rows)
            + f"\n\nBLEU: sacrebleu {result['last']['bleu_signature']}, beam {result['beam']}, "
              f"{result['eval_sentences']} sentences; +- is the half-width of sacrebleu's bootstrap 95% interval.\n")


_STOP_FIELDS = ('max_epochs', 'max_updates', 'time_budget_s')
# the flags of the fields whose flag is not their name
_FLAGS = dict(max_epochs='--epochs', time_budget_s='--time-budget', log_interval_s='--log-interval-s')


def _flag(field: str) -> str:
    return _FLAGS.get(field, '--' + field.replace('_', '-'))


def resumed_config(cfg: MTConfig, saved: Dict[str, Any], given: Optional[Sequence[str]] = None) -> MTConfig:
    """The config of a resumed run: the checkpoint's (`saved`), with the settings `given` on the resuming command
    taken from `cfg`, except those `_RESUMED_FIELDS` fixes (the model, the data, the optimization): a given one of
    those is kept as the checkpoint's, with a warning that names it. Stopping limits given replace the checkpoint's
    (--max-updates alone drops its --time-budget).

    given: the fields the command line set (tools/train_mt.py passes them); None: those that differ from MTConfig's
    defaults.
    """
    return resumed_settings(cfg, saved, given, _RESUMED_FIELDS, _STOP_FIELDS, _flag, 'model, data and optimization',
                            _logger)


def _check_budget_left(cfg: MTConfig, ckpt: Dict[str, Any], path: str) -> None:
    """A resumed run whose time budget is spent would train 0 updates: say so, with the flags that do what was
    meant."""
    spent, updates, budget = ckpt['train_seconds'], ckpt['updates'], cfg.time_budget_s
    done = ((cfg.max_updates is not None and updates >= cfg.max_updates)
            or (cfg.max_epochs is not None and ckpt['epoch'] >= cfg.max_epochs))
    if budget is not None and spent >= budget and not done:
        raise ValueError(
            f"--time-budget {budget:g} is the run's total training time (counted over its resumes), and {path} has "
            f'trained {spent:.1f} s of it already (update {updates}): nothing is left to train. Give the total you '
            f'want, e.g. --time-budget {spent + budget:.4g} for {budget:g} s more, or --max-updates {updates} to only '
            'evaluate the checkpoint')


def _warn_small_corpus(cfg: MTConfig, pairs: int, params: int) -> None:
    """A new run of a large model on a small corpus: it overfits, and a short run does not leave the warm-up."""
    if pairs < SMALL_CORPUS_PAIRS and params > SMALL_CORPUS_MAX_PARAMS:
        _logger.warning(
            f'{pairs:,} training pairs for a model of {params / 1e6:.1f}M parameters ({cfg.model}'
            + (f' {cfg.model_kwargs}' if cfg.model_kwargs else '') + f", lr {cfg.resolved_lr():g}, "
            f"{cfg.warmup_updates} warm-up updates; fairseq's IWSLT recipe is for 160k pairs): it overfits, and a "
            f"short run ends inside the warm-up. For a corpus of thousands of pairs, the demo's size and schedule: "
            f'{SMALL_CORPUS_FLAGS} (docs/sequence.md, "A small corpus"; twice the lr for a GRC model)')


def run(cfg: MTConfig, given: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Train (or resume) and evaluate a translation model; returns the result (also in result.json / result.md).

    `given`: with `cfg.resume`, the fields the command line set (see `resumed_config`).
    """
    resume_ckpt = None
    if cfg.resume:
        path = os.path.join(cfg.output, 'last.pt') if cfg.resume == 'auto' else cfg.resume
        resume_ckpt = load_checkpoint(path)
        resume_ckpt['path'] = path
        cfg = resumed_config(cfg, resume_ckpt['config'], given)
        _check_budget_left(cfg, resume_ckpt, path)
    cfg.check()
    procs = init_eval_processes(cfg.device)
    try:
        os.makedirs(cfg.output, exist_ok=True)
        data = _prepare_data(cfg, procs.rank, procs.world_size, None if resume_ckpt is None else resume_ckpt['vocab'])
        if procs.primary:
            _logger.info(f'{len(data.train[0]):,} training pairs ({data.dropped} longer than {cfg.max_positions} '
                         f'dropped), vocabulary {len(data.vocab)}, {procs.world_size} process(es) on {procs.device}')
        trainer = _Trainer(cfg, data, procs.device, procs.rank, procs.world_size, resume_ckpt)
        if procs.primary and resume_ckpt is None:
            _warn_small_corpus(cfg, len(data.train[0]), sum(p.numel() for p in trainer.model.parameters()))
        by_budget = trainer.train()
        trainer.save(averaging_point=True)
        model = trainer.model
        result: Dict[str, Any] = dict(
            model=cfg.model, model_kwargs=cfg.model_kwargs, params=sum(p.numel() for p in model.parameters()),
            source_lang=cfg.source_lang, target_lang=cfg.target_lang, vocab=len(data.vocab), lr=trainer.lr,
            updates=trainer.updates, epochs=trainer.epoch, train_seconds=round(trainer.train_seconds, 1),
            stopped_by_time_budget=by_budget, eval_split=cfg.eval_split, eval_sentences=len(data.eval_sources),
            beam=cfg.beam, commit=source_commit(), machine=machine_description(str(procs.device)),
            world_size=procs.world_size, amp=cfg.amp and cfg.amp_dtype)
        result['last'] = _score(model, data, cfg, procs.device, 'last')
        saved = _broadcast(trainer.saved, procs.world_size)
        averaged = average_checkpoints(saved)
        model.load_state_dict(averaged)
        result['averaged_checkpoints'] = len(saved)
        result['averaged'] = _score(model, data, cfg, procs.device, f'average of the last {len(saved)}')
        if procs.primary:
            save_atomic(dict(model=averaged, vocab=data.vocab.to_tensor(), config=dataclasses.asdict(cfg)),
                        os.path.join(cfg.output, 'averaged.pt'))
            result['output'] = cfg.output
            write_json(os.path.join(cfg.output, 'result.json'), result)
            write_text(os.path.join(cfg.output, 'result.md'), _report_markdown(result))
        return result
    finally:
        close_eval_processes()


def config_to_json(cfg: MTConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=2)
