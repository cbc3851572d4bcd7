"""Benchmarks the GRC (Cached Transformers) models against their timm base models, from one run.

Each GRC model ``<base>_grc`` is paired with ``<base>`` (default: PVTv2-b2, Swin-T and DeiT-S; ``--models`` takes GRC
model names or wildcards, ``--all`` runs every GRC model). For each pair and batch size it prints the parameters and
GFLOPs of both (``lsvision.flops``, multiply-adds, per image at the model's default input size), the extra FLOPs of
GRC in %, the median ms/image and images/s of both, the slowdown (GRC median time / base median time) and whether GRC
meets the target of at most ``--target`` (1.25) times the base's time. Both models run in eval mode, where GRC
computes each sample's cache update from the frozen cache without storing it. Progress goes to stderr; the tables go
to stdout and the results to a JSON file (``--out``).

Interleaved timing, to reduce the noise of a shared machine (``lsvision.measure.time_forward_interleaved``): the two
models of a pair are not timed one after the other (a load change halfway would then bias the ratio) but in
alternating rounds, one forward pass of each per round, in the order base, GRC in even rounds and GRC, base in odd
rounds (ABBA), so that a steady drift affects both alike. Warm-up passes are interleaved the same way. The reported
time of each model is the median of its passes over all rounds; the JSON also keeps every pass and the median of the
per-round ratios (``paired_slowdown``), a second estimate that is robust to load changes between rounds. ``--budget``
bounds warm-up plus timing of one pair at one batch size (warm-up stops after a quarter of it); at least one warm-up
round (if ``--warmup`` > 0) and one timed round always run. Interleaving does not help against thread
oversubscription: with as many torch threads as cores while another process keeps them busy, OpenMP synchronization
can cost milliseconds per op, which penalizes the model with more ops (GRC); use ``--threads`` below the free core
count on a busy machine.

``--floor`` adds two more models to the same rounds: the GRC model with its GRC layers reduced to their matrix
products, and to their matrix products plus the memory attention (``lsvision.benchmark.grc_matmul_floor``). Their
slowdowns bound from below what any implementation of GRC on top of torch's matmul and attention kernels can reach.

Example (each pair takes at most ``--budget`` seconds per batch size, plus model creation and FLOP counting)::

    python tools/bench_grc.py
    python tools/bench_grc.py --models 'pvt_v2_b*_grc' --batch-size 1 8
    python tools/bench_grc.py --floor --batch-size 1 8   # with the floors of the slowdown
    python tools/bench_grc.py --models pvt_v2_b0_grc --iters 2 --out /tmp/grc.json   # quick check
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import timm

import lsvision
from lsvision.benchmark import grc_matmul_floor, markdown_table, write_json
from lsvision.flops import count_flops
from lsvision.measure import machine_description, machine_info, time_forward_interleaved

DEFAULT_MODELS = ['pvt_v2_b2_grc', 'swin_tiny_patch4_window7_224_grc', 'deit_small_patch16_224_grc']
DEFAULT_OUT = Path('output') / 'bench_grc' / 'results.json'
SUFFIX = '_grc'


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', default=DEFAULT_MODELS,
                        help="GRC models or wildcards, e.g. 'pvt_v2_*_grc'; each is compared with the model of the "
                             f"same name without '{SUFFIX}'")
    parser.add_argument('--all', action='store_true', help='run every GRC model (overrides --models)')
    parser.add_argument('--batch-size', nargs='+', type=int, default=[1],
                        help='images per forward pass; several, e.g. 1 8, give one row per pair and batch size')
    parser.add_argument('--threads', type=int, default=None, help='torch threads (default: all usable cores)')
    parser.add_argument('--warmup', type=int, default=3, help='warm-up rounds (one pass of each model per round)')
    parser.add_argument('--iters', type=int, default=10,
                        help='timed rounds (one pass of each model per round; fewer if over budget)')
    parser.add_argument('--budget', type=float, default=60.0,
                        help='seconds per pair and batch size for warm-up plus timing of both models; at least 1 '
                             'warm-up and 1 timed round always run')
    parser.add_argument('--target', type=float, default=1.25,
                        help='largest acceptable slowdown (GRC time / base time)')
    parser.add_argument('--floor', action='store_true',
                        help='also time the GRC model reduced to its matrix products (and memory attention): the '
                             'floors of the slowdown')
    parser.add_argument('--amp', default=None, choices=['bfloat16', 'float16'], help='autocast dtype (e.g. on GPU)')
    parser.add_argument('--device', default='cpu', help='device to run on, e.g. cpu or cuda')
    parser.add_argument('--out', type=Path, default=DEFAULT_OUT, help=f'JSON output file (default: {DEFAULT_OUT})')
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batch_size):
        parser.error('--batch-size must be positive')
    if args.iters < 1:
        parser.error('--iters must be at least 1')
    try:
        args.pairs = resolve_pairs(['*' + SUFFIX] if args.all else args.models)
    except ValueError as e:
        parser.error(str(e))
    return args


def resolve_pairs(patterns: Sequence[str]) -> List[Tuple[str, str]]:
    """Expands GRC model names or wildcards into (base, GRC model) pairs, in the order given, without repeats."""
    grc_models = lsvision.models.list_models('*' + SUFFIX)
    names: List[str] = []
    for pattern in patterns:
        matches = [n for n in lsvision.models.list_models(pattern) if n in grc_models]
        if not matches:
            raise ValueError(f'{pattern!r} matches no GRC model; GRC models: {", ".join(grc_models)}')
        names += matches
    pairs = []
    for name in dict.fromkeys(names):
        base = name[:-len(SUFFIX)]
        if not timm.is_model(base):
            raise ValueError(f'base model {base!r} of {name!r} is not registered with timm')
        pairs.append((base, name))
    return pairs


def log(msg: str) -> None:
    """Prints a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def describe(name: str, args: argparse.Namespace) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """Creates a model (eval mode, no weights) and counts its parameters and FLOPs per image."""
    model = timm.create_model(name, pretrained=False).to(args.device).eval()
    input_size = tuple(model.pretrained_cfg.get('input_size', (3, 224, 224)))
    flops = count_flops(model, input_size, warn_unsupported=False)
    info = {
        'input_size': list(input_size),
        'params': sum(p.numel() for p in model.parameters()),
        'gflops': flops.gflops,
        'unsupported_ops': flops.unsupported,
    }
    return model, info


def measure_pair(base: str, name: str, batch_sizes: Sequence[int], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Counts parameters and FLOPs of a base/GRC pair and times both, interleaved, at each batch size."""
    t0 = time.perf_counter()
    base_model, base_info = describe(base, args)
    grc_model, grc_info = describe(name, args)
    input_size = grc_info['input_size']
    if base_info['input_size'] != input_size:
        log(f'  note: {base} defaults to {base_info["input_size"]}, timing both at {input_size}')
    models = [base_model, grc_model]
    if args.floor:
        models += [grc_matmul_floor(grc_model, attention=False), grc_matmul_floor(grc_model, attention=True)]
    rows = []
    for b in batch_sizes:
        timings = time_forward_interleaved(
            models, tuple(input_size), batch_size=b, warmup=args.warmup, iters=args.iters,
            max_time_s=args.budget, amp_dtype=None if args.amp is None else getattr(torch, args.amp))
        base_t, grc_t = timings[:2]
        base_times, grc_times, warm = base_t.times_s, grc_t.times_s, grc_t.warmup
        slowdown = grc_t.median_s / base_t.median_s
        row = {
            'model': name,
            'base': base,
            'batch_size': b,
            'input_size': input_size,
            'params_base': base_info['params'],
            'params_grc': grc_info['params'],
            'gflops_base': base_info['gflops'],
            'gflops_grc': grc_info['gflops'],
            'delta_flops_pct': (grc_info['gflops'] / base_info['gflops'] - 1) * 100,
            'ms_per_image_base': base_t.per_image_s * 1e3,
            'ms_per_image_grc': grc_t.per_image_s * 1e3,
            'images_per_s_base': base_t.images_per_s,
            'images_per_s_grc': grc_t.images_per_s,
            'slowdown': slowdown,
            'paired_slowdown': statistics.median(g / t for g, t in zip(grc_times, base_times)),
            'meets_target': slowdown <= args.target,
            'rounds': len(grc_times),
            'unsupported_ops_base': base_info['unsupported_ops'],
            'unsupported_ops_grc': grc_info['unsupported_ops'],
            'timing_base': base_t.to_dict(),
            'timing_grc': grc_t.to_dict(),
        }
        if args.floor:
            row['floor_matmul_slowdown'] = timings[2].median_s / base_t.median_s
            row['floor_attention_slowdown'] = timings[3].median_s / base_t.median_s
        log(f"  {name} vs {base} b{b}: {row['ms_per_image_grc']:.1f} vs {row['ms_per_image_base']:.1f} ms/img "
            f"(medians of {row['rounds']} interleaved rounds after {warm} warm-up), slowdown {slowdown:.2f}x "
            f"(paired {row['paired_slowdown']:.2f}x), GFLOPs {row['gflops_grc']:.2f} vs {row['gflops_base']:.2f} "
            f"({row['delta_flops_pct']:+.1f}%)"
            + (f", floors {row['floor_matmul_slowdown']:.2f}x / {row['floor_attention_slowdown']:.2f}x" if args.floor
               else '') + f'; {time.perf_counter() - t0:.0f} s')
        rows.append(row)
    del base_model, grc_model, models
    return rows


def print_table(rows: List[Dict[str, Any]], target: float) -> None:
    """Prints the comparison table."""
    header = ['GRC model', 'base', 'batch', 'params base', 'params GRC', 'GFLOPs base', 'GFLOPs GRC', 'ΔFLOPs',
              'ms/img base', 'ms/img GRC', 'img/s base', 'img/s GRC', 'slowdown', f'≤ {target:g}x']
    floors = bool(rows) and all('floor_matmul_slowdown' in r for r in rows)
    if floors:
        header += ['floor: matmuls', 'floor: + memory attention']
    table = []
    for r in rows:
        line = [r['model'], r['base'], str(r['batch_size']), f"{r['params_base'] / 1e6:.2f}M",
                f"{r['params_grc'] / 1e6:.2f}M", f"{r['gflops_base']:.2f}", f"{r['gflops_grc']:.2f}",
                f"{r['delta_flops_pct']:+.1f}%", f"{r['ms_per_image_base']:.1f}", f"{r['ms_per_image_grc']:.1f}",
                f"{r['images_per_s_base']:.1f}", f"{r['images_per_s_grc']:.1f}", f"{r['slowdown']:.2f}x",
                'yes' if r['meets_target'] else 'no']
        if floors:
            line += [f"{r['floor_matmul_slowdown']:.2f}x", f"{r['floor_attention_slowdown']:.2f}x"]
        table.append(line)
    print(markdown_table(header, table, left_columns=2))
    if floors:
        print('\nFloors: the GRC model with its GRC layers reduced to their matrix products, and to those plus the '
              'memory attention (lsvision.benchmark.grc_matmul_floor), timed in the same rounds; slowdown vs the base.')


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the benchmark."""
    args = parse_args(argv)
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count())
    torch.set_num_threads(threads)
    machine = machine_description(args.device)
    log(f'Machine: {machine}')
    start = time.perf_counter()
    batch_sizes = list(dict.fromkeys(args.batch_size))

    rows: List[Dict[str, Any]] = []
    for base, name in args.pairs:
        log(f'{name} vs {base}, batch {batch_sizes}')
        rows += measure_pair(base, name, batch_sizes, args)

    print(f'## GRC models vs their timm base models\n\nMeasured on: {machine}\n')
    print('Settings: eval mode' + (f', autocast {args.amp}' if args.amp else '')
          + f'; base and GRC timed in alternating rounds (one pass each, ABBA order), {args.warmup} warm-up and up '
          f'to {args.iters} timed rounds within {args.budget:g} s per pair and batch size; median times; FLOPs are '
          f'multiply-adds per image (lsvision.flops); slowdown = GRC time / base time, target ≤ {args.target:g}x.\n')
    print_table(rows, args.target)

    results = {
        'machine': machine,
        'machine_info': machine_info(args.device),
        'settings': {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != 'pairs'},
            'threads': threads,
            'pairs': [list(p) for p in args.pairs],
        },
        'rows': rows,
        'wall_time_s': time.perf_counter() - start,
    }
    write_json(args.out, results)  # atomic: a temporary file, then a rename
    log(f'Wrote {args.out} ({results["wall_time_s"]:.0f} s in all)')


if __name__ == '__main__':
    main()
