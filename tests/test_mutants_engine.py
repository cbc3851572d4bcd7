"""Tests written to kill mutants of the training step's loss scaling and gradient accumulation
(`lsvision/train/engine.py`: `micro_batches_of_update`, `backward_micro_batch`, `optimizer_update`, `train_step`;
docs/testing.md, "Mutation testing"). In process and cheap: a linear layer, plain SGD, the gradients written out
here; tests/test_ddp_equivalence.py checks the same step under DDP and through whole training runs.
"""
import argparse
import contextlib
from typing import List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lsvision.train import engine

LR = 0.1


def test_micro_batches_of_update_is_the_size_of_its_group():
    """Updates group consecutive batches from the epoch's start, `steps` at a time; the last group holds the rest."""
    for batches in range(1, 11):
        for steps in range(1, 5):
            for i in range(batches):
                start = i // steps * steps
                assert engine.micro_batches_of_update(i, batches, steps) == min(steps, batches - start), \
                    (i, batches, steps)


def _linear(dtype=torch.float64) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(dtype)


def _batch(n: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def _reference_grads(model: nn.Linear, x: torch.Tensor, y: torch.Tensor, factor: float) -> List[torch.Tensor]:
    w, b = model.weight.detach().clone().requires_grad_(), model.bias.detach().clone().requires_grad_()
    return list(torch.autograd.grad(F.cross_entropy(x @ w.t() + b, y) * factor, [w, b]))


@pytest.mark.parametrize('micro_batches', [1, 3])
@pytest.mark.parametrize('scale', [None, 8.])
def test_backward_micro_batch_divides_the_loss_by_its_micro_batches(micro_batches, scale):
    """The gradient of (mean loss / micro-batches), times the scaler's scale under a GradScaler; it adds to the
    gradient already there; the returned loss is the micro-batch's unscaled mean loss."""
    dtype = torch.float32 if scale else torch.float64
    model = _linear(dtype)
    scaler = torch.amp.GradScaler('cpu', init_scale=scale) if scale else None
    x, y = _batch(5, 1, dtype)
    factor = (scale or 1.) / micro_batches
    want = _reference_grads(model, x, y, factor)
    loss = engine.backward_micro_batch(model, nn.CrossEntropyLoss(), x, y, contextlib.nullcontext, scaler,
                                       micro_batches)
    torch.testing.assert_close(loss.detach(), F.cross_entropy(model(x), y).detach())
    for got, ref in zip((model.weight.grad, model.bias.grad), want):
        torch.testing.assert_close(got, ref)
    x2, y2 = _batch(2, 2, dtype)  # a second micro-batch accumulates
    want = [a + b for a, b in zip(want, _reference_grads(model, x2, y2, factor))]
    engine.backward_micro_batch(model, nn.CrossEntropyLoss(), x2, y2, contextlib.nullcontext, scaler, micro_batches)
    for got, ref in zip((model.weight.grad, model.bias.grad), want):
        torch.testing.assert_close(got, ref)


def _clipped(grads: List[torch.Tensor], clip) -> List[torch.Tensor]:
    if clip is None:
        return grads
    mode, limit = clip
    if mode == 'value':
        return [g.clamp(-limit, limit) for g in grads]
    norm = torch.cat([g.flatten() for g in grads]).norm()
    return [g * min(1., limit / (norm.item() + 1e-6)) for g in grads]


@pytest.mark.parametrize('clip', [None, ('norm', 0.5), ('value', 0.05)])
@pytest.mark.parametrize('scale', [None, 8.])
def test_optimizer_update_steps_on_the_unscaled_clipped_gradient(clip, scale):
    """SGD steps by the gradient divided by the scaler's scale, then clipped (by norm or value); the gradients are
    zeroed afterwards and the scaler updates its scale (growth after every good step here)."""
    model = _linear(torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler('cpu', init_scale=scale, growth_interval=1) if scale else None
    torch.manual_seed(1)
    grads = [torch.randn_like(p) for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    loss = sum((p * g).sum() for p, g in zip(model.parameters(), grads))  # gradient g
    (loss if scaler is None else scaler.scale(loss)).backward()
    engine.optimizer_update(optimizer, scaler, model.parameters(), None if clip is None else clip[1],
                            'norm' if clip is None else clip[0])
    for p, p0, g in zip(model.parameters(), before, _clipped(grads, clip)):
        torch.testing.assert_close(p.detach(), p0 - LR * g)
        assert p.grad is None or not p.grad.any()
    if scaler is not None:
        assert scaler.get_scale() == 2 * scale


@pytest.mark.parametrize('steps,updates', [(1, [[0], [1], [2], [3], [4]]), (2, [[0, 1], [2, 3], [4]]),
                                           (3, [[0, 1, 2], [3, 4]])])
def test_train_step_updates_on_the_mean_loss_of_each_group(steps, updates):
    """5 micro-batches of 3 samples: each optimizer update is one SGD step on the mean of its micro-batches' mean
    losses (the epoch's last update on fewer); train_step says when it stepped and returns each micro-batch's loss."""
    model = _linear()
    init = [p.detach().clone() for p in model.parameters()]
    args = argparse.Namespace(grad_accum_steps=steps, distributed=False, clip_grad=None, clip_mode='norm')
    opt = engine._Optimization(torch.optim.SGD(model.parameters(), lr=LR), contextlib.nullcontext, None, None, None,
                               1)
    batches = [_batch(3, 10 + i) for i in range(5)]
    stepped = []
    for i, (x, y) in enumerate(batches):
        before = [p.detach().clone() for p in model.parameters()]
        loss, update = engine.train_step(model, nn.CrossEntropyLoss(), opt, x, y, i, len(batches), args)
        torch.testing.assert_close(loss.detach(), F.cross_entropy(F.linear(x, *before), y))
        stepped.append(update)
    assert stepped == [i == group[-1] for group in updates for i in group]
    w, b = (t.clone().requires_grad_() for t in init)
    for group in updates:
        loss = sum(F.cross_entropy(batches[i][0] @ w.t() + b, batches[i][1]) for i in group) / len(group)
        gw, gb = torch.autograd.grad(loss, [w, b])
        with torch.no_grad():
            w -= LR * gw
            b -= LR * gb
    torch.testing.assert_close(model.weight.detach(), w.detach())
    torch.testing.assert_close(model.bias.detach(), b.detach())


@pytest.mark.parametrize('scale,clip', [(8., None), (None, ('norm', 0.5)), (8., ('value', 0.05))])
def test_train_step_scales_unscales_and_clips(scale, clip):
    """With a GradScaler and/or clipping (--clip-grad, --clip-mode): each update is an SGD step on the clipped
    gradient of its group's mean loss (2 micro-batches, then the epoch's single last one)."""
    model = _linear(torch.float32)
    init = [p.detach().clone() for p in model.parameters()]
    args = argparse.Namespace(grad_accum_steps=2, distributed=False, clip_grad=None if clip is None else clip[1],
                              clip_mode='norm' if clip is None else clip[0])
    scaler = torch.amp.GradScaler('cpu', init_scale=scale) if scale else None
    opt = engine._Optimization(torch.optim.SGD(model.parameters(), lr=LR), contextlib.nullcontext, scaler, None,
                               None, 1)
    batches = [_batch(3, 20 + i, torch.float32) for i in range(3)]
    for i, (x, y) in enumerate(batches):
        engine.train_step(model, nn.CrossEntropyLoss(), opt, x, y, i, len(batches), args)
    w, b = (t.clone().requires_grad_() for t in init)
    for group in ([0, 1], [2]):
        loss = sum(F.cross_entropy(batches[i][0] @ w.t() + b, batches[i][1]) for i in group) / len(group)
        grads = _clipped(list(torch.autograd.grad(loss, [w, b])), clip)
        with torch.no_grad():
            w -= LR * grads[0]
            b -= LR * grads[1]
    torch.testing.assert_close(model.weight.detach(), w.detach())
    torch.testing.assert_close(model.bias.detach(), b.detach())
