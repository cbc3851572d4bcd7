"""Benchmarks HSW, HSW-LS and the flat full-attention encoder at 4k, 16k and 64k tokens (inference, batch 1).

Models: `hsw_tiny`, `hsw_tiny` with `attn='ls'` (HSW-LS) and `hsw_flat_tiny` (width 96, 8 full-attention blocks,
through F.scaled_dot_product_attention), all with the RoBERTa vocabulary (50265) and 11 classes. For each length
it prints the median forward time (models timed in interleaved rounds, `lsvision.measure.time_forward`) and the peak
memory of one forward (`peak_memory_forward`: on CPU the process's resident-memory peak), the speed-up of HSW over
the flat encoder and the cost of HSW-LS over HSW (medians of the per-round ratios), against the targets
(flat / HSW >= 5 at 4096 and >= 15 at 16384 tokens; HSW-LS / HSW <= 1.3).

The flat encoder above `--flat-full-max` tokens (default 16384) is timed with 1 of its 8 blocks and the time is
scaled by 8 (its blocks are identical; embedding and head are negligible): a full 64k pass takes minutes on a CPU.
Its peak memory is that of the 1-block pass (inference frees each block's activations before the next).

Load on a shared machine distorts timings: the load average is recorded beside every measurement, and the default
is 1 torch thread (oversubscribed OpenMP threads cost more than they give on a busy machine).

    python tools/bench_hsw.py                                   # ~8 min on a 2-core CPU
    python tools/bench_hsw.py --lengths 4096 --budget 10        # quick look
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from lsvision.measure import machine_description, machine_info, peak_memory_forward, time_forward
from lsvision.sequence import create_model

DEFAULT_OUT = Path('output') / 'bench_hsw' / 'results.json'
MODELS = {
    'HSW': ('hsw_tiny', {}),
    'HSW-LS': ('hsw_tiny', {'attn': 'ls'}),
    'flat': ('hsw_flat_tiny', {}),
}
TARGETS = {4096: 5., 16384: 15.}
LS_TARGET = 1.3


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--lengths', nargs='+', type=int, default=[4096, 16384, 65536], help='tokens per document')
    parser.add_argument('--models', nargs='+', default=list(MODELS), choices=list(MODELS))
    parser.add_argument('--threads', type=int, default=1, help='torch threads (default 1, see the docstring)')
    parser.add_argument('--budget', type=float, default=30.,
                        help='seconds of timing per model and length (the rounds stop after budget x models)')
    parser.add_argument('--iters', type=int, default=5, help='timed passes (fewer when over budget; at least 1)')
    parser.add_argument('--flat-full-max', type=int, default=16384,
                        help='longest length at which the flat encoder runs all 8 blocks (above: 1 block x 8)')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--out', type=Path, default=DEFAULT_OUT, help=f'JSON output (default {DEFAULT_OUT})')
    args = parser.parse_args(argv)
    if any(n < 64 for n in args.lengths):
        parser.error('--lengths must be at least 64 tokens')
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_average() -> List[float]:
    return [round(v, 2) for v in os.getloadavg()] if hasattr(os, 'getloadavg') else []


def build(label: str, length: int, args: argparse.Namespace):
    """The model of `label` for `length` tokens, and the factor its time is scaled by (8 for a 1-block flat)."""
    name, kwargs = MODELS[label]
    scale = 1
    if label == 'flat':
        kwargs = dict(kwargs, max_len=length)
        if length > args.flat_full_max:
            kwargs['depth'], scale = 1, 8
    torch.manual_seed(0)
    return create_model(name, **kwargs).to(args.device).eval(), scale


def measure_length(length: int, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Times every model at one length (batch 1, random token ids), interleaved.

    One warm-up pass each, then rounds of one timed pass per model, in the model order in even rounds and reversed
    in odd rounds (ABBA), so that a load change on the shared machine hits all models alike; rounds stop after
    `iters` or when `budget` x (number of models) seconds are spent (at least one). Then one pass each for the peak
    memory. Each row keeps its times and the per-round ratios to HSW (`paired_over_hsw`).
    """
    x = torch.randint(0, 50265, (1, length), device=args.device)
    models = {label: build(label, length, args) for label in args.models}
    load_before = load_average()
    t0 = time.perf_counter()
    for model, _ in models.values():
        time_forward(model, x, warmup=0, iters=1)
    times: Dict[str, List[float]] = {label: [] for label in models}
    rounds = 0
    while rounds < args.iters and (rounds == 0 or time.perf_counter() - t0 < args.budget * len(models)):
        order = list(models) if rounds % 2 == 0 else list(reversed(models))
        for label in order:
            model, scale = models[label]
            times[label].append(time_forward(model, x, warmup=0, iters=1).median_s * scale)
        rounds += 1
    rows = []
    for label, (model, scale) in models.items():
        peak = peak_memory_forward(model, x, warmup=0)
        params = sum(p.numel() for p in model.parameters())
        if scale > 1:  # the parameters of the whole 8-block encoder
            params += (scale - 1) * sum(p.numel() for p in model.blocks[0].parameters())
        paired = ([t / h for t, h in zip(times[label], times['HSW'])] if 'HSW' in times else [])
        rows.append(dict(
            model=label, tokens=length, params=params, median_s=statistics.median(times[label]),
            min_s=min(times[label]), times_s=times[label],
            paired_over_hsw=statistics.median(paired) if paired else None,
            peak_mb=None if peak is None else peak / 2 ** 20,
            blocks_timed='1 of 8, time x 8' if scale > 1 else 'all',
            load_average_before=load_before, load_average_after=load_average(),
        ))
        log(f'{label} @ {length}: {rows[-1]["median_s"]:.3f} s (x{scale}, {rounds} rounds), '
            f'peak {rows[-1]["peak_mb"]} MB, load {rows[-1]["load_average_after"]}')
    log(f'{length} tokens: {time.perf_counter() - t0:.0f} s')
    return rows


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label in MODELS:
        pts = [r for r in rows if r['model'] == label]
        if not pts:
            continue
        n = [r['tokens'] for r in pts]
        axes[0].plot(n, [r['median_s'] for r in pts], 'o-', label=label)
        axes[1].plot(n, [r['peak_mb'] or float('nan') for r in pts], 'o-', label=label)
    for ax, ylabel in zip(axes, ('forward time, s (batch 1)', 'peak memory of a forward, MB')):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel('tokens')
        ax.set_ylabel(ylabel)
        ax.grid(True, which='both', alpha=.3)
        ax.legend()
    fig.suptitle('HSW vs flat full attention (inference)')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: List[Dict[str, Any]], summary: List[Dict[str, Any]]) -> str:
    lines = ['| tokens | model | params | median s | peak MB | timed | load avg (1 min) |',
             '|---|---|---|---|---|---|---|']
    for r in rows:
        peak = '-' if r['peak_mb'] is None else f"{r['peak_mb']:.0f}"
        lines.append(f"| {r['tokens']} | {r['model']} | {r['params']:,} | {r['median_s']:.3f} | {peak} | "
                     f"{r['blocks_timed']} | {r['load_average_after'][0] if r['load_average_after'] else '-'} |")
    lines += ['', 'Ratios: median over the interleaved rounds of (model time / HSW time in the same round).', '',
              '| tokens | flat / HSW | target | HSW-LS / HSW | target |', '|---|---|---|---|---|']
    for s in summary:
        speedup = '-' if s['flat_over_hsw'] is None else f"{s['flat_over_hsw']:.1f}x"
        verdict = 'met' if s['flat_met'] else 'NOT met'
        target = '-' if s['flat_met'] is None else f">= {s['flat_target']:.0f}x: {verdict}"
        ls = '-' if s['ls_over_hsw'] is None else f"{s['ls_over_hsw']:.2f}x"
        ls_target = '-' if s['ls_over_hsw'] is None else f"<= {LS_TARGET}x: {'met' if s['ls_met'] else 'NOT met'}"
        lines.append(f"| {s['tokens']} | {speedup} | {target} | {ls} | {ls_target} |")
    return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    log(f'{machine_description(args.device)}; load average {load_average()}')
    rows = []
    for length in args.lengths:
        rows += measure_length(length, args)
    summary = []
    for length in args.lengths:
        by = {r['model']: r for r in rows if r['tokens'] == length}
        hsw = by.get('HSW')
        flat_ratio = by['flat']['paired_over_hsw'] if hsw and 'flat' in by else None
        ls_ratio = by['HSW-LS']['paired_over_hsw'] if hsw and 'HSW-LS' in by else None
        target = TARGETS.get(length)
        summary.append(dict(
            tokens=length, flat_over_hsw=flat_ratio, flat_target=target,
            flat_met=None if flat_ratio is None or target is None else flat_ratio >= target,
            ls_over_hsw=ls_ratio, ls_met=None if ls_ratio is None else ls_ratio <= LS_TARGET))
    table = markdown(rows, summary)
    print(f'{machine_description(args.device)}\n\n{table}')
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(machine=machine_info(args.device), args={k: str(v) for k, v in vars(args).items()}, rows=rows,
                  summary=summary)
    tmp = args.out.with_suffix('.json.tmp')
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, args.out)
    args.out.with_suffix('.md').write_text(table + '\n')
    plot(rows, args.out.with_suffix('.png'))
    print(f'\nJSON: {args.out}, markdown: {args.out.with_suffix(".md")}, plot: {args.out.with_suffix(".png")}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
