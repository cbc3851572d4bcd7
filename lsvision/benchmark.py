"""Model benchmarks: parameters, FLOPs, activations, latency, throughput, train-step time and training memory;
resolution sweeps.

Two kinds of measurement, both written as JSON, CSV or markdown (and a PNG plot for sweeps); ``tools/benchmark.py``
is the command line (it also runs each measurement in a fresh process and in alternating order, for comparisons on a
shared machine).

* :func:`benchmark_model` measures one model at one input size: parameters, FLOPs and activations per image
  (:mod:`lsvision.flops`, which counts attention), the inference latency (warm-up, then repeated timed passes: median,
  p10-p90 and standard deviation, :func:`lsvision.measure.time_forward`), throughput and peak memory of a forward
  pass, and the time and activation memory of a training step (:func:`lsvision.measure.time_train_step`); with a batch
  size, channels-last, autocast (AMP) and ``torch.compile`` as options, on CPU or CUDA (synchronized after each pass).
* :func:`resolution_sweep` measures time and peak memory against the input size for several models (curves), for
  instance long-short attention beside full attention, and continues each curve only while it stays within a
  :class:`SweepBudget`. Each point runs in a fresh process, so that its peak memory is its own and a point that runs
  away can be stopped (a time-out, or on CPU an address-space limit that turns an oversized allocation into an
  error). :func:`sweep_exponents` fits the scaling exponent of time and memory against the pixel count (the slope of a
  log-log least-squares line: 1 is linear, 2 quadratic) and :func:`plot_sweep` draws the curves.
"""

import csv
import gc
import io
import json
import math
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import timm

from lsvision.flops import count_activations, count_flops, parameter_count
from lsvision.layers import LongShortAttention2d
from lsvision.measure import (
    _read_status_kb,
    machine_description,
    machine_info,
    run_in_fresh_process,
    time_forward,
    time_train_step,
)
from lsvision.models import list_models
from lsvision.models.cvt import ConvAttention

__all__ = [
    'AMP_DTYPES',
    'BENCH_KINDS',
    'BenchmarkConfig',
    'REPORT_FORMATS',
    'SweepBudget',
    'SweepConfig',
    'SweepCurve',
    'benchmark_model',
    'benchmark_table',
    'compiled',
    'create_benchmark_model',
    'fit_exponent',
    'input_size_of',
    'is_out_of_memory',
    'markdown_table',
    'parse_curve',
    'without_attention',
    'NoOpAttention',
    'ProjectionsOnly',
    'projections_only',
    'CURVE_SUFFIXES',
    'FULL_ATTENTION',
    'NO_ATTENTION',
    'PROJECTIONS_ONLY',
    'plot_sweep',
    'resolution_sweep',
    'resolve_model_names',
    'sweep_exponents',
    'sweep_markdown',
    'write_benchmark_reports',
    'write_json',
    'write_results_file',
]

MIB = 2 ** 20
AMP_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}
"""Autocast dtypes by name, as the command line takes them."""
BENCH_KINDS = ('inference', 'train', 'both')
"""What :func:`benchmark_model` times (timm's ``benchmark.py --bench`` names)."""

FULL_ATTENTION = '@full'
"""Suffix of a model that runs it with full attention in every stage (see :func:`parse_curve`)."""
NO_ATTENTION = '@noattn'
"""Suffix of a model whose blocks' attention is a no-op of the same output shape: the floor of a training step or
pass that any attention implementation adds to (see :func:`without_attention`)."""
PROJECTIONS_ONLY = '@projonly'
"""Suffix of a model whose blocks' attention runs its own projections only (q, k, v, and in long-short attention the
dynamic-projection logits; then the output projection), the attention math between them a no-op: the floor that any
implementation of the attention math adds to, given the model's projections (see :func:`projections_only`)."""
CURVE_SUFFIXES = (FULL_ATTENTION, NO_ATTENTION, PROJECTIONS_ONLY)
"""The suffixes a model spec may carry (see :func:`parse_curve`); the last two name floors."""
TIME_KEYS = {'wall': 'time_per_image_s', 'cpu': 'cpu_time_per_image_s'}
"""The point field holding the time per image of each clock."""

_FULL_ATTENTION_KWARGS = {
    # ViL-LS: stages 1-2 become the ViL-style full attention with relative-position bias, as stages 3-4 already are
    'vil_ls_': dict(attn_types=('full',) * 4),
}


def resolve_model_names(patterns: Sequence[str]) -> List[str]:
    """Expands model names and wildcards, in the order given and without repeats.

    A pattern is matched against the lsvision models first (fnmatch wildcards, e.g. ``'cvt_ls_*'``; ``'*'`` for all of
    them); a pattern that matches none of them may name (or match) any timm model instead.

    Args:
        patterns: Model names or wildcards.

    Returns:
        The model names.

    Raises:
        ValueError: If a pattern matches no model.
    """
    names: List[str] = []
    for pattern in patterns:
        matches = list_models(pattern) or timm.list_models(pattern)
        if not matches:
            raise ValueError(
                f'{pattern!r} matches no model. lsvision models: {", ".join(list_models())}; any timm model name '
                '(timm.list_models()) works too.')
        names += matches
    return list(dict.fromkeys(names))


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left_columns: int = 1) -> str:
    """Renders a markdown table, left-aligning the first ``left_columns`` columns and right-aligning the rest.

    Args:
        header: Column names.
        rows: Cells, already formatted.
        left_columns: How many leading columns hold text rather than numbers.

    Returns:
        The table, one line per row, without a trailing newline.
    """
    align = ['---'] * left_columns + ['---:'] * (len(header) - left_columns)
    return '\n'.join('| ' + ' | '.join(line) + ' |' for line in [header, align, *rows])


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Fits ``y = c * x**k`` by least squares on ``log y`` against ``log x`` and returns ``k``.

    Against the pixel count, ``k = 1`` is linear growth and ``k = 2`` quadratic.

    Args:
        xs: Positive x values.
        ys: Positive y values, one per x.

    Returns:
        The exponent, or None with fewer than two distinct x values.

    Raises:
        ValueError: If the lengths differ or a value is not positive.
    """
    if len(xs) != len(ys):
        raise ValueError(f'xs and ys must have the same length, got {len(xs)} and {len(ys)}.')
    if any(v <= 0 for v in [*xs, *ys]):
        raise ValueError('fit_exponent needs positive values (it fits on a log-log scale).')
    if len(set(xs)) < 2:
        return None
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def write_json(path: Path, data: Any) -> Path:
    """Writes JSON atomically (a temporary file, then ``os.replace``), creating the folder; returns the path."""
    return _write_text(path, json.dumps(data, indent=2) + '\n')


def _write_text(path: Path, text: str) -> Path:
    """Writes a text file atomically, creating the folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + '.tmp')
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------------------------------------------------
# One model at one size


@dataclass
class BenchmarkConfig:
    """How :func:`benchmark_model` measures.

    Attributes:
        img_size: Square input size; None for the model's own (``pretrained_cfg['input_size']``).
        batch_size: Images per pass for latency, throughput, memory and train steps (FLOPs are per image).
        device: Device to run on, e.g. ``'cpu'`` or ``'cuda'``.
        amp: Autocast dtype name (``'bfloat16'`` or ``'float16'``); None to run in the model's dtype.
        channels_last: Run model and input in the channels-last memory format.
        compile: ``torch.compile`` mode to time the model compiled with (``'default'``, ``'reduce-overhead'``,
            ``'max-autotune'``...; compilation happens in the warm-up passes); None for eager.
        warmup: Warm-up passes (or steps) before timing.
        iters: Timed passes (or steps; fewer if ``max_time_s`` runs out; at least one always runs).
        max_time_s: Seconds for warm-up plus timing of one measurement; None for no limit.
        flops: Count FLOPs and activations (one traced forward pass each, on the uncompiled model).
        memory: Measure memory: the peak of one more forward pass (inference) and the activation memory of the
            training steps (train).
        bench: What to time: ``'inference'`` (forward passes), ``'train'`` (forward, backward, SGD step) or
            ``'both'``.
    """

    img_size: Optional[int] = None
    batch_size: int = 1
    device: str = 'cpu'
    amp: Optional[str] = None
    channels_last: bool = False
    compile: Optional[str] = None
    warmup: int = 3
    iters: int = 10
    max_time_s: Optional[float] = 30.0
    flops: bool = True
    memory: bool = True
    bench: str = 'inference'

    def __post_init__(self) -> None:
        if self.amp is not None and self.amp not in AMP_DTYPES:
            raise ValueError(f'amp must be one of {sorted(AMP_DTYPES)} or None, got {self.amp!r}.')
        if self.bench not in BENCH_KINDS:
            raise ValueError(f'bench must be one of {", ".join(BENCH_KINDS)}, got {self.bench!r}.')
        if self.batch_size < 1 or self.iters < 1 or self.warmup < 0:
            raise ValueError('batch_size and iters must be at least 1 and warmup at least 0.')
        if self.img_size is not None and self.img_size < 1:
            raise ValueError(f'img_size must be positive, got {self.img_size}.')


class NoOpAttention(nn.Module):
    """Stands in for a block's attention: returns its input (same shape), computes nothing, has no parameters."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return x


def without_attention(model: nn.Module) -> nn.Module:
    """Replaces the `attn` module of every block by a `NoOpAttention`, in place (the floor of the attention's cost).

    Raises:
        ValueError: If the model has no block with an `attn` module.
    """
    blocks = [m for m in model.modules() if isinstance(getattr(m, 'attn', None), nn.Module)]
    if not blocks:
        raise ValueError(f'{type(model).__name__} has no block with an `attn` module to replace')
    for block in blocks:
        block.attn = NoOpAttention()
    return model


class ProjectionsOnly(nn.Module):
    """Stands in for a block's attention: runs that attention's own projections (the same modules, parameters and
    training paths) and joins their outputs by sums instead of attention, then its output projection.

    Every projection reaches every output token through a mean over the tokens (as attention mixes them), so that a
    training step runs each one's backward with gradients as in the model (a classifier reading the cls token sees
    all patches); the sums and means that join them are elementwise, a small fraction of any attention's work. Known
    attentions: long-short (`LongShortAttention2d`: q, k, v and the dynamic-projection logits) and CvT's
    (`ConvAttention`: q, and k, v from the strided map).
    """

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
        else:  # CvT: keys and values of the strided map, fewer tokens than queries
            q, k, v = attn.projections(x, feat_size)
            out = q + (q.mean(1, keepdim=True) + k.mean(1, keepdim=True) + v.mean(1, keepdim=True))
        return attn.proj_drop(attn.proj(out))


def projections_only(model: nn.Module) -> nn.Module:
    """Wraps the `attn` module of every block in a `ProjectionsOnly`, in place (the floor of the attention math).

    Raises:
        ValueError: If the model has no block with an `attn` module, or one whose attention has no known projections.
    """
    blocks = [m for m in model.modules() if isinstance(getattr(m, 'attn', None), nn.Module)]
    if not blocks:
        raise ValueError(f'{type(model).__name__} has no block with an `attn` module to replace')
    for block in blocks:
        if not isinstance(block.attn, (LongShortAttention2d, ConvAttention)):
            raise ValueError(
                f'{type(block.attn).__name__} has no projections-only floor: {PROJECTIONS_ONLY} knows long-short '
                f'attention (LongShortAttention2d) and CvT attention (ConvAttention); {NO_ATTENTION} works for any')
        block.attn = ProjectionsOnly(block.attn)
    return model


_FLOORS: Dict[str, Tuple[str, Callable[[nn.Module], nn.Module]]] = {
    NO_ATTENTION: ('attention no-op', without_attention),
    PROJECTIONS_ONLY: ('projections only', projections_only),
}
"""Each floor suffix: the label it adds to the model's name, and what it does to the model (in place)."""


def create_benchmark_model(
        name: str,
        device: str,
        model_kwargs: Optional[Dict[str, Any]] = None,
        floor: str = '',
) -> nn.Module:
    """Creates a model without pretrained weights, in eval mode, on ``device``; ``floor`` (`NO_ATTENTION` or
    `PROJECTIONS_ONLY`, '' for none) turns it into that floor."""
    model = timm.create_model(name, pretrained=False, **(model_kwargs or {}))
    if floor:
        if floor not in _FLOORS:
            raise ValueError(f'unknown floor {floor!r}; floors: {", ".join(_FLOORS)}')
        _FLOORS[floor][1](model)
    return model.to(device).eval()


def input_size_of(model: nn.Module, img_size: Optional[int]) -> Tuple[int, int, int]:
    """The (C, H, W) input of a model: its pretrained cfg's, resized to ``img_size`` if given."""
    channels, height, width = model.pretrained_cfg.get('input_size', (3, 224, 224))
    return (channels, height, width) if img_size is None else (channels, img_size, img_size)


def compiled(model: nn.Module, mode: Optional[str]) -> nn.Module:
    """``torch.compile(model)`` in ``mode`` (``'default'`` for torch's default), or the model itself for None."""
    if mode is None:
        return model
    return torch.compile(model, mode=None if mode == 'default' else mode)


def benchmark_model(
        name: str,
        config: Optional[BenchmarkConfig] = None,
        model_kwargs: Optional[Dict[str, Any]] = None,
        floor: str = '',
) -> Dict[str, Any]:
    """Measures one model: parameters, FLOPs, activations, inference latency, throughput and peak memory, and the time
    and activation memory of a training step.

    The model is created without weights (``timm.create_model(name, pretrained=False, **model_kwargs)``). Training is
    timed after inference when both are asked for, in the same process; ``tools/benchmark.py`` runs each in a fresh
    process instead.

    Args:
        name: A timm model name (lsvision registers its models with timm).
        config: What to measure and how; the defaults of :class:`BenchmarkConfig` if None.
        model_kwargs: Extra keyword arguments for ``timm.create_model``.

    Returns:
        A JSON-serializable row: ``model``, ``input_size``, ``batch_size``, ``params``, ``gflops`` (multiply-adds per
        image), ``mactivations`` (millions of activations per image), ``latency_ms`` (median time of a pass) with
        ``latency_p10_ms``, ``latency_p90_ms`` and ``latency_std_ms``, ``ms_per_image``, ``images_per_s``,
        ``peak_mib``, ``train_step_ms`` (median) with ``train_step_p10_ms`` and ``train_step_p90_ms``,
        ``train_images_per_s`` and ``train_memory_mib`` (the activation memory of training, see
        :func:`lsvision.measure.time_train_step`), the settings, and the raw ``timing`` / ``train_timing``; None where
        not measured.
    """
    config = config or BenchmarkConfig()
    model = create_benchmark_model(name, config.device, model_kwargs, floor)
    input_size = input_size_of(model, config.img_size)
    row: Dict[str, Any] = {
        'model': name,
        'input_size': list(input_size),
        'batch_size': config.batch_size,
        'device': config.device,
        'amp': config.amp,
        'channels_last': config.channels_last,
        'compile': config.compile,
        'params': parameter_count(model),
        'gflops': None,
        'mactivations': None,
        'unsupported_ops': {},
        'latency_ms': None, 'latency_p10_ms': None, 'latency_p90_ms': None, 'latency_std_ms': None,
        'ms_per_image': None, 'images_per_s': None, 'timed_passes': None, 'peak_mib': None, 'timing': None,
        'train_step_ms': None, 'train_step_p10_ms': None, 'train_step_p90_ms': None, 'train_images_per_s': None,
        'train_memory_mib': None, 'train_timing': None,
    }
    if config.flops:
        flops = count_flops(model, input_size, warn_unsupported=False)
        row['gflops'] = flops.gflops
        row['unsupported_ops'] = flops.unsupported
        row['mactivations'] = count_activations(model, input_size) / 1e6
    amp_dtype = AMP_DTYPES.get(config.amp) if config.amp else None
    runner = compiled(model, config.compile)
    timing_args = dict(batch_size=config.batch_size, warmup=config.warmup, iters=config.iters,
                       max_time_s=config.max_time_s, amp_dtype=amp_dtype, channels_last=config.channels_last,
                       measure_memory=config.memory)
    if config.bench in ('inference', 'both'):
        timing = time_forward(runner, input_size, **timing_args)
        row.update(
            latency_ms=timing.median_s * 1e3,
            latency_p10_ms=timing.p10_s * 1e3,
            latency_p90_ms=timing.p90_s * 1e3,
            latency_std_ms=timing.std_s * 1e3,
            ms_per_image=timing.per_image_s * 1e3,
            images_per_s=timing.images_per_s,
            timed_passes=timing.iters,
            peak_mib=None if timing.peak_bytes is None else timing.peak_bytes / MIB,
            timing=timing.to_dict(),
        )
    if config.bench in ('train', 'both'):
        train = time_train_step(runner, input_size, **timing_args)
        row.update(
            train_step_ms=train.median_s * 1e3,
            train_step_p10_ms=train.p10_s * 1e3,
            train_step_p90_ms=train.p90_s * 1e3,
            train_images_per_s=train.images_per_s,
            train_memory_mib=None if train.peak_bytes is None else train.peak_bytes / MIB,
            train_timing=train.to_dict(),
        )
    del model, runner
    gc.collect()
    return row


def _ratio(v: float) -> str:
    return f'{v:.2f}x'


_TABLE_COLUMNS: List[Tuple[str, str, Optional[Callable[[Any], str]]]] = [
    ('model', 'model', str),
    ('input', 'input_size', lambda v: f'{v[1]}x{v[2]}'),
    ('batch', 'batch_size', str),
    ('params (M)', 'params', lambda v: f'{v / 1e6:.2f}'),
    ('GFLOPs/img', 'gflops', lambda v: f'{v:.3f}'),
    ('MActs/img', 'mactivations', lambda v: f'{v:.1f}'),
    ('latency ms (p10-p90)', 'latency_ms', None),  # filled in by benchmark_table
    ('img/s', 'images_per_s', lambda v: f'{v:.1f}'),
    ('reparam ms (p10-p90)', 'reparam_latency_ms', None),
    ('reparam / plain', 'reparam_ratio', lambda v: f'{v:.3f}'),
    ('peak MiB', 'peak_mib', lambda v: f'{v:.0f}'),
    ('latency / baseline', 'latency_ratio', _ratio),
    ('peak / baseline', 'peak_ratio', _ratio),
    ('train step ms (p10-p90)', 'train_step_ms', None),
    ('train img/s', 'train_images_per_s', lambda v: f'{v:.1f}'),
    ('train act. MiB', 'train_memory_mib', lambda v: f'{v:.0f}'),
    ('train time / baseline', 'train_step_ratio', _ratio),
    ('train mem. / baseline', 'train_memory_ratio', _ratio),
    ('latency / baseline, paired', 'latency_ratio_paired', None),
    ('train time / baseline, paired', 'train_step_ratio_paired', None),
]
_SPREAD_KEYS = {'latency_ms': 'latency', 'reparam_latency_ms': 'reparam_latency', 'train_step_ms': 'train_step'}
_PAIRED_KEYS = ('latency_ratio_paired', 'train_step_ratio_paired')  # shown with the range of the rounds' ratios
_ALWAYS_SHOWN = 3  # model, input, batch


def benchmark_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Renders :func:`benchmark_model` rows as a markdown table ('-' where a number was not measured); a column that
    no row measured (e.g. training in an inference benchmark, or the ratios without a baseline) is left out."""
    columns = [c for i, c in enumerate(_TABLE_COLUMNS)
               if i < _ALWAYS_SHOWN or any(r.get(c[1]) is not None for r in rows)]
    table = []
    for r in rows:
        cells = []
        for _, key, fmt in columns:
            if key == 'model':  # a label such as 'vil_ls_medium (full attention)' says more than the timm name
                cells.append(str(r.get('label') or r['model']))
            elif r.get(key) is None:
                cells.append('-')
            elif key in _PAIRED_KEYS:
                rounds = r[key.replace('_paired', '_rounds')]
                cells.append(f'{r[key]:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})')
            elif key in _SPREAD_KEYS:
                p = _SPREAD_KEYS[key]
                cells.append(f"{r[key]:.1f} ({r[p + '_p10_ms']:.1f}-{r[p + '_p90_ms']:.1f})")
            else:
                cells.append(fmt(r[key]))
        table.append(cells)
    return markdown_table([c[0] for c in columns], table, left_columns=2)


def _csv_text(rows: Sequence[Dict[str, Any]]) -> str:
    """The scalar fields of the rows as CSV (nested fields such as raw timings stay in the JSON)."""
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if not isinstance(v, (dict, list)) or k == 'input_size'))
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator='\n')
    writer.writerow(keys)
    for r in rows:
        writer.writerow(['x'.join(map(str, r[k])) if isinstance(r.get(k), list) else r.get(k) for k in keys])
    return buf.getvalue()


REPORT_FORMATS = ('json', 'csv', 'md')
"""The formats of benchmark reports, by file suffix."""


def write_results_file(
        rows: Sequence[Dict[str, Any]],
        path: Path,
        settings: Dict[str, Any],
        device: str = 'cpu',
) -> Path:
    """Writes :func:`benchmark_model` rows to one file (atomically), in the format its suffix names.

    Args:
        rows: The measured rows.
        path: ``*.json`` (rows, settings and the machine), ``*.csv`` (the scalar fields of the rows) or ``*.md`` (the
            machine, the settings and :func:`benchmark_table`).
        settings: The settings to record beside the rows (JSON and markdown).
        device: The device measured on, for the machine description.

    Returns:
        The path written.

    Raises:
        ValueError: If the suffix is not one of :data:`REPORT_FORMATS`.
    """
    path = Path(path)
    fmt = path.suffix.lstrip('.').lower()
    if fmt not in REPORT_FORMATS:
        raise ValueError(f'{path}: a results file must end in .json, .csv or .md (the format it is written in).')
    machine = machine_description(device)
    if fmt == 'json':
        return write_json(path, {
            'machine': machine, 'machine_info': machine_info(device), 'settings': settings, 'rows': list(rows)})
    if fmt == 'csv':
        return _write_text(path, _csv_text(rows))
    return _write_text(path, f'## Benchmark\n\nMeasured on: {machine}\n\nSettings: '
                       + ', '.join(f'{k} {v}' for k, v in settings.items()) + '\n\n' + benchmark_table(rows) + '\n')


def write_benchmark_reports(
        rows: Sequence[Dict[str, Any]],
        out_dir: Path,
        settings: Dict[str, Any],
        device: str = 'cpu',
        formats: Sequence[str] = REPORT_FORMATS,
) -> Dict[str, Path]:
    """Writes :func:`benchmark_model` rows as ``results.json``, ``results.csv`` and ``results.md`` in ``out_dir``
    (:func:`write_results_file`).

    Args:
        rows: The measured rows.
        out_dir: Folder for the reports (created if needed).
        settings: The settings to record beside the rows (JSON and markdown).
        device: The device measured on, for the machine description.
        formats: Which of ``'json'``, ``'csv'`` and ``'md'`` to write.

    Returns:
        The written paths by format.
    """
    unknown = set(formats) - set(REPORT_FORMATS)
    if unknown:
        raise ValueError(f'unknown report formats {sorted(unknown)}; choose from json, csv, md.')
    return {fmt: write_results_file(rows, Path(out_dir) / f'results.{fmt}', settings, device) for fmt in formats}


# --------------------------------------------------------------------------------------------------------------------
# Resolution sweep


@dataclass
class SweepCurve:
    """One curve of a resolution sweep: a model (with optional constructor arguments) under a label."""

    label: str
    model: str
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    floor: str = ''  # NO_ATTENTION or PROJECTIONS_ONLY for a floor model (`create_benchmark_model`), '' for the model


def parse_curve(spec: str) -> SweepCurve:
    """Parses a curve spec: a model name, or a model name with ``@full`` for its full-attention counterpart or
    ``@noattn`` for the model with every block's attention a no-op (the floor), or ``@projonly`` for the model whose
    attention runs its projections only (the floor of the attention math, :func:`projections_only`).

    ``vil_ls_medium@full`` is ViL-LS-Medium with full attention (relative-position bias) in every stage instead of
    long-short attention in stages 1-2. CvT's full-attention counterpart is a model of its own (``cvt_13``).

    Args:
        spec: E.g. ``'cvt_ls_13'`` or ``'vil_ls_medium@full'``.

    Returns:
        The curve.

    Raises:
        ValueError: If the model is unknown or has no full-attention switch.
    """
    suffix = next((s for s in CURVE_SUFFIXES if spec.endswith(s)), '')
    name = spec[:len(spec) - len(suffix)]
    if not timm.is_model(name):
        raise ValueError(f'unknown model {name!r} in curve {spec!r}; lsvision models: {", ".join(list_models())}')
    if suffix in _FLOORS:
        return SweepCurve(f'{name} ({_FLOORS[suffix][0]})', name, floor=suffix)
    if not suffix:
        return SweepCurve(spec, name)
    for prefix, kwargs in _FULL_ATTENTION_KWARGS.items():
        if name.startswith(prefix):
            return SweepCurve(f'{name} (full attention)', name, dict(kwargs))
    raise ValueError(
        f'{spec!r}: only models starting with {", ".join(_FULL_ATTENTION_KWARGS)} have a full-attention switch; '
        'name a full-attention model directly instead (e.g. cvt_13 beside cvt_ls_13).')


@dataclass
class SweepBudget:
    """When a sweep curve stops: the first size whose point exceeds a limit is the curve's last.

    Attributes:
        time_per_image_s: Largest median time per image, in seconds; None for no limit.
        peak_mib: Largest peak memory of a forward pass, in MiB; None for no limit.
        clock: The time the limit applies to: ``'wall'`` (wall-clock) or ``'cpu'`` (CPU time of the measuring
            process, which other processes on a shared machine hardly disturb; with one thread it equals the
            wall-clock time of a quiet machine).
    """

    time_per_image_s: Optional[float] = None
    peak_mib: Optional[float] = None
    clock: str = 'wall'

    def __post_init__(self) -> None:
        if self.clock not in TIME_KEYS:
            raise ValueError(f'clock must be one of {sorted(TIME_KEYS)}, got {self.clock!r}.')

    def exceeded(self, point: Dict[str, Any]) -> List[str]:
        """Says which limits a measured point exceeds (empty if none)."""
        reasons = []
        seconds = point[TIME_KEYS[self.clock]]
        if self.time_per_image_s is not None and seconds is not None and seconds > self.time_per_image_s:
            reasons.append(f'{self.clock} time {seconds:.3g} s/img > {self.time_per_image_s:g} s')
        if self.peak_mib is not None and point['peak_mib'] is not None and point['peak_mib'] > self.peak_mib:
            reasons.append(f"memory {point['peak_mib']:.0f} MiB > {self.peak_mib:g} MiB")
        return reasons


@dataclass
class SweepConfig:
    """How each point of a sweep is measured.

    Attributes:
        device: Device to run on.
        threads: torch threads in each point's process; None for torch's default (all usable cores).
        warmup: Warm-up passes per point.
        iters: Timed passes per point (fewer once ``point_time_s`` is spent; at least one always runs).
        point_time_s: Seconds for warm-up plus timing of one point.
        timeout_s: A point still running after this many seconds is stopped and counts as over the budget.
        memory_limit_mib: On CPU, the address space a point's process may grow by after building its model (an
            allocation beyond it fails, and the point counts as over the budget), protecting the machine from a
            runaway point; None for no limit.
        flops: Count FLOPs at each point within the budget (one traced forward pass more).
        isolate: Run each point in a fresh process (``spawn``); False runs them in this process (no time-out, no
            memory limit; peak memory then also depends on earlier points).
    """

    device: str = 'cpu'
    threads: Optional[int] = None
    warmup: int = 1
    iters: int = 3
    point_time_s: float = 60.0
    timeout_s: float = 600.0
    memory_limit_mib: Optional[float] = None
    flops: bool = True
    isolate: bool = True


def _limit_address_space(extra_mib: float) -> bool:
    """Lets this process's address space grow by at most ``extra_mib`` from now on; returns whether it was set."""
    current_kb = _read_status_kb('VmSize')
    if current_kb is None:
        return False
    limit = current_kb * 1024 + int(extra_mib * MIB)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return True


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error is a failed allocation (CPU or CUDA), or says so (a message passed on from another process)."""
    text = str(error).lower()
    return isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError)) or 'out of memory' in text \
        or "can't allocate memory" in text


def _measure_point(job: Dict[str, Any]) -> Dict[str, Any]:
    """Measures one sweep point: time per image and peak memory of a forward pass, and FLOPs within the budget."""
    config = SweepConfig(**job['config'])
    if config.threads:
        torch.set_num_threads(config.threads)
    size = job['size']
    point: Dict[str, Any] = {
        'label': job['label'], 'model': job['model'], 'size': size, 'pixels': size * size, 'status': 'ok',
        'time_per_image_s': None, 'cpu_time_per_image_s': None, 'peak_mib': None, 'gflops': None, 'exceeded': [],
        'error': None,
    }
    model = create_benchmark_model(job['model'], config.device, job['model_kwargs'], job.get('floor', ''))
    if config.memory_limit_mib is not None and config.device == 'cpu':
        _limit_address_space(config.memory_limit_mib)
    input_size = (3, size, size)
    try:
        timing = time_forward(
            model, input_size, warmup=config.warmup, iters=config.iters, max_time_s=config.point_time_s,
            measure_memory=True)
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        point.update(status='out_of_memory', error=str(e).splitlines()[0][:300])
        point['exceeded'] = [f'allocation failed (memory limit {config.memory_limit_mib} MiB)']
        return point
    point.update(
        time_per_image_s=timing.per_image_s,
        cpu_time_per_image_s=timing.cpu_per_image_s,
        peak_mib=None if timing.peak_bytes is None else timing.peak_bytes / MIB,
        timing=timing.to_dict(),
    )
    point['exceeded'] = SweepBudget(**job['budget']).exceeded(point)
    if config.flops and not point['exceeded']:
        point['gflops'] = count_flops(model, input_size, warn_unsupported=False).gflops
    return point


def _run_point(job: Dict[str, Any], config: SweepConfig) -> Dict[str, Any]:
    """Measures one point, in a fresh process if ``config.isolate``; a time-out or a crash is a point over budget."""
    if not config.isolate:
        return _measure_point(job)
    kind, payload = run_in_fresh_process(_measure_point, job, config.timeout_s)
    if kind == 'ok':
        return payload
    if kind == 'error':
        raise RuntimeError(f"sweep point {job['label']} at {job['size']}: {payload}")
    failure = payload  # a time-out or a crash
    return {
        'label': job['label'], 'model': job['model'], 'size': job['size'], 'pixels': job['size'] ** 2,
        'status': kind, 'time_per_image_s': None, 'cpu_time_per_image_s': None, 'peak_mib': None, 'gflops': None,
        'exceeded': [failure],
        'error': failure,
    }


def resolution_sweep(
        curves: Sequence[SweepCurve],
        sizes: Sequence[int],
        budget: SweepBudget,
        config: Optional[SweepConfig] = None,
        fit_min: int = 0,
        progress: Optional[Callable[[str], None]] = None,
) -> Dict[str, Any]:
    """Measures time per image and peak memory against the input size, each curve until it exceeds the budget.

    For each curve the sizes run in increasing order (batch 1, square inputs). A point that exceeds the budget (or
    runs out of time or memory, see :class:`SweepConfig`) is kept, marked, and ends its curve: larger sizes are not
    run for that curve.

    Args:
        curves: The models to sweep.
        sizes: Square input sizes.
        budget: The limits that end a curve.
        config: How each point is measured; the defaults of :class:`SweepConfig` if None.
        fit_min: Smallest size used by the exponent fit (:func:`sweep_exponents`).
        progress: Called with a line of text after each point (e.g. ``print``).

    Returns:
        A JSON-serializable dict: ``machine``, ``machine_info``, ``budget``, ``config``, ``sizes``, ``curves`` (label,
        model, kwargs, ``stopped_at``: the size that exceeded the budget or None), ``points`` (one per measured
        size) and ``exponents``.
    """
    config = config or SweepConfig()
    if not curves:
        raise ValueError('resolution_sweep needs at least one curve.')
    sizes = sorted(set(sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f'sizes must be positive, got {sizes}.')
    threads_before = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)  # so that machine_info records the threads the points use
    try:
        start = time.perf_counter()
        points: List[Dict[str, Any]] = []
        curve_info = []
        for curve in curves:
            stopped_at = None
            for size in sizes:
                job = {'label': curve.label, 'model': curve.model, 'model_kwargs': curve.model_kwargs, 'size': size,
                       'floor': curve.floor,
                       'config': asdict(config), 'budget': asdict(budget)}
                t0 = time.perf_counter()
                point = _run_point(job, config)
                points.append(point)
                if progress is not None:
                    progress(_point_line(point, time.perf_counter() - t0))
                if point['exceeded']:
                    stopped_at = size
                    break
            curve_info.append({'label': curve.label, 'model': curve.model, 'model_kwargs': curve.model_kwargs,
                               'stopped_at': stopped_at})
        result = {
            'machine': machine_description(config.device),
            'machine_info': machine_info(config.device),
            'budget': asdict(budget),
            'config': asdict(config),
            'sizes': sizes,
            'fit_min': fit_min,
            'curves': curve_info,
            'points': points,
            'wall_time_s': time.perf_counter() - start,
        }
    finally:
        torch.set_num_threads(threads_before)
    result['exponents'] = sweep_exponents(result, fit_min)
    return result


def _point_line(point: Dict[str, Any], seconds: float) -> str:
    """One progress line for a sweep point."""
    size = f"{point['label']} {point['size']}x{point['size']}"
    if point['time_per_image_s'] is None:
        return f"  {size}: {point['status']} ({point['error']}); {seconds:.0f} s"
    mem = '' if point['peak_mib'] is None else f", peak {point['peak_mib']:.0f} MiB"
    over = f" -> over budget: {'; '.join(point['exceeded'])}" if point['exceeded'] else ''
    cpu = '' if point['cpu_time_per_image_s'] is None else f" (CPU {point['cpu_time_per_image_s'] * 1e3:.0f} ms)"
    return f"  {size}: {point['time_per_image_s'] * 1e3:.0f} ms/img{cpu}{mem}{over}; {seconds:.0f} s"


def sweep_exponents(result: Dict[str, Any], fit_min: int = 0) -> Dict[str, Dict[str, Any]]:
    """Fits the growth exponents of each sweep curve against the pixel count.

    Every measured point of size ``>= fit_min`` is used, including a point that exceeded the budget (it was
    measured all the same); points that timed out or ran out of memory have no numbers and are left out.

    Args:
        result: The output of :func:`resolution_sweep`.
        fit_min: Smallest size to fit (small inputs are dominated by per-layer overheads, not by attention).

    Returns:
        Per curve label: ``time`` (wall-clock), ``cpu_time``, ``memory`` and ``flops`` exponents (None where fewer
        than two points) and the ``sizes`` fitted.
    """
    exponents = {}
    for curve in result['curves']:
        pts = [p for p in result['points'] if p['label'] == curve['label'] and p['size'] >= fit_min
               and p['time_per_image_s'] is not None]

        def fit(key: str, pts: List[Dict[str, Any]] = pts) -> Optional[float]:
            usable = [p for p in pts if p[key] is not None and p[key] > 0]
            return fit_exponent([p['pixels'] for p in usable], [p[key] for p in usable]) if usable else None

        exponents[curve['label']] = {
            'time': fit('time_per_image_s'), 'cpu_time': fit('cpu_time_per_image_s'), 'memory': fit('peak_mib'),
            'flops': fit('gflops'), 'sizes': [p['size'] for p in pts],
        }
    return exponents


def _fmt(value: Optional[float], spec: str) -> str:
    """Formats a number, or '-' for None."""
    return '-' if value is None else format(value, spec)


def sweep_markdown(result: Dict[str, Any], command: Optional[str] = None) -> str:
    """Renders a sweep result as markdown: the settings, the points of each curve and the fitted exponents."""
    budget = result['budget']
    limits = [f'{budget["time_per_image_s"]:g} s of {budget["clock"]} time per image'
              if budget['time_per_image_s'] is not None else None,
              f'{budget["peak_mib"]:g} MiB peak memory' if budget['peak_mib'] is not None else None]
    cfg = result['config']
    lines = ['## Time and peak memory against input size', '']
    if command:
        lines += [f'Produced by `{command}`.', '']
    if result.get('refit_command'):
        lines += [f"Exponents fitted again from {result['fit_min']} by `{result['refit_command']}`.", '']
    where = 'each point in a fresh process' if cfg['isolate'] else 'all points in one process'
    lines += [
        f"Measured on: {result['machine']}.", '',
        f"Budget: {' and '.join(x for x in limits if x) or 'none'}; a curve ends at the first size over it. Batch 1, "
        f"{cfg['warmup']} warm-up and up to {cfg['iters']} timed passes within {cfg['point_time_s']:g} s per point "
        '(median time); peak memory is the extra memory of one forward pass (CPU: resident memory, CUDA: allocated); '
        f'{where}.', '',
    ]
    header = ['model', 'size', 'within budget', 'pixels', 'wall ms/img', 'CPU ms/img', 'peak MiB', 'GFLOPs']
    rows = []
    for p in result['points']:
        ms = [None if p[key] is None else p[key] * 1e3 for key in ('time_per_image_s', 'cpu_time_per_image_s')]
        within = 'no: ' + '; '.join(p['exceeded']) if p['exceeded'] else 'yes'
        rows.append([p['label'], f"{p['size']}x{p['size']}", within, f"{p['pixels']:,}", _fmt(ms[0], '.0f'),
                     _fmt(ms[1], '.0f'), _fmt(p['peak_mib'], '.0f'), _fmt(p['gflops'], '.2f')])
    lines += [markdown_table(header, rows, left_columns=3), '']
    lines += ['### Fitted exponent against pixel count (log-log slope; 1 = linear, 2 = quadratic)', '']
    exp_rows = [[label, ', '.join(map(str, e['sizes'])) or 'none', _fmt(e['time'], '.2f'), _fmt(e['cpu_time'], '.2f'),
                 _fmt(e['memory'], '.2f'), _fmt(e['flops'], '.2f')] for label, e in result['exponents'].items()]
    header = ['model', 'sizes fitted', 'wall time', 'CPU time', 'peak memory', 'FLOPs']
    lines += [markdown_table(header, exp_rows, left_columns=2), '']
    return '\n'.join(lines)


def plot_sweep(result: Dict[str, Any], path: Path, title: Optional[str] = None) -> Path:
    """Plots time per image and peak memory against the pixel count (log-log), one line per curve.

    Points over the budget are drawn hollow, the budget as a dashed line; the legend gives the fitted exponents.

    Args:
        result: The output of :func:`resolution_sweep`.
        path: The PNG to write (the folder is created).
        title: Figure title; a default names the curves.

    Returns:
        The path written.
    """
    import matplotlib  # optional dependency (the `bench` extra)
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    clock = result['budget']['clock']
    panels = [(TIME_KEYS[clock], f'{clock} time per image (s)', 'time' if clock == 'wall' else 'cpu_time',
               result['budget']['time_per_image_s']),
              ('peak_mib', 'peak memory of a forward pass (MiB)', 'memory', result['budget']['peak_mib'])]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    sizes = result['sizes']
    for ax, (key, ylabel, exp_key, limit) in zip(axes, panels):
        for i, curve in enumerate(result['curves']):
            color = f'C{i}'
            pts = [p for p in result['points'] if p['label'] == curve['label'] and p[key] is not None]
            ok = [p for p in pts if not p['exceeded']]
            over = [p for p in pts if p['exceeded']]
            exponent = result['exponents'][curve['label']][exp_key]
            label = curve['label'] + ('' if exponent is None else f' (exponent {exponent:.2f})')
            ax.plot([p['pixels'] for p in pts], [p[key] for p in pts], '-', color=color, alpha=0.6)
            ax.plot([p['pixels'] for p in ok], [p[key] for p in ok], 'o', color=color, label=label)
            if over:
                ax.plot([p['pixels'] for p in over], [p[key] for p in over], 'o', color=color, mfc='none', ms=10,
                        label=f"{curve['label']}: over budget at {over[0]['size']}")
            failed = [p for p in result['points'] if p['label'] == curve['label'] and p[key] is None and p['exceeded']]
            if failed and pts:  # no numbers (time-out, failed allocation): a cross above the curve's last point
                ax.plot([failed[0]['pixels']], [pts[-1][key] * 1.5], 'x', color=color, ms=10, mew=2,
                        label=f"{curve['label']}: {failed[0]['status'].replace('_', ' ')} at {failed[0]['size']}")
        if limit is not None:
            ax.axhline(limit, color='0.4', ls='--', lw=1, label=f'budget {limit:g}')
        first = next((p for p in result['points'] if p[key] is not None), None)
        if first is not None:  # guides through the first point: slope 1 (linear) and 2 (quadratic) in pixels
            xs = [first['pixels'], sizes[-1] ** 2]
            for slope, style in ((1, ':'), (2, '-.')):
                ax.plot(xs, [first[key] * (x / xs[0]) ** slope for x in xs], style, color='0.6', lw=1,
                        label=f'slope {slope} ({"linear" if slope == 1 else "quadratic"})')
        ax.set_xscale('log')
        ax.set_yscale('log')
        ax.set_xticks([s * s for s in sizes])
        ax.set_xticklabels([f'{s}²' for s in sizes], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel('input size (pixels, log scale)')
        ax.set_ylabel(ylabel + ', log scale')
        ax.grid(True, which='major', alpha=0.3)
        ax.legend(fontsize=8)
    cfg = result['config']
    fig.suptitle(title or ' vs '.join(c['label'] for c in result['curves']) + ', batch 1')
    fig.text(0.5, 0.01, f"{result['machine']}; device {cfg['device']}", ha='center', fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + '.tmp.png')
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
