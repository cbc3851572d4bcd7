"""Benchmark machinery for a noisy shared CPU, used by ``tools/benchmark.py`` (not part of the library).

* :func:`abba_order` and :func:`time_forward_interleaved`: several models timed in alternating rounds (ABBA), so that
  a drift of the machine's speed affects all of them alike.
* :func:`run_alternating`: each measurement in a fresh process, the models in alternating order over repeats, so that
  no model is measured in a process that an earlier model warmed up (or fragmented).
* :func:`measure_job`: what runs in each of those processes: one model at one point, one kind of bench
  (:func:`lsvision.benchmark.benchmark_model`), with ``--reparam`` the plain and the folded model in alternating rounds
  (:func:`reparam_fields`).
* :func:`retry_smaller_batch`: a measurement that runs out of memory (CUDA, or a failed CPU allocation) is retried
  with a smaller batch, as timm's ``benchmark.py`` does.
* :data:`REUSING_ALLOCATOR_ENV` and :func:`reexec_with_reusing_allocator`: glibc malloc settings under which freed
  memory is reused, as a caching allocator does, and a restart of the running tool with them.
"""
import gc
import os
import signal
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.nn as nn

from timm.models import reparameterize_model
from timm.utils import decay_batch_step

from lsvision.benchmark import (
    AMP_DTYPES,
    BenchmarkConfig,
    benchmark_model,
    compiled,
    create_benchmark_model,
    input_size_of,
    is_out_of_memory,
)
from lsvision.flops import count_flops
from lsvision.measure import InputSpec, TimingResult, run_in_fresh_process, time_forward

T = TypeVar('T')

REUSING_ALLOCATOR_ENV = {'MALLOC_MMAP_MAX_': '0', 'MALLOC_TRIM_THRESHOLD_': str(1 << 40)}
"""glibc malloc settings under which freed memory is kept and reused: no block is mmapped (and so returned to the
system on free, to be page-faulted and zeroed again by the next call) and the heap is never trimmed. glibc mmaps
every block above 32 MiB, so by default a step whose tensors exceed that size pays for fresh pages on every call,
and time grows faster than the work from one size to the next (measured: 1D long-short layer fwd+bwd 31x from 4k to
64k tokens with glibc's defaults, 16x, exactly linear, with these). Caching allocators (PyTorch's on CUDA) reuse
memory the same way. Peak resident memory then includes freed blocks the heap keeps (fragmentation)."""


def allocator_reuses_memory() -> bool:
    """True if this process runs with `REUSING_ALLOCATOR_ENV` (glibc reads it at start-up)."""
    return all(os.environ.get(k) == v for k, v in REUSING_ALLOCATOR_ENV.items())


def reexec_with_reusing_allocator() -> None:
    """Restart the running script (same interpreter and `sys.argv`) with `REUSING_ALLOCATOR_ENV`, unless it has it.

    For command lines only: it replaces the process. glibc reads these settings at start-up, so they cannot be
    switched on later in a running process.
    """
    if allocator_reuses_memory():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **REUSING_ALLOCATOR_ENV})


def abba_order(count: int, round_index: int) -> List[int]:
    """Indices of `count` models in round `round_index`: in order in even rounds, reversed in odd ones (ABBA), so
    that a steady drift of the machine's speed affects all models alike."""
    indices = list(range(count))
    return indices if round_index % 2 == 0 else indices[::-1]


def time_forward_interleaved(
        models: Sequence[nn.Module],
        inputs: InputSpec = (3, 224, 224),
        batch_size: int = 1,
        warmup: int = 3,
        iters: int = 10,
        max_time_s: Optional[float] = None,
        amp_dtype: Optional[torch.dtype] = None,
) -> List[TimingResult]:
    """Times several models' forward passes in alternating rounds, for comparisons on a shared machine.

    Timed one after the other, models are compared under whatever load each happened to meet: a load change halfway
    biases the ratio. Here each round runs one pass of every model, in the given order in even rounds and in reverse
    in odd rounds (ABBA), so that a steady drift affects all alike; warm-up rounds are interleaved the same way. Each
    pass is one :func:`time_forward` pass (eval mode, ``torch.inference_mode``, a fresh random input of the same
    shape per model). Interleaving does not help against thread oversubscription (as many torch threads as cores
    while another process keeps them busy), which penalizes the model with more ops.

    Args:
        models: The models, each on the device to time it on.
        inputs: The input shape without the batch dimension, or a tensor with it (shared by all models).
        batch_size: Batch size of generated inputs.
        warmup: Warm-up rounds, not timed.
        iters: Timed rounds.
        max_time_s: Budget in seconds for warm-up plus timing of all models together: warm-up stops once it has
            taken a quarter of it and timing once it is spent (checked after each round); one warm-up round (if
            ``warmup > 0``) and one timed round always run. None for no budget.
        amp_dtype: Run under ``torch.autocast`` with this dtype; None for each model's dtype.

    Returns:
        One :class:`TimingResult` per model, in the order given; ``times_s[i]`` of every model is from round ``i``.
    """
    if iters < 1:
        raise ValueError(f'iters must be at least 1, got {iters}.')
    if not models:
        raise ValueError('time_forward_interleaved needs at least one model.')
    start = time.perf_counter()

    def spent(fraction: float = 1.0) -> bool:
        return max_time_s is not None and time.perf_counter() - start >= fraction * max_time_s

    def one_pass(model: nn.Module) -> TimingResult:
        return time_forward(model, inputs, batch_size=batch_size, warmup=0, iters=1, amp_dtype=amp_dtype)

    done_warmup = 0
    while done_warmup < warmup and not (done_warmup > 0 and spent(0.25)):
        for i in abba_order(len(models), done_warmup):
            one_pass(models[i])
        done_warmup += 1
    passes: List[List[TimingResult]] = [[] for _ in models]
    rounds = 0
    while True:
        for i in abba_order(len(models), rounds):
            passes[i].append(one_pass(models[i]))
        rounds += 1
        if rounds >= iters or spent():
            break
    return [
        TimingResult(
            times_s=[p.times_s[0] for p in model_passes], batch_size=model_passes[0].batch_size, warmup=done_warmup,
            device=model_passes[0].device, cpu_times_s=[p.cpu_times_s[0] for p in model_passes])
        for model_passes in passes
    ]




def retry_smaller_batch(
        measure: Callable[[int], T],
        batch_size: int,
        retry: bool = True,
        log: Optional[Callable[[str], None]] = None,
) -> Tuple[T, int]:
    """Calls ``measure(batch_size)``; while it runs out of memory, retries with a smaller batch.

    The batch shrinks by timm's ``decay_batch_step`` (e.g. 8, 6, 4, 3, 2, 1), as timm's ``benchmark.py`` does; an
    out-of-memory error at batch 1 (or with ``retry=False``) is raised.

    Args:
        measure: The measurement at a batch size; it raises on failure (CUDA out of memory, a failed CPU
            allocation, or an error passed on from a child process that says so).
        batch_size: The batch size to try first.
        retry: Whether to retry at all.
        log: Called with a line of text before each retry.

    Returns:
        The result of ``measure`` and the batch size it ran at.
    """
    while True:
        try:
            return measure(batch_size), batch_size
        except (RuntimeError, MemoryError) as e:
            if not retry or batch_size <= 1 or not is_out_of_memory(e):
                raise
            smaller = decay_batch_step(batch_size)
            if log is not None:
                log(f'  out of memory at batch {batch_size} ({str(e).splitlines()[0][:200]}); retrying at batch '
                    f'{smaller}')
            batch_size = smaller
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def run_isolated(fn: Callable[[Dict[str, Any]], T], job: Dict[str, Any], timeout_s: float) -> T:
    """``fn(job)`` in a fresh process (:func:`lsvision.measure.run_in_fresh_process`); its result, or a RuntimeError
    that says how the child failed (a child killed by a signal, as the kernel's OOM killer does, counts as out of
    memory)."""
    kind, payload = run_in_fresh_process(fn, job, timeout_s)
    if kind == 'ok':
        return payload
    if kind == 'crash' and payload.endswith(f'exit code -{signal.SIGKILL}'):
        payload += ' (killed: out of memory?)'
    raise RuntimeError(f"{job.get('label', job.get('model', 'job'))}: {kind}: {payload}")


def run_alternating(
        fn: Callable[[Dict[str, Any]], Dict[str, Any]],
        jobs: Sequence[Dict[str, Any]],
        repeats: int,
        timeout_s: float,
        retry: bool = True,
        log: Optional[Callable[[str], None]] = None,
) -> List[List[Dict[str, Any]]]:
    """Runs ``fn(job)`` for every job, each run in a fresh process, ``repeats`` times in alternating order.

    The jobs run in the order given in even repeats and reversed in odd ones (A B, then B A, ...), so that neither a
    drift of the machine's speed nor the position in the run favours one of them. A job that runs out of memory is
    retried at a smaller batch (:func:`retry_smaller_batch`; ``job['batch_size']``), which its later repeats keep.

    Args:
        fn: A module-level function (the child imports it by name) taking a job and returning a dict.
        jobs: Picklable job dicts with a ``batch_size``; each run gets its ``repeat`` (0, 1, ...) as well.
        repeats: Runs per job.
        timeout_s: A run that gives no result in this many seconds fails.
        retry: Retry a run that ran out of memory at a smaller batch.
        log: Called with a progress line after each run.

    Returns:
        Per job, in the order given, the results of its runs.
    """
    if repeats < 1:
        raise ValueError(f'repeats must be at least 1, got {repeats}.')
    jobs = [dict(job) for job in jobs]
    results: List[List[Dict[str, Any]]] = [[] for _ in jobs]
    for r in range(repeats):
        for i in abba_order(len(jobs), r):
            job = jobs[i]
            t0 = time.perf_counter()
            result, job['batch_size'] = retry_smaller_batch(
                lambda b, job=job, r=r: run_isolated(fn, {**job, 'batch_size': b, 'repeat': r}, timeout_s),
                job['batch_size'], retry, log)
            results[i].append(result)
            if log is not None:
                log(f"  [{r + 1}/{repeats}] {job.get('label', job.get('model'))} b{job['batch_size']}: "
                    f'{time.perf_counter() - t0:.0f} s')
    return results


def measure_job(job: Dict[str, Any]) -> Dict[str, Any]:
    """Child side of ``tools/benchmark.py``: one model, one input size, one kind of bench, in this (fresh) process.

    Args:
        job: ``model``, ``label``, ``model_kwargs``, ``config`` (the fields of
            :class:`lsvision.benchmark.BenchmarkConfig`), ``batch_size`` (overrides the config's), ``threads`` and
            ``reparam`` (also time the model folded for inference, in alternating rounds with the plain one), and
            ``repeat`` (FLOPs are counted in run 0 only).

    Returns:
        The :func:`lsvision.benchmark.benchmark_model` row, with ``label``, the ``pid`` that measured it and, with
        ``reparam``, the reparameterized model's latency and its ratio to the plain one.
    """
    import lsvision  # noqa: F401  (registers the lsvision models in the fresh process)
    if job.get('threads'):
        torch.set_num_threads(job['threads'])
    config = BenchmarkConfig(**{**job['config'], 'batch_size': job['batch_size']})
    config.flops = config.flops and job.get('repeat', 0) == 0  # the same in every run: counted in the first
    row = benchmark_model(job['model'], config, job.get('model_kwargs'), job.get('floor', ''))
    if job.get('reparam') and config.bench != 'train':
        row.update(reparam_fields(job['model'], config, job.get('model_kwargs')))
    row.update(label=job.get('label', job['model']), pid=os.getpid())
    return row


def reparam_fields(name: str, config: BenchmarkConfig, model_kwargs: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Times a model and its ``timm.models.reparameterize_model`` copy in alternating rounds
    (:func:`time_forward_interleaved`, so that their ratio holds on a shared machine); returns the ``reparam_*``
    fields of a benchmark row."""
    model = create_benchmark_model(name, config.device, model_kwargs)
    folded = reparameterize_model(model)
    input_size = input_size_of(model, config.img_size)
    fields: Dict[str, Any] = {}
    if config.flops:
        fields['reparam_gflops'] = count_flops(folded, input_size, warn_unsupported=False).gflops
    x = torch.randn(config.batch_size, *input_size, device=config.device, dtype=next(model.parameters()).dtype)
    if config.channels_last:
        for m in (model, folded):
            m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    timing, folded_timing = time_forward_interleaved(
        [compiled(model, config.compile), compiled(folded, config.compile)], x, warmup=config.warmup,
        iters=config.iters, max_time_s=config.max_time_s, amp_dtype=AMP_DTYPES.get(config.amp or ''))
    fields.update(
        reparam_latency_ms=folded_timing.median_s * 1e3,
        reparam_latency_p10_ms=folded_timing.p10_s * 1e3,
        reparam_latency_p90_ms=folded_timing.p90_s * 1e3,
        reparam_images_per_s=folded_timing.images_per_s,
        # median over rounds of the per-round ratio: both passes of a round met the same load
        reparam_ratio=statistics.median(f / p for f, p in zip(folded_timing.times_s, timing.times_s)),
        reparam_timing=folded_timing.to_dict(),
        plain_timing_in_reparam_rounds=timing.to_dict(),
    )
    return fields
