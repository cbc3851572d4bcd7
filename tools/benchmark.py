"""Benchmarks lsvision (or any timm) models: inference and training, named suites, resolution sweeps and the model
cards, with the flag names of timm's ``benchmark.py``; the measuring is ``lsvision.bench`` (docs/benchmarks/README.md).

Every measurement runs in a fresh process, the models in alternating order over ``--repeats``; ``--baseline MODEL``
adds ratios to it. Model specs: names, wildcards, ``NAME@full`` (ViL-LS with full attention everywhere), the floors
``NAME@noattn`` / ``NAME@projonly`` (attention a no-op / its projections only), ``NAME@reparam`` (folded)::

    python tools/benchmark.py --bench train --models cvt_ls_13 --baseline cvt_13 --points 224x8 384x2 768x1
    python tools/benchmark.py --models 'pvt_v2_*_grc' --device cuda --batch-size 64 --amp --amp-dtype bfloat16 \\
        --channels-last --torchcompile --results-file output/bench.csv

``--suite NAME`` writes NAME.{json,csv,md,png} (``--out``, default docs/benchmarks/); the sub-commands ``sweep`` (time
and memory against input size until a budget), ``cards`` (model_cards/ and the README table) and ``dense``
(backbone + detection FPN or segmentation head, ``detection`` its earlier name) have their own help. ``run ...`` is
the earlier spelling.
"""
import argparse
import functools
import json
import math
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import lsvision.sequence as seq
from lsvision import bench
from lsvision.detection import backbone_with_fpn, detector_input_size
from lsvision.flops import parameter_count
from lsvision.measure_cuda import add_count_ratios, count_row, count_step, counts_markdown
from lsvision.models import list_models
from lsvision.reports import machine_description, markdown_table, plot, write_json, write_reports, write_text
from lsvision.runs import source_commit, unknown_name_message
from lsvision.segmentation import semantic_fpn, upernet
from lsvision.sequence.suites import HSW_LS_TARGET, HSW_MODELS, HSW_TARGETS, MEM, SEQUENCE_CONFIGS, D
from lsvision.zoo import GENERATED_NOTE, render_outputs

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'docs' / 'benchmarks'
Point = Tuple[Optional[int], int]  # (square input size, or None for each model's own; batch size)
VISION_SUITES: Dict[str, Dict[str, Any]] = {
    'cvt_ls': dict(title='CvT-LS (long-short attention) vs CvT (full attention) against input size',
                   models=['cvt_ls_13', 'cvt_13'], baseline='cvt_13', bench='both',
                   points=[(224, 8), (384, 2), (512, 1), (768, 1), (1024, 1)],
                   references={'swin_tiny_patch4_window7_224': [224]}),  # issue 18: within 1.15x of Swin-T at 224
    'vil_ls': dict(title='ViL-LS vs the same model with full attention in every stage', bench='both',
                   models=['vil_ls_medium_384', 'vil_ls_medium_384@full'], baseline='vil_ls_medium_384@full',
                   points=[(384, 1)]),
    'grc': dict(title="GRC models vs their timm base models (target: at most 1.25x the base's time)",
                models=['pvt_v2_b2_grc', 'swin_tiny_patch4_window7_224_grc', 'deit_small_patch16_224_grc'],
                baseline=None, bench='inference', points=[(None, 1), (None, 8)]),
}
CARD_FIELDS = dict(params=None, gflops=3, mactivations=1, input_size=None, batch_size=None, images_per_s=2,
                   latency_ms=1, latency_p10_ms=1, latency_p90_ms=1, timed_passes=None)
"""The measured fields a card stores, and the digits each is rounded to."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_pair(text: str, form: str = 'SIZExBATCH', example: str = '384x2', minimum: int = 1) -> Tuple[int, int]:
    """``AxB`` (e.g. ``384x2``), both at least ``minimum``: ``--points``, and ``detection --sizes`` (``HxW``)."""
    try:
        a, b = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is not {form}, e.g. {example}') from None
    if min(a, b) < minimum:
        raise argparse.ArgumentTypeError(f'{text!r}: both numbers must be at least {minimum}')
    return a, b


def resolve_points(sizes: Optional[Sequence[int]], batches: Optional[Sequence[int]],
                   points: Optional[Sequence[Point]]) -> List[Point]:
    """``--points``, or ``--img-size`` and ``--batch-size`` paired in order (one value of either goes with all)."""
    if points:
        if sizes or batches:
            raise ValueError('give either --points or --img-size/--batch-size, not both')
        return list(dict.fromkeys(points))
    s: List[Optional[int]] = list(sizes) if sizes else [None]
    b = list(batches) if batches else [1]
    if any(x is not None and x < 1 for x in s) or any(x < 1 for x in b):
        raise ValueError('--img-size and --batch-size must be positive')
    s, b = (s * len(b), b) if len(s) == 1 else (s, b * len(s) if len(b) == 1 else b)
    if len(s) != len(b):
        raise ValueError(f'--img-size has {len(s)} values and --batch-size {len(b)}: give as many batch sizes as '
                         'input sizes (paired in order), or one of either')
    return list(dict.fromkeys(zip(s, b)))


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The options of the model benchmark and the suites (timm's ``benchmark.py`` names where it has them)."""
    parser.add_argument('--bench', choices=('inference', 'train', 'both'), default=None,
                        help="what to time (train: forward, backward, SGD step; default: inference, or the suite's)")
    parser.add_argument('--models', '--model', '-m', nargs='+', default=None, help='model specs or wildcards')
    parser.add_argument('--baseline', default=None, help="report each model's time and memory relative to this one")
    parser.add_argument('--img-size', nargs='+', type=int, default=None, help="square input sizes (default: model's)")
    parser.add_argument('--batch-size', '-b', nargs='+', type=int, default=None,
                        help='batch sizes, paired in order with --img-size (or one for all; default: 1)')
    parser.add_argument('--points', nargs='+', type=parse_pair, default=None, metavar='SIZExBATCH',
                        help='(size, batch) points, e.g. 384x2 768x1, instead of --img-size/--batch-size')
    parser.add_argument('--repeats', type=int, default=2, help='fresh processes per model and point (default: 2)')
    add_timing_args(parser, warmup=3, budget=10.0, threads=None, device='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--amp', action='store_true', help='run under torch.autocast (see --amp-dtype)')
    parser.add_argument('--amp-dtype', default='float16', choices=sorted(bench.AMP_DTYPES), help='autocast dtype')
    parser.add_argument('--channels-last', action='store_true', help='channels-last memory format')
    parser.add_argument('--torchcompile', nargs='?', const='default', default=None, metavar='MODE',
                        help='time torch.compile(model, mode=MODE)')
    parser.add_argument('--reparam', action='store_true', help='also measure NAME@reparam, with its ratio to NAME')
    parser.add_argument('--no-retry', action='store_true', help='fail on out-of-memory instead of a smaller batch')
    parser.add_argument('--no-flops', action='store_true', help='skip FLOP and activation counting')
    parser.add_argument('--no-memory', action='store_true', help='skip memory measurements')
    parser.add_argument('--results-file', type=Path, default=None, help='also write the rows to .csv, .json or .md')
    parser.add_argument('--out', type=Path, default=None, help='folder for results.* (suites: NAME.*, default '
                        'docs/benchmarks)')
    parser.add_argument('--suite', choices=[*VISION_SUITES, 'sequence', 'hsw'], default=None,
                        help='run a named comparison; --models/--img-size/... override its defaults')
    parser.add_argument('--lengths', nargs='+', type=int, default=None, help='sequence, hsw: tokens per sequence')
    parser.add_argument('--names', nargs='+', default=None,
                        help='sequence: only these configurations (e.g. sdpa_full); hsw: of HSW, HSW-LS, flat')
    parser.add_argument('--flat-full-max', type=int, default=16384,
                        help='hsw: longest length at which the flat encoder runs all 8 blocks (above: 1 block x 8)')


def job_of(args: argparse.Namespace, label: str, build: Any, **fields: Any) -> bench.Job:
    """A :class:`bench.Job` with the command line's timing options; ``fields`` set (or override) the others."""
    return bench.Job(label, build, **{**dict(warmup=args.warmup, budget_s=args.budget_s, device=args.device,
                                             threads=args.threads, timeout_s=args.timeout), **fields})


def model_job(spec: str, args: argparse.Namespace, size: Optional[int], batch: int, kind: str) -> bench.Job:
    """The :class:`Job` of one model spec at one point from the model benchmark's command line."""
    return job_of(args, bench.spec_label(spec), functools.partial(bench.create_model, spec), img_size=size,
                  batch_size=batch, kind=kind, amp=args.amp_dtype if args.amp else None,
                  channels_last=args.channels_last, compile=args.torchcompile, flops=not args.no_flops,
                  memory=not args.no_memory)


def measure_rows(jobs: Dict[str, List[bench.Job]], args: argparse.Namespace, point: Any, baseline: Optional[str],
                 keep_going: bool = False) -> List[Dict[str, Any]]:
    """Runs the jobs of one point (spec -> one job per kind; kinds one after the other, the specs alternating) and
    returns one combined row per spec, its ``baseline`` set (a ``@reparam`` spec's is its plain model); ``keep_going``:
    see :func:`bench.run_jobs`."""
    specs = list(jobs)
    by_kind = {}
    for k in range(len(next(iter(jobs.values())))):
        kind_jobs = [jobs[s][k] if k == 0 else replace(jobs[s][k], flops=False) for s in specs]
        by_kind[kind_jobs[0].kind] = bench.run_jobs(kind_jobs, args.repeats, not getattr(args, 'no_retry', False), log,
                                                    keep_going)
    return [dict(bench.combine({kind: runs[i] for kind, runs in by_kind.items()}), spec=spec, point=point,
                 baseline=spec.removesuffix('@reparam') if spec.endswith('@reparam') else baseline)
            for i, spec in enumerate(specs)]


def benchmark_models(specs: Sequence[str], points: Sequence[Point], args: argparse.Namespace,
                     baseline: Optional[str] = None,
                     references: Optional[Dict[str, Sequence[int]]] = None) -> List[Dict[str, Any]]:
    """Every spec (plus ``references`` at their sizes) at every point; one row each, with ratios."""
    rows = []
    for size, batch in points:
        point_specs = list(specs) + [n for n, sizes in (references or {}).items() if size in sizes]
        if args.reparam:
            point_specs += [s + '@reparam' for s in point_specs if '@' not in s]
        log(f"Point {f'{size}x{size}' if size else 'native size'}, batch {batch}: {', '.join(point_specs)}")
        kinds = ['inference', 'train'] if args.bench == 'both' else [args.bench]
        jobs = {s: [model_job(s, args, size, batch, kind) for kind in kinds] for s in point_specs}
        rows += measure_rows(jobs, args, [size, batch], baseline)
    bench.add_ratios(rows)
    return rows


def settings_of(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != 'command'}


def run_models(args: argparse.Namespace) -> int:
    """The model benchmark (no sub-command, no suite)."""
    if not args.models:
        raise ValueError('name the models to benchmark: --models NAME [NAME ...] (or a --suite)')
    points = resolve_points(args.img_size, args.batch_size, args.points)
    specs = bench.resolve_specs(args.models + ([args.baseline] if args.baseline else []))  # the baseline measured too
    if args.results_file is not None and args.results_file.suffix.lower() not in ('.csv', '.json', '.md'):
        raise ValueError(f'--results-file {args.results_file}: the suffix must be .csv, .json or .md')
    log(f'Machine: {machine_description(args.device)}')
    rows = benchmark_models(specs, points, args, args.baseline)
    ratios = any('latency_ratio' in r or 'train_step_ratio' in r for r in rows)
    table = bench.benchmark_table(rows) + (f'\n\n{bench.RATIOS_EXPLAINED}' if ratios else '')
    text = f'## Benchmark\n\nMeasured on: {machine_description(args.device)}\n\n{table}\n'
    if args.results_file is not None:
        f = args.results_file
        write_reports(rows, f.with_suffix(''), text, settings_of(args), args.device, [f.suffix.lower()[1:]])
    if args.out is not None:
        write_reports(rows, args.out / 'results', text, settings_of(args), args.device)
    print(table)
    return 0


def size_series(rows: Sequence[Dict[str, Any]]) -> Dict[str, List[Tuple[float, Any, Any]]]:
    """Plot series of vision rows: per model, inference and train (time per image and memory against size)."""
    series: Dict[str, List[Tuple[float, Any, Any]]] = {}
    for r in rows:
        for kind, memory in (('inference', 'peak_mib'), ('train', 'train_memory_mib')):
            if r.get(f'{kind}_ms_per_image') is not None:
                series.setdefault(f"{r['label']}, {kind}", []).append(
                    (r['input_size'][1], r[f'{kind}_ms_per_image'], r.get(memory)))
    return series


def label_series(rows: Sequence[Dict[str, Any]], x: str, time: str, memory: str
                 ) -> Dict[str, List[Tuple[float, Any, Any]]]:
    """Plot series of token rows: per label, (row[x], row[time], row[memory])."""
    series: Dict[str, List[Tuple[float, Any, Any]]] = {}
    for r in rows:
        series.setdefault(r['label'], []).append((r[x], r[time], r[memory]))
    return series


def write_suite(name: str, args: argparse.Namespace, rows: List[Dict[str, Any]], title: str, body: str,
                series: Dict[str, List[Tuple[float, Any, Any]]], command: str, **plot_kwargs: Any) -> None:
    stem = (args.out or OUT) / name
    machine = machine_description(args.device)
    text = f'## {title}\n\nProduced by `{command}`.\n\nMeasured on: {machine}.\n\n{body}\n'
    write_reports(rows, stem, text, {**settings_of(args), 'command': command}, args.device)
    plot(series, stem.with_suffix('.png'), title, **plot_kwargs)
    print(text)
    log(f'Wrote {stem}.{{json,csv,md,png}}')


def run_vision_suite(name: str, args: argparse.Namespace, command: str) -> int:
    """``--suite cvt_ls``, ``vil_ls`` or ``grc``."""
    suite = VISION_SUITES[name]
    args.bench = args.bench or suite['bench']
    points = resolve_points(args.img_size, args.batch_size, args.points) \
        if (args.img_size or args.batch_size or args.points) else suite['points']
    if name == 'grc':
        grc = [s for s in bench.resolve_specs(args.models or suite['models']) if s.endswith('_grc')]
        if not grc:
            raise ValueError('--suite grc needs GRC models (NAME_grc)')
        groups = [([s[:-4], s], s[:-4]) for s in grc]
    else:
        baseline = args.baseline or suite['baseline']
        groups = [(bench.resolve_specs((args.models or suite['models']) + [baseline]), baseline)]
    references = None if args.models else suite.get('references')
    log(f'Machine: {machine_description(args.device)}')
    rows = [r for specs, base in groups for r in benchmark_models(specs, points, args, base, references)]
    body = (f'Each model and point in {args.repeats} fresh process(es), in alternating order; times are medians of '
            'the pooled timed passes, memory the median over the processes (inference: peak above the memory once '
            'model and input exist; training: once model, input and optimizer exist). '
            f'{bench.RATIOS_EXPLAINED}\n\n{bench.benchmark_table(rows)}')
    write_suite(name, args, rows, suite['title'], body, size_series(rows), command)
    return 0


def run_sequence(args: argparse.Namespace, command: str) -> int:
    """``--suite sequence``: training steps of 1D layers and models against SDPA; a configuration stops growing once
    its next length is predicted (linear, or quadratic for full attention) over 60 s or 6 GiB."""
    lengths = args.lengths or [1024, 4096, 16384, 65536]
    names = [name for name in SEQUENCE_CONFIGS if not args.names or name in args.names]
    rows: List[Dict[str, Any]] = []
    last: Dict[str, Dict[str, Any]] = {}
    for n in lengths:
        jobs = {}
        for name in names:
            kind, build, _ = SEQUENCE_CONFIGS[name]
            prev = last.get(name)
            if prev is not None:
                growth = (n / prev['n']) ** (2 if any(s in name for s in ('sdpa', 'full', 'official')) else 1)
                est_s, est_mib = prev['train_step_ms'] / 1e3 * growth, (prev['train_memory_mib'] or 0) * growth
                if est_s > 60 or est_mib > 6144:
                    rows.append(dict(kind=kind, name=name, n=n, skipped=f'est. {est_s:.0f} s / {est_mib:.0f} MiB'))
                    continue
            inputs = [((n,), 200)] if kind == 'model' else [((n, D), None)] + [((MEM, D), None)] * ('ls_causal' in name)
            jobs[name] = [job_of(args, f'{kind}: {name}', functools.partial(build, max_len=n) if kind == 'model' else
                                 build, inputs=inputs, kind='train', warmup=1, threads=args.threads or 1,
                                 extra=dict(n=n, name=name))]
        point_rows = measure_rows(jobs, args, n, None) if jobs else []
        for row in point_rows:
            row.update(kind=SEQUENCE_CONFIGS[row['name']][0], baseline=SEQUENCE_CONFIGS[row['name']][2])
            last[row['name']] = row
        bench.add_ratios(point_rows)
        rows += point_rows
    measured = [r for r in rows if 'skipped' not in r]
    body = '\n'.join([f'Each long-short configuration against its full-attention counterpart. {bench.RATIOS_EXPLAINED}',
                      '', bench.benchmark_table(measured), ''] + [
        f"- {r['kind']}: {r['name']} at {r['n']} tokens: skipped ({r['skipped']})" for r in rows if 'skipped' in r])
    series = label_series(measured, 'n', 'train_step_ms', 'train_memory_mib')
    write_suite('sequence', args, rows, '1D long-short attention vs SDPA (training steps)', body, series, command,
                xlabel='sequence length (tokens)', ylabels=('training step (ms)', 'activation memory (MiB)'))
    return 0


def run_hsw(args: argparse.Namespace, command: str) -> int:
    """``--suite hsw``: inference of HSW, HSW-LS and the flat encoder (above ``--flat-full-max`` tokens 1 of its 8
    identical blocks, its time x 8), paired ratios to HSW against the targets."""
    lengths, labels = args.lengths or [4096, 16384, 65536], args.names or list(HSW_MODELS)
    unknown = sorted(set(labels) - set(HSW_MODELS)) + [str(n) for n in lengths if n < 64]
    if unknown:
        raise ValueError(f"--suite hsw: unknown --names or --lengths below 64: {', '.join(unknown)}; names: "
                         f"{', '.join(HSW_MODELS)}")
    rows, summary = [], []
    for n in lengths:
        jobs = {}
        for label in labels:
            name, kwargs = HSW_MODELS[label]
            kwargs = dict(kwargs, max_len=n) if label == 'flat' else kwargs
            params = parameter_count(seq.create_model(name, **kwargs))  # of all blocks, though 1 may run
            scale = 8 if label == 'flat' and n > args.flat_full_max else 1
            build = functools.partial(seq.create_model, name, **kwargs, **({'depth': 1} if scale > 1 else {}))
            jobs[label] = [job_of(args, label, build, inputs=[((n,), 50265)], warmup=1, threads=args.threads or 1,
                                  extra=dict(tokens=n, full_params=params, time_scale=scale))]
        point_rows = measure_rows(jobs, args, n, 'HSW' if 'HSW' in labels else None)
        for r in point_rows:
            for key in ('latency_ms', 'latency_p10_ms', 'latency_p90_ms'):
                r[key] *= r['time_scale']
            r.update(latency_runs_ms=[t * r['time_scale'] for t in r['latency_runs_ms']], params=r['full_params'])
        bench.add_ratios(point_rows)
        rows += point_rows
        ratios = {r['label']: r.get('latency_ratio_paired', r.get('latency_ratio')) for r in point_rows}
        flat, ls = ratios.get('flat'), ratios.get('HSW-LS')
        summary.append([str(n), '-' if flat is None else f'{flat:.1f}x', '-' if flat is None or n not in HSW_TARGETS
                        else f">= {HSW_TARGETS[n]:.0f}x: {'met' if flat >= HSW_TARGETS[n] else 'NOT met'}",
                        '-' if ls is None else f'{ls:.2f}x',
                        '-' if ls is None else f"<= {HSW_LS_TARGET}x: {'met' if ls <= HSW_LS_TARGET else 'NOT met'}"])
    body = (f'{bench.benchmark_table(rows)}\n\nThe flat encoder above --flat-full-max tokens: 1 of its 8 blocks timed, '
            f'x 8. {bench.RATIOS_EXPLAINED}\n\n'
            + markdown_table(['tokens', 'flat / HSW', 'target', 'HSW-LS / HSW', 'target'], summary))
    series = label_series(rows, 'tokens', 'latency_ms', 'peak_mib')
    write_suite('hsw', args, rows, 'HSW vs flat full attention (inference, batch 1)', body, series, command,
                xlabel='tokens', ylabels=('forward time, ms (batch 1)', 'peak memory of a forward, MiB'))
    return 0


def add_sweep_args(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument('--models', nargs='+', default=['cvt_ls_13', 'cvt_13'], help='curves: model specs')
    sweep.add_argument('--sizes', nargs='+', type=int, default=[224, 384, 512, 640, 768, 1024, 1280, 1536])
    sweep.add_argument('--time-budget', type=float, default=15.0,
                       help="largest seconds of the process's CPU time (steady on a shared machine) per image")
    sweep.add_argument('--memory-budget', type=float, default=4096.0, help='largest peak memory in MiB')
    sweep.add_argument('--memory-limit', type=float, default=8192.0,
                       help='a point predicted (quadratic growth from the previous point) to need more MiB is not run')
    sweep.add_argument('--fit-min', type=int, default=512, help='smallest size of the exponent fit (default: 512)')
    sweep.add_argument('--no-flops', action='store_true', help='skip FLOP counting at each point')
    sweep.add_argument('--refit', '--from-json', type=Path, default=None, metavar='JSON',
                       help='fit a stored sweep again and write its markdown and plot (measures nothing)')
    sweep.add_argument('--name', default=None, help='file stem of the outputs (default: MODEL1_vs_MODEL2)')
    sweep.add_argument('--out', type=Path, default=OUT, help='output folder (default: docs/benchmarks)')
    add_timing_args(sweep, warmup=1, budget=10.0, threads=1, timeout=600.0)


def add_cards_args(cards: argparse.ArgumentParser) -> None:
    cards.add_argument('--models', nargs='+', default=None, help='re-measure only these; the others keep theirs')
    cards.add_argument('--reuse', action='store_true', help='measure nothing; render from the stored numbers')
    cards.add_argument('--cards-dir', type=Path, default=ROOT / 'model_cards', help='folder of the cards')
    cards.add_argument('--readme', type=Path, default=ROOT / 'README.md', help='README whose models table to update')
    # 3 warm-up passes: with 1, cvt_ls_13's median still held first-call costs (oneDNN primitives): 183 ms vs 102 ms
    add_timing_args(cards, warmup=3, budget=5.0, threads=None)


def add_timing_args(parser: argparse.ArgumentParser, warmup: int, budget: float, threads: Optional[int],
                    timeout: float = 1800.0, device: str = 'cpu') -> None:
    """The options of every measurement, with the defaults of the model benchmark, ``sweep`` or ``cards``."""
    parser.add_argument('--device', default=device, help=f'device to run on (default: {device})')
    parser.add_argument('--threads', type=int, default=threads, help=f'torch threads (default: {threads or "torch"})')
    parser.add_argument('--num-warm-iter', '--warmup', dest='warmup', type=int, default=warmup,
                        help=f'warm-up passes or steps per measurement (default: {warmup})')
    parser.add_argument('--budget-s', type=float, default=budget,
                        help=f'seconds of timed passes per measurement (blocked_autorange; default: {budget:g})')
    parser.add_argument('--timeout', type=float, default=timeout, help=f'seconds before a measurement is stopped '
                        f'(default: {timeout:g})')


def sweep_exponents(rows: Sequence[Dict[str, Any]], fit_min: int) -> Dict[str, Dict[str, Any]]:
    """Each curve's exponents of time, CPU time, memory and FLOPs against the pixel count, from size ``fit_min``: the
    least-squares slopes in log-log (None below two sizes)."""
    out = {}
    for label in dict.fromkeys(r['label'] for r in rows):
        pts = [r for r in rows if r['label'] == label and r['input_size'][1] >= fit_min and r.get('latency_ms')]
        fits = {}
        for what, key in (('time', 'latency_ms'), ('cpu_time', 'inference_cpu_ms_per_image'), ('memory', 'peak_mib'),
                          ('flops', 'gflops')):
            xy = [(math.log(r['input_size'][1] ** 2), math.log(r[key])) for r in pts if r.get(key)]
            fits[what] = statistics.linear_regression(*zip(*xy)).slope if len({x for x, _ in xy}) > 1 else None
        out[label] = {**fits, 'sizes': [r['input_size'][1] for r in pts]}
    return out


def write_sweep(result: Dict[str, Any], stem: Path) -> None:
    """Writes a sweep's JSON, markdown (rows and exponents) and plot."""
    result['exponents'] = sweep_exponents(result['rows'], result['fit_min'])
    exps = [[label, ', '.join(map(str, e['sizes'])) or 'none'] + ['-' if e[k] is None else f'{e[k]:.2f}' for k in
             ('time', 'cpu_time', 'memory', 'flops')] for label, e in result['exponents'].items()]
    text = (f"## Time and peak memory against input size\n\nProduced by `{result['command']}`.\n\nMeasured on: "
            f"{result['machine']}.\n\nBudget: {result['budget']}; a curve ends at the first size over it. Batch 1, "
            'each point in a fresh process; peak memory above the memory once model and input exist.\n\n'
            f"{bench.benchmark_table(result['rows'])}\n\n### Fitted exponent against pixel count from "
            f"{result['fit_min']} (log-log slope; 1 = linear, 2 = quadratic)\n\n"
            + markdown_table(['model', 'sizes fitted', 'wall time', 'CPU time', 'peak memory', 'FLOPs'], exps, 2))
    write_json(stem.with_suffix('.json'), result)
    write_text(stem.with_suffix('.md'), text + '\n')
    plot(size_series(result['rows']), stem.with_suffix('.png'), ' vs '.join(result['exponents']) + ', batch 1')
    print(text)
    log(f'Wrote {stem}.{{json,md,png}}')


def over_budget(row: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    """Which of the sweep's budgets a measured point exceeds."""
    seconds = row['inference_cpu_ms_per_image'] / 1e3
    over = [f'cpu time {seconds:.3g} s/img > {args.time_budget:g} s'] * (seconds > args.time_budget)
    if row['peak_mib'] is not None and row['peak_mib'] > args.memory_budget:
        over.append(f"memory {row['peak_mib']:.0f} MiB > {args.memory_budget:g} MiB")
    return over


def run_sweep(args: argparse.Namespace, command: str) -> int:
    """The ``sweep`` sub-command: each curve over the sizes until a point exceeds the budget (or is predicted, from
    quadratic growth, to need more than ``--memory-limit``, and is not run)."""
    if args.refit is not None:
        write_sweep(dict(bench.read_report(args.refit, sweep=True), fit_min=args.fit_min), args.refit.with_suffix(''))
        return 0
    specs = bench.resolve_specs(args.models)
    rows = []
    for spec in specs:
        prev = None
        for size in sorted(set(args.sizes)):
            row: Dict[str, Any] = dict(label=bench.spec_label(spec), input_size=[3, size, size], batch_size=1)
            predicted = (prev or {}).get('peak_mib') and prev['peak_mib'] * (size / prev['input_size'][1]) ** 4
            if predicted and predicted > args.memory_limit:
                row['exceeded'] = [f'predicted over the memory limit of {args.memory_limit:g} MiB; not run']
            else:
                job = job_of(args, row['label'], functools.partial(bench.create_model, spec), img_size=size,
                             flops=not args.no_flops)
                try:
                    row = bench.combine({'inference': bench.run_jobs([job], log=log)[0]})
                    row['exceeded'] = over_budget(row, args)
                except RuntimeError as e:
                    row['exceeded'] = [str(e).splitlines()[0][:300]]
            rows.append(row)
            prev = row
            if row['exceeded']:
                break
    budget = f'{args.time_budget:g} s of cpu time per image and {args.memory_budget:g} MiB'
    result = dict(machine=machine_description(args.device), command=command, budget=budget,
                  settings=settings_of(args), fit_min=args.fit_min, rows=rows)
    write_sweep(result, args.out / (args.name or '_vs_'.join(s.replace('@', '_') for s in args.models)))
    return 0


def run_cards(args: argparse.Namespace, command: str) -> int:
    """The ``cards`` sub-command: measure (unless ``--reuse``), store, render every card and the README table."""
    store = args.cards_dir / 'measurements.json'
    stored = json.loads(store.read_text()) if store.exists() else {'models': {}}
    names = list_models()
    to_measure = [] if args.reuse else (bench.resolve_specs(args.models) if args.models else names)
    if set(to_measure) - set(names):
        raise ValueError(f'not registered lsvision models (cards are for those only): '
                         f'{sorted(set(to_measure) - set(names))}')
    for i, name in enumerate(to_measure, 1):
        job = job_of(args, name, functools.partial(bench.create_model, name), flops=True, memory=False)
        r = bench.combine({'inference': bench.run_jobs([job], log=log)[0]})
        stored['models'][name] = {k: r[k] if n is None else round(r[k], n) for k, n in CARD_FIELDS.items()}
        stored['models'][name].update(machine=machine_description(args.device),
                                      measured_at=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()))
        stored['models'] = {n: stored['models'][n] for n in names if n in stored['models']}
        stored['command'] = command
        write_json(store, stored)  # after each model: an interrupted run keeps what it measured
        log(f"[{i}/{len(to_measure)}] {name}: {r['gflops']:.3f} GFLOPs, {r['images_per_s']:.2f} img/s")
    outputs = render_outputs(stored['models'], names, args.readme.read_text(),
                             cards_dir=os.path.relpath(args.cards_dir, args.readme.parent))
    for rel, text in outputs.items():
        path = args.readme if rel == 'README.md' else args.readme.parent / rel
        if not path.exists() or path.read_text() != text:
            write_text(path, text)
            log(f'Wrote {path}')
    for card in args.cards_dir.glob('*.md'):  # generated cards of models no longer registered
        if card.stem not in names and card.read_text().startswith(GENERATED_NOTE):
            card.unlink()
            log(f'Removed {card}')
    return 0


SEGMENTATION = (['cvt_ls_13', 'cvt_13', 'pvt_v2_b0', 'pvt_v2_b0_grc'], [(512, 512), (1024, 1024), (1024, 2048)])
DENSE_HEADS = {'fpn': ('FPN', backbone_with_fpn, ['cvt_ls_13', 'cvt_13', 'pvt_small', 'pvt_small_grc'],
                       [(800, 1333), (1024, 1024)], 'detection'),
               **{h: (name, functools.partial(fn, num_classes=150, **kw), *SEGMENTATION, 'segmentation' + suffix) for
                  h, name, fn, kw, suffix in (('semantic_fpn', 'Semantic FPN', semantic_fpn, {}, ''),
                                              ('upernet', 'UperNet (GN)', upernet, dict(norm='gn'), '_upernet'))}}
"""Head -> (name, builder, models, sizes (H, W), report name); 150 classes as ADE20K. UperNet's head has GroupNorm
(GN): BatchNorm cannot train its 1x1 pyramid-pooling cell at batch 1."""


def add_dense_args(det: argparse.ArgumentParser) -> None:
    det.add_argument('--head', choices=sorted(DENSE_HEADS), default='fpn', help="fpn: detection's backbone + FPN "
                     '(default); semantic_fpn, upernet: the segmentors of lsvision.segmentation')
    det.add_argument('--models', nargs='+', default=None, help="backbones (timm names; default: the head's)")
    det.add_argument('--baseline', default='cvt_13', help='the model the ratios are to (default: cvt_13)')
    det.add_argument('--sizes', nargs='+', default=None, metavar='HxW',
                     type=functools.partial(parse_pair, form='HEIGHTxWIDTH', example='800x1333', minimum=32),
                     help='image sizes (default: fpn 800x1333 1024x1024, segmentation 512x512 1024x1024 1024x2048)')
    det.add_argument('--bench', choices=('inference', 'train', 'both'), default='both',
                     help='forward, AdamW training step, or both (default)')
    det.add_argument('--amp', choices=sorted(bench.AMP_DTYPES), default=None, help='autocast dtype')
    det.add_argument('--cuda-count', action='store_true', help="beside each time, the step's kernels, bytes and "
                     'FLOPs on the fake CUDA device (cuda-count; bf16 autocast; forward + backward)')
    det.add_argument('--repeats', type=int, default=2, help='fresh processes per model, size and kind (default: 2)')
    det.add_argument('--out', type=Path, default=OUT, help='folder of the reports (default: docs/benchmarks)')
    det.add_argument('--name', default=None, help="reports' file name, without suffix (default: the head's)")
    det.add_argument('--note', default='', help='a sentence for the report (e.g. how loaded the machine was)')
    det.add_argument('--from-json', type=Path, default=None, metavar='JSON', help="write the markdown of a report's "
                     'JSON again (measures nothing; its command, commit, machine and note are kept)')
    add_timing_args(det, warmup=1, budget=1.0, threads=None, timeout=3600.0)


def _dense_table(rows: Sequence[Dict[str, Any]], kind: str, baseline: str) -> str:
    """One kind's table: wall-clock and CPU time and memory, each with its ratio to the baseline at the same size
    (wall-clock: paired where there are rounds; CPU time: this process's, steadier on a shared machine), the CUDA
    counts where counted (ratios in brackets) and why a run did not finish."""
    prefix, memory = {'inference': ('latency', 'peak_mib'), 'train': ('train_step', 'train_memory_mib')}[kind]
    cpu, measured = f'{kind}_cpu_ms_per_image', []
    for r in rows:
        base = next((b for b in rows if b['spec'] == baseline and b['point'] == r['point']), {})
        c, b = r.get(f'{kind}_cuda'), base.get(f'{kind}_cuda')
        cuda = c and f"{c['kernels']}, {c['bytes'] / 1e9:.1f}, {c['flops'] / 1e12:.2f}" + (
            f" ({', '.join(f'{c[k] / b[k]:.2f}x' for k in c)})" if b else '')
        over = [e for e in r.get('exceeded', []) if e.startswith(kind)]
        if r.get(f'{prefix}_ms') is not None or over:
            measured.append(dict(r, cpu_ratio=r[cpu] / base[cpu] if base.get(cpu) and r.get(cpu) else None,
                                 cuda=cuda, exceeded=over or None))
    columns = [('backbone + head', 'label', ''), ('image', 'image', ''), ('input', 'input_size', 'size'),
               ('wall ms', f'{prefix}_ms', '.0f'), ('CPU ms', cpu, '.0f'), ('MiB', memory, '.0f'),
               (f'wall / {baseline}', f'{prefix}_ratio', 'ratio'), (f'CPU / {baseline}', 'cpu_ratio', 'x'),
               (f'MiB / {baseline}', memory.replace('_mib', '_ratio'), 'x'),
               ('CUDA kernels, GB, TFLOP', 'cuda', ''), ('not measured', 'exceeded', 'list')]
    return bench.benchmark_table(measured, columns, left_columns=3) if measured else 'Not measured.'


def dense_markdown(rows: Sequence[Dict[str, Any]], settings: Dict[str, Any], machine: str, more: str = '') -> str:
    """The report: what was measured, per kind the times and memory with their ratios to the baseline, and every
    measured field; ``settings`` give its head, command, commit and note (and whether it is ``complete``)."""
    head, baseline = settings.get('head', 'fpn'), rows[0]['baseline'] if rows else settings['baseline']
    note = settings.get('note', '') + ('' if settings.get('complete', True) else ' Partial: ' + ', '.join(
        sorted({r['image'] for r in rows})) + ' measured so far.') + more
    what = ("FPN (`lsvision.detection.backbone_with_fpn`, 256 channels, five levels) at batch 1, on the input "
            "torchvision's detector transform makes of each image (padded to a multiple of 32)", "sum of the levels' "
            'means') if head == 'fpn' else (f'{DENSE_HEADS[head][0]} (`lsvision.segmentation.{head}`, 150 classes, '
                                            'logits at the input size) at batch 1 on the whole image', "logits' mean")
    cuda = (' CUDA: kernels, GB moved, TFLOP of a forward (train: and backward; AdamW apart) on the fake CUDA device, '
            'bf16 autocast (docs/benchmarks/cuda_counting.md), ratios in brackets; they stand where a CPU run failed.')
    return '\n'.join([
        f"## Backbone + {DENSE_HEADS[head][0]} at {'detection' if head == 'fpn' else 'segmentation'} resolution: "
        'long-short attention against full and spatial-reduction attention', '',
        f"Produced by `{settings['command']}` at commit `{settings['commit']}`.", '', f'Measured on: {machine}.', '',
        f'Backbone + {what[0]}. Forward: eval mode, inference mode; train step: forward, the {what[1]}, backward, '
        'AdamW (lr 1e-4, weight decay 0.05; its state counts in the train memory). Memory is the peak above the memory '
        'in use once model and input exist (CPU: resident, CUDA: allocated). Each model, size and kind ran in fresh '
        f"processes, the models in alternating order. {bench.RATIOS_EXPLAINED} CPU ms: the measuring process's CPU "
        'time per pass.' + (cuda if settings.get('cuda_count') else '') + ('\n\n' + note.strip() if note.strip() else
                                                                          ''), '',
        '### Forward', '', _dense_table(rows, 'inference', baseline), '', '### Training step (AdamW)', '',
        _dense_table(rows, 'train', baseline), '', '### Every measured field', '', bench.benchmark_table(rows), ''])



def run_dense(args: argparse.Namespace, command: str) -> int:
    """``dense`` (``detection`` its earlier name): backbone + ``--head`` at each size (the FPN on the detector's input
    for it), forward and AdamW step, ratios to the baseline, a run killed for memory or over ``--timeout`` noted; the
    reports rewritten after each size. ``--from-json``: the markdown of a stored report again, beside it."""
    if args.from_json is not None:
        data, md = bench.read_report(args.from_json), args.from_json.with_suffix('.md')
        # the machine line the run printed (load average at its start), from its markdown; else the JSON's (its end)
        line = re.search(r'^Measured on: (.*)\.$', md.read_text() if md.is_file() else '', flags=re.M)
        machine = line.group(1) if line else f"{data['machine']} (the load average when the JSON was written)"
        text = dense_markdown(data['rows'], data['settings'], machine, ' This markdown was written from its JSON by '
                              f'`python tools/benchmark.py {args.command} --from-json {args.from_json}`.')
        write_text(md, text)
        print(text)
        return 0
    specs, build = list(dict.fromkeys([*args.models, args.baseline])), DENSE_HEADS[args.head][1]
    kinds = ['inference', 'train'] if args.bench == 'both' else [args.bench]
    settings = {**settings_of(args), 'command': command, 'commit': source_commit()}
    machine = machine_description(args.device)
    log(f'Machine: {machine}')
    rows: List[Dict[str, Any]] = []
    for i, (h, w) in enumerate(args.sizes, 1):
        size = detector_input_size(h, w) if args.head == 'fpn' else (h, w)
        log(f"{h}x{w} images (input {size[0]}x{size[1]}): {', '.join(specs)}")
        jobs = {s: [job_of(args, s, functools.partial(build, s), inputs=[((3, *size), None)], kind=kind, amp=args.amp,
                           optimizer='adamw', extra=dict(image=f'{h}x{w}')) for kind in kinds] for s in specs}
        rows += measure_rows(jobs, args, [h, w], args.baseline, keep_going=True)
        for row in rows[-len(specs):] if args.cuda_count else []:
            row.update({f'{k}_cuda': count_step(build(row['spec']), functools.partial(
                lambda s: [torch.randn(1, 3, *s)], size), k == 'train', optimizer=False).total() for k in kinds})
            log(f"  {row['spec']}: {[row[k + '_cuda']['kernels'] for k in kinds]} CUDA kernels")
        bench.add_ratios(rows)
        settings['complete'] = i == len(args.sizes)
        text = dense_markdown(rows, settings, machine)
        write_reports(rows, args.out / args.name, text, settings, args.device)
        log(f'Wrote {args.out / args.name}.{{json,csv,md}}' + ('' if settings['complete'] else ' (partial)'))
    print(text)
    return 0


def parse_count_point(text: str) -> Tuple[str, int, int]:
    match = re.fullmatch(r'(train|inference):(\d+):(\d+)', text)
    if match is None:
        raise argparse.ArgumentTypeError(f'a point is KIND:SIZE:BATCH, KIND train or inference (e.g. train:224:256), '
                                         f'not {text!r}')
    return match[1], int(match[2]), int(match[3])


def add_count_args(count: argparse.ArgumentParser) -> None:
    count.add_argument('--models', dest='count_models', nargs='+', default=['cvt_ls_13', 'cvt_13'], metavar='MODEL',
                       help='vision specs (timm names; @full, @flex, ...) or sequence models (default: cvt_ls_13 '
                            'cvt_13)')
    count.add_argument('--baseline', dest='count_baseline', default='cvt_13', help='ratios to (default: cvt_13)')
    count.add_argument('--points', nargs='+', default=['train:224:256', 'inference:224:32'], metavar='KIND:SIZE:BATCH',
                       type=parse_count_point, help='train or inference, image side or sequence length, batch '
                                                    '(default: train:224:256 inference:224:32)')
    count.add_argument('--dtype', choices=('bfloat16', 'float16', 'float32'), default='bfloat16', help='autocast')
    count.add_argument('--out', type=Path, default=OUT, help='folder of the reports (default: docs/benchmarks)')
    count.add_argument('--name', default='cuda_counts', help='file name of the reports, without suffix')
    count.set_defaults(threads=None)


def run_count(args: argparse.Namespace, command: str) -> int:
    """The ``cuda-count`` sub-command: kernels, bytes and FLOPs of each model and point on the fake CUDA device."""
    commit = source_commit()  # of the code that counts, before the (long) counting
    rows = []
    for kind, size, batch in args.points:
        for model in args.count_models:
            rows.append(count_row(model, kind, size, batch, None if args.dtype == 'float32' else args.dtype))
            log(f"{rows[-1]['point']} {model}: {rows[-1]['kernels']} kernels")
    add_count_ratios(rows, args.count_baseline)
    text = f'`{command}` at {commit}\n\n{counts_markdown(rows)}'
    write_json(args.out / f'{args.name}.json', dict(command=command, commit=commit, rows=rows))
    write_text(args.out / f'{args.name}.md', text)
    print(text)
    return 0


SUBCOMMANDS = {
    'cuda-count': (add_count_args, run_count, 'kernels, bytes and FLOPs of a step on a fake CUDA device'),
    'sweep': (add_sweep_args, run_sweep, 'time and peak memory against input size, until a budget'),
    'cards': (add_cards_args, run_cards, 'measure every registered model; write model_cards/ and README'),
    'dense': (add_dense_args, run_dense, 'backbone + detection FPN or segmentation head, forward and AdamW step'),
    'detection': (add_dense_args, run_dense, 'the earlier name of dense (its default --head fpn)'),
}
"""Sub-command -> (add its arguments, run it with the arguments and the command line, its help)."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The model benchmark or a suite, or a sub-command (:data:`SUBCOMMANDS`)."""
    argv = list(argv[1:] if argv[:1] == ['run'] else argv)
    parser = argparse.ArgumentParser(prog='benchmark.py', description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        sub = parser.add_subparsers(dest='command', required=True)
        for name, (add_args, _, help_text) in SUBCOMMANDS.items():
            add_args(sub.add_parser(name, help=help_text))
    else:
        add_bench_args(parser)
        parser.set_defaults(command='bench')
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error('--threads must be at least 1')
    if getattr(args, 'repeats', 1) < 1:
        parser.error('--repeats must be at least 1')
    if args.command == 'bench':
        args.bench = args.bench or (None if args.suite else 'inference')
    if args.command in ('dense', 'detection'):  # the head's defaults
        _, _, models, sizes, name = DENSE_HEADS[args.head]
        args.models, args.sizes, args.name = args.models or models, args.sizes or sizes, args.name or name
    return args


def check_names(args: argparse.Namespace) -> None:
    """A model spec (or wildcard; ``cuda-count``'s too) or a ``--suite sequence`` configuration that does not exist is
    a ValueError with the closest names, before anything is measured."""
    baseline = getattr(args, 'baseline', None)
    bench.resolve_specs(list(getattr(args, 'models', None) or []) + ([baseline] if baseline else []))
    for model in getattr(args, 'count_models', None) or []:  # cuda-count: sequence models, or specs (all, up front)
        seq.is_model(model) or bench.split_spec(model)
    if getattr(args, 'suite', None) == 'sequence':
        for name in args.names or []:
            if name not in SEQUENCE_CONFIGS:
                raise ValueError('--suite sequence --names: ' + unknown_name_message(name, list(SEQUENCE_CONFIGS),
                                                                                     'configuration'))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; bad input (a ValueError, raised before anything is measured or written) exits with 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(['python', 'tools/benchmark.py', *argv])
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the measuring processes' count, for the machine description
    try:
        check_names(args)
        if args.command in SUBCOMMANDS:
            return SUBCOMMANDS[args.command][1](args, command)
        if args.suite in VISION_SUITES:
            return run_vision_suite(args.suite, args, command)
        if args.suite is not None:
            return (run_sequence if args.suite == 'sequence' else run_hsw)(args, command)
        return run_models(args)
    except ValueError as e:
        log(str(e))
        return 2


if __name__ == '__main__':
    sys.exit(main())
