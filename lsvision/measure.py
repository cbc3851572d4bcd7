"""Wall-clock timing and peak memory of model forward passes, and a description of the machine they ran on.

:func:`time_forward` times a model's inference forward pass (eval mode, ``torch.inference_mode``) after warm-up and
returns a :class:`TimingResult` with robust statistics; with ``measure_memory=True`` it also measures the peak memory
of one forward pass with :func:`peak_memory_forward`. :func:`time_train_step` times a training step (forward,
backward, optimizer step) and, with ``measure_memory=True``, its activation memory. :func:`run_in_fresh_process` runs
a measurement in a fresh process, so that nothing measured before disturbs it. :func:`machine_description` says where
a measurement was taken, and under what load. Machinery for a noisy shared CPU (passes of several models in
alternating rounds, glibc allocator settings) belongs to the benchmark tool (``tools/_bench_cpu.py``), not here.

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
    'peak_memory_forward',
    'run_in_fresh_process',
    'time_forward',
    'time_train_step',
]

InputSpec = Union[Sequence[int], torch.Tensor]
"""A model input: a shape without the batch dimension, e.g. ``(3, 224, 224)``, or a ready tensor (with it)."""

_PROC_STATUS = '/proc/self/status'

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
        peak_bytes: Peak memory of one forward pass in bytes (see :func:`peak_memory_forward`; from
            :func:`time_train_step`: the training activation memory), or None if it was not
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
        measure_memory: bool = False,
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
        measure_memory: Also measure the training activation memory, stored in :attr:`TimingResult.peak_bytes`: the
            peak memory of all warm-up and timed steps above the memory in use once the model, the input and the
            optimizer exist (CPU: resident memory, CUDA: allocated; the module docstring describes how). It holds
            the activations kept for backward, the gradients and the optimizer's workspace.

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

    def loop() -> Tuple[List[float], List[float], int]:
        return _timed_loop(step, warmup, iters, min_time_s, max_time_s)

    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        peak, (times, cpu_times, done_warmup) = _peak_and_result(loop, device) if measure_memory else (None, loop())
    finally:
        for module, mode in modes:
            module.training = mode
    return TimingResult(
        times_s=times, batch_size=x.shape[0], warmup=done_warmup, device=str(device), cpu_times_s=cpu_times,
        peak_bytes=peak)


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
        return _peak_and_result(step, device)[0]


def _peak_and_result(step: Callable[[], Any], device: torch.device) -> Tuple[Optional[int], Any]:
    """Runs ``step`` once; returns the peak memory it needed above the memory in use before it (None where it cannot
    be measured: see :func:`peak_memory_forward`) and its result."""
    if device.type == 'cuda':
        return _peak_cuda(step, device)
    if device.type == 'cpu':
        return _peak_cpu(step)
    return None, step()


def _peak_cuda(step: Callable[[], Any], device: torch.device) -> Tuple[int, Any]:
    """Peak CUDA memory allocated by ``step`` above what was allocated before it, and the result of ``step``."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    out = step()
    return max(0, torch.cuda.max_memory_allocated(device) - baseline), out


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


def _peak_cpu(step: Callable[[], Any], reset_peak: bool = True) -> Tuple[Optional[int], Any]:
    """Peak resident memory of the process while ``step`` runs, above the RSS just before it, and the result of
    ``step``; the peak is None where the RSS cannot be read.

    Uses the kernel's peak RSS if it can be reset (and ``reset_peak`` is True), else samples the RSS in a thread.
    """
    _trim_heap()
    if reset_peak and _reset_peak_rss():
        baseline_kb = _read_status_kb('VmRSS')
        out = step()
        peak_kb = _read_status_kb('VmHWM')
        if baseline_kb is not None and peak_kb is not None:
            return max(0, peak_kb - baseline_kb) * 1024, out
        del out
    read = _rss_reader()
    if read is None:
        return None, step()
    baseline = read()
    with _RssSampler(read) as sampler:
        out = step()
    return max(0, sampler.peak - baseline), out


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


def _load_average() -> Optional[Tuple[float, float, float]]:
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
        'load_average': _load_average(),
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
