"""Time-budgeted training and evaluation of sequence classifiers (for demos on a shared CPU).

Training runs until a wall-clock budget is spent (cosine learning rate over the budget's time, not over steps), so
a demo takes the same time however busy the machine is; the number of steps it got is part of the result.
"""
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lsvision.runtime import auto_threads  # noqa: F401  (re-exported: the one thread policy)

__all__ = [
    'TrainResult', 'EvalResult', 'train_for_seconds', 'evaluate_for_seconds', 'macro_f1', 'accuracy',
    'stratified_order', 'auto_threads', 'lr_factor', 'time_decay', 'train_on_lr_factor', 'random_crop',
]


def time_decay(spent: float, decay_from: float = 0.6) -> float:
    """`lr_factor`'s decay alone: 1, then linear to 2 % over the last 40 % of the budget (`spent`: the fraction of the
    budget used; 2 % from the end of the budget on)."""
    return 1. if spent < decay_from else max(0.02, (1. - spent) / (1. - decay_from))


def lr_factor(step: int, spent: float, warmup: int = 30, decay_from: float = 0.6) -> float:
    """Linear warm-up over `warmup` steps, flat, then linear decay to 2 % over the last 40 % of the wall-clock budget
    (`spent` = fraction of the budget used): the schedule follows time, since the step count is unknown upfront."""
    return min(1., (step + 1) / warmup) * time_decay(spent, decay_from)


@dataclass
class TrainResult:
    steps: int
    samples: int
    seconds: float
    final_loss: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / max(self.seconds, 1e-9)


@dataclass
class EvalResult:
    predictions: torch.Tensor  # (n,) for the first n samples of the evaluation order
    index: torch.Tensor  # (n,) which samples they are
    seconds: float

    @property
    def samples_per_s(self) -> float:
        return len(self.index) / max(self.seconds, 1e-9)


def train_for_seconds(
        model: nn.Module,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        seconds: float,
        mask: Optional[torch.Tensor] = None,
        batch_size: int = 8,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        warmup_fraction: float = 0.05,
        max_steps: Optional[int] = None,
        crop: Optional[int] = None,
        class_balanced: bool = False,
        seed: int = 0,
        log: Optional[Callable[[str], None]] = None,
        log_every_s: float = 10.,
) -> TrainResult:
    """AdamW on shuffled mini-batches until `seconds` have passed (at least one step).

    The learning rate warms up linearly over the first `warmup_fraction` of the time, then follows a cosine to 0
    at the end of the budget. `crop` trains on a random window of `crop` positions of each sample (within its real
    tokens when `mask` is given): more, cheaper steps for a model whose prediction pools over positions.
    `class_balanced` draws each sample's class uniformly, then a sample of that class (instead of epochs over the
    shuffled data): a short run then does not learn the class frequencies first.
    """
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and 'relative_position_bias' not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and 'relative_position_bias' not in n)]
    # fused: one kernel for all parameters instead of ~10 ops per tensor (a small model's step was 1/5 optimizer)
    fused = all(p.dtype in (torch.float32, torch.float64) for p in model.parameters())
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.)], lr=lr,
        fused=fused or None)
    model.train()
    n = inputs.shape[0]
    order = torch.randperm(n, generator=gen)
    by_class = _indices_by_class(labels)
    pos = steps = samples = 0
    loss_value = float('nan')
    start = last_log = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if steps > 0 and (elapsed >= seconds or (max_steps is not None and steps >= max_steps)):
            break
        frac = min(elapsed / seconds, 1.)
        scale = frac / warmup_fraction if frac < warmup_fraction else 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group['lr'] = lr * max(scale, 0.01)
        if class_balanced:
            classes = torch.randint(len(by_class), (batch_size,), generator=gen).tolist()
            idx = torch.stack([by_class[c][torch.randint(len(by_class[c]), (1,), generator=gen)[0]] for c in classes])
        else:
            if pos + batch_size > n:
                order, pos = torch.randperm(n, generator=gen), 0
            idx = order[pos:pos + batch_size]
            pos += batch_size
        x, m = inputs[idx], None if mask is None else mask[idx]
        if crop is not None and crop < x.shape[1]:
            x, m = random_crop(x, m, crop, gen)
        logits = model(x, m)
        loss = F.cross_entropy(logits, labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps += 1
        samples += len(idx)
        loss_value = loss.item()
        if log is not None and time.perf_counter() - last_log >= log_every_s:
            last_log = time.perf_counter()
            log(f'  step {steps}, {samples} samples, {last_log - start:.0f}/{seconds:.0f} s, loss {loss_value:.3f}')
    return TrainResult(steps, samples, time.perf_counter() - start, loss_value)


def random_crop(
        inputs: torch.Tensor,
        mask: Optional[torch.Tensor],
        length: int,
        generator: torch.Generator,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A random window of `length` positions of each row of `inputs` (B, N) (and of its `mask`), drawn within the
    row's real tokens (the mask's count of ones, assumed to be a prefix) where there are more than `length`."""
    B, N = inputs.shape
    real = mask.sum(1) if mask is not None else torch.full((B,), N)
    start = (torch.rand(B, generator=generator) * ((real - length).clamp(min=0) + 1)).long()
    index = start[:, None] + torch.arange(length)
    return inputs.gather(1, index), None if mask is None else mask.gather(1, index)


def train_on_lr_factor(
        model: nn.Module,
        batch_loss: Callable[[torch.Generator], torch.Tensor],
        seconds: float,
        lr: float,
        seed: int = 0,
        clip_grad: Optional[float] = None,
        describe_loss: Callable[[float], str] = lambda avg: f'loss {avg:.3f}',
        log_every_s: float = 15.,
) -> Tuple[int, float, float]:
    """AdamW (weight decay 0.01) until `seconds` have passed, the learning rate following `lr_factor`.

    `batch_loss(generator)` draws a batch with the generator (seeded with `seed`) and returns its loss. A line with
    the elapsed time, step, `describe_loss` of the running loss average and the learning rate goes to stderr every
    `log_every_s`. Returns (steps, seconds spent, running loss average).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    step, last_log, loss_avg = 0, start, None
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
        step_lr = lr * lr_factor(step, elapsed / seconds)
        for group in opt.param_groups:
            group['lr'] = step_lr
        loss = batch_loss(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        if time.perf_counter() - last_log > log_every_s:
            last_log = time.perf_counter()
            print(f'  {last_log - start:5.0f}s  step {step}  {describe_loss(loss_avg)}  lr {step_lr:.2e}',
                  file=sys.stderr, flush=True)
    return step, time.perf_counter() - start, loss_avg


def _indices_by_class(labels: torch.Tensor) -> List[torch.Tensor]:
    """The sample indices of each class present in `labels`, in increasing class order."""
    return [torch.nonzero(labels == c).flatten() for c in labels.unique().tolist()]


def stratified_order(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """An order of the samples that cycles through the classes (a shuffled round-robin), so that any prefix of it
    is close to class-balanced: the evaluation order when evaluation may stop early."""
    gen = torch.Generator().manual_seed(seed)
    per_class = [ids[torch.randperm(len(ids), generator=gen)] for ids in _indices_by_class(labels)]
    out: List[int] = []
    for i in range(max(len(ids) for ids in per_class)):
        out += [int(ids[i]) for ids in per_class if i < len(ids)]
    return torch.tensor(out, dtype=torch.long)


@torch.inference_mode()
def evaluate_for_seconds(
        model: nn.Module,
        inputs: torch.Tensor,
        order: torch.Tensor,
        seconds: Optional[float] = None,
        mask: Optional[torch.Tensor] = None,
        batch_size: int = 8,
) -> EvalResult:
    """Predictions on the samples in `order`, batch by batch, until all are done or `seconds` have passed (at least
    one batch)."""
    model.eval()
    preds = []
    start = time.perf_counter()
    done = 0
    while done < len(order):
        if done > 0 and seconds is not None and time.perf_counter() - start >= seconds:
            break
        idx = order[done:done + batch_size]
        preds.append(model(inputs[idx], None if mask is None else mask[idx]).argmax(-1))
        done += len(idx)
    return EvalResult(torch.cat(preds), order[:done], time.perf_counter() - start)


def macro_f1(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """Mean over classes of F1 = 2 TP / (2 TP + FP + FN); classes absent from both labels and predictions are
    skipped."""
    scores = []
    for c in range(num_classes):
        tp = int(((predictions == c) & (labels == c)).sum())
        fp = int(((predictions == c) & (labels != c)).sum())
        fn = int(((predictions != c) & (labels == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / max(len(scores), 1)


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    return float((predictions == labels).float().mean()) if len(labels) else float('nan')
