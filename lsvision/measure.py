"""Wall-clock timing and peak memory of model forward passes, and a description of the machine they ran on.

:func:`time_forward` times a model's inference forward pass (eval mode, ``torch.inference_mode``) after warm-up and
returns a :class:`TimingResult` with robust statistics; with ``measure_memory=True`` it also measures the peak memory
of one forward pass with :func:`peak_memory_forward`. :func:`time_forward_interleaved` times several models in
alternating rounds, so that a load change on a shared machine biases none of them. :func:`time_train_step` times a
training step (forward, backward, optimizer step). :func:`machine_description` says where a measurement was taken,
and under what load.

Peak memory is measured for real, not estimated:

* On CUDA it is ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats``, minus the memory
  allocated just before the forward pass (weights, the input and anything else alive then): the extra device memory
  the forward pass itself needs, as seen by PyTorch's caching allocator.
* On CPU it is the process's resident memory (RSS), which includes everything PyTorch, oneDNN and the C allocator
  touch, unlike ``tracemalloc`` which only sees Python objects. On Linux the kernel's peak RSS (``VmHWM`` in
  ``/proc/self/status``) is reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs``; after the
  forward pass the result is ``VmHWM`` minus the RSS just before the forward pass. Freed heap memory is returned to
  the OS first (glibc ``malloc_trim``) so that memory cached from earlier runs does not hide the new peak. If the
  reset is not possible (old kernels, no ``/proc``), the RSS is sampled about every millisecond by a background
  thread instead (``/proc/self/statm``, or ``psutil`` where there is no ``/proc``), which can miss very short peaks.
  As a difference of process-wide numbers, a CPU peak includes whatever other threads of the process allocate
  meanwhile, and is rounded to pages.

Timings are only comparable on the same machine with the same thread count; :func:`machine_description` records both.
"""

import contextlib
import ctypes
import ctypes.util
import gc
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

__all__ = [
    'TimingResult',
    'machine_description',
    'machine_info',
    'load_average',
    'peak_memory_forward',
    'REUSING_ALLOCATOR_ENV',
    'allocator_reuses_memory',
    'reexec_with_reusing_allocator',
    'run_in_fresh_process',
    'time_forward',
    'time_forward_interleaved',
    'time_forward_isolated',
    'time_train_step',
]

InputSpec = Union[Sequence[int], torch.Tensor]
"""A model input: a shape without the batch dimension, e.g. ``(3, 224, 224)``, or a ready tensor (with it)."""

_PROC_STATUS = '/proc/self/status'

REUSING_ALLOCATOR_ENV = {'MALLOC_MMAP_MAX_': '0', 'MALLOC_TRIM_THRESHOLD_': str(1 << 40)}
"""glibc malloc settings under which freed memory is kept and reused: no block is mmapped (and so returned to the
system on free, to be page-faulted and zeroed again by the next call) and the heap is never trimmed. glibc mmaps
every block above 32 MiB, so by default a step whose tensors exceed that size pays for fresh pages on every call,
and time grows faster than the work from one size to the next (measured: 1D long-short layer fwd+bwd 31x from 4k to
64k tokens with glibc's defaults, 16x, exactly linear, with these). Caching allocators (PyTorch's on CUDA) reuse
memory the same way. Peak resident memory then includes freed blocks the heap keeps (fragmentation)."""
_PROC_STATM = '/proc/self/statm'
_PROC_CLEAR_REFS = '/proc/self/clear_refs'


@dataclass
class TimingResult:
    """Wall-clock times of a model's forward passes, from :func:`time_forward`.

    Attributes:
        times_s: The time of each timed forward pass, in seconds, in the order run.
        batch_size: Images per forward pass.
        warmup: Warm-up forward passes run before timing (not in ``times_s``).
        device: The device the model ran on, e.g. ``'cpu'`` or ``'cuda:0'``.
        iters: Number of timed forward passes (``len(times_s)``).
        median_s: Median time per forward pass, in seconds: the headline number.
        mean_s: Mean time per forward pass.
        std_s: Sample standard deviation of the times (0 for a single pass).
        min_s: Fastest pass.
        max_s: Slowest pass.
        p10_s: 10th percentile (linear interpolation between passes).
        p90_s: 90th percentile.
        peak_bytes: Peak memory of one forward pass in bytes (see :func:`peak_memory_forward`), or None if it was not
            measured.
        cpu_times_s: The CPU time of this process during each timed pass (``time.process_time``: all its threads),
            in the order run; empty where not recorded. Unlike wall-clock time it hardly changes when other processes
            compete for the cores, so it is the steadier measure of work on a shared machine.
    """

    times_s: List[float]
    batch_size: int
    warmup: int
    device: str
    iters: int = field(init=False)
    median_s: float = field(init=False)
    mean_s: float = field(init=False)
    std_s: float = field(init=False)
    min_s: float = field(init=False)
    max_s: float = field(init=False)
    p10_s: float = field(init=False)
    p90_s: float = field(init=False)
    peak_bytes: Optional[int] = None
    cpu_times_s: List[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.times_s:
            raise ValueError('A TimingResult needs at least one timed pass.')
        times = sorted(self.times_s)
        self.iters = len(times)
        self.median_s = statistics.median(times)
        self.mean_s = statistics.fmean(times)
        self.std_s = statistics.stdev(times) if len(times) > 1 else 0.0
        self.min_s = times[0]
        self.max_s = times[-1]
        self.p10_s = _percentile(times, 0.1)
        self.p90_s = _percentile(times, 0.9)

    @property
    def per_image_s(self) -> float:
        """Median time per image, in seconds (median pass time divided by the batch size)."""
        return self.median_s / self.batch_size

    @property
    def images_per_s(self) -> float:
        """Throughput in images per second at the median pass time."""
        return self.batch_size / self.median_s

    @property
    def cpu_per_image_s(self) -> Optional[float]:
        """Median CPU time of a pass per image, in seconds; None if CPU times were not recorded."""
        return statistics.median(self.cpu_times_s) / self.batch_size if self.cpu_times_s else None

    def to_dict(self) -> Dict[str, Any]:
        """Returns the result as a JSON-serializable dict, including ``per_image_s`` and ``images_per_s``."""
        out = asdict(self)
        out['per_image_s'] = self.per_image_s
        out['images_per_s'] = self.images_per_s
        out['cpu_per_image_s'] = self.cpu_per_image_s
        return out


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Returns the ``q`` quantile (0..1) of sorted values, interpolating linearly between neighbours."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _model_device(model: nn.Module) -> torch.device:
    """Returns the device of a model's first parameter or buffer (CPU for a model with neither)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device('cpu')


def _model_float_dtype(model: nn.Module) -> torch.dtype:
    """Returns the dtype of a model's first floating parameter or buffer (the default dtype if it has none)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def _prepare(
        model: nn.Module,
        inputs: InputSpec,
        batch_size: int,
        channels_last: bool,
) -> Tuple[torch.Tensor, torch.device]:
    """Builds (or moves) the input tensor onto the model's device and applies ``channels_last`` to model and input."""
    device = _model_device(model)
    if isinstance(inputs, torch.Tensor):
        x = inputs.to(device)
    else:
        if not all(isinstance(s, int) and s > 0 for s in inputs):
            raise ValueError(f'inputs must be a shape of positive ints or a tensor, got {inputs!r}.')
        if batch_size < 1:
            raise ValueError(f'batch_size must be positive, got {batch_size}.')
        generator = torch.Generator().manual_seed(0)
        x = torch.randn((batch_size, *inputs), generator=generator)
        x = x.to(device=device, dtype=_model_float_dtype(model))
    if channels_last:
        model.to(memory_format=torch.channels_last)
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
    return x, device


def _sync(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA and MPS run asynchronously)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    elif device.type == 'mps':
        torch.mps.synchronize()


@contextlib.contextmanager
def _inference(model: nn.Module, device: torch.device, amp_dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Eval mode, inference mode and optional autocast; restores each submodule's training mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    amp = contextlib.nullcontext() if amp_dtype is None else torch.autocast(device_type=device.type, dtype=amp_dtype)
    try:
        with torch.inference_mode(), amp:
            yield
    finally:
        for module, mode in modes:
            module.training = mode


def _forward_fn(model: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[], Any]:
    """Returns a function running one synchronized forward pass."""
    def step() -> Any:
        out = model(x)
        _sync(device)
        return out
    return step


def _timed_loop(
        step: Callable[[], Any],
        warmup: int,
        iters: int,
        min_time_s: float,
        max_time_s: Optional[float],
) -> Tuple[List[float], List[float], int]:
    """Runs warm-up steps, then timed steps; returns the wall-clock and CPU times of the steps and the warm-up count.

    See :func:`time_forward` for how ``warmup``, ``iters``, ``min_time_s`` and ``max_time_s`` interact.
    """
    if iters < 1:
        raise ValueError(f'iters must be at least 1, got {iters}.')
    start = time.perf_counter()

    def spent(fraction: float = 1.0) -> bool:
        return max_time_s is not None and time.perf_counter() - start >= fraction * max_time_s

    times: List[float] = []
    cpu_times: List[float] = []
    done_warmup = 0
    while done_warmup < warmup and not (done_warmup > 0 and spent(0.25)):
        step()
        done_warmup += 1
    while True:
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        if (len(times) >= iters and sum(times) >= min_time_s) or spent():
            break
    return times, cpu_times, done_warmup


def time_forward(
        model: nn.Module,
        inputs: InputSpec = (3, 224, 224),
        batch_size: int = 1,
        warmup: int = 3,
        iters: int = 10,
        min_time_s: float = 0.0,
        max_time_s: Optional[float] = None,
        amp_dtype: Optional[torch.dtype] = None,
        channels_last: bool = False,
        measure_memory: bool = False,
) -> TimingResult:
    """Times a model's forward pass (inference) on its own device.

    The model runs in eval mode under ``torch.inference_mode`` (each submodule's training mode is restored
    afterwards). Warm-up passes run first; then each timed pass is measured with ``time.perf_counter``, with the
    device synchronized after it on CUDA and MPS. At least ``iters`` passes are timed, more while their total is
    below ``min_time_s``; ``max_time_s`` cuts warm-up and timing short, so that slow configurations still finish.

    Args:
        model: The model, on the device to time it on.
        inputs: The input shape without the batch dimension, e.g. ``(3, 224, 224)`` (a random input of the model's
            dtype is made), or a tensor with the batch dimension, used as is (``batch_size`` is then taken from it).
        batch_size: Batch size of the generated input.
        warmup: Warm-up passes, not timed.
        iters: Minimum number of timed passes.
        min_time_s: Keep timing passes until their total time reaches this many seconds.
        max_time_s: Budget in seconds for warm-up plus timing together, overriding ``warmup``, ``iters`` and
            ``min_time_s``: warm-up stops once it has taken a quarter of the budget and timing once the whole budget
            is spent (checked after each pass), but one warm-up pass (if ``warmup > 0``) and one timed pass always
            run. None for no budget.
        amp_dtype: Run under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``); None for the model's dtype.
        channels_last: Convert the model (in place) and a 4D input to the channels-last memory format.
        measure_memory: Also measure the peak memory of one more forward pass (:func:`peak_memory_forward`) and
            store it in :attr:`TimingResult.peak_bytes`.

    Returns:
        The timing result.
    """
    x, device = _prepare(model, inputs, batch_size, channels_last)
    with _inference(model, device, amp_dtype):
        times, cpu_times, done_warmup = _timed_loop(
            _forward_fn(model, x, device), warmup, iters, min_time_s, max_time_s)
    result = TimingResult(
        times_s=times, batch_size=x.shape[0], warmup=done_warmup, device=str(device), cpu_times_s=cpu_times)
    if measure_memory:
        result.peak_bytes = peak_memory_forward(model, x, warmup=0, amp_dtype=amp_dtype)
    return result


def _abba_order(count: int, round_index: int) -> List[int]:
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
        for i in _abba_order(len(models), done_warmup):
            one_pass(models[i])
        done_warmup += 1
    passes: List[List[TimingResult]] = [[] for _ in models]
    rounds = 0
    while True:
        for i in _abba_order(len(models), rounds):
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


def _fresh_process_main(fn: Callable[[Dict[str, Any]], Any], job: Dict[str, Any], conn: Any) -> None:
    """Child side of :func:`run_in_fresh_process`: sends back ('ok', fn(job)) or ('error', message)."""
    try:
        conn.send(('ok', fn(job)))
    except BaseException as e:  # noqa: B036  (report everything to the parent, which decides)
        conn.send(('error', f'{type(e).__name__}: {e}'))
    finally:
        conn.close()


def run_in_fresh_process(
        fn: Callable[[Dict[str, Any]], Any],
        job: Dict[str, Any],
        timeout_s: float,
) -> Tuple[str, Any]:
    """Runs ``fn(job)`` in a fresh (spawned) Python process and returns what it sent back.

    Nothing of this process's memory state (allocator, caches, loaded models) reaches the child, so measurements in it
    are independent of what ran before. The child is always gone on return, also on KeyboardInterrupt.

    Args:
        fn: A module-level function (the child imports it by name) taking the job dict; its result must pickle.
        job: Picklable arguments of ``fn``.
        timeout_s: A child that gives no result in this many seconds is stopped.

    Returns:
        ('ok', result), or ('error', message) if ``fn`` raised, ('timeout', message) or ('crash', message) if the
        process died before it answered (e.g. killed for memory).
    """
    ctx = multiprocessing.get_context('spawn')
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_fresh_process_main, args=(fn, job, sender), daemon=True)
    process.start()
    sender.close()
    kind, payload = 'timeout', f'no result within {timeout_s:g} s'
    try:
        if receiver.poll(timeout_s):
            kind, payload = receiver.recv()
    except EOFError:  # the process died before it could answer
        kind = 'crash'
    finally:  # also on KeyboardInterrupt: leave no process behind
        process.join(timeout=10.0 if kind == 'ok' else 0.0)
        if process.is_alive():
            process.kill()
            process.join()
        receiver.close()
    if kind == 'crash':
        payload = f'process ended with exit code {process.exitcode}'
    return kind, payload


def _isolated_timing(job: Dict[str, Any]) -> Dict[str, Any]:
    """Child job of :func:`time_forward_isolated`: creates one model, times it, returns its timing dict."""
    import timm

    import lsvision  # noqa: F401  (registers the lsvision models in the fresh process)
    if job['threads']:
        torch.set_num_threads(job['threads'])
    model = timm.create_model(job['name'], **job['model_kwargs']).to(job['device']).eval()
    timing = time_forward(model, tuple(job['input_size']), batch_size=job['batch_size'], warmup=job['warmup'],
                          iters=job['iters'], max_time_s=job['max_time_s'])
    return {'times_s': timing.times_s, 'cpu_times_s': timing.cpu_times_s, 'warmup': timing.warmup,
            'device': timing.device}


def time_forward_isolated(
        model_names: Sequence[str],
        input_size: Sequence[int] = (3, 224, 224),
        batch_size: int = 1,
        rounds: int = 3,
        warmup: int = 5,
        iters: int = 10,
        max_time_s: Optional[float] = None,
        threads: Optional[int] = None,
        device: str = 'cpu',
        model_kwargs: Optional[Dict[str, Any]] = None,
        timeout_s: float = 900.0,
) -> List[TimingResult]:
    """Times timm models (lsvision's included) each in a fresh process, in rounds of alternating order.

    In one process, models timed in turn disturb each other beyond the load: one model's freed buffers change glibc's
    mmap threshold and so which of the next model's tensors are page-faulted afresh on every pass (pvt_v2_b2 ran 24
    GFLOP/s alone against 34-37 between other models). Here each model runs as a user runs it, alone in its own
    process: created, warmed up, then timed. Each round starts one process per model, in the given order in even
    rounds and reversed in odd rounds (ABBA), so that a drift of the machine's speed affects all alike; the result of
    a model holds its timed passes of all rounds.

    Args:
        model_names: timm model names.
        input_size: Input shape without the batch dimension.
        batch_size: Images per forward pass.
        rounds: Processes per model.
        warmup: Warm-up passes per process, not timed.
        iters: Timed passes per process.
        max_time_s: Budget per process for its warm-up plus timing (see :func:`time_forward`); None for none.
        threads: torch threads in each process (None: torch's default).
        device: Device of the models.
        model_kwargs: Keyword arguments of every `timm.create_model` call.
        timeout_s: A process that gives no result in this many seconds is stopped and raises RuntimeError.

    Returns:
        One :class:`TimingResult` per model, in the order given.
    """
    if rounds < 1 or iters < 1:
        raise ValueError(f'rounds and iters must be at least 1, got {rounds} and {iters}.')
    if not model_names:
        raise ValueError('time_forward_isolated needs at least one model.')
    collected: List[List[Dict[str, Any]]] = [[] for _ in model_names]
    for r in range(rounds):
        for i in _abba_order(len(model_names), r):
            job = {'name': model_names[i], 'input_size': list(input_size), 'batch_size': batch_size,
                   'warmup': warmup, 'iters': iters, 'max_time_s': max_time_s, 'threads': threads, 'device': device,
                   'model_kwargs': dict(model_kwargs or {})}
            kind, payload = run_in_fresh_process(_isolated_timing, job, timeout_s)
            if kind != 'ok':
                raise RuntimeError(f'timing {model_names[i]} in its own process failed: {payload}')
            collected[i].append(payload)
    return [
        TimingResult(
            times_s=[t for run in runs for t in run['times_s']], batch_size=batch_size, warmup=runs[0]['warmup'],
            device=runs[0]['device'], cpu_times_s=[t for run in runs for t in run['cpu_times_s']])
        for runs in collected
    ]


def time_train_step(
        model: nn.Module,
        inputs: InputSpec = (3, 224, 224),
        batch_size: int = 1,
        warmup: int = 2,
        iters: int = 5,
        min_time_s: float = 0.0,
        max_time_s: Optional[float] = None,
        amp_dtype: Optional[torch.dtype] = None,
        channels_last: bool = False,
) -> TimingResult:
    """Times a training step: forward in train mode, backward of a scalar loss, and an optimizer step.

    The loss is the mean of the output (its value does not matter for timing). The optimizer is plain SGD with a
    learning rate of 0, so the step costs what an optimizer's update pass costs but leaves the weights as they were
    (buffers that train mode updates, e.g. BatchNorm statistics or a GRC cache, do change). Gradients are freed with
    ``zero_grad(set_to_none=True)`` after each step; each submodule's training mode is restored afterwards. Warm-up,
    ``iters``, ``min_time_s`` and ``max_time_s`` work as in :func:`time_forward`, and the device is synchronized after
    each step.

    Args:
        model: The model, on the device to time it on. It must have parameters that require grad.
        inputs: The input shape without the batch dimension, or a tensor with it (see :func:`time_forward`).
        batch_size: Batch size of the generated input.
        warmup: Warm-up steps, not timed.
        iters: Minimum number of timed steps.
        min_time_s: Keep timing steps until their total time reaches this many seconds.
        max_time_s: Budget in seconds for warm-up plus timing together (see :func:`time_forward`).
        amp_dtype: Run the forward pass under ``torch.autocast`` with this dtype; None for the model's dtype.
        channels_last: Convert the model (in place) and a 4D input to the channels-last memory format.

    Returns:
        The timing result (times per training step).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError('time_train_step needs a model with trainable parameters (requires_grad=True).')
    x, device = _prepare(model, inputs, batch_size, channels_last)
    optimizer = torch.optim.SGD(params, lr=0.0)
    amp = contextlib.nullcontext() if amp_dtype is None else torch.autocast(device_type=device.type, dtype=amp_dtype)

    def step() -> None:
        with amp:
            loss = model(x).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)

    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        times, cpu_times, done_warmup = _timed_loop(step, warmup, iters, min_time_s, max_time_s)
    finally:
        for module, mode in modes:
            module.training = mode
    return TimingResult(
        times_s=times, batch_size=x.shape[0], warmup=done_warmup, device=str(device), cpu_times_s=cpu_times)


def peak_memory_forward(
        model: nn.Module,
        inputs: InputSpec = (3, 224, 224),
        batch_size: int = 1,
        warmup: int = 1,
        amp_dtype: Optional[torch.dtype] = None,
        channels_last: bool = False,
) -> Optional[int]:
    """Measures the peak memory of one forward pass (inference) above the memory in use just before it.

    Run as in :func:`time_forward` (eval mode, ``torch.inference_mode``). After ``warmup`` passes (so that one-time
    allocations such as kernel caches are not counted) the baseline is taken and one pass is measured. On CUDA this
    is allocated device memory as seen by PyTorch's allocator; on CPU it is the process's resident memory (the
    module docstring describes how). The forward's output is still alive when the peak is read, so it is included.

    Args:
        model: The model, on the device to measure it on.
        inputs: The input shape without the batch dimension, or a tensor with it (see :func:`time_forward`). A tensor
            already exists before the baseline, so it is not counted; a generated input is made before it as well.
        batch_size: Batch size of the generated input.
        warmup: Forward passes run before measuring.
        amp_dtype: Run under ``torch.autocast`` with this dtype; None for the model's dtype.
        channels_last: Convert the model (in place) and a 4D input to the channels-last memory format.

    Returns:
        The peak in bytes (never negative), or None where it cannot be measured (CPU without ``/proc`` or
        ``psutil``; devices other than CPU and CUDA).
    """
    x, device = _prepare(model, inputs, batch_size, channels_last)
    step = _forward_fn(model, x, device)
    with _inference(model, device, amp_dtype):
        for _ in range(warmup):
            step()
        if device.type == 'cuda':
            return _peak_cuda(step, device)
        if device.type == 'cpu':
            return _peak_cpu(step)
    return None


def _peak_cuda(step: Callable[[], Any], device: torch.device) -> int:
    """Peak CUDA memory allocated by ``step`` above what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    out = step()
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return max(0, peak - baseline)


def _read_status_kb(key: str) -> Optional[int]:
    """Reads a ``kB`` value such as ``VmRSS`` or ``VmHWM`` from ``/proc/self/status``."""
    try:
        with open(_PROC_STATUS) as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _trim_heap() -> None:
    """Collects garbage and returns free C heap memory to the OS (glibc ``malloc_trim``), where possible."""
    gc.collect()
    libc_name = ctypes.util.find_library('c')
    if libc_name is None:
        return
    try:
        libc = ctypes.CDLL(libc_name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _reset_peak_rss() -> bool:
    """Resets the kernel's peak RSS (``VmHWM``) to the current RSS; returns whether that demonstrably worked."""
    try:
        with open(_PROC_CLEAR_REFS, 'w') as f:
            f.write('5')
    except OSError:
        return False
    hwm, rss = _read_status_kb('VmHWM'), _read_status_kb('VmRSS')
    # After a reset the peak equals the RSS of that moment; allow for a little growth since.
    return hwm is not None and rss is not None and hwm <= rss + 1024


def _rss_reader() -> Optional[Callable[[], int]]:
    """Returns a function reading the current RSS in bytes, or None if there is no way to read it."""
    if os.path.exists(_PROC_STATM):
        page = os.sysconf('SC_PAGE_SIZE')

        def read_statm() -> int:
            with open(_PROC_STATM) as f:
                return int(f.read().split()[1]) * page
        return read_statm
    try:
        import psutil  # optional
    except ImportError:
        return None
    process = psutil.Process()
    return lambda: int(process.memory_info().rss)


class _RssSampler:
    """Samples the RSS in a background thread and keeps the maximum."""

    def __init__(self, read: Callable[[], int], interval_s: float = 0.001):
        self.read = read
        self.interval_s = interval_s
        self.peak = read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(self.interval_s)

    def __enter__(self) -> '_RssSampler':
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def _peak_cpu(step: Callable[[], Any], reset_peak: bool = True) -> Optional[int]:
    """Peak resident memory of the process while ``step`` runs, above the RSS just before it.

    Uses the kernel's peak RSS if it can be reset (and ``reset_peak`` is True), else samples the RSS in a thread.
    """
    _trim_heap()
    if reset_peak and _reset_peak_rss():
        baseline_kb = _read_status_kb('VmRSS')
        out = step()
        peak_kb = _read_status_kb('VmHWM')
        del out
        if baseline_kb is not None and peak_kb is not None:
            return max(0, peak_kb - baseline_kb) * 1024
    read = _rss_reader()
    if read is None:
        return None
    baseline = read()
    with _RssSampler(read) as sampler:
        out = step()
    del out
    return max(0, sampler.peak - baseline)


def _cpu_model() -> str:
    """Returns the CPU model name (from ``/proc/cpuinfo`` on Linux), or the platform's processor string."""
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.lower().startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or 'unknown CPU'


def _usable_cores() -> int:
    """Returns the number of CPU cores this process may run on (its affinity where known)."""
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average() -> Optional[Tuple[float, float, float]]:
    """Returns the system load average over 1, 5 and 15 minutes (as ``uptime`` prints it), or None where unknown.

    On a shared machine it says how much other work competed with a measurement.
    """
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_info(device: Optional[Union[str, torch.device]] = None) -> Dict[str, Any]:
    """Describes the machine a measurement runs on, as a JSON-serializable dict.

    Args:
        device: The device measured on; for a CUDA device the GPU is described as well. None for the CPU.

    Returns:
        A dict with ``cpu``, ``cores`` (usable by this process), ``torch_threads``, ``torch``, ``python``,
        ``platform``, ``load_average`` (1, 5 and 15 minutes, at the time of the call) and, for CUDA, ``gpu``,
        ``gpu_memory_gib`` and ``cuda``.
    """
    info: Dict[str, Any] = {
        'cpu': _cpu_model(),
        'cores': _usable_cores(),
        'torch_threads': torch.get_num_threads(),
        'torch': torch.__version__,
        'python': platform.python_version(),
        'platform': f'{platform.system()} {platform.machine()}',
        'load_average': load_average(),
    }
    device = torch.device(device) if device is not None else torch.device('cpu')
    if device.type == 'cuda' and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info['gpu'] = props.name
        info['gpu_memory_gib'] = round(props.total_memory / 2 ** 30, 1)
        info['cuda'] = torch.version.cuda
    return info


def machine_description(device: Optional[Union[str, torch.device]] = None) -> str:
    """Describes the machine a measurement runs on in one line, for reports.

    Args:
        device: The device measured on; for a CUDA device the GPU is named first. None for the CPU.

    Returns:
        E.g. ``'AMD EPYC, 2 cores, torch 2.4.1 with 2 threads, Python 3.11.7, Linux x86_64, load average 1.52 / 1.20
        / 0.98'`` (the load over 1, 5 and 15 minutes when it was called).
    """
    info = machine_info(device)
    text = (
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']} with {info['torch_threads']} threads, "
        f"Python {info['python']}, {info['platform']}"
    )
    if info['load_average'] is not None:
        text += ', load average ' + ' / '.join(f'{x:.2f}' for x in info['load_average'])
    if 'gpu' in info:
        text = f"{info['gpu']} ({info['gpu_memory_gib']} GiB, CUDA {info['cuda']}); host: {text}"
    return text


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
