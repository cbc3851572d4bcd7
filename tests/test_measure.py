"""Tests for lsvision.measure: timing statistics, time budgets, real peak memory and the machine description."""

import json
import os
import time
from typing import List

import pytest
import torch
import torch.nn as nn

from lsvision.measure import (
    TimingResult,
    _peak_cpu,  # the sampling fallback, forced below
    machine_description,
    machine_info,
    peak_memory_forward,
    run_in_fresh_process,
    time_forward,
    time_train_step,
)

MB = 10 ** 6
BIG_ELEMENTS = 50_000_000  # 200 MB of float32


class Recorder(nn.Module):
    """A tiny linear layer that records the mode and grad state its forward runs in."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.seen: List[tuple] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, torch.is_inference_mode_enabled()))
        return self.fc(x)


class Sleeper(nn.Module):
    """Takes a fixed time per forward."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


class BigAlloc(nn.Module):
    """Creates (and writes) a 200 MB temporary tensor in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(BIG_ELEMENTS)
        return x + big[:1].sum()


class NoAlloc(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_timing_result_fields():
    model = Recorder().train()
    result = time_forward(model, (8,), batch_size=4, warmup=2, iters=5)
    assert isinstance(result, TimingResult)
    assert result.iters == len(result.times_s) == 5
    assert result.warmup == 2
    assert result.batch_size == 4
    assert result.device == 'cpu'
    assert all(t > 0 for t in result.times_s)
    assert 0 < result.min_s <= result.p10_s <= result.median_s <= result.p90_s <= result.max_s
    assert result.min_s <= result.mean_s <= result.max_s
    assert result.std_s >= 0
    assert result.per_image_s == pytest.approx(result.median_s / 4)
    assert result.images_per_s == pytest.approx(4 / result.median_s)
    assert result.peak_bytes is None
    # 2 warm-up + 5 timed passes, all in eval and inference mode; the training mode is restored afterwards
    assert model.seen == [(False, True)] * 7
    assert model.training and model.fc.training
    json.dumps(result.to_dict())


def test_timing_statistics():
    result = TimingResult(times_s=[3.0, 1.0, 2.0, 4.0, 5.0], batch_size=2, warmup=0, device='cpu')
    assert (result.median_s, result.min_s, result.max_s, result.mean_s) == (3.0, 1.0, 5.0, 3.0)
    assert result.p10_s == pytest.approx(1.4)
    assert result.p90_s == pytest.approx(4.6)
    assert result.per_image_s == 1.5
    with pytest.raises(ValueError):
        TimingResult(times_s=[], batch_size=1, warmup=0, device='cpu')


def test_tensor_input_sets_batch_size():
    result = time_forward(NoAlloc(), torch.zeros(3, 8), batch_size=99, warmup=0, iters=2)
    assert result.batch_size == 3 and result.iters == 2 and result.warmup == 0


def test_min_time_adds_iterations():
    result = time_forward(Sleeper(0.01), (1,), warmup=0, iters=1, min_time_s=0.05)
    assert result.iters >= 5
    assert sum(result.times_s) >= 0.05
    assert result.min_s >= 0.01


def test_max_time_budget_cuts_short():
    result = time_forward(Sleeper(0.02), (1,), warmup=10, iters=100, max_time_s=0.1)
    assert 1 <= result.warmup < 10  # warm-up may use a quarter of the budget
    assert 1 <= result.iters < 100
    # even a budget smaller than one pass runs one warm-up and one timed pass
    result = time_forward(Sleeper(0.02), (1,), warmup=3, iters=5, max_time_s=0.001)
    assert (result.warmup, result.iters) == (1, 1)


def test_peak_memory_cpu():
    big = peak_memory_forward(BigAlloc(), (8,))
    small = peak_memory_forward(NoAlloc(), (8,))
    assert big is not None and small is not None
    assert 150 * MB < big < 400 * MB
    assert small < 20 * MB
    # the same through time_forward
    result = time_forward(BigAlloc(), (8,), warmup=1, iters=1, measure_memory=True)
    assert result.peak_bytes is not None and result.peak_bytes > 150 * MB


def test_peak_memory_cpu_sampling_fallback():
    x = torch.zeros(8)
    big, out = _peak_cpu(lambda: BigAlloc()(x), reset_peak=False)
    small, _ = _peak_cpu(lambda: NoAlloc()(x), reset_peak=False)
    assert torch.equal(out, x + 1)  # the step's result comes back
    assert big is not None and small is not None
    assert big > 150 * MB
    assert small < 20 * MB


def test_machine_description():
    text = machine_description()
    assert text and torch.__version__ in text
    info = machine_info()
    assert info['cores'] >= 1 and info['torch_threads'] == torch.get_num_threads()
    json.dumps(info)
    load = info['load_average']
    if hasattr(os, 'getloadavg'):  # Linux and macOS
        assert len(load) == 3 and all(x >= 0 for x in load)
        assert 'load average' in text


def test_cpu_times_recorded():
    busy = time_forward(Recorder(), (8,), warmup=0, iters=3)
    assert len(busy.cpu_times_s) == 3 and all(t >= 0 for t in busy.cpu_times_s)
    # sleeping takes wall-clock time but (almost) no CPU time
    sleeper = time_forward(Sleeper(0.05), (1,), warmup=0, iters=2)
    assert sleeper.median_s >= 0.05 and sleeper.cpu_per_image_s < 0.025
    assert sleeper.to_dict()['cpu_per_image_s'] == sleeper.cpu_per_image_s
    assert TimingResult(times_s=[1.0], batch_size=1, warmup=0, device='cpu').cpu_per_image_s is None


def test_time_train_step():
    model = Recorder().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = time_train_step(model, (8,), batch_size=4, warmup=1, iters=3)
    assert (result.iters, result.warmup, result.batch_size) == (3, 1, 4)
    assert all(t > 0 for t in result.times_s) and len(result.cpu_times_s) == 3
    # 4 steps in train mode with grad; the eval mode is restored, the weights are unchanged (SGD at lr 0)
    assert model.seen == [(True, False)] * 4 and not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert result.peak_bytes is None  # not asked for
    frozen = Recorder().requires_grad_(False)
    with pytest.raises(ValueError, match='trainable parameters'):
        time_train_step(frozen, (8,))


class KeepsBig(nn.Module):
    """A linear layer whose forward multiplies a 200 MB tensor by a weight: backward needs the tensor, so it is kept."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.ones(BIG_ELEMENTS) * self.fc.weight[0, 0]
        return self.fc(x) + big[:1]


def test_time_train_step_measures_activation_memory():
    big = time_train_step(KeepsBig(), (8,), batch_size=2, warmup=1, iters=1, measure_memory=True)
    small = time_train_step(Recorder(), (8,), batch_size=2, warmup=1, iters=1, measure_memory=True)
    assert big.peak_bytes is not None and small.peak_bytes is not None
    # the kept tensor (and its gradient's pass), not the model or the input built before the baseline
    assert 150 * MB < big.peak_bytes < 800 * MB
    assert small.peak_bytes < 20 * MB
    assert big.to_dict()['peak_bytes'] == big.peak_bytes


def test_run_in_fresh_process_returns_the_result_or_says_how_the_child_failed():
    # builtins as the child's function: they pickle by name, so each case is one fresh process and nothing else
    assert run_in_fresh_process(len, {'a': 1, 'b': 2}, timeout_s=60) == ('ok', 2)
    kind, message = run_in_fresh_process(int, {'a': 1}, timeout_s=60)
    assert kind == 'error' and message.startswith('TypeError')
    assert run_in_fresh_process(os._exit, 3, timeout_s=60) == ('crash', 'process ended with exit code 3')
    start = time.perf_counter()
    assert run_in_fresh_process(time.sleep, 60, timeout_s=0.5) == ('timeout', 'no result within 0.5 s')
    assert time.perf_counter() - start < 30  # the sleeping child was stopped, not waited for
