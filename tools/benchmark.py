"""Benchmarks lsvision (or any timm) models, sweeps input resolutions, and generates the model cards.

Subcommands (``python tools/benchmark.py <subcommand> --help`` for all options):

``run``    params, GFLOPs (multiply-adds, attention counted) and activations per image, inference latency (median and
           p10-p90 of timed passes after warm-up) and throughput, peak memory, optionally train-step time; one model,
           a list or wildcards; writes results.json, results.csv and results.md::

               python tools/benchmark.py run --models cvt_ls_13 'pvt_v2_*_grc' --batch-size 8 --out output/bench
               python tools/benchmark.py run --models vil_ls_medium --device cuda --amp bfloat16 --channels-last \\
                   --compile --train
               python tools/benchmark.py run --models cvt_ls_13 --reparam   # plain and reparameterized, one run

``sweep``  time and peak memory against input size, each model until a time or memory budget is exceeded (each
           point in a fresh process), with the fitted exponents against pixel count and a PNG plot. The default is the
           long-short vs full-attention comparison in docs/benchmarks/ (cvt_ls_13 vs cvt_13), on one thread with the
           budget on CPU time, so that other work on the machine hardly moves the curves
           (``--threads 2 --budget-clock wall`` for wall-clock time on two cores)::

               python tools/benchmark.py sweep
               python tools/benchmark.py sweep --models vil_ls_medium vil_ls_medium@full --name vil_ls_medium_vs_full

``cards``  measures every registered model (params, GFLOPs at its native size, batch-1 throughput) and writes
           model_cards/<model>.md beside the papers' numbers, plus the models table of README.md::

               python tools/benchmark.py cards                  # measure all (bounded: a few passes per model)
               python tools/benchmark.py cards --reuse           # re-render from model_cards/measurements.json

Progress goes to stderr, tables to stdout.
"""

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from lsvision.benchmark import (
    AMP_DTYPES,
    BenchmarkConfig,
    SweepBudget,
    SweepConfig,
    benchmark_model,
    benchmark_table,
    parse_curve,
    plot_sweep,
    resolution_sweep,
    resolve_model_names,
    sweep_exponents,
    sweep_markdown,
    write_benchmark_reports,
    write_json,
)
from lsvision.measure import machine_description
from lsvision.models import list_models
from lsvision.zoo import GENERATED_NOTE, measure_model, render_outputs

ROOT = Path(__file__).resolve().parents[1]
SWEEP_DIR = ROOT / 'docs' / 'benchmarks'
MEASUREMENTS = 'measurements.json'


def log(msg: str) -> None:
    """Prints a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def add_timing_args(parser: argparse.ArgumentParser, warmup: int, iters: int, budget: float) -> None:
    """Adds the options every subcommand shares: device, threads, warm-up, timed passes and time per measurement."""
    parser.add_argument('--device', default='cpu', help='device to run on, e.g. cpu or cuda (default: cpu)')
    parser.add_argument('--threads', type=int, default=None,
                        help="torch threads (default: torch's own choice; sweep: 1)")
    parser.add_argument('--warmup', type=int, default=warmup, help=f'warm-up passes (default: {warmup})')
    parser.add_argument('--iters', type=int, default=iters, help=f'timed passes, fewer if over --budget-s '
                        f'(default: {iters})')
    parser.add_argument('--budget-s', type=float, default=budget,
                        help=f'seconds for warm-up plus timing of one measurement; one warm-up and one timed pass '
                             f'always run (default: {budget:g})')


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest='command', required=True)

    run = sub.add_parser('run', help='params, FLOPs, latency, throughput (and train steps) of models')
    run.add_argument('--models', nargs='+', required=True, help="model names or wildcards, e.g. 'cvt_ls_*'")
    run.add_argument('--img-size', type=int, default=None, help="square input size (default: each model's own)")
    run.add_argument('--batch-size', type=int, default=1, help='images per pass (default: 1)')
    run.add_argument('--amp', default=None, choices=sorted(AMP_DTYPES), help='autocast dtype')
    run.add_argument('--channels-last', action='store_true', help='channels-last memory format')
    run.add_argument('--compile', action='store_true', help='time torch.compile(model)')
    run.add_argument('--train', action='store_true', help='also time training steps (forward, backward, SGD step)')
    run.add_argument('--reparam', action='store_true',
                     help='also time the model folded for inference (timm.models.reparameterize_model), in the same '
                          'alternating rounds as the plain one; prints both times and their ratio')
    run.add_argument('--no-flops', action='store_true', help='skip FLOP and activation counting')
    run.add_argument('--no-memory', action='store_true', help='skip peak memory (one pass fewer)')
    run.add_argument('--out', type=Path, default=Path('output') / 'benchmark',
                     help='folder for results.json, results.csv and results.md (default: output/benchmark)')
    add_timing_args(run, warmup=3, iters=10, budget=30.0)

    sweep = sub.add_parser('sweep', help='time and peak memory against input size, until a budget is exceeded')
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

    cards = sub.add_parser('cards', help='measure every registered model and write model_cards/ and the README table')
    cards.add_argument('--models', nargs='+', default=None,
                       help='re-measure only these (names or wildcards); the others keep their stored numbers')
    cards.add_argument('--reuse', action='store_true', help='measure nothing; render from the stored numbers')
    cards.add_argument('--cards-dir', type=Path, default=ROOT / 'model_cards', help='folder of the cards')
    cards.add_argument('--readme', type=Path, default=ROOT / 'README.md', help='README whose models table to update')
    # 3 warm-up passes: with 1, the median of 3 timed passes still held first-call costs (oneDNN primitives):
    # cvt_ls_13 measured 183 ms a pass against 102 ms with 3
    add_timing_args(cards, warmup=3, iters=5, budget=20.0)

    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error('--threads must be at least 1')
    return args


def command_line(argv: Optional[Sequence[str]]) -> str:
    """The command as typed, for reports."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(['python', 'tools/benchmark.py', *args])


def run_models(args: argparse.Namespace) -> int:
    """The ``run`` subcommand."""
    try:
        names = resolve_model_names(args.models)
    except ValueError as e:
        log(str(e))
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BenchmarkConfig(
        img_size=args.img_size, batch_size=args.batch_size, device=args.device, amp=args.amp,
        channels_last=args.channels_last, compile=args.compile, warmup=args.warmup, iters=args.iters,
        max_time_s=args.budget_s, flops=not args.no_flops, memory=not args.no_memory, train=args.train,
        reparam=args.reparam)
    log(f'Machine: {machine_description(args.device)}')
    rows = []
    for i, name in enumerate(names, 1):
        row = benchmark_model(name, config)
        rows.append(row)
        reparam = '' if not args.reparam else (
            f"; reparameterized {row['reparam_latency_ms']:.1f} ms/pass ({row['reparam_ratio']:.3f}x plain)")
        log(f"[{i}/{len(names)}] {name}: {row['latency_ms']:.1f} ms/pass, {row['images_per_s']:.1f} img/s{reparam}")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != 'command'}
    paths = write_benchmark_reports(rows, args.out, settings, device=args.device)
    print(benchmark_table(rows))
    log('Wrote ' + ', '.join(str(p) for p in paths.values()))
    return 0


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the chosen subcommand."""
    args = parse_args(argv)
    if args.command == 'run':
        return run_models(args)
    if args.command == 'sweep':
        return run_sweep(args, argv)
    return run_cards(args, argv)


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
