"""Benchmarks 1D long-short attention (one layer and one model) against F.scaled_dot_product_attention.

Layers (batch 1, D 256, 4 heads, fp32, each with its q/k/v/out projections): full SDPA, bidirectional LS (w, r =
8, 32), causal SDPA, causal LS (W 128, l 16, r 1, a cache of M = 128 tokens) in the blocked design (queries blocked
by segment, chunked, only visible segments scored) and in the official design (every query scores every segment,
then masks). Models: the 2-layer LRA encoder (D 64) with LS and with full attention, and a 2-layer causal char-LM
(D 256) with causal LS and with causal SDPA. For each sequence length it times forward + backward and measures the
peak memory of one forward + backward above the memory in use before it (`lsvision.measure`: CPU RSS / CUDA
allocator). A configuration stops growing once its predicted time or memory exceeds the budget.

    python tools/bench_sequence.py                                  # 1k, 4k, 16k, 64k; output/bench_sequence.*
    python tools/bench_sequence.py --lengths 1024 4096 --only layer  # quick

Writes JSON, a markdown table and a PNG plot (time and memory against length), and prints the ratios.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

import lsvision.sequence as seq
from lsvision.layers import CausalLongShortAttention, FullAttention1d, LongShortAttention1d
from lsvision.measure import (
    _peak_cpu,
    _peak_cuda,
    allocator_reuses_memory,
    machine_description,
    machine_info,
    reexec_with_reusing_allocator,
)
from lsvision.sequence.char_lm import CausalFullAttention

D, HEADS = 256, 4


class _CachedCausal(nn.Module):
    """Causal LS layer with a fixed random cache of M tokens (the cache is an input, not a parameter)."""

    def __init__(self, layer: CausalLongShortAttention, mem_len: int):
        super().__init__()
        self.layer = layer
        self.register_buffer('cache', torch.randn(1, mem_len, layer.dim), persistent=False)

    def forward(self, x):
        return self.layer(x, self.cache)


def layer_configs() -> Dict[str, Callable[[], nn.Module]]:
    return {
        'sdpa_full': lambda: FullAttention1d(D, HEADS),
        'ls_bidir_w8_r32': lambda: LongShortAttention1d(D, HEADS, 8, 32),
        'sdpa_causal': lambda: CausalFullAttention(D, HEADS),
        'ls_causal_blocked': lambda: _CachedCausal(CausalLongShortAttention(D, HEADS, 128, 16, 1), 128),
        'ls_causal_official': lambda: _CachedCausal(CausalLongShortAttention(
            D, HEADS, 128, 16, 1, query_chunk_size=None, checkpoint_chunks=False), 128),
    }


class _LMLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)[0]


def model_configs(n: int) -> Dict[str, Callable[[], nn.Module]]:
    lm = dict(vocab_size=256, dim=256, depth=2, num_heads=4, mlp_hidden=1024, drop=0.)
    return {
        'lra_ls': lambda: seq.create_model('ls_lra_text', max_len=n),
        'lra_full': lambda: seq.create_model('full_lra_text', max_len=n),
        'lm_ls_causal': lambda: _LMLoss(seq.CharLM(window_size=128, segment_size=16, dp_rank=1, mem_len=128,
                                                   cache_mode='official', **lm)),
        'lm_sdpa_causal': lambda: _LMLoss(seq.CharLM(attn='full', max_len=n, **lm)),
    }


def make_input(kind: str, name: str, n: int, device) -> torch.Tensor:
    if kind == 'model':
        return torch.randint(1, 200, (1, n), device=device)
    return torch.randn(1, n, D, device=device, requires_grad=True)


def measure(module: nn.Module, x: torch.Tensor, device, budget_s: float) -> Dict[str, float]:
    def step():
        out = module(x)
        out.float().square().mean().backward()
        if device.type == 'cuda':
            torch.cuda.synchronize(device)
        return None

    t0 = time.perf_counter()
    step()  # warm-up
    first = time.perf_counter() - t0
    times = []
    while not times or (len(times) < 3 and sum(times) + first < budget_s):
        module.zero_grad(set_to_none=True)
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    module.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    peak = _peak_cuda(step, device) if device.type == 'cuda' else _peak_cpu(step)
    return dict(time_s=min(times), median_s=sorted(times)[len(times) // 2], runs=len(times),
                peak_mb=None if peak is None else peak / 2 ** 20)


def run(kind: str, lengths: Sequence[int], args) -> List[dict]:
    device = torch.device(args.device)
    rows = []
    names = list(layer_configs()) if kind == 'layer' else list(model_configs(1))
    if args.names:
        names = [n for n in names if n in args.names]
    for name in names:
        prev: Optional[dict] = None
        for n in lengths:
            quadratic = 'sdpa' in name or 'full' in name or 'official' in name
            if prev is not None:
                growth = (n / prev['n']) ** (2 if quadratic else 1)
                est_t, est_m = prev['time_s'] * growth, (prev['peak_mb'] or 0) * growth
                if est_t > args.max_time or est_m > args.mem_budget_gb * 1024:
                    rows.append(dict(kind=kind, name=name, n=n, skipped=f'est. {est_t:.0f} s / {est_m:.0f} MB'))
                    print(f'{kind} {name} n={n}: skipped (est. {est_t:.0f} s, {est_m:.0f} MB)', file=sys.stderr)
                    continue
            torch.manual_seed(0)
            cfgs = layer_configs() if kind == 'layer' else model_configs(n)
            module = cfgs[name]().to(device)
            x = make_input(kind, name, n, device)
            res = measure(module, x, device, args.budget)
            row = dict(kind=kind, name=name, n=n, **res)
            rows.append(row)
            prev = row
            print(f'{kind} {name} n={n}: {res["time_s"]:.3f} s fwd+bwd, peak {res["peak_mb"] or float("nan"):.0f} MB',
                  file=sys.stderr, flush=True)
            del module, x
    return rows


def ratios(rows: List[dict]) -> Dict[str, float]:
    get = {(r['name'], r['n']): r for r in rows if 'time_s' in r}
    out = {}

    def ratio(a, b, n, key='time_s'):
        if (a, n) in get and (b, n) in get and get[(b, n)][key]:
            return get[(a, n)][key] / get[(b, n)][key]
        return None

    for n in sorted({r['n'] for r in rows}):
        out[f'ls_bidir/sdpa_full time @{n}'] = ratio('ls_bidir_w8_r32', 'sdpa_full', n)
        out[f'ls_causal_blocked/sdpa_causal time @{n}'] = ratio('ls_causal_blocked', 'sdpa_causal', n)
        out[f'ls_causal_blocked/sdpa_causal peak mem @{n}'] = ratio('ls_causal_blocked', 'sdpa_causal', n, 'peak_mb')
        out[f'ls_causal_official/sdpa_causal time @{n}'] = ratio('ls_causal_official', 'sdpa_causal', n)
        out[f'lra_ls/lra_full time @{n}'] = ratio('lra_ls', 'lra_full', n)
        out[f'lm_ls_causal/lm_sdpa_causal time @{n}'] = ratio('lm_ls_causal', 'lm_sdpa_causal', n)
    for name in ('ls_bidir_w8_r32', 'ls_causal_blocked'):
        if (name, 4096) in get and (name, 65536) in get:
            out[f'{name} time 64k/4k (linear = 16)'] = get[(name, 65536)]['time_s'] / get[(name, 4096)]['time_s']
    return {k: round(v, 4) for k, v in out.items() if v is not None}


def markdown(rows: List[dict], lengths: Sequence[int]) -> str:
    lines = ['| kind | config | ' + ' | '.join(f'{n // 1024}k fwd+bwd s / peak MB' for n in lengths) + ' |',
             '|---|---|' + '---|' * len(lengths)]
    names = list(dict.fromkeys((r['kind'], r['name']) for r in rows))
    for kind, name in names:
        cells = []
        for n in lengths:
            r = next((r for r in rows if r['name'] == name and r['n'] == n), None)
            if r is None:
                cells.append('')
            elif 'skipped' in r:
                cells.append(f'skipped ({r["skipped"]})')
            else:
                mem = '?' if r['peak_mb'] is None else f'{r["peak_mb"]:.0f}'
                cells.append(f'{r["time_s"]:.3f} / {mem}')
        lines.append(f'| {kind} | {name} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, name in dict.fromkeys((r['kind'], r['name']) for r in rows if 'time_s' in r):
        pts = [r for r in rows if r['name'] == name and 'time_s' in r]
        style = '-' if kind == 'layer' else '--'
        axes[0].plot([p['n'] for p in pts], [p['time_s'] for p in pts], style, marker='o', label=f'{kind}: {name}')
        axes[1].plot([p['n'] for p in pts], [p['peak_mb'] or float('nan') for p in pts], style, marker='o')
    for ax, label in zip(axes, ('forward + backward time (s)', 'peak memory of fwd+bwd (MB)')):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel('sequence length (tokens)')
        ax.set_ylabel(label)
        ax.grid(True, which='both', alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle('1D long-short attention vs F.scaled_dot_product_attention')
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--lengths', nargs='+', type=int, default=[1024, 4096, 16384, 65536])
    parser.add_argument('--only', choices=['layer', 'model'], default=None, help='only layers or only models')
    parser.add_argument('--names', nargs='+', default=None, help='only these configurations (e.g. sdpa_full)')
    parser.add_argument('--threads', type=int, default=1,
                        help='torch threads (default 1: on a shared 2-core machine contended threads mostly wait)')
    parser.add_argument('--budget', type=float, default=20., help='seconds of timed runs per point (>= 1 run)')
    parser.add_argument('--max-time', type=float, default=60., help='skip a point predicted slower than this (s)')
    parser.add_argument('--mem-budget-gb', type=float, default=6., help='skip a point predicted above this')
    parser.add_argument('--device', default='cpu')
    parser.add_argument('--out', type=Path, default=Path('output/bench_sequence'), help='path stem of the reports')
    parser.add_argument('--allocator', choices=['glibc', 'reuse'], default='glibc',
                        help="CPU memory allocator settings: glibc's defaults, or 'reuse' (restarts the tool with "
                             'lsvision.measure.REUSING_ALLOCATOR_ENV: freed memory is kept and reused, as a caching '
                             'allocator does, so large tensors are not page-faulted again on every call)')
    args = parser.parse_args(argv)
    if args.allocator == 'reuse' and not allocator_reuses_memory():
        if argv is not None:
            parser.error('--allocator reuse restarts the process: run the tool as a command, or set '
                         'lsvision.measure.REUSING_ALLOCATOR_ENV in the environment before Python starts')
        reexec_with_reusing_allocator()
    torch.set_num_threads(args.threads)
    rows = []
    for kind in ('layer', 'model'):
        if args.only in (None, kind):
            rows += run(kind, args.lengths, args)
    summary = ratios(rows)
    table = markdown(rows, args.lengths)
    allocator = 'reuse' if allocator_reuses_memory() else 'glibc'
    print(f'\n{machine_description(args.device)}, {args.threads} threads, allocator {allocator}\n\n{table}\n')
    for k, v in summary.items():
        print(f'{k}: {v:.3f}')
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = dict(machine=machine_info(args.device), threads=args.threads, allocator=allocator, rows=rows,
                  ratios=summary)
    tmp = args.out.with_suffix('.json.tmp')
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(args.out.with_suffix('.json'))
    args.out.with_suffix('.md').write_text(table + '\n\n' + '\n'.join(f'- {k}: {v:.3f}' for k, v in summary.items())
                                           + '\n')
    plot(rows, args.out.with_suffix('.png'))
    print(f'\nreports: {args.out}.json / .md / .png', file=sys.stderr)
    return 0 if all(math.isfinite(r.get('time_s', 0.)) for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
