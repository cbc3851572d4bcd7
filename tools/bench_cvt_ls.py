"""Benchmarks CvT-LS (linear long-short attention) against CvT (quadratic full attention) as the input grows.

From one run on one machine it prints markdown tables to stdout (progress goes to stderr) and writes the same results
to a JSON file:

(a) For each model (default ``cvt_ls_13`` and ``cvt_13``) at each input size (the same model, only bigger inputs):
    the median time per image, GFLOPs (lsvision's fvcore-based counter, multiply-adds), peak memory of a forward pass,
    and the time ratio of the second model to the first per size; plus the fitted exponent of time and of FLOPs
    against the pixel count (log-log least-squares slope over the sizes ``>= --fit-min``): 1 is linear, 2 quadratic.
(b) Achieved GFLOP/s (FLOPs / median time) at 224 of the models beside timm baselines (Swin-T, PVTv2-b2), created
    with ``timm.create_model`` without weights, and each relative to the first model's.

All models compared in one table are timed in alternating rounds (``lsvision.measure.time_forward_interleaved``: one
pass of each per round, the order reversed every other round), so that a load change on a shared machine biases none
of them; ``--budget`` is per model. Peak memory is measured after the timing, one model at a time.
``--isolated N`` times the GFLOP/s table instead with each model alone in a fresh process, N processes per model in
alternating order (``lsvision.measure.time_forward_isolated``): in one process, one model's freed buffers change
glibc's mmap threshold for the next, which moves the ratios by several percent.

Example (a few minutes on 2 CPU cores)::

    python tools/bench_cvt_ls.py
    python tools/bench_cvt_ls.py --sizes 224 384 --iters 2 --out /tmp/bench.json   # quick check
    python tools/bench_cvt_ls.py --sizes 224 --batch-sizes 1 8 --isolated 3   # GFLOP/s, each model on its own
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import timm

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.benchmark import fit_exponent, markdown_table, write_json
from lsvision.flops import count_flops
from lsvision.measure import (
    TimingResult,
    machine_description,
    machine_info,
    peak_memory_forward,
    time_forward_interleaved,
    time_forward_isolated,
)

DEFAULT_OUT = Path('output') / 'bench_cvt_ls' / 'results.json'
MIB = 2 ** 20


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=['cvt_ls_13', 'cvt_13'],
                        help='models for the size sweep; ratios are of each model to the first')
    parser.add_argument('--sizes', nargs='+', type=int, default=[224, 384, 512, 768, 1024],
                        help='square input sizes for the size sweep')
    parser.add_argument('--baselines', nargs='*', default=['swin_tiny_patch4_window7_224', 'pvt_v2_b2'],
                        help='timm models compared at 224 in the GFLOP/s table (none to skip)')
    parser.add_argument('--throughput-size', type=int, default=224, help='input size of the GFLOP/s table')
    parser.add_argument('--batch-sizes', nargs='+', type=int, default=[1],
                        help='batch sizes of the GFLOP/s table, e.g. 1 8 (the size sweep uses batch 1)')
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: all usable cores)')
    parser.add_argument('--warmup', type=int, default=3, help='warm-up passes per measurement')
    parser.add_argument('--iters', type=int, default=8, help='timed passes per measurement (fewer if over budget)')
    parser.add_argument('--budget', type=float, default=20.0,
                        help='seconds per measurement for warm-up plus timing; at least 1 warm-up and 1 timed pass '
                             'always run')
    parser.add_argument('--isolated', type=int, default=0, metavar='N',
                        help='time the GFLOP/s table with each model alone in a fresh process, N processes per model '
                             'in alternating order (0: all in this process, in alternating rounds)')
    parser.add_argument('--fit-min', type=int, default=512, help='smallest size used to fit the scaling exponents')
    parser.add_argument('--no-memory', action='store_true', help='skip peak memory (saves one pass per size)')
    parser.add_argument('--device', default='cpu', help='device to run on, e.g. cpu or cuda')
    parser.add_argument('--out', type=Path, default=DEFAULT_OUT, help=f'JSON output file (default: {DEFAULT_OUT})')
    return parser.parse_args(argv)


def log(msg: str) -> None:
    """Prints a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def measure_interleaved(
        models: Dict[str, torch.nn.Module], size: int, batch_size: int, args: argparse.Namespace,
        memory: bool = False,
) -> List[Dict[str, Any]]:
    """Counts FLOPs and times several models at one size and batch size in alternating rounds; with `memory`, then
    measures each one's peak memory of one forward pass."""
    input_size = (3, size, size)
    t0 = time.perf_counter()
    flops = {name: count_flops(m, input_size, batch_size=1, warn_unsupported=False) for name, m in models.items()}
    timings = time_forward_interleaved(
        list(models.values()), input_size, batch_size=batch_size, warmup=args.warmup, iters=args.iters,
        max_time_s=args.budget * len(models))
    if memory:
        for model, timing in zip(models.values(), timings):
            timing.peak_bytes = peak_memory_forward(model, input_size, batch_size=batch_size, warmup=0)
    return [result_row(name, size, flops[name], t, t0) for name, t in zip(models, timings)]


def measure_isolated(
        models: Dict[str, torch.nn.Module], size: int, batch_size: int, args: argparse.Namespace, threads: int,
) -> List[Dict[str, Any]]:
    """Counts FLOPs here and times each model alone in fresh processes (`--isolated` of them per model)."""
    input_size = (3, size, size)
    t0 = time.perf_counter()
    flops = {name: count_flops(m, input_size, batch_size=1, warn_unsupported=False) for name, m in models.items()}
    timings = time_forward_isolated(
        list(models), input_size, batch_size=batch_size, rounds=args.isolated, warmup=args.warmup, iters=args.iters,
        max_time_s=args.budget, threads=threads, device=args.device)
    return [result_row(name, size, flops[name], t, t0) for name, t in zip(models, timings)]


def result_row(name: str, size: int, flops: Any, timing: TimingResult, t0: float) -> Dict[str, Any]:
    """One result row (JSON-ready) from a FLOP count and a timing; logs a progress line."""
    flops_total = flops.total * timing.batch_size
    row = {
        'model': name,
        'size': size,
        'pixels': size * size,
        'batch_size': timing.batch_size,
        'flops': flops_total,
        'gflops_per_image': flops.gflops,
        'unsupported_ops': flops.unsupported,
        'time_per_image_s': timing.per_image_s,
        'images_per_s': timing.images_per_s,
        'achieved_gflop_per_s': flops_total / timing.median_s / 1e9,
        'peak_mib': None if timing.peak_bytes is None else timing.peak_bytes / MIB,
        'timing': timing.to_dict(),
    }
    peak = '' if row['peak_mib'] is None else f", peak {row['peak_mib']:.0f} MiB"
    log(
        f'  {name} {size}x{size} b{timing.batch_size}: {timing.per_image_s * 1e3:.1f} ms/img '
        f'(median of {timing.iters}, p10-p90 {timing.p10_s * 1e3:.1f}-{timing.p90_s * 1e3:.1f} ms/pass), '
        f'{flops.gflops:.2f} GFLOPs/img{peak}; {time.perf_counter() - t0:.0f} s'
    )
    return row


def fmt(value: Optional[float], spec: str) -> str:
    """Formats a number, or '-' for None."""
    return '-' if value is None else format(value, spec)


def scaling_report(rows: List[Dict[str, Any]], models: Sequence[str], sizes: Sequence[int], fit_min: int) -> Dict:
    """Builds the per-size ratios and the fitted exponents of the size sweep."""
    by_key = {(r['model'], r['size']): r for r in rows}
    ratios: Dict[str, Dict[int, float]] = {}
    for other in models[1:]:
        ratios[other] = {
            s: by_key[(other, s)]['time_per_image_s'] / by_key[(models[0], s)]['time_per_image_s'] for s in sizes
        }
    exponents = {}
    for name in models:
        fit = [by_key[(name, s)] for s in sizes if s >= fit_min]
        exponents[name] = {
            'fit_sizes': [r['size'] for r in fit],
            'time_vs_pixels': fit_exponent([r['pixels'] for r in fit], [r['time_per_image_s'] for r in fit]),
            'flops_vs_pixels': fit_exponent([r['pixels'] for r in fit], [r['flops'] for r in fit]),
        }
    return {'ratios': ratios, 'exponents': exponents}


def print_scaling(rows: List[Dict[str, Any]], report: Dict, models: Sequence[str], sizes: Sequence[int]) -> None:
    """Prints the size-sweep tables."""
    by_key = {(r['model'], r['size']): r for r in rows}
    header = ['size']
    for name in models:
        header += [f'{name} ms/img', f'{name} GFLOPs', f'{name} peak MiB']
    header += [f'{other} / {models[0]} time' for other in models[1:]]
    table = []
    for s in sizes:
        line = [f'{s}x{s}']
        for name in models:
            r = by_key[(name, s)]
            line += [f"{r['time_per_image_s'] * 1e3:.1f}", f"{r['gflops_per_image']:.2f}", fmt(r['peak_mib'], '.0f')]
        line += [f"{report['ratios'][other][s]:.2f}x" for other in models[1:]]
        table.append(line)
    print('### Time, FLOPs and peak memory vs input size (batch 1)\n')
    print(markdown_table(header, table))
    exp_rows = []
    for name in models:
        e = report['exponents'][name]
        fit = ', '.join(str(s) for s in e['fit_sizes']) or 'none'
        exp_rows.append([name, fmt(e['time_vs_pixels'], '.2f'), fmt(e['flops_vs_pixels'], '.2f'), fit])
    print('\n### Fitted exponent vs pixel count (log-log slope; 1 = linear, 2 = quadratic)\n')
    print(markdown_table(['model', 'time exponent', 'FLOPs exponent', 'sizes fitted'], exp_rows))


def print_throughput(rows: List[Dict[str, Any]], size: int, isolated: int = 0) -> None:
    """Prints the achieved GFLOP/s table, with each model's GFLOP/s relative to the first model's at that batch."""
    first = {}
    for r in rows:
        first.setdefault(r['batch_size'], r)
    table = [
        [r['model'], str(r['batch_size']), f"{r['gflops_per_image']:.2f}", f"{r['time_per_image_s'] * 1e3:.1f}",
         f"{r['images_per_s']:.1f}", f"{r['achieved_gflop_per_s']:.1f}",
         f"{r['achieved_gflop_per_s'] / first[r['batch_size']]['achieved_gflop_per_s']:.2f}x"]
        for r in rows
    ]
    name = rows[0]['model'] if rows else ''
    how = (f'each model alone in {isolated} fresh processes, in alternating order' if isolated
           else 'models timed in alternating rounds')
    print(f'\n### Achieved GFLOP/s at {size}x{size} (FLOPs / median time; {how})\n')
    print(markdown_table(['model', 'batch', 'GFLOPs/img', 'ms/img', 'img/s', 'GFLOP/s', f'GFLOP/s / {name}'], table))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the benchmark."""
    args = parse_args(argv)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count())
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    sizes = sorted(set(args.sizes))
    machine = machine_description(device)
    log(f'Machine: {machine}')
    start = time.perf_counter()

    models = {}
    for name in dict.fromkeys([*args.models, *args.baselines]):
        models[name] = timm.create_model(name, pretrained=False).to(device)

    log(f'(a) size sweep: {", ".join(args.models)} at {sizes}')
    sweep = [
        row for s in sizes
        for row in measure_interleaved({n: models[n] for n in args.models}, s, 1, args, memory=not args.no_memory)
    ]
    report = scaling_report(sweep, args.models, sizes, args.fit_min)

    through_names = list(dict.fromkeys([*args.models, *args.baselines]))
    log(f'(b) GFLOP/s at {args.throughput_size}: {", ".join(through_names)}, batch {args.batch_sizes}')
    through_models = {n: models[n] for n in through_names}
    throughput = [
        row for b in args.batch_sizes
        for row in (measure_isolated(through_models, args.throughput_size, b, args, threads) if args.isolated
                    else measure_interleaved(through_models, args.throughput_size, b, args))
    ]

    print(f'## CvT-LS vs CvT benchmark\n\nMeasured on: {machine}\n')
    print(f'Settings: warm-up {args.warmup}, up to {args.iters} timed passes within {args.budget:g} s per measurement; '
          'median times; FLOPs are multiply-adds (lsvision.flops); peak memory is the extra resident memory of one '
          'forward pass (lsvision.measure).\n')
    print_scaling(sweep, report, args.models, sizes)
    print_throughput(throughput, args.throughput_size, args.isolated)

    results = {
        'machine': machine,
        'machine_info': machine_info(device),
        'settings': {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, 'threads': threads},
        'size_sweep': sweep,
        'ratios_to_first_model': report['ratios'],
        'exponents': report['exponents'],
        'throughput': throughput,
        'wall_time_s': time.perf_counter() - start,
    }
    write_json(args.out, results)  # atomic: a temporary file, then a rename
    log(f'Wrote {args.out} ({results["wall_time_s"]:.0f} s in all)')


if __name__ == '__main__':
    main()
