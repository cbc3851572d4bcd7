"""Benchmarks lsvision (or any timm) models: inference and training, named comparison suites, resolution sweeps and
the model cards. One tool, with the flag names of timm's ``benchmark.py``.

Models (``--models``: names, wildcards, or ``NAME@full`` for a ViL-LS model with full attention in every stage) are
measured at one or more (input size, batch) points. Every measurement runs in a fresh process, the models in
alternating order over ``--repeats`` (A B, then B A, ...), so that no model is slowed or sped up by running first or
by what ran before it in the process; the times of all repeats are pooled (median, p10-p90). ``--bench`` picks
inference (params, GFLOPs and activations per image, latency, throughput, peak memory of a forward pass), train
(the time of a training step: forward, backward, SGD step; and the training activation memory: on CPU the peak
resident memory minus the resident memory once the model, input and optimizer exist, on CUDA the
``max_memory_allocated`` delta) or both. ``--baseline MODEL`` adds the ratio of each model's time (per image) and
memory to that model's at the same point. A measurement that runs out of memory (CUDA, or a failed CPU allocation)
is retried at a smaller batch (``--no-retry`` to fail instead)::

    python tools/benchmark.py --bench both --models cvt_ls_13 cvt_13
    python tools/benchmark.py --bench train --models cvt_ls_13 --baseline cvt_13 --threads 2 \\
        --img-size 224 384 768 1024 --batch-size 8 2 1 1          # or: --points 224x8 384x2 768x1 1024x1
    python tools/benchmark.py --models 'pvt_v2_*_grc' --device cuda --batch-size 64 --amp --amp-dtype bfloat16 \\
        --channels-last --torchcompile --results-file output/bench.csv
    python tools/benchmark.py --models cvt_ls_13 --reparam      # plain and reparameterized, in alternating rounds

``--suite NAME`` runs a named comparison and writes NAME.{json,csv,md,png} (``--out``, default docs/benchmarks/):

    cvt_ls     cvt_ls_13 vs cvt_13 (baseline): inference and training against input size, table and plot
    vil_ls     vil_ls_medium_384 vs the same model with full attention in every stage (baseline), inference and training
    grc        each GRC model vs its timm base (baseline), inference; the slowdown against the 1.25x target
    sequence   1D long-short attention layers and models vs F.scaled_dot_product_attention, fwd+bwd, 1k-64k tokens
    hsw        HSW, HSW-LS and the flat full-attention encoder at 4k-64k tokens, inference

Sub-commands::

    python tools/benchmark.py sweep     # time and peak memory against input size until a budget, docs/benchmarks/
    python tools/benchmark.py cards     # measure every registered model; model_cards/ and the README models table

``python tools/benchmark.py run ...`` (the earlier spelling) is the same as without ``run``; its ``--train`` means
``--bench both``. Progress goes to stderr, tables to stdout.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tool's helper modules beside it  # noqa: E402
import _bench_cpu  # noqa: E402
import _bench_suites  # noqa: E402

from lsvision.benchmark import (  # noqa: E402
    AMP_DTYPES,
    BENCH_KINDS,
    CURVE_SUFFIXES,
    BenchmarkConfig,
    SweepBudget,
    SweepConfig,
    benchmark_table,
    parse_curve,
    plot_sweep,
    resolution_sweep,
    resolve_model_names,
    sweep_exponents,
    sweep_markdown,
    write_benchmark_reports,
    write_json,
    write_results_file,
)
from lsvision.measure import TimingResult, machine_description  # noqa: E402
from lsvision.models import list_models  # noqa: E402
from lsvision.zoo import GENERATED_NOTE, measure_model, render_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SWEEP_DIR = ROOT / 'docs' / 'benchmarks'
MEASUREMENTS = 'measurements.json'
SUBCOMMANDS = ('sweep', 'cards')
SUITES = ('cvt_ls', 'vil_ls', 'grc', 'sequence', 'hsw')
Point = Tuple[Optional[int], int]  # (square input size or None for each model's own, batch size)


def log(msg: str) -> None:
    """Prints a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def parse_point(text: str) -> Point:
    """Parses ``SIZExBATCH`` (e.g. ``384x2``) for ``--points``."""
    try:
        size, batch = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is not SIZExBATCH, e.g. 384x2') from None
    if size < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f'{text!r}: size and batch must be positive')
    return size, batch


def resolve_points(img_sizes: Optional[Sequence[int]], batch_sizes: Optional[Sequence[int]],
                   points: Optional[Sequence[Point]]) -> List[Point]:
    """The (size, batch) points: ``--points``, or ``--img-size`` and ``--batch-size`` paired in order (one value of
    either goes with every value of the other).

    Raises:
        ValueError: If ``--points`` comes with ``--img-size``/``--batch-size``, or the lists cannot be paired.
    """
    if points:
        if img_sizes or batch_sizes:
            raise ValueError('give either --points or --img-size/--batch-size, not both')
        return list(dict.fromkeys(points))
    sizes: List[Optional[int]] = list(img_sizes) if img_sizes else [None]
    batches = list(batch_sizes) if batch_sizes else [1]
    if any(s is not None and s < 1 for s in sizes) or any(b < 1 for b in batches):
        raise ValueError('--img-size and --batch-size must be positive')
    if len(sizes) == 1:
        sizes = sizes * len(batches)
    elif len(batches) == 1:
        batches = batches * len(sizes)
    if len(sizes) != len(batches):
        raise ValueError(f'--img-size has {len(sizes)} values and --batch-size {len(batches)}: give as many batch '
                         'sizes as input sizes (paired in order), or one of either')
    return list(dict.fromkeys(zip(sizes, batches)))


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The options of the model benchmark and the suites (timm's ``benchmark.py`` names where it has them)."""
    parser.add_argument('--bench', choices=BENCH_KINDS, default=None,
                        help='what to time: inference, train (forward, backward, SGD step) or both '
                             "(default: inference, or the suite's)")
    parser.add_argument('--models', '--model', '-m', nargs='+', default=None,
                        help="model names or wildcards, e.g. 'cvt_ls_*', NAME@full (ViL-LS with full attention) or "
                             "NAME@noattn (every block's attention a no-op: the floor) or NAME@projonly (the "
                             "attention runs its projections only: the floor of the attention math)")
    parser.add_argument('--baseline', default=None,
                        help="report each model's time and memory relative to this model (added to --models if "
                             'missing)')
    parser.add_argument('--img-size', nargs='+', type=int, default=None,
                        help="square input sizes (default: each model's own)")
    parser.add_argument('--batch-size', '-b', nargs='+', type=int, default=None,
                        help='batch sizes, paired in order with --img-size (or one for all; default: 1)')
    parser.add_argument('--points', nargs='+', type=parse_point, default=None, metavar='SIZExBATCH',
                        help='(size, batch) points, e.g. 384x2 768x1, instead of --img-size/--batch-size')
    parser.add_argument('--repeats', type=int, default=2,
                        help='fresh processes per model and point, in alternating order (default: 2: A B, B A)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                        help='device to run on (default: cuda when there is one, else cpu)')
    parser.add_argument('--threads', type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument('--amp', action='store_true', help='run under torch.autocast (see --amp-dtype)')
    parser.add_argument('--amp-dtype', default='float16', choices=sorted(AMP_DTYPES),
                        help='autocast dtype with --amp (default: float16)')
    parser.add_argument('--channels-last', action='store_true', help='channels-last memory format')
    parser.add_argument('--torchcompile', nargs='?', const='default', default=None, metavar='MODE',
                        help="time torch.compile(model, mode=MODE) (MODE default: torch's default)")
    parser.add_argument('--reparam', action='store_true',
                        help='also time the model folded for inference (timm.models.reparameterize_model), in the '
                             'same alternating rounds as the plain one; prints both times and their ratio')
    parser.add_argument('--num-warm-iter', '--warmup', dest='warmup', type=int, default=3,
                        help='warm-up passes or steps per measurement (default: 3)')
    parser.add_argument('--num-bench-iter', '--iters', dest='iters', type=int, default=10,
                        help='timed passes or steps per measurement, fewer if over --budget-s (default: 10)')
    parser.add_argument('--budget-s', type=float, default=60.0,
                        help='seconds for warm-up plus timing of one measurement; one warm-up and one timed pass '
                             'always run (default: 60)')
    parser.add_argument('--timeout', type=float, default=1800.0,
                        help="seconds before a measurement's process is stopped (default: 1800)")
    parser.add_argument('--no-retry', action='store_true', help='fail on out-of-memory instead of a smaller batch')
    parser.add_argument('--no-flops', action='store_true', help='skip FLOP and activation counting')
    parser.add_argument('--no-memory', action='store_true', help='skip memory measurements')
    parser.add_argument('--results-file', type=Path, default=None,
                        help='write the rows to this file: .csv, .json or .md by its suffix')
    parser.add_argument('--out', type=Path, default=None,
                        help='folder for results.{json,csv,md} (suites: NAME.{json,csv,md,png}; default '
                             f'{os.path.relpath(SWEEP_DIR, ROOT)}/)')
    parser.add_argument('--suite', choices=SUITES, default=None,
                        help='run a named comparison (see above); --models/--img-size/... override its defaults')
    parser.add_argument('--train', action='store_true', help=argparse.SUPPRESS)  # `run --train`: --bench both
    suite = parser.add_argument_group('sequence and hsw suites')
    suite.add_argument('--lengths', nargs='+', type=int, default=None, help='tokens per sequence')
    suite.add_argument('--only', choices=['layer', 'model'], default=None, help='sequence: only layers or models')
    suite.add_argument('--names', nargs='+', default=None,
                       help='sequence: only these configurations (e.g. sdpa_full); hsw: of HSW, HSW-LS, flat')
    suite.add_argument('--flat-full-max', type=int, default=16384,
                       help='hsw: longest length at which the flat encoder runs all 8 blocks (above: 1 block x 8)')
    suite.add_argument('--allocator', choices=['glibc', 'reuse'], default='glibc',
                       help="sequence: glibc's malloc defaults, or 'reuse' (restarts the tool with settings under "
                            'which freed memory is reused, as a caching allocator does)')


def bench_config(args: argparse.Namespace, size: Optional[int], batch: int, bench: str) -> BenchmarkConfig:
    """The :class:`BenchmarkConfig` of one measurement from the command line."""
    return BenchmarkConfig(
        img_size=size, batch_size=batch, device=args.device, amp=args.amp_dtype if args.amp else None,
        channels_last=args.channels_last, compile=args.torchcompile, warmup=args.warmup, iters=args.iters,
        max_time_s=args.budget_s, flops=not args.no_flops, memory=not args.no_memory, bench=bench)


def _pooled(runs: Sequence[Dict[str, Any]], key: str) -> TimingResult:
    """The timed passes of all runs of a measurement as one :class:`TimingResult`."""
    timings = [r[key] for r in runs]
    return TimingResult(
        times_s=[t for tm in timings for t in tm['times_s']], batch_size=timings[0]['batch_size'],
        warmup=timings[0]['warmup'], device=timings[0]['device'],
        cpu_times_s=[t for tm in timings for t in tm['cpu_times_s']])


def _median_or_none(values: Sequence[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def combine_runs(by_kind: Dict[str, List[Dict[str, Any]]]) -> Dict[str, Any]:
    """One row from the runs (fresh processes) of one model at one point: timed passes pooled over the runs, memory
    the median over the runs, FLOPs from the run that counted them; ``pids`` lists the process of each run."""
    first = next(iter(by_kind.values()))[0]
    row = dict(first)
    for runs in by_kind.values():
        for key in ('gflops', 'mactivations', 'reparam_gflops'):
            row[key] = next((r[key] for r in runs if r.get(key) is not None), row.get(key))
    row['pids'] = {kind: [r['pid'] for r in runs] for kind, runs in by_kind.items()}
    row['repeats'] = max(len(runs) for runs in by_kind.values())
    row.pop('pid', None)
    if 'inference' in by_kind:
        runs = by_kind['inference']
        t = _pooled(runs, 'timing')
        row.update(
            latency_ms=t.median_s * 1e3, latency_p10_ms=t.p10_s * 1e3, latency_p90_ms=t.p90_s * 1e3,
            latency_std_ms=t.std_s * 1e3, ms_per_image=t.per_image_s * 1e3, images_per_s=t.images_per_s,
            timed_passes=t.iters, peak_mib=_median_or_none([r['peak_mib'] for r in runs]), timing=t.to_dict(),
            batch_size=t.batch_size, latency_runs_ms=_run_medians_ms(runs, 'timing'))
        if runs[0].get('reparam_ratio') is not None:
            f = _pooled(runs, 'reparam_timing')
            row.update(
                reparam_latency_ms=f.median_s * 1e3, reparam_latency_p10_ms=f.p10_s * 1e3,
                reparam_latency_p90_ms=f.p90_s * 1e3, reparam_images_per_s=f.images_per_s, reparam_timing=f.to_dict(),
                reparam_ratio=statistics.median(r['reparam_ratio'] for r in runs))
    if 'train' in by_kind:
        runs = by_kind['train']
        t = _pooled(runs, 'train_timing')
        row.update(
            train_step_ms=t.median_s * 1e3, train_step_p10_ms=t.p10_s * 1e3, train_step_p90_ms=t.p90_s * 1e3,
            train_images_per_s=t.images_per_s, train_memory_mib=_median_or_none([r['train_memory_mib'] for r in runs]),
            train_timing=t.to_dict(), train_batch_size=t.batch_size,
            train_step_runs_ms=_run_medians_ms(runs, 'train_timing'))
    return row


def _run_medians_ms(runs: Sequence[Dict[str, Any]], key: str) -> List[float]:
    """The median time of each run (fresh process) of a measurement, in ms, in the order of the rounds."""
    return [statistics.median(r[key]['times_s']) * 1e3 for r in runs]


_RATIOS = [  # (ratio field, measured field, its batch field, per image)
    ('latency_ratio', 'latency_ms', 'batch_size', True),
    ('peak_ratio', 'peak_mib', 'batch_size', False),
    ('train_step_ratio', 'train_step_ms', 'train_batch_size', True),
    ('train_memory_ratio', 'train_memory_mib', 'train_batch_size', False),
]

_PAIRED_RATIOS = [  # (ratio field, per-run medians field, its batch field): time per image, round by round
    ('latency_ratio', 'latency_runs_ms', 'batch_size'),
    ('train_step_ratio', 'train_step_runs_ms', 'train_batch_size'),
]


def _per_image_ratio(value: float, batch: int, base_value: float, base_batch: int) -> float:
    """A time's ratio to the baseline's per image, so that a batch retried smaller still compares."""
    return (value / batch) / (base_value / base_batch)


# What the ratio columns are, after "Ratios to <baseline>" in the printout and in a suite's markdown
_RATIOS_EXPLAINED = ("at the same input size: time per image, memory at the same batch size; paired: the median (and "
                     "range) over the rounds of each round's ratio, its two processes run in one pass over the models, "
                     "so that the machine's drift between rounds cancels out.")


def add_ratios(rows: List[Dict[str, Any]], baseline: str) -> None:
    """Adds each row's ratios to the baseline's row at the same point: time per image (so that a batch retried
    smaller still compares), memory only where both ran at the same batch size."""
    for row in rows:
        base = next((r for r in rows if r['spec'] == baseline and r['point'] == row['point']), None)
        row['baseline'] = baseline
        for ratio, key, batch_key, per_image in _RATIOS:
            value = None
            if base is not None and row.get(key) is not None and base.get(key):
                if per_image:
                    value = _per_image_ratio(row[key], row[batch_key], base[key], base[batch_key])
                elif row[batch_key] == base[batch_key]:
                    value = row[key] / base[key]
            row[ratio] = value
        for ratio, key, batch_key in _PAIRED_RATIOS:
            rounds = _round_ratios(row, base, key, batch_key)
            row[ratio + '_rounds'] = rounds
            row[ratio + '_paired'] = statistics.median(rounds) if rounds else None


def _round_ratios(row: Dict[str, Any], base: Optional[Dict[str, Any]], key: str, batch_key: str) -> List[float]:
    """Each round's ratio of a row's time per image to the baseline's, from the two processes of that round (run
    within one pass over the models, so that a drift of the machine's speed between rounds cancels out); empty with
    fewer than 2 rounds or without the baseline."""
    if base is None or not row.get(key) or not base.get(key) or len(row[key]) != len(base[key]) or len(row[key]) < 2:
        return []
    return [_per_image_ratio(a, row[batch_key], b, base[batch_key]) for a, b in zip(row[key], base[key])]


def benchmark_models(specs: Sequence[str], points: Sequence[Point], args: argparse.Namespace,
                     baseline: Optional[str] = None,
                     references: Optional[Dict[str, Sequence[int]]] = None) -> List[Dict[str, Any]]:
    """Measures models (``NAME`` or ``NAME@full``) at each point, each measurement in a fresh process and the models
    in alternating order (``args.repeats`` runs each); returns one row per model and point, with ratios to
    ``baseline`` if given. ``references`` maps further models to the only input sizes they run at (e.g. a timm model
    built for 224), where they join the alternation."""
    kinds = ['inference', 'train'] if args.bench == 'both' else [args.bench]
    rows = []
    all_specs = specs
    for size, batch in points:
        specs = list(all_specs) + [name for name, sizes in (references or {}).items() if size in sizes]
        curves = [parse_curve(spec) for spec in specs]
        where = f'{size}x{size}' if size else "each model's own size"
        log(f"Point {where}, batch {batch}: {', '.join(c.label for c in curves)}")
        results: Dict[str, List[List[Dict[str, Any]]]] = {}
        for kind in kinds:
            config = bench_config(args, size, batch, kind)
            config.flops = config.flops and kind == kinds[0]  # counted once per model and point
            jobs = [dict(model=c.model, label=c.label, model_kwargs=c.model_kwargs, floor=c.floor, batch_size=batch,
                         threads=args.threads, reparam=args.reparam, config=asdict(config))
                    for c in curves]
            results[kind] = _bench_cpu.run_alternating(
                _bench_cpu.measure_job, jobs, args.repeats, args.timeout, retry=not args.no_retry, log=log)
        for i, (spec, curve) in enumerate(zip(specs, curves)):
            row = combine_runs({kind: results[kind][i] for kind in kinds})
            row.update(spec=spec, label=curve.label, point=[size, batch])
            rows.append(row)
            log('  ' + row_summary(row))
    if baseline is not None:
        add_ratios(rows, baseline)
    return rows


def row_summary(row: Dict[str, Any]) -> str:
    """One progress line for a row."""
    parts = [f"{row['label']} {row['input_size'][1]}x{row['input_size'][2]} b{row['batch_size']}:"]
    if row.get('latency_ms') is not None:
        parts.append(f"{row['latency_ms']:.1f} ms/pass, {row['images_per_s']:.1f} img/s")
    if row.get('reparam_ratio') is not None:
        parts.append(f"reparameterized {row['reparam_latency_ms']:.1f} ms/pass ({row['reparam_ratio']:.3f}x plain)")
    if row.get('train_step_ms') is not None:
        mem = row.get('train_memory_mib')
        parts.append(f"train step {row['train_step_ms']:.1f} ms" + ('' if mem is None else f', {mem:.0f} MiB act.'))
    return ' '.join(parts[:1]) + ' ' + '; '.join(parts[1:])


def model_specs(patterns: Sequence[str], baseline: Optional[str]) -> List[str]:
    """Model names from names and wildcards (``NAME@full``, ``NAME@noattn`` and ``NAME@projonly`` kept as is), with the
    baseline added if missing."""
    specs: List[str] = []
    for pattern in patterns:
        specs += [pattern] if pattern.endswith(CURVE_SUFFIXES) else resolve_model_names([pattern])
    if baseline is not None and baseline not in specs:
        specs.append(baseline)
    return list(dict.fromkeys(specs))


def settings_of(args: argparse.Namespace) -> Dict[str, Any]:
    """The command-line settings, JSON-ready."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != 'command'}


def write_rows(rows: List[Dict[str, Any]], args: argparse.Namespace) -> None:
    """Writes the rows where the command line asks (``--results-file``, ``--out``)."""
    settings = settings_of(args)
    paths = []
    if args.results_file is not None:
        paths.append(write_results_file(rows, args.results_file, settings, device=args.device))
    if args.out is not None:
        paths += write_benchmark_reports(rows, args.out, settings, device=args.device).values()
    if paths:
        log('Wrote ' + ', '.join(str(p) for p in paths))


def run_models(args: argparse.Namespace) -> int:
    """The model benchmark (no sub-command)."""
    try:
        if not args.models:
            raise ValueError('name the models to benchmark: --models NAME [NAME ...] (or a --suite)')
        points = resolve_points(args.img_size, args.batch_size, args.points)
        specs = model_specs(args.models, args.baseline)
        if args.results_file is not None and args.results_file.suffix.lower() not in ('.csv', '.json', '.md'):
            raise ValueError(f'--results-file {args.results_file}: the suffix must be .csv, .json or .md')
    except ValueError as e:
        log(str(e))
        return 2
    log(f'Machine: {machine_description(args.device)}')
    rows = benchmark_models(specs, points, args, args.baseline)
    write_rows(rows, args)
    print(benchmark_table(rows))
    if args.baseline is not None:
        print(f'\nRatios to {args.baseline} {_RATIOS_EXPLAINED}')
    return 0


GRC_SUFFIX = '_grc'
GRC_TARGET = 1.25
VISION_SUITES: Dict[str, Dict[str, Any]] = {
    'cvt_ls': dict(
        title='CvT-LS (long-short attention) vs CvT (full attention) against input size',
        models=['cvt_ls_13', 'cvt_13'], baseline='cvt_13', bench='both',
        points=[(224, 8), (384, 2), (512, 1), (768, 1), (1024, 1)],
        # issue 18's target at 224 b8: cvt_ls_13's step within 1.15x of Swin-T's
        references={'swin_tiny_patch4_window7_224': [224]}),
    'vil_ls': dict(
        title='ViL-LS vs the same model with full attention in every stage',
        models=['vil_ls_medium_384', 'vil_ls_medium_384@full'], baseline='vil_ls_medium_384@full', bench='both',
        points=[(384, 1)]),
    'grc': dict(
        title=f"GRC models vs their timm base models (target: at most {GRC_TARGET:g}x the base's time)",
        models=['pvt_v2_b2_grc', 'swin_tiny_patch4_window7_224_grc', 'deit_small_patch16_224_grc'], baseline=None,
        bench='inference', points=[(None, 1), (None, 8)]),
}


def grc_pairs(patterns: Sequence[str]) -> List[Tuple[str, str]]:
    """(base, GRC model) pairs from GRC model names or wildcards, in the order given, without repeats.

    Raises:
        ValueError: If a pattern matches no GRC model.
    """
    grc_models = list_models('*' + GRC_SUFFIX)
    names: List[str] = []
    for pattern in patterns:
        matches = [n for n in list_models(pattern) if n in grc_models]
        if not matches:
            raise ValueError(f'{pattern!r} matches no GRC model; GRC models: {", ".join(grc_models)}')
        names += matches
    return [(name[:-len(GRC_SUFFIX)], name) for name in dict.fromkeys(names)]


def plot_rows(rows: Sequence[Dict[str, Any]], path: Path, title: str) -> Path:
    """Plots time per image and memory against the input size (log-log), inference and training, one line per
    model; writes the PNG atomically."""
    import matplotlib  # optional dependency (the `bench` extra)
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    panels = [(('ms_per_image', 'inference'), ('train_ms_per_image', 'train step')),
              (('peak_mib', 'inference peak'), ('train_memory_mib', 'train activations'))]
    for i, label in enumerate(dict.fromkeys(r['label'] for r in rows)):
        pts = sorted((r for r in rows if r['label'] == label), key=lambda r: r['input_size'][1])
        for ax, series in zip(axes, panels):
            for (key, what), style, marker in zip(series, ('-', '--'), ('o', 's')):
                xy = [(r['input_size'][1], r.get(key)) for r in pts if r.get(key) is not None]
                if xy:
                    ax.plot([x for x, _ in xy], [y for _, y in xy], style, marker=marker, color=f'C{i}',
                            label=f'{label}, {what}')
    for ax, ylabel in zip(axes, ('time per image (ms)', 'memory (MiB)')):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        sizes = sorted({r['input_size'][1] for r in rows})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(s) for s in sizes])
        ax.minorticks_off()
        ax.set_xlabel('input size (pixels per side, log scale)')
        ax.set_ylabel(ylabel + ', log scale')
        ax.grid(True, which='major', alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + '.tmp.png')
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def run_vision_suite(name: str, args: argparse.Namespace, command: str) -> int:
    """``--suite cvt_ls``, ``vil_ls`` or ``grc``: the suite's models and points (the command line's where given),
    measured as the model benchmark does; writes NAME.{json,csv,md,png} into ``--out``."""
    suite = VISION_SUITES[name]
    args.bench = args.bench or suite['bench']
    try:
        points = resolve_points(args.img_size, args.batch_size, args.points) \
            if (args.img_size or args.batch_size or args.points) else suite['points']
        if name == 'grc':
            groups = [([base, grc], base) for base, grc in grc_pairs(args.models or suite['models'])]
        else:
            baseline = args.baseline or suite['baseline']
            groups = [(model_specs(args.models or suite['models'], baseline), baseline)]
        references = None if args.models else suite.get('references')
    except ValueError as e:
        log(str(e))
        return 2
    log(f'Machine: {machine_description(args.device)}')
    rows = [row for specs, baseline in groups for row in benchmark_models(specs, points, args, baseline, references)]
    for row in rows:
        if row.get('train_step_ms') is not None:
            row['train_ms_per_image'] = row['train_step_ms'] / row['train_batch_size']
    stem = (args.out or SWEEP_DIR) / name
    settings = {**settings_of(args), 'command': command}
    for suffix in ('.json', '.csv'):
        write_results_file(rows, stem.with_suffix(suffix), settings, device=args.device)
    baselines = sorted({b for _, b in groups if b})
    text = (f"## {suite['title']}\n\nProduced by `{command}`.\n\nMeasured on: {machine_description(args.device)}.\n\n"
            f"Each model and point in {args.repeats} fresh process{'es' if args.repeats > 1 else ''}, in alternating "
            'order; times are medians of the '
            'pooled timed passes, memory the median over the processes (inference: peak of one forward pass; '
            'training: peak resident (CPU) or allocated (CUDA) memory of the steps above the memory once the model, '
            f"input and optimizer exist). Ratios to the baseline ({', '.join(baselines) or 'none'}) "
            f'{_RATIOS_EXPLAINED}\n\n' + benchmark_table(rows) + '\n')
    stem.with_suffix('.md').write_text(text)
    plot_rows(rows, stem.with_suffix('.png'), suite['title'])
    print(text)
    log(f'Wrote {stem}.{{json,csv,md,png}}')
    return 0


def run_suite(args: argparse.Namespace, command: str, is_cli: bool) -> int:
    """``--suite NAME``."""
    if args.suite in VISION_SUITES:
        return run_vision_suite(args.suite, args, command)
    stem = (args.out or SWEEP_DIR) / args.suite
    stem.parent.mkdir(parents=True, exist_ok=True)
    run = _bench_suites.run_sequence if args.suite == 'sequence' else _bench_suites.run_hsw
    return run(args, stem, command, is_cli)


def add_sweep_args(sweep: argparse.ArgumentParser) -> None:
    """The options of the ``sweep`` sub-command."""
    sweep.add_argument('--models', nargs='+', default=['cvt_ls_13', 'cvt_13'],
                       help='curves: model names, or NAME@full for a ViL-LS model with full attention in every '
                            'stage (default: cvt_ls_13 cvt_13)')
    sweep.add_argument('--sizes', nargs='+', type=int, default=[224, 384, 512, 640, 768, 1024, 1280, 1536],
                       help='square input sizes (default: 224 to 1536)')
    sweep.add_argument('--time-budget', type=float, default=15.0,
                       help='largest median seconds per image; a curve ends at the first size over it (default: 15)')
    sweep.add_argument('--budget-clock', choices=['cpu', 'wall'], default='cpu',
                       help='the time the budget applies to: CPU time of the measuring process (steady on a shared '
                            'machine; with --threads 1 it equals the wall-clock time of a quiet machine) or '
                            'wall-clock time (default: cpu)')
    sweep.add_argument('--memory-budget', type=float, default=4096.0,
                       help='largest peak memory of a forward pass in MiB (default: 4096)')
    sweep.add_argument('--memory-limit', type=float, default=8192.0,
                       help='CPU: MiB a point may allocate at most, beyond which its allocation fails (protects the '
                            'machine; default: 8192; 0 for none)')
    sweep.add_argument('--timeout', type=float, default=600.0, help='seconds before a point is stopped (default: 600)')
    sweep.add_argument('--fit-min', type=int, default=512, help='smallest size of the exponent fit (default: 512)')
    sweep.add_argument('--no-flops', action='store_true', help='skip FLOP counting at each point')
    sweep.add_argument('--refit', type=Path, default=None, metavar='JSON',
                       help='measure nothing: fit the exponents of a stored sweep again (with --fit-min) and '
                            'rewrite its markdown and plot')
    sweep.add_argument('--name', default=None, help='file stem of the outputs (default: MODEL1_vs_MODEL2)')
    sweep.add_argument('--out', type=Path, default=SWEEP_DIR, help=f'output folder (default: {SWEEP_DIR})')
    add_timing_args(sweep, warmup=1, iters=3, budget=60.0)
    sweep.set_defaults(threads=1)  # one thread: steady timings on a shared machine, CPU time = work done


def add_cards_args(cards: argparse.ArgumentParser) -> None:
    """The options of the ``cards`` sub-command."""
    cards.add_argument('--models', nargs='+', default=None,
                       help='re-measure only these (names or wildcards); the others keep their stored numbers')
    cards.add_argument('--reuse', action='store_true', help='measure nothing; render from the stored numbers')
    cards.add_argument('--cards-dir', type=Path, default=ROOT / 'model_cards', help='folder of the cards')
    cards.add_argument('--readme', type=Path, default=ROOT / 'README.md', help='README whose models table to update')
    # 3 warm-up passes: with 1, the median of 3 timed passes still held first-call costs (oneDNN primitives):
    # cvt_ls_13 measured 183 ms a pass against 102 ms with 3
    add_timing_args(cards, warmup=3, iters=5, budget=20.0)


def add_timing_args(parser: argparse.ArgumentParser, warmup: int, iters: int, budget: float) -> None:
    """Adds the options the sub-commands share: device, threads, warm-up, timed passes and time per measurement."""
    parser.add_argument('--device', default='cpu', help='device to run on, e.g. cpu or cuda (default: cpu)')
    parser.add_argument('--threads', type=int, default=None,
                        help="torch threads (default: torch's own choice; sweep: 1)")
    parser.add_argument('--num-warm-iter', '--warmup', dest='warmup', type=int, default=warmup,
                        help=f'warm-up passes (default: {warmup})')
    parser.add_argument('--num-bench-iter', '--iters', dest='iters', type=int, default=iters,
                        help=f'timed passes, fewer if over --budget-s (default: {iters})')
    parser.add_argument('--budget-s', type=float, default=budget,
                        help=f'seconds for warm-up plus timing of one measurement; one warm-up and one timed pass '
                             f'always run (default: {budget:g})')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line: the model benchmark or a suite, or the ``sweep`` or ``cards`` sub-command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ['run']:  # the earlier spelling of the model benchmark
        argv = argv[1:]
    if argv[:1] and argv[0] in SUBCOMMANDS:
        parser = argparse.ArgumentParser(prog='benchmark.py', description=__doc__.split('\n\n')[0])
        sub = parser.add_subparsers(dest='command', required=True)
        sweep = sub.add_parser('sweep', help='time and peak memory against input size, until a budget is exceeded')
        cards = sub.add_parser('cards', help='measure every registered model; write model_cards/ and the README table')
        add_sweep_args(sweep)
        add_cards_args(cards)
    else:
        parser = argparse.ArgumentParser(prog='benchmark.py', description=__doc__.split('\n\n')[0],
                                         formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
        add_bench_args(parser)
        parser.set_defaults(command='bench')
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error('--threads must be at least 1')
    if args.command == 'bench':
        if args.train:
            args.bench = 'both'
        if args.suite is None:
            args.bench = args.bench or 'inference'
        if args.repeats < 1:
            parser.error('--repeats must be at least 1')
    return args


def command_line(argv: Optional[Sequence[str]]) -> str:
    """The command as typed, for reports."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(['python', 'tools/benchmark.py', *args])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the model benchmark, a suite, or a sub-command."""
    args = parse_args(argv)
    if args.command == 'sweep':
        return run_sweep(args, argv)
    if args.command == 'cards':
        return run_cards(args, argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the measuring processes' count, for the machine description
    if args.suite is not None:
        return run_suite(args, command_line(argv), is_cli=argv is None)
    return run_models(args)


def write_sweep(result: Dict[str, Any], out_dir: Path, stem: str) -> None:
    """Writes a sweep's JSON, markdown and plot, and prints the markdown."""
    text = sweep_markdown(result, command=result['command'])
    write_json(out_dir / f'{stem}.json', result)
    (out_dir / f'{stem}.md').write_text(text)
    plot_sweep(result, out_dir / f'{stem}.png')
    print(text)
    log(f'Wrote {out_dir / stem}.{{json,md,png}}')


def run_sweep(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """The ``sweep`` subcommand."""
    if args.refit is not None:
        result = json.loads(args.refit.read_text())
        result['fit_min'] = args.fit_min
        result['exponents'] = sweep_exponents(result, args.fit_min)
        result['refit_command'] = command_line(argv)
        write_sweep(result, args.refit.parent, args.refit.stem)
        return 0
    try:
        curves = [parse_curve(spec) for spec in args.models]
    except ValueError as e:
        log(str(e))
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = SweepBudget(time_per_image_s=args.time_budget, peak_mib=args.memory_budget, clock=args.budget_clock)
    config = SweepConfig(
        device=args.device, threads=args.threads, warmup=args.warmup, iters=args.iters, point_time_s=args.budget_s,
        timeout_s=args.timeout, memory_limit_mib=args.memory_limit or None, flops=not args.no_flops)
    log(f'Machine: {machine_description(args.device)}')
    log(f"Sweeping {', '.join(c.label for c in curves)} over {sorted(set(args.sizes))}")
    result = resolution_sweep(curves, args.sizes, budget, config, fit_min=args.fit_min, progress=log)
    result['command'] = command_line(argv)
    write_sweep(result, args.out, args.name or '_vs_'.join(spec.replace('@', '_') for spec in args.models))
    log(f"{result['wall_time_s']:.0f} s in all")
    return 0


def run_cards(args: argparse.Namespace, argv: Optional[Sequence[str]]) -> int:
    """The ``cards`` subcommand: measure (unless ``--reuse``), store, then render every card and the README table."""
    store = args.cards_dir / MEASUREMENTS
    stored = json.loads(store.read_text()) if store.exists() else {'models': {}}
    names = list_models()
    try:
        to_measure = [] if args.reuse else (resolve_model_names(args.models) if args.models else names)
    except ValueError as e:
        log(str(e))
        return 2
    unregistered = [n for n in to_measure if n not in names]
    if unregistered:
        log(f'not registered lsvision models (cards are for those only): {unregistered}')
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BenchmarkConfig(device=args.device, warmup=args.warmup, iters=args.iters, max_time_s=args.budget_s,
                             memory=False)
    if to_measure:
        log(f'Machine: {machine_description(args.device)}')
    for i, name in enumerate(to_measure, 1):
        t0 = time.perf_counter()
        stored['models'][name] = measure_model(name, config)
        stored['models'] = {n: stored['models'][n] for n in names if n in stored['models']}  # drop unregistered
        stored['command'] = command_line(argv)
        write_json(store, stored)  # after each model, so that an interrupted run keeps what it measured
        m = stored['models'][name]
        log(f"[{i}/{len(to_measure)}] {name}: {m['params'] / 1e6:.2f}M params, {m['gflops']:.3f} GFLOPs, "
            f"{m['images_per_s']:.2f} img/s; {time.perf_counter() - t0:.0f} s")
    try:
        outputs = render_outputs(stored['models'], names, args.readme.read_text(),
                                 cards_dir=os.path.relpath(args.cards_dir, args.readme.parent))
    except (KeyError, ValueError) as e:
        log(str(e))
        return 2
    for rel, text in outputs.items():
        path = args.readme if rel == 'README.md' else args.readme.parent / rel
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            log(f'Wrote {path}')
    for card in args.cards_dir.glob('*.md'):  # generated cards of models no longer registered
        if card.stem not in names and card.read_text().startswith(GENERATED_NOTE):
            card.unlink()
            log(f'Removed {card}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
