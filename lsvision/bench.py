"""Measuring models on standard libraries: time, peak memory and FLOPs, each in a fresh process, with paired ratios.

:func:`measure` times one :class:`Job` with ``Timer.blocked_autorange`` after warm-up; its peak memory is CUDA's
``max_memory_allocated`` or the CPU's ``ru_maxrss``, a lifetime peak: hence a fresh process per measurement
(:func:`run_jobs`, in alternating order over repeats). :func:`combine` pools a job's runs, :func:`add_ratios` adds
pooled and paired ratios to a baseline. Model specs: a timm name with ``@full`` (ViL-LS with full attention in every
stage), ``@noattn`` (every block's attention a no-op), ``@projonly`` (its projections only), ``@reparam`` (folded),
``@flex`` (long-short windows as one FlexAttention call, ``span_kernel='flex'``) or ``@span`` (the span path,
``span_kernel='span'``: the CPU's, and CUDA's before the flex path became its default).
"""
import contextlib
import functools
import json
import math
import os
import resource
import signal
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
from torch.utils.benchmark import Timer

import timm
from timm.models import reparameterize_model
from timm.utils import decay_batch_step

from lsvision.flops import count_activations, count_flops, parameter_count
from lsvision.layers import LongShortAttention2d
from lsvision.models import list_models
from lsvision.models.cvt import ConvAttention
from lsvision.reports import markdown_table
from lsvision.runs import unknown_model_message
from lsvision.runtime import fresh_process_context

MIB = 2 ** 20
AMP_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}
SUFFIXES = {'@full': 'full attention', '@noattn': 'attention no-op', '@projonly': 'projections only',
            '@reparam': 'reparameterized', '@flex': 'FlexAttention windows', '@span': 'span-path windows'}
"""Model spec suffixes and the label each adds to the model's name."""
_FULL_ATTENTION_KWARGS = {'vil_ls_': dict(attn_types=('full',) * 4)}
"""Model name prefix -> kwargs of its full-attention counterpart (CvT's is a model of its own, cvt_13)."""


# --------------------------------------------------------------------------------------------------------------------
# Models: specs and floors


class NoOpAttention(nn.Module):
    """A block's attention that returns its input: the floor of any attention."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


class ProjectionsOnly(nn.Module):
    """Runs a block attention's own projections and joins them by sums and means instead of attention, then its output
    projection: the floor of the attention math (every projection reaches every token, so backward runs as in the
    model). Knows long-short attention (q, k, v and the projection logits) and CvT's (q; k, v of the strided map)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        attn = self.attn
        if isinstance(attn, LongShortAttention2d):
            q, k, v, qkv_prefix, logits = attn.projections(x, feat_size)
            patches = q + k + v + logits.mean(-1, keepdim=True)
            mixed = patches.mean(1, keepdim=True)
            out = patches + mixed
            if qkv_prefix.shape[2] > 0:
                out = torch.cat([qkv_prefix.sum(0) + mixed, out], dim=1)
        else:
            q, k, v = attn.projections(x, feat_size)
            out = q + (q.mean(1, keepdim=True) + k.mean(1, keepdim=True) + v.mean(1, keepdim=True))
        return attn.proj_drop(attn.proj(out))


def _replace_attention(model: nn.Module, suffix: str) -> nn.Module:
    """Replaces every block's ``attn`` by its floor (``@noattn`` or ``@projonly``), in place."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, 'attn', None), nn.Module)]
    if not blocks:
        raise ValueError(f'{type(model).__name__} has no block with an `attn` module to replace')
    for block in blocks:
        if suffix == '@noattn':
            block.attn = NoOpAttention()
        elif isinstance(block.attn, (LongShortAttention2d, ConvAttention)):
            block.attn = ProjectionsOnly(block.attn)
        else:
            raise ValueError(f'{type(block.attn).__name__} has no projections-only floor: @projonly knows '
                             'LongShortAttention2d and ConvAttention (CvT); @noattn works for any attention')
    return model


def split_spec(spec: str) -> Tuple[str, str]:
    """``'vil_ls_medium@full'`` -> ``('vil_ls_medium', '@full')``; a ValueError if the model is unknown (with the
    closest names) or ``@full`` names a model without a full-attention switch."""
    suffix = next((s for s in SUFFIXES if spec.endswith(s)), '')
    name = spec[:len(spec) - len(suffix)]
    if not timm.is_model(name):
        raise ValueError(unknown_model_message(name) or f'{spec!r}: {name!r} is not a timm model name')
    if suffix == '@full' and not any(name.startswith(p) for p in _FULL_ATTENTION_KWARGS):
        raise ValueError(f'{spec!r}: only models starting with {", ".join(_FULL_ATTENTION_KWARGS)} have a '
                         'full-attention switch; name a full-attention model directly (e.g. cvt_13 beside cvt_ls_13).')
    return name, suffix


def spec_label(spec: str) -> str:
    """'vil_ls_medium (full attention)' for 'vil_ls_medium@full'."""
    name, suffix = split_spec(spec)
    return f'{name} ({SUFFIXES[suffix]})' if suffix else name


def create_model(spec: str, **kwargs: Any) -> nn.Module:
    """A model from a spec (see the module docstring), without pretrained weights, in eval mode."""
    name, suffix = split_spec(spec)
    if suffix == '@full':
        kwargs = {**next(v for p, v in _FULL_ATTENTION_KWARGS.items() if name.startswith(p)), **kwargs}
    if suffix in ('@flex', '@span'):
        kwargs = {'span_kernel': suffix[1:], **kwargs}
    model = timm.create_model(name, pretrained=False, **kwargs).eval()
    if suffix in ('@noattn', '@projonly'):
        _replace_attention(model, suffix)
    return reparameterize_model(model) if suffix == '@reparam' else model


def resolve_specs(patterns: Sequence[str]) -> List[str]:
    """Model specs from names, wildcards (lsvision's models first, then timm's) and suffixed specs, without repeats;
    a ValueError if a name is unknown (see :func:`split_spec`) or a wildcard matches no model."""
    specs: List[str] = []
    for pattern in patterns:
        if not any(ch in pattern for ch in '*?['):
            split_spec(pattern)
            specs.append(pattern)
            continue
        matches = list_models(pattern) or timm.list_models(pattern)
        if not matches:
            raise ValueError(f'{pattern!r} matches no model. lsvision models: {", ".join(list_models())}; any timm '
                             'model name (timm.list_models()) works too.')
        specs += matches
    return list(dict.fromkeys(specs))


# --------------------------------------------------------------------------------------------------------------------
# One measurement (in a fresh process)


@dataclass
class Job:
    """One measurement (``kind`` ``'inference'`` or ``'train'``): ``build`` makes the model and must pickle (a class
    or ``functools.partial`` of importable things); ``inputs`` are (shape without batch, high) per model input, token
    ids below ``high`` or ``randn`` if None, or None for an image of the model's size (``img_size`` overrides it);
    ``budget_s`` seconds of timed passes; ``flops`` per image (image models); ``optimizer`` of a train step: 'sgd'
    (lr 0: the update's cost, the weights unchanged) or 'adamw' (lr 1e-4, weight decay 0.05: a real update, its state
    in the memory); ``extra`` fields go into the row."""

    label: str
    build: Callable[[], nn.Module]
    inputs: Optional[List[Tuple[Tuple[int, ...], Optional[int]]]] = None
    img_size: Optional[int] = None
    batch_size: int = 1
    kind: str = 'inference'
    warmup: int = 3
    budget_s: float = 10.0
    device: str = 'cpu'
    amp: Optional[str] = None
    channels_last: bool = False
    compile: Optional[str] = None
    flops: bool = False
    memory: bool = True
    optimizer: str = 'sgd'
    threads: Optional[int] = None
    timeout_s: float = 1800.0
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in ('inference', 'train'):
            raise ValueError(f"kind must be 'inference' or 'train', got {self.kind!r}")
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f'amp must be one of {sorted(AMP_DTYPES)} or None, got {self.amp!r}')
        if self.optimizer not in ('sgd', 'adamw'):
            raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}")
        if self.batch_size < 1 or self.warmup < 0 or self.budget_s < 0:
            raise ValueError('batch_size must be at least 1, warmup and budget_s at least 0')


def _rss_bytes(peak: bool = False) -> int:
    """The resident memory now (``/proc/self/statm``), or the peak so far (``ru_maxrss``; also where there is no
    /proc)."""
    if not peak and os.path.exists('/proc/self/statm'):
        with open('/proc/self/statm') as f:
            return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == 'darwin' else 1024)


@contextlib.contextmanager
def peak_memory(device: torch.device, out: Dict[str, Optional[float]]) -> Any:
    """Sets ``out['peak_mib']`` to the peak memory of the block above the memory in use before it (CUDA: allocated;
    CPU: resident, a lifetime peak, hence meaningful in a fresh process only; elsewhere ``out`` is left alone)."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        out['peak_mib'] = max(0, torch.cuda.max_memory_allocated(device) - base) / MIB
    elif device.type == 'cpu':
        base = _rss_bytes()
        yield
        out['peak_mib'] = max(0, _rss_bytes(peak=True) - base) / MIB
    else:
        yield


def timing_stats(times: Sequence[float], passes: int) -> Dict[str, Any]:
    """Median, p10, p90 and IQR (linear interpolation) of per-pass times (s) of ``passes`` timed passes."""
    p10, p25, median, p75, p90 = np.quantile(times, [.1, .25, .5, .75, .9]).tolist()
    return dict(times_s=list(times), passes=passes, median_s=median, p10_s=p10, p90_s=p90, iqr_s=p75 - p25)


def time_step(step: Callable[[], Any], warmup: int, budget_s: float) -> Dict[str, Any]:
    """Runs ``step`` ``warmup`` times, then ``Timer.blocked_autorange(min_run_time=budget_s)`` (its block-size
    estimate runs one more pass; the accelerator is synchronized around blocks); returns :func:`timing_stats` of the
    blocks' per-pass times and ``cpu_per_pass_s``, this process's CPU time per pass (steadier on a shared machine)."""
    calls = [0]

    def counted() -> None:
        calls[0] += 1
        step()

    for _ in range(warmup):
        step()
    cpu0 = time.process_time()
    m = Timer('step()', globals={'step': counted}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=budget_s)
    stats = timing_stats(m.times, len(m.raw_times) * m.number_per_run)
    stats['cpu_per_pass_s'] = (time.process_time() - cpu0) / max(1, calls[0])
    return stats


def _inputs(model: nn.Module, job: Job, device: torch.device) -> List[torch.Tensor]:
    """The job's random inputs, batch first, on the model's device and (floats) dtype."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    specs = job.inputs
    if specs is None:
        c, h, w = model.pretrained_cfg.get('input_size', (3, 224, 224))
        specs = [((c, h, w) if job.img_size is None else (c, job.img_size, job.img_size), None)]
    g = torch.Generator().manual_seed(0)
    out = [torch.randint(high, (job.batch_size, *shape), generator=g) if high else
           torch.randn((job.batch_size, *shape), generator=g).to(dtype) for shape, high in specs]
    if job.channels_last:
        out = [x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x for x in out]
    return [x.to(device) for x in out]


def _step(model: nn.Module, inputs: Sequence[torch.Tensor], job: Job, device: torch.device) -> Callable[[], Any]:
    """One forward pass (inference) or training step (the job's optimizer) on the mean of the output (of each output
    of a dict, e.g. an FPN's levels, summed)."""
    amp = functools.partial(torch.autocast, device.type, AMP_DTYPES[job.amp]) if job.amp else contextlib.nullcontext
    runner = torch.compile(model, mode=None if job.compile == 'default' else job.compile) if job.compile else model
    if job.kind == 'inference':
        model.eval()

        def forward() -> Any:
            with torch.inference_mode(), amp():
                return runner(*inputs)
        return forward
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.0) if job.optimizer == 'sgd' else \
        torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05)

    def train_step() -> None:
        with amp():
            out = runner(*inputs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(out, dict):
            out = torch.stack([v.float().mean() for v in out.values()]).sum()
        out.float().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return train_step


def measure(job: Job) -> Dict[str, Any]:
    """Measures one job in this process (meant to be a fresh one, see :func:`run_jobs`); returns its row."""
    import lsvision  # noqa: F401  (registers the models with timm in a fresh process)
    if job.threads:
        torch.set_num_threads(job.threads)
    torch.manual_seed(0)
    device = torch.device(job.device)
    model = job.build().to(device)
    if job.channels_last:
        model.to(memory_format=torch.channels_last)
    inputs = _inputs(model, job, device)
    row: Dict[str, Any] = dict(
        label=job.label, kind=job.kind, input_size=list(inputs[0].shape[1:]), batch_size=job.batch_size,
        device=job.device, amp=job.amp, channels_last=job.channels_last, compile=job.compile,
        params=parameter_count(model), pid=os.getpid(), **job.extra)
    if job.flops:
        flops = count_flops(model, tuple(row['input_size']), warn_unsupported=False)
        row.update(gflops=flops.gflops, unsupported_ops=flops.unsupported,
                   mactivations=count_activations(model, tuple(row['input_size'])) / 1e6)
    step = _step(model, inputs, job, device)
    memory: Dict[str, Optional[float]] = {'peak_mib': None}
    with peak_memory(device, memory) if job.memory else contextlib.nullcontext():
        timing = time_step(step, job.warmup, job.budget_s)
    row.update(timing=timing, peak_mib=memory['peak_mib'])
    return row


# --------------------------------------------------------------------------------------------------------------------
# Fresh processes, alternating order, pooled rows and paired ratios


def _run_with_alarm(fn: Callable[[Job], Any], job: Job) -> Any:
    """Child side of :func:`run_fresh`: SIGALRM (default action: end the process) after the job's time-out."""
    if hasattr(signal, 'alarm'):
        signal.alarm(max(1, math.ceil(job.timeout_s)))
    try:
        return fn(job)
    except BaseException as e:  # noqa: B036  (the exception type may not unpickle in the parent)
        raise RuntimeError(f'{type(e).__name__}: {e}') from None


def run_fresh(job: Job, fn: Callable[[Job], Any] = measure) -> Any:
    """``fn(job)`` in a fresh process (forked from a server that imported this module: `fresh_process_context`); a
    child that dies (killed for memory, or over ``job.timeout_s``) is a RuntimeError that says so."""
    with ProcessPoolExecutor(1, mp_context=fresh_process_context([__name__]), max_tasks_per_child=1) as pool:
        try:
            return pool.submit(_run_with_alarm, fn, job).result()
        except BrokenProcessPool:
            raise RuntimeError(f'{job.label}: the measuring process died (killed for memory, or over the time-out of '
                               f'{job.timeout_s:g} s)') from None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is, or reports, a failed allocation (CPU or CUDA) or a child killed for memory."""
    text = str(error).lower()
    return isinstance(error, MemoryError) or any(
        s in text for s in ('out of memory', "can't allocate memory", 'killed for memory'))


def run_jobs(jobs: Sequence[Job], repeats: int = 1, retry: bool = True, log: Optional[Callable[[str], None]] = None,
             keep_going: bool = False) -> List[List[Dict[str, Any]]]:
    """Runs every job ``repeats`` times, each run in a fresh process, in the order given in even rounds and reversed
    in odd ones (A B, B A, ...), so that neither the machine's drift nor the position favours a job. A run that runs
    out of memory is retried at a smaller batch (``decay_batch_step``), which the job's later runs keep; then (or
    killed for memory, or over its time-out), with ``keep_going``, it is a row with ``failed`` (why), and runs no more.

    Returns:
        Per job, in the order given, the rows of its runs (each with its ``repeat``).
    """
    if repeats < 1:
        raise ValueError(f'repeats must be at least 1, got {repeats}')
    jobs = list(jobs)
    results: List[List[Dict[str, Any]]] = [[] for _ in jobs]
    for r in range(repeats):
        for i in (range(len(jobs)) if r % 2 == 0 else reversed(range(len(jobs)))):
            if any('failed' in x for x in results[i]):
                continue  # it failed before
            t0 = time.perf_counter()
            while True:
                try:  # FLOPs are the same in every run: counted in the first
                    row = run_fresh(replace(jobs[i], flops=jobs[i].flops and r == 0))
                    break
                except RuntimeError as e:
                    if keep_going and is_out_of_memory(e) and (not retry or jobs[i].batch_size <= 1):
                        row = dict(label=jobs[i].label, batch_size=jobs[i].batch_size, failed=str(e), **jobs[i].extra,
                                   input_size=list(jobs[i].inputs[0][0]) if jobs[i].inputs else None)
                        break
                    if not retry or jobs[i].batch_size <= 1 or not is_out_of_memory(e):
                        raise
                    jobs[i] = replace(jobs[i], batch_size=decay_batch_step(jobs[i].batch_size))
                    if log:
                        log(f'  {jobs[i].label}: out of memory; retrying at batch {jobs[i].batch_size}')
            results[i].append({**row, 'repeat': r})
            if log:
                log(f'  [{r + 1}/{repeats}] {jobs[i].label} {jobs[i].kind} b{jobs[i].batch_size}: '
                    + (row.get('failed') or f"{row['timing']['median_s'] * 1e3:.1f} ms/pass")
                    + f'; {time.perf_counter() - t0:.0f} s')
    return results


_PREFIX = {'inference': 'latency', 'train': 'train_step'}
_MEMORY = {'inference': 'peak_mib', 'train': 'train_memory_mib'}


def combine(runs_by_kind: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """One row from the runs of one model at one point (FLOPs from the first kind's first run): per kind, the per-pass
    times of all runs pooled (median, p10-p90), the median of each run (for paired ratios), memory their median; runs
    that ``failed`` (:func:`run_jobs`) are ``exceeded``, 'KIND: why'."""
    first = next(iter(runs_by_kind.values()))[0]
    failed = [f"{kind}: {r['failed']}" for kind, runs in runs_by_kind.items() for r in runs if 'failed' in r]
    runs_by_kind = {kind: ok for kind, runs in runs_by_kind.items() if (ok := [r for r in runs if 'failed' not in r])}
    row = {k: v for k, v in first.items() if k not in ('timing', 'peak_mib', 'pid', 'kind', 'repeat', 'failed')}
    row.update(dict(exceeded=failed) if failed else {})
    row['pids'] = {kind: [r['pid'] for r in runs] for kind, runs in runs_by_kind.items()}
    for kind, runs in runs_by_kind.items():
        p, batch = _PREFIX[kind], runs[-1]['batch_size']
        t = timing_stats([x for r in runs for x in r['timing']['times_s']], sum(r['timing']['passes'] for r in runs))
        t['cpu_per_pass_s'] = statistics.median(r['timing']['cpu_per_pass_s'] for r in runs)
        memory = [r['peak_mib'] for r in runs if r['peak_mib'] is not None]
        row.update({f'{p}_ms': t['median_s'] * 1e3, f'{p}_p10_ms': t['p10_s'] * 1e3, f'{p}_p90_ms': t['p90_s'] * 1e3,
                    f'{p}_runs_ms': [r['timing']['median_s'] * 1e3 for r in runs], _MEMORY[kind]: (
                        statistics.median(memory) if memory else None), f'{kind}_batch_size': batch,
                    f'{kind}_timing': t, f'{kind}_ms_per_image': t['median_s'] * 1e3 / batch,
                    f'{kind}_cpu_ms_per_image': t['cpu_per_pass_s'] * 1e3 / batch,
                    f'{kind}_images_per_s': batch / t['median_s']})
    row['batch_size'] = runs_by_kind.get('inference', runs_by_kind.get('train', [first]))[-1]['batch_size']
    if 'inference' in runs_by_kind:  # the names of timm's benchmark.py and of the cards
        row.update(images_per_s=row['inference_images_per_s'], ms_per_image=row['inference_ms_per_image'],
                   timed_passes=row['inference_timing']['passes'])
    return row


def add_ratios(rows: List[Dict[str, Any]]) -> None:
    """Adds each row's ratios to the row named by its ``baseline`` spec at the same ``point``: time per image (a batch
    retried smaller still compares) from the pooled medians and paired (median and range of the per-round ratios, each
    from two processes of one pass over the models, so that drift between rounds cancels; 2 rounds or more), and
    memory where both ran at the same batch."""
    for row in rows:
        base = next((r for r in rows if r['spec'] == row.get('baseline') and r['point'] == row['point']), None)
        for kind, p in _PREFIX.items():
            if base is None or row.get(f'{p}_ms') is None or base.get(f'{p}_ms') is None:
                continue
            scale = base[f'{kind}_batch_size'] / row[f'{kind}_batch_size']
            row[f'{p}_ratio'] = row[f'{p}_ms'] / base[f'{p}_ms'] * scale
            mem, base_mem = row.get(_MEMORY[kind]), base.get(_MEMORY[kind])
            if mem is not None and base_mem and scale == 1:
                row[_MEMORY[kind].replace('_mib', '_ratio')] = mem / base_mem
            rounds = [a / b * scale for a, b in zip(row[f'{p}_runs_ms'], base[f'{p}_runs_ms'])]
            if len(rounds) >= 2 and len(row[f'{p}_runs_ms']) == len(base[f'{p}_runs_ms']):
                row.update({f'{p}_ratio_rounds': rounds, f'{p}_ratio_paired': statistics.median(rounds)})


# --------------------------------------------------------------------------------------------------------------------
# The table of rows, and reading reports back


TABLE_COLUMNS: List[Tuple[str, str, str]] = [
    ('model', 'label', ''), ('input', 'input_size', 'size'), ('batch', 'batch_size', ''),
    ('params (M)', 'params', 'M'), ('GFLOPs/img', 'gflops', '.3f'), ('MActs/img', 'mactivations', '.1f'),
    ('latency ms (p10-p90)', 'latency_ms', 'spread'), ('img/s', 'images_per_s', '.1f'),
    ('CPU ms/img', 'inference_cpu_ms_per_image', '.1f'), ('peak MiB', 'peak_mib', '.0f'),
    ('latency / baseline', 'latency_ratio', 'x'), ('peak / baseline', 'peak_ratio', 'x'),
    ('train step ms (p10-p90)', 'train_step_ms', 'spread'), ('train act. MiB', 'train_memory_mib', '.0f'),
    ('train time / baseline', 'train_step_ratio', 'x'), ('train mem. / baseline', 'train_memory_ratio', 'x'),
    ('latency / baseline, paired', 'latency_ratio_paired', 'paired'),
    ('train time / baseline, paired', 'train_step_ratio_paired', 'paired'), ('over budget', 'exceeded', 'list'),
]
"""(header, row key, format): a format spec, or M (millions), x (a ratio), spread (median and p10-p90), paired
(median and range of the rounds), ratio (paired where there are rounds, else x), size (of an input), list (of
reasons)."""


def format_cell(row: Dict[str, Any], key: str, fmt: str) -> str:
    """``row[key]`` in a :data:`TABLE_COLUMNS` format."""
    value = row[key]
    if fmt == 'size':  # of an image without its channels
        return 'x'.join(map(str, value[1:] if len(value) == 3 else value))
    if fmt == 'spread':  # (p10-p90) where measured
        low, high = row.get(key[:-3] + '_p10_ms'), row.get(key[:-3] + '_p90_ms')
        return f'{value:.1f}' if low is None else f'{value:.1f} ({low:.1f}-{high:.1f})'
    if fmt == 'paired':
        rounds = row[key[:-len('_paired')] + '_rounds']
        return f'{value:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})'
    if fmt == 'ratio' and row.get(key + '_paired') is not None:
        return format_cell(row, key + '_paired', 'paired')
    if fmt == 'list':
        return '; '.join(value) or 'no'
    return f'{value / 1e6:.2f}' if fmt == 'M' else f'{value:.2f}x' if fmt in ('x', 'ratio') else format(value, fmt)


RATIOS_EXPLAINED = ('Ratios are to the baseline at the same point: time per image, memory at the same batch; paired: '
                    "the median (and range) over the rounds of each round's ratio, from two processes of one pass over "
                    "the models, so that the machine's drift between rounds cancels out.")


def benchmark_table(rows: Sequence[Dict[str, Any]], columns: Sequence[Tuple[str, str, str]] = TABLE_COLUMNS,
                    left_columns: int = 2) -> str:
    """Rows as a markdown table of ``columns`` (as :data:`TABLE_COLUMNS`): '-' where not measured; a column after the
    third that no row has is left out."""
    columns = [c for i, c in enumerate(columns) if i < 3 or any(r.get(c[1]) is not None for r in rows)]
    cells = [[format_cell(r, key, fmt) if r.get(key) is not None else '-' for _, key, fmt in columns] for r in rows]
    return markdown_table([c[0] for c in columns], cells, left_columns=left_columns)


def read_report(path: Path, sweep: bool = False) -> Dict[str, Any]:
    """A JSON report of :func:`lsvision.reports.write_reports` (machine, settings, rows) or of a sweep (also its
    command, budget and fit_min); a ValueError that says what is missing from another format."""
    data = json.loads(Path(path).read_text())
    keys = ('machine', 'settings', 'rows') + (('command', 'budget', 'fit_min') if sweep else ())
    missing = [k for k in keys if k not in data] or sorted({k for r in data['rows'] if 'skipped' not in r for k in (
        'label', 'input_size', 'batch_size') if k not in r})
    if missing:
        raise ValueError(f'{path} is not a report of this tool ({"sweep" if sweep else "suite or benchmark"}): it '
                         f'lacks {", ".join(missing)}.')
    return data
