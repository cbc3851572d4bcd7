"""Benchmarks ViL-LS-Medium against its full-attention counterpart at 224 and 384, from one run.

The counterpart is the same model with ``attn_types=('full',) * 4``: stages 1-2 use full attention with a relative
position bias (the ViL-style quadratic attention) instead of long-short attention; stages 3-4 are full attention in
both. At 224 the models are ``vil_ls_medium`` (w = 7), at 384 ``vil_ls_medium_384`` (w = 8). For each it prints
GFLOPs (``lsvision.flops``, multiply-adds), images/s and ms/image (median of timed forward passes,
``lsvision.measure``), and the ratios full / long-short. Progress goes to stderr; ``--out`` also writes JSON.

Example (a few minutes on 2 CPU cores)::

    python tools/bench_vil_ls.py
    python tools/bench_vil_ls.py --iters 2 --budget 10   # quick check
"""

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import timm

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.benchmark import write_json
from lsvision.flops import count_flops
from lsvision.measure import machine_description, machine_info, time_forward

MODELS = {224: 'vil_ls_medium', 384: 'vil_ls_medium_384'}
FULL = dict(attn_types=('full',) * 4)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--sizes', nargs='+', type=int, default=[224, 384], choices=sorted(MODELS),
                        help='input sizes (each with its own registered model)')
    parser.add_argument('--batch-size', type=int, default=1, help='images per forward pass')
    parser.add_argument('--warmup', type=int, default=2, help='warm-up passes per measurement')
    parser.add_argument('--iters', type=int, default=8, help='timed passes per measurement (fewer if over budget)')
    parser.add_argument('--budget', type=float, default=30.0,
                        help='seconds per measurement for warm-up plus timing (1 warm-up and 1 timed pass always run)')
    parser.add_argument('--threads', type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument('--amp', default=None, choices=['bfloat16', 'float16'], help='autocast dtype (e.g. on GPU)')
    parser.add_argument('--device', default='cpu', help='device to run on, e.g. cpu or cuda')
    parser.add_argument('--out', type=Path, default=None, help='also write the results as JSON here')
    return parser.parse_args(argv)


def log(msg: str) -> None:
    """Prints a progress line to stderr."""
    print(msg, file=sys.stderr, flush=True)


def measure(name: str, size: int, full: bool, args: argparse.Namespace) -> Dict[str, Any]:
    """FLOPs and forward time of one model at one size."""
    t0 = time.perf_counter()
    model = timm.create_model(name, **(FULL if full else {})).to(args.device).eval()
    flops = count_flops(model, (3, size, size), warn_unsupported=False)
    amp = None if args.amp is None else getattr(torch, args.amp)
    timing = time_forward(
        model, (3, size, size), batch_size=args.batch_size, warmup=args.warmup, iters=args.iters,
        max_time_s=args.budget, amp_dtype=amp)
    row = {
        'model': name + (' (full attention)' if full else ''),
        'size': size,
        'attn': 'full' if full else 'long-short',
        'params': sum(p.numel() for p in model.parameters()),
        'gflops': flops.gflops,
        'images_per_s': timing.images_per_s,
        'ms_per_image': timing.per_image_s * 1e3,
        'timing': timing.to_dict(),
    }
    log(f"  {row['model']} {size}x{size}: {row['gflops']:.2f} GFLOPs, {row['images_per_s']:.2f} img/s "
        f"(median of {timing.iters}, p10-p90 {timing.p10_s * 1e3:.0f}-{timing.p90_s * 1e3:.0f} ms/pass); "
        f'{time.perf_counter() - t0:.0f} s')
    del model
    return row


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Runs the benchmark and prints the table."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_description(args.device)
    log(f'Machine: {machine}')
    rows: List[Dict[str, Any]] = []
    ratios = []
    for size in args.sizes:
        ls = measure(MODELS[size], size, False, args)
        full = measure(MODELS[size], size, True, args)
        rows += [ls, full]
        ratios.append({
            'size': size,
            'speedup': full['ms_per_image'] / ls['ms_per_image'],
            'flops_ratio': full['gflops'] / ls['gflops'],
        })

    print('## ViL-LS vs full attention\n')
    print(f'Measured on: {machine}; batch {args.batch_size}'
          + (f', autocast {args.amp}' if args.amp else '') + '; median of timed forward passes.\n')
    print('| size | model | attention in stages 1-2 | params | GFLOPs | images/s | ms/image |')
    print('|---|---|---|---:|---:|---:|---:|')
    for r in rows:
        print(f"| {r['size']} | {r['model']} | {r['attn']} | {r['params'] / 1e6:.2f}M | {r['gflops']:.2f} | "
              f"{r['images_per_s']:.2f} | {r['ms_per_image']:.1f} |")
    print('\n| size | speed-up of long-short (time full / time LS) | FLOPs full / LS |')
    print('|---|---:|---:|')
    for r in ratios:
        print(f"| {r['size']} | {r['speedup']:.2f}x | {r['flops_ratio']:.2f}x |")
    if args.out is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json(args.out, {'machine': machine, 'machine_info': machine_info(args.device), 'settings': settings,
                              'rows': rows, 'ratios': ratios})
        log(f'Wrote {args.out}')


if __name__ == '__main__':
    main()
