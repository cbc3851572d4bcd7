"""Word-level language-model training and evaluation behind `tools/train_lm.py` (Transformer-XL and its GRC version).

The recipe is Transformer-XL's `run_wt103_base.sh`: the training text as `batch_size` contiguous streams, segments
of `tgt_len` tokens read in order with the memory (or GRC cache) carried from one segment to the next, Adam (no
weight decay) at 2.5e-4 with a cosine schedule over the updates (timm's CosineLRScheduler), gradient clipping at
0.25; a new epoch starts the streams again with an empty memory. With a time budget the learning rate follows the
time instead (`lsvision.sequence.budget_train.lr_factor`), as the other CPU demos do.

Perplexity is evaluated with the memory (cache) carried over each stream, by one of two protocols
(`eval_protocol`): 'authors' is Transformer-XL's pytorch/eval.py (their TensorFlow code cuts the rows the same way;
the paper's numbers come from that code): the split cut into `eval_batch_size` contiguous rows of N // B tokens
(eval.py's default 10, kept by their PyTorch scripts), each row predicting its own tokens but the first
(B * (N // B - 1) targets; `lsvision.data.text_corpus.authors_eval_streams`).
'every-token' (the default) scores every token of the split but the first exactly once, over `eval_batch_size`
streams (`eval_streams`; 1: one stream over the whole split). Relative distances are clamped only for a clamp_len
> 0, as the authors' (their default -1 is no clamp).

Runs under torchrun (one process per device; DDP; the global `batch_size` streams are split over the processes, so
that N processes equal one process with the same global batch), with autocast (bfloat16, or float16 with a loss
scaler), resumes exactly (`last.pth.tar`: model, optimizer, scheduler, scaler, the position in the streams; each
process's carried memory and RNG states in `streams-rank<r>.pth`; all written atomically), logs progress, and writes
`result.json` and `result.md`.

Written for lsvision, Apache-2.0.
"""
import dataclasses
import logging
import math
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Collection, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

import lsvision.sequence as seq
from lsvision.data.text_corpus import (
    WordCorpus,
    authors_eval_streams,
    eval_streams,
    load_text_files,
    load_wikitext,
    stdlib_docstrings,
    stream_batches,
)
from lsvision.eval.distributed import close_eval_processes, init_eval_processes, shard_range
from lsvision.reports import machine_description, markdown_table, write_json, write_text
from lsvision.runs import source_commit
from lsvision.runtime import PROGRESS_SECONDS, ProgressClock
from lsvision.sequence.budget_train import time_decay
from lsvision.sequence.transformer_xl import GrcStreamState, TransformerXL, TxlState

from .args import resumed_settings
from .checkpoint import get_rng_state, load_checkpoint, save_atomic, set_rng_state
from .engine import long_warmup_warning, optimizer_update

__all__ = ['LMConfig', 'LMSetupError', 'run', 'resumed_config', 'evaluate_perplexity', 'load_corpus', 'state_to_dict',
           'state_from_dict', 'SMALL_CORPUS_FLAGS']

_logger = logging.getLogger('train_lm')
EVAL_PROTOCOLS = ('every-token', 'authors')  # see the module doc

# a recipe for a corpus of a few million tokens or less (WikiText-103 has 103M): tools/demo_lm.py's model and schedule
# (docs/sequence.md); a new run on fewer training tokens than SMALL_CORPUS_TOKENS with a model of more parameters than
# SMALL_CORPUS_MAX_PARAMS gets it as a warning
SMALL_CORPUS_FLAGS = ('--model txl_tiny --model-kwargs drop=0.0 --tgt-len 64 --batch-size 8 --lr 1e-3 '
                      '--warmup-steps 20')
SMALL_CORPUS_TOKENS, SMALL_CORPUS_MAX_PARAMS = 10_000_000, 10_000_000


class LMSetupError(ValueError):
    """The run cannot start as configured; the message says what to change."""


@dataclasses.dataclass
class LMConfig:
    """A language-model run (`tools/train_lm.py`'s options; Transformer-XL's WikiText-103 base recipe by default).

    Data: `data_dir` (WikiText's word-level files), or `train_file` (+ `valid_file`, `test_file`; any text), or
    `corpus='stdlib'` (the standard library's docstrings, no download). Training stops at `max_steps` or after
    `time_budget_s` seconds of training (evaluation not counted), whichever comes first; both count the whole run,
    over its resumes. A progress line every `log_interval` steps or `log_interval_s` seconds, whichever comes first.
    """
    model: str = 'txl_wt103_base'
    model_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    data_dir: Optional[str] = None
    train_file: Optional[str] = None
    valid_file: Optional[str] = None
    test_file: Optional[str] = None
    corpus: Optional[str] = None
    min_freq: int = 1
    max_vocab: Optional[int] = None
    tgt_len: int = 150
    batch_size: int = 60
    lr: float = 2.5e-4
    min_lr: float = 0.
    warmup_steps: int = 0
    clip_grad: float = 0.25
    max_steps: int = 200000
    time_budget_s: Optional[float] = None
    eval_interval: int = 4000
    eval_tgt_len: Optional[int] = None
    eval_batch_size: int = 10
    eval_mem_len: Optional[int] = None
    eval_clamp_len: Optional[int] = None
    eval_same_length: bool = False
    eval_protocol: str = 'every-token'
    eval_max_tokens: Optional[int] = None
    log_interval: int = 200
    log_interval_s: float = PROGRESS_SECONDS
    save_interval: int = 1000
    amp: bool = False
    amp_dtype: str = 'bfloat16'
    device: str = 'cpu'
    seed: int = 1111
    output: str = 'output/train_lm'
    resume: Optional[str] = None

    def check(self) -> None:
        sources = [self.data_dir is not None, self.train_file is not None, self.corpus is not None]
        if sum(sources) != 1:
            raise LMSetupError('give exactly one of --data-dir (WikiText files), --train-file (any text) or '
                               '--corpus stdlib')
        if not seq.is_model(self.model):
            import difflib
            close = difflib.get_close_matches(self.model, seq.list_models(), n=3, cutoff=0.5)
            hint = f'; did you mean {", ".join(close)}?' if close else '.'
            raise LMSetupError(f'unknown model {self.model!r}{hint} The language models: '
                               f'{", ".join(seq.list_models("*txl*"))}')
        if self.corpus not in (None, 'stdlib'):
            raise LMSetupError(f"--corpus must be 'stdlib', got {self.corpus!r}")
        if self.eval_protocol not in EVAL_PROTOCOLS:
            raise LMSetupError(f'--eval-protocol must be one of {", ".join(EVAL_PROTOCOLS)}, got '
                               f'{self.eval_protocol!r}')
        if self.amp_dtype not in ('bfloat16', 'float16'):
            raise LMSetupError(f"--amp-dtype must be 'bfloat16' or 'float16', got {self.amp_dtype!r}")
        for name in ('tgt_len', 'batch_size', 'eval_batch_size', 'max_steps', 'log_interval', 'save_interval',
                     'eval_interval'):
            if getattr(self, name) < 1:
                raise LMSetupError(f'--{name.replace("_", "-")} must be >= 1, got {getattr(self, name)}')


def load_corpus(cfg: LMConfig) -> WordCorpus:
    """The corpus the config names (every process builds the same one: the vocabulary is deterministic)."""
    if cfg.data_dir is not None:
        return load_wikitext(cfg.data_dir, cfg.min_freq, cfg.max_vocab)
    if cfg.train_file is not None:
        return load_text_files(cfg.train_file, cfg.valid_file, cfg.test_file, max(cfg.min_freq, 1), cfg.max_vocab)
    return stdlib_docstrings()


def state_to_dict(state: Any) -> Dict[str, Any]:
    """A carried LM state as plain tensors and lists (for `torch.load(weights_only=True)`)."""
    if isinstance(state, TxlState):
        return dict(kind='xl', mems=list(state.mems), valid=state.valid)
    if isinstance(state, GrcStreamState):
        return dict(kind='grc', caches=list(state.caches), summaries=list(state.summaries), pending=state.pending)
    return dict(kind='none')


def state_from_dict(d: Dict[str, Any]) -> Any:
    if d['kind'] == 'xl':
        return TxlState(tuple(d['mems']), d['valid'])
    if d['kind'] == 'grc':
        return GrcStreamState(tuple(d['caches']), tuple(d['summaries']), d['pending'])
    return None


def _unwrap(model: nn.Module) -> TransformerXL:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextmanager
def _eval_settings(model: TransformerXL, mem_len: Optional[int], clamp_len: Optional[int],
                   same_length: Optional[bool]) -> Iterator[None]:
    """Transformer-XL's evaluation options for the duration of an evaluation (the authors evaluate with a longer
    memory, clamped distances and same-length attention). None keeps the model's; a clamp_len <= 0 is no clamp."""
    if mem_len is not None and model.memory != 'xl':
        raise LMSetupError('--eval-mem-len changes the memory of Transformer-XL; a GRC model keeps its cache length '
                           f'(T_m = {model.mem_len}): leave it out')
    saved = (model.mem_len, model.clamp_len, model.same_length)
    model.mem_len = saved[0] if mem_len is None else mem_len
    model.clamp_len = saved[1] if clamp_len is None else clamp_len
    model.same_length = saved[2] if same_length is None else same_length
    try:
        yield
    finally:
        model.mem_len, model.clamp_len, model.same_length = saved


def _autocast(cfg: LMConfig, device: torch.device):
    if not cfg.amp:
        return nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, cfg.amp_dtype))


@torch.no_grad()
def evaluate_perplexity(model: nn.Module, data: torch.Tensor, tgt_len: int, batch_size: int = 1,
                        device: Optional[torch.device] = None, max_tokens: Optional[int] = None,
                        mem_len: Optional[int] = None, clamp_len: Optional[int] = None,
                        same_length: Optional[bool] = None, autocast: Any = None,
                        protocol: str = 'every-token') -> Dict[str, float]:
    """Perplexity of a token stream with the state carried over each row: `protocol` 'every-token' scores each
    token but the first once (`eval_streams`), 'authors' as Transformer-XL's eval.py (`authors_eval_streams`: B
    rows of N // B tokens, each predicting its own tokens but the first).

    Under torchrun each process scores its share of the `batch_size` rows and the sums are all-reduced.

    Returns:
        dict(nll=mean NLL in nats, ppl, tokens=tokens scored).
    """
    lm = _unwrap(model)
    was_training = lm.training
    lm.eval()
    device = device or lm.embed.weight.device
    if max_tokens is not None:
        data = data[:max_tokens + 1]
    if protocol not in EVAL_PROTOCOLS:
        raise ValueError(f'protocol must be one of {", ".join(EVAL_PROTOCOLS)}, got {protocol!r}')
    segments = (authors_eval_streams if protocol == 'authors' else eval_streams)(data, batch_size, tgt_len)
    rows = shard_range(segments[0].inputs.shape[0])
    total = torch.zeros(2, dtype=torch.float64, device=device)
    state = None
    with _eval_settings(lm, mem_len, clamp_len, same_length):
        for s in segments:
            if len(rows) == 0:
                break
            x, y, m = (t[rows.start:rows.stop].to(device) for t in (s.inputs, s.targets, s.mask))
            with autocast or nullcontext():
                nll, state = lm(x, y, state, mask=m)
            total[0] += nll.double().sum()
            total[1] += m.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    lm.train(was_training)
    nll = float(total[0] / total[1].clamp(min=1))
    return dict(nll=nll, ppl=math.exp(min(nll, 700.)), tokens=int(total[1]))


def _build_model(cfg: LMConfig, vocab_size: int) -> TransformerXL:
    try:
        return seq.create_model(cfg.model, vocab_size=vocab_size, **cfg.model_kwargs)
    except ValueError as e:
        if 'cutoffs' in str(e):
            raise LMSetupError(f'{e}. This corpus has {vocab_size:,} words: give cutoffs below that, e.g. '
                               "--model-kwargs 'cutoffs=[]' for a plain softmax") from e
        raise


class _Trainer:
    """The model (DDP under torchrun), optimizer, scheduler, scaler, the position in the streams, checkpoints."""

    def __init__(self, cfg: LMConfig, corpus: WordCorpus, device: torch.device, rank: int, world: int,
                 resume: Optional[Dict[str, Any]]):
        self.cfg, self.corpus, self.device, self.rank, self.world = cfg, corpus, device, rank, world
        if cfg.batch_size % world:
            raise LMSetupError(f'--batch-size {cfg.batch_size} streams cannot be split evenly over {world} '
                               f'processes; use a multiple of {world}')
        torch.manual_seed(cfg.seed)
        self.lm = _build_model(cfg, len(corpus.vocab)).to(device)
        self.model: nn.Module = self.lm
        if world > 1:
            self.model = nn.parallel.DistributedDataParallel(
                self.lm, device_ids=[device.index] if device.type == 'cuda' else None)
        from timm.optim import create_optimizer_v2
        from timm.scheduler import CosineLRScheduler
        self.optimizer = create_optimizer_v2(self.lm, 'adam', lr=cfg.lr, weight_decay=0.)
        self.scheduler = CosineLRScheduler(self.optimizer, t_initial=cfg.max_steps, lr_min=cfg.min_lr,
                                           warmup_t=cfg.warmup_steps, t_in_epochs=False)
        self.scaler = torch.amp.GradScaler(device.type) if cfg.amp and cfg.amp_dtype == 'float16' else None
        rows = shard_range(cfg.batch_size, rank, world)
        self.streams = stream_batches(corpus.train, cfg.batch_size)[rows.start:rows.stop]
        self.step, self.epoch, self.pos, self.train_seconds = 0, 0, 0, 0.
        self.state: Any = None
        # the schedule's decay factor reached so far (after the warm-up it never rises: see _set_lr)
        self.lr_decay = 1.
        self.warmup_checked = False
        self.best: Optional[float] = None
        self.history: List[Dict[str, Any]] = []
        self.loss_window: List[float] = []
        if resume is not None:
            self._load(resume)

    def _load(self, ckpt: Dict[str, Any]) -> None:
        self.lm.load_state_dict(ckpt['model'])
        self.optimizer.load_state_dict(ckpt['optimizer'])
        # not the scheduler's state: it would bring back the first run's --max-steps (the cosine follows this run's)
        if self.scaler is not None and ckpt.get('scaler'):
            self.scaler.load_state_dict(ckpt['scaler'])
        self.step, self.epoch, self.pos = ckpt['step'], ckpt['epoch'], ckpt['pos']
        self.train_seconds, self.best, self.history = ckpt['train_seconds'], ckpt['best'], ckpt['history']
        # an older checkpoint without it: the factor of the lr it last applied (past the warm-up)
        last = ckpt['optimizer']['param_groups'][0]['lr'] / self.cfg.lr if self.cfg.lr > 0 else 1.
        self.lr_decay = ckpt.get('lr_decay', min(1., last) if self.step > self.cfg.warmup_steps else 1.)
        path = os.path.join(os.path.dirname(ckpt['path']), f'streams-rank{self.rank}.pth')
        streams = load_checkpoint(path, map_location=str(self.device))
        if streams['step'] != self.step:
            raise LMSetupError(f'{path} is of step {streams["step"]}, the checkpoint of step {self.step}: the run '
                               'stopped between the two writes; resume from the checkpoint before, or start again')
        self.state = state_from_dict(streams['state'])
        set_rng_state(streams['rng'])
        _logger.info(f'resumed at step {self.step} (epoch {self.epoch}, stream position {self.pos}, '
                     f'{self.train_seconds:.0f} s trained) from {ckpt["path"]}')

    def save(self) -> str:
        """Each process's carried state and RNG first, then rank 0's checkpoint (which names the step)."""
        out = self.cfg.output
        if self.cfg.time_budget_s:  # the decay the time schedule has reached (2 % once the budget is spent)
            self.lr_decay = min(self.lr_decay, time_decay(self.train_seconds / self.cfg.time_budget_s))
        save_atomic(dict(step=self.step, state=state_to_dict(self.state), rng=get_rng_state()),
                    os.path.join(out, f'streams-rank{self.rank}.pth'))
        if self.world > 1:
            dist.barrier()
        path = os.path.join(out, 'last.pth.tar')
        if self.rank == 0:
            save_atomic(dict(model=self.lm.state_dict(), optimizer=self.optimizer.state_dict(),
                             scheduler=self.scheduler.state_dict(),
                             scaler=self.scaler.state_dict() if self.scaler is not None else None,
                             step=self.step, epoch=self.epoch, pos=self.pos, train_seconds=self.train_seconds,
                             lr_decay=self.lr_decay,
                             best=self.best, history=self.history, vocab=self.corpus.vocab.symbols,
                             config=dataclasses.asdict(self.cfg), path=path), path)
        return path

    def _set_lr(self) -> None:
        """The step's learning rate: the cosine over --max-steps (timm's), or with a time budget the time's
        (`lsvision.sequence.budget_train.lr_factor`: flat, then down to 2 % over the last 40 % of the budget).

        After the warm-up the decay never rises (`lr_decay`, kept in the checkpoint): a run resumed with a larger
        budget or more steps keeps the rate it had reached until the new schedule comes down to it, then follows
        that to the end, instead of jumping back up. An uninterrupted run is unchanged (its schedule only falls).
        """
        cfg = self.cfg
        if cfg.time_budget_s:
            self.lr_decay = min(self.lr_decay, time_decay(self.train_seconds / cfg.time_budget_s))
            factor = min(1., (self.step + 1) / max(cfg.warmup_steps, 1)) * self.lr_decay
            for g in self.optimizer.param_groups:
                g['lr'] = cfg.lr * factor
            return
        self.scheduler.step_update(self.step)
        if self.step < cfg.warmup_steps or cfg.lr <= 0:
            return
        decay = self.optimizer.param_groups[0]['lr'] / cfg.lr
        if decay > self.lr_decay:  # a resumed run's new schedule above the rate reached: keep that rate
            for g in self.optimizer.param_groups:
                g['lr'] = cfg.lr * self.lr_decay
        else:
            self.lr_decay = decay

    def train_step(self) -> float:
        cfg, n = self.cfg, self.streams.shape[1]
        if self.pos + 1 >= n:  # a new epoch: the streams again, from an empty memory
            self.epoch, self.pos, self.state = self.epoch + 1, 0, None
        L = min(cfg.tgt_len, n - 1 - self.pos)
        x = self.streams[:, self.pos:self.pos + L].long().to(self.device)
        y = self.streams[:, self.pos + 1:self.pos + 1 + L].long().to(self.device)
        self._set_lr()
        self.model.train()
        with _autocast(cfg, self.device):
            nll, state = self.model(x, y, self.state)
            loss = nll.float().mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(f'loss is {float(loss)} at step {self.step}; lower --lr or turn off --amp')
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()  # gradients: None since the last update
        optimizer_update(self.optimizer, self.scaler, self.lm.parameters(),
                         cfg.clip_grad if cfg.clip_grad > 0 else None, 'norm')
        self.state, self.pos, self.step = state, self.pos + L, self.step + 1
        return float(loss.detach())

    def evaluate(self, split: str, max_tokens: Optional[int] = None) -> Dict[str, float]:
        cfg = self.cfg
        return evaluate_perplexity(
            self.lm, getattr(self.corpus, split), cfg.eval_tgt_len or cfg.tgt_len, cfg.eval_batch_size,
            self.device, max_tokens, cfg.eval_mem_len, cfg.eval_clamp_len, cfg.eval_same_length or None,
            _autocast(cfg, self.device), cfg.eval_protocol)

    def _log_progress(self, t0: float, steps0: int) -> None:
        cfg = self.cfg
        rate = (self.step - steps0) / max(time.perf_counter() - t0, 1e-9)
        tokens = rate * cfg.tgt_len * cfg.batch_size
        loss = sum(self.loss_window) / len(self.loss_window)
        self.loss_window = []
        if cfg.time_budget_s:
            left = f'{max(0., cfg.time_budget_s - self.train_seconds):.0f}s of the time budget left'
        else:
            left = f'ETA {(cfg.max_steps - self.step) / max(rate, 1e-9) / 60:.1f} min'
        lr = self.optimizer.param_groups[0]['lr']
        of = '' if cfg.time_budget_s else f'/{cfg.max_steps}'
        _logger.info(f'step {self.step}{of} | epoch {self.epoch} | lr {lr:.3g}'
                     f' | loss {loss:.3f} | ppl {math.exp(min(loss, 700.)):.1f} | {tokens:,.0f} tok/s | {left}')

    def check_warmup(self, projected: bool = False) -> None:
        """Warn (rank 0, once) when the warm-up is not shorter than the run: --max-steps, or with a time budget the
        steps it is projected to make at this run's pace (`projected`, after some steps)."""
        cfg = self.cfg
        if self.rank != 0 or self.warmup_checked or cfg.warmup_steps <= 0:
            return
        total, note = cfg.max_steps, f'--max-steps {cfg.max_steps}'
        if cfg.time_budget_s:
            if not projected or self.train_seconds <= 0:
                return
            pace = int(self.step / self.train_seconds * cfg.time_budget_s)
            if pace < total:
                total, note = pace, f'about {pace} in --time-budget-s {cfg.time_budget_s:g} at this pace'
        self.warmup_checked = True
        start = cfg.lr / max(cfg.warmup_steps, 1) if cfg.time_budget_s else 0.
        message = long_warmup_warning(f'--warmup-steps {cfg.warmup_steps}', cfg.warmup_steps, total, 'steps', start,
                                      cfg.lr, f'(the run: {note})')
        if message:
            _logger.warning(message)

    def train(self) -> bool:
        """Train to max_steps or the time budget; returns True when the budget stopped it."""
        cfg = self.cfg
        t0, steps0 = time.perf_counter(), self.step
        clock = ProgressClock(cfg.log_interval, cfg.log_interval_s)
        by_budget = False
        self.check_warmup()
        while self.step < cfg.max_steps:
            if cfg.time_budget_s and self.train_seconds >= cfg.time_budget_s:
                by_budget = True
                break
            start = time.perf_counter()
            self.loss_window.append(self.train_step())
            self.train_seconds += time.perf_counter() - start
            if cfg.time_budget_s and self.world > 1:  # one clock for all: the same lr and the same last step
                seconds = torch.tensor([self.train_seconds], dtype=torch.float64, device=self.device)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                self.train_seconds = float(seconds)
            if self.rank == 0 and clock.due(self.step):
                self._log_progress(t0, steps0)
                self.check_warmup(projected=True)
            if self.step % cfg.eval_interval == 0:
                self._validate()
            if self.step % cfg.save_interval == 0:
                self.save()
        return by_budget

    def _validate(self) -> None:
        result = self.evaluate('valid', self.cfg.eval_max_tokens)
        self.history.append(dict(step=self.step, valid_ppl=round(result['ppl'], 3), tokens=result['tokens']))
        if self.rank == 0:
            _logger.info(f'step {self.step}: valid ppl {result["ppl"]:.2f} ({result["tokens"]:,} tokens)')
        if self.best is None or result['ppl'] < self.best:
            self.best = result['ppl']
            if self.rank == 0:
                save_atomic(dict(model=self.lm.state_dict(), step=self.step, valid_ppl=result['ppl'],
                                 vocab=self.corpus.vocab.symbols, config=dataclasses.asdict(self.cfg)),
                            os.path.join(self.cfg.output, 'model_best.pth.tar'))


def _report_markdown(r: Dict[str, Any]) -> str:
    rows = [[split, f"{r[split]['ppl']:.2f}", f"{r[split]['nll']:.4f}", f"{r[split]['tokens']:,}"]
            for split in ('valid', 'test')]
    return (f"# {r['model']}: word-level language model on {r['corpus']}\n\n"
            f"{r['steps']} steps ({r['epochs']} full epochs), {r['train_seconds']:.0f} s of training "
            f"({'stopped by the time budget' if r['stopped_by_time_budget'] else 'to --max-steps'}); "
            f"{r['params']:,} parameters; vocabulary {r['vocab']:,}; segments of {r['tgt_len']} tokens, "
            f"{r['batch_size']} streams; commit {r['commit']}; {r['machine']}.\n\n"
            + markdown_table(['split', 'perplexity', 'NLL (nats)', 'tokens scored'], rows)
            + f"\n\nEvaluated with the memory carried over each split ({_PROTOCOL_TEXT[r['eval_protocol']]} "
              f"{r['eval_batch_size']} streams), weights: {r['weights']}.\n")


_PROTOCOL_TEXT = {'every-token': 'each token but the first scored once, over',
                  'authors': "the authors' eval.py protocol: each row's tokens but its first scored, over"}


# what a resumed run may change: where it stops, its bookkeeping, where it runs and how it evaluates (a --max-steps
# at or below the checkpoint's step only evaluates, e.g. with the authors' --eval-* settings); the rest (model, data,
# batches, optimization) stays the checkpoint's
_RESUME_MAY_CHANGE = ('max_steps', 'time_budget_s', 'output', 'resume', 'log_interval', 'log_interval_s',
                      'eval_interval', 'save_interval', 'eval_tgt_len', 'eval_batch_size', 'eval_mem_len',
                      'eval_clamp_len', 'eval_same_length', 'eval_max_tokens', 'eval_protocol', 'device', 'amp',
                      'amp_dtype')
_STOP_FIELDS = ('max_steps', 'time_budget_s')


def _flag(field: str) -> str:
    return '--' + field.replace('_', '-')


def resumed_config(cfg: LMConfig, saved: Dict[str, Any], given: Optional[Collection[str]] = None) -> LMConfig:
    """The config of a resumed run: the checkpoint's (`saved`), with the settings `given` on the resuming command
    that a resumed run may change (`_RESUME_MAY_CHANGE`) taken from `cfg`. Stopping limits given replace the
    checkpoint's (--max-steps alone drops its --time-budget-s). A given setting it may not change (model, data,
    batches, optimization) is kept as the checkpoint's, with a warning that names it.

    given: the fields the command line set (tools/train_lm.py passes them); None: those that differ from LMConfig's
    defaults.
    """
    fixed = {f.name for f in dataclasses.fields(LMConfig)} - set(_RESUME_MAY_CHANGE)
    return resumed_settings(cfg, saved, given, fixed, _STOP_FIELDS, _flag, 'model, data, batches and optimization',
                            _logger)


def _check_budget_left(cfg: LMConfig, ckpt: Dict[str, Any]) -> None:
    """A resumed run whose time budget is spent would train 0 steps: say so, with the flags that do what was meant."""
    spent, step = ckpt['train_seconds'], ckpt['step']
    if cfg.time_budget_s and spent >= cfg.time_budget_s and step < cfg.max_steps:
        raise LMSetupError(
            f"--time-budget-s {cfg.time_budget_s:g} is the run's total training time (counted over its resumes), and "
            f"{ckpt['path']} has trained {spent:.1f} s of it already (step {step}): nothing is left to train. Give the "
            f'total you want, e.g. --time-budget-s {spent + cfg.time_budget_s:.4g} for {cfg.time_budget_s:g} s '
            f'more, or --max-steps {step} to only evaluate the checkpoint')


def _warn_small_corpus(cfg: LMConfig, tokens: int, params: int) -> None:
    """A new run of a large model on a small corpus: it overfits, and a CPU run of minutes makes a few steps."""
    if tokens < SMALL_CORPUS_TOKENS and params > SMALL_CORPUS_MAX_PARAMS:
        _logger.warning(
            f"{tokens:,} training tokens for a model of {params / 1e6:.1f}M parameters ({cfg.model}, segments of "
            f"{cfg.tgt_len} x {cfg.batch_size} streams: Transformer-XL's recipe for WikiText-103's 103M tokens): it "
            f"overfits, and a run of minutes on a CPU makes a handful of steps. For a small corpus, the demo's size "
            f'and schedule: {SMALL_CORPUS_FLAGS} (docs/sequence.md)')


def run(cfg: LMConfig, corpus: Optional[WordCorpus] = None, given: Optional[Collection[str]] = None
        ) -> Dict[str, Any]:
    """Train (or resume) and evaluate a language model; returns the result (also in result.json / result.md).

    `corpus`: the data already loaded (the demo trains two models on one); None loads what `cfg` names.
    `given`: with `cfg.resume`, the fields the command line set (see `resumed_config`).
    """
    resume = None
    if cfg.resume:
        path = os.path.join(cfg.output, 'last.pth.tar') if cfg.resume == 'auto' else cfg.resume
        resume = load_checkpoint(path)
        resume['path'] = path
        cfg = resumed_config(cfg, resume['config'], given)
        _check_budget_left(cfg, resume)
    cfg.check()
    procs = init_eval_processes(cfg.device)
    try:
        os.makedirs(cfg.output, exist_ok=True)
        corpus = corpus if corpus is not None else load_corpus(cfg)
        if resume is not None and resume['vocab'] != corpus.vocab.symbols:
            raise LMSetupError(f"the vocabulary built from the data differs from the checkpoint's "
                               f'({len(corpus.vocab)} vs {len(resume["vocab"])} words): resume on the same files')
        if procs.primary:
            _logger.info(f'{corpus.summary()}; {procs.world_size} process(es) on {procs.device}')
        trainer = _Trainer(cfg, corpus, procs.device, procs.rank, procs.world_size, resume)
        if procs.primary and resume is None:
            _warn_small_corpus(cfg, len(corpus.train), sum(p.numel() for p in trainer.lm.parameters()))
        by_budget = trainer.train()
        last = trainer.save()
        weights = 'last'
        best_path = os.path.join(cfg.output, 'model_best.pth.tar')
        if trainer.history and os.path.exists(best_path) and trainer.best < trainer.history[-1]['valid_ppl']:
            trainer.lm.load_state_dict(load_checkpoint(best_path, str(procs.device))['model'])
            weights = f'best on valid (model_best.pth.tar, step {load_checkpoint(best_path)["step"]})'
        lm = trainer.lm
        result: Dict[str, Any] = dict(
            model=cfg.model, model_kwargs=cfg.model_kwargs, params=sum(p.numel() for p in lm.parameters()),
            corpus=corpus.source, vocab=len(corpus.vocab), tgt_len=cfg.tgt_len, batch_size=cfg.batch_size,
            steps=trainer.step, epochs=trainer.epoch, train_seconds=round(trainer.train_seconds, 1),
            stopped_by_time_budget=by_budget, eval_batch_size=cfg.eval_batch_size,
            eval_protocol=cfg.eval_protocol, weights=weights,
            commit=source_commit(), machine=machine_description(str(procs.device)), world_size=procs.world_size,
            amp=cfg.amp and cfg.amp_dtype, history=trainer.history, checkpoint=last)
        result['valid'] = trainer.evaluate('valid')
        result['test'] = trainer.evaluate('test')
        if procs.primary:
            write_json(os.path.join(cfg.output, 'result.json'), result)
            write_text(os.path.join(cfg.output, 'result.md'), _report_markdown(result))
        return result
    finally:
        close_eval_processes()


def config_fields() -> Tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(LMConfig))
