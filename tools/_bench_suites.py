"""The 1D suites of ``tools/benchmark.py``: ``--suite sequence`` and ``--suite hsw`` (their models take tokens, not
images, so they have their own loops; the image suites are in ``tools/benchmark.py``).

``sequence``: one 1D long-short layer (bidirectional, and causal in the blocked and the official design) and two
models against ``F.scaled_dot_product_attention`` (full and causal). Layers: batch 1, D 256, 4 heads, fp32, each with
its q/k/v/out projections: full SDPA, bidirectional LS (w, r = 8, 32), causal SDPA, causal LS (W 128, l 16, r 1, a
cache of M = 128 tokens) blocked (queries blocked by segment, chunked, only visible segments scored) and official
(every query scores every segment, then masks). Models: the 2-layer LRA encoder (D 64) with LS and with full
attention, and a 2-layer causal char-LM (D 256) with causal LS and with causal SDPA. For each length it times a
training step (forward, backward, SGD step) and its activation memory (``lsvision.measure.time_train_step``); a
configuration stops growing once its predicted time or memory exceeds the limits.

``hsw``: inference (batch 1) of ``hsw_tiny``, HSW-LS (``attn='ls'``) and ``hsw_flat_tiny`` (width 96, 8
full-attention blocks through SDPA), timed in alternating rounds, with the speed-up of HSW over the flat encoder
and the cost of HSW-LS over HSW (medians of the per-round ratios) against the targets (flat / HSW >= 5 at 4096 and
>= 15 at 16384 tokens; HSW-LS / HSW <= 1.3). Above ``--flat-full-max`` tokens the flat encoder is timed with 1 of its
8 identical blocks and its time scaled by 8 (a full 64k pass takes minutes on a CPU).
"""
import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import _bench_cpu
import torch
import torch.nn as nn

import lsvision.sequence as seq
from lsvision.benchmark import write_json
from lsvision.layers import CausalLongShortAttention, FullAttention1d, LongShortAttention1d
from lsvision.measure import machine_description, machine_info, peak_memory_forward, time_train_step
from lsvision.sequence.char_lm import CausalFullAttention

D, HEADS = 256, 4
SEQUENCE_LENGTHS = [1024, 4096, 16384, 65536]
SEQUENCE_MAX_TIME_S = 60.0  # a point predicted slower than this is skipped
SEQUENCE_MAX_MIB = 6 * 1024  # a point predicted to need more memory is skipped
HSW_LENGTHS = [4096, 16384, 65536]
HSW_MODELS = {'HSW': ('hsw_tiny', {}), 'HSW-LS': ('hsw_tiny', {'attn': 'ls'}), 'flat': ('hsw_flat_tiny', {})}
HSW_TARGETS = {4096: 5., 16384: 15.}
HSW_LS_TARGET = 1.3


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_reports(out_stem: Path, report: Dict[str, Any], markdown: str, plot: Callable[[Path], None]) -> None:
    """Writes a suite's JSON (atomically), markdown and PNG plot."""
    write_json(out_stem.with_suffix('.json'), report)
    out_stem.with_suffix('.md').write_text(markdown + '\n')
    plot(out_stem.with_suffix('.png'))
    log(f'Wrote {out_stem}.{{json,md,png}}')


# --------------------------------------------------------------------------------------------------------------------
# sequence


class _CachedCausal(nn.Module):
    """Causal LS layer with a fixed random cache of M tokens (the cache is an input, not a parameter)."""

    def __init__(self, layer: CausalLongShortAttention, mem_len: int):
        super().__init__()
        self.layer = layer
        self.register_buffer('cache', torch.randn(1, mem_len, layer.dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.cache)


class _LMLogits(nn.Module):
    """A char-LM that returns its logits only."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)[0]


def layer_configs() -> Dict[str, Callable[[], nn.Module]]:
    return {
        'sdpa_full': lambda: FullAttention1d(D, HEADS),
        'ls_bidir_w8_r32': lambda: LongShortAttention1d(D, HEADS, 8, 32),
        'sdpa_causal': lambda: CausalFullAttention(D, HEADS),
        'ls_causal_blocked': lambda: _CachedCausal(CausalLongShortAttention(D, HEADS, 128, 16, 1), 128),
        'ls_causal_official': lambda: _CachedCausal(CausalLongShortAttention(
            D, HEADS, 128, 16, 1, query_chunk_size=None, checkpoint_chunks=False), 128),
    }


def model_configs(n: int) -> Dict[str, Callable[[], nn.Module]]:
    lm = dict(vocab_size=256, dim=256, depth=2, num_heads=4, mlp_hidden=1024, drop=0.)
    return {
        'lra_ls': lambda: seq.create_model('ls_lra_text', max_len=n),
        'lra_full': lambda: seq.create_model('full_lra_text', max_len=n),
        'lm_ls_causal': lambda: _LMLogits(seq.CharLM(window_size=128, segment_size=16, dp_rank=1, mem_len=128,
                                                     cache_mode='official', **lm)),
        'lm_sdpa_causal': lambda: _LMLogits(seq.CharLM(attn='full', max_len=n, **lm)),
    }


def _sequence_runs(kind: str, lengths: Sequence[int], args: argparse.Namespace) -> List[Dict[str, Any]]:
    device = torch.device(args.device)
    rows: List[Dict[str, Any]] = []
    names = list(layer_configs()) if kind == 'layer' else list(model_configs(1))
    if args.names:
        names = [n for n in names if n in args.names]
    for name in names:
        prev: Optional[Dict[str, Any]] = None
        for n in lengths:
            quadratic = 'sdpa' in name or 'full' in name or 'official' in name
            if prev is not None:
                growth = (n / prev['n']) ** (2 if quadratic else 1)
                est_t, est_m = prev['time_s'] * growth, (prev['peak_mb'] or 0) * growth
                if est_t > SEQUENCE_MAX_TIME_S or est_m > SEQUENCE_MAX_MIB:
                    rows.append(dict(kind=kind, name=name, n=n, skipped=f'est. {est_t:.0f} s / {est_m:.0f} MB'))
                    log(f'{kind} {name} n={n}: skipped (est. {est_t:.0f} s, {est_m:.0f} MB)')
                    continue
            torch.manual_seed(0)
            module = (layer_configs() if kind == 'layer' else model_configs(n))[name]().to(device)
            x = (torch.randint(1, 200, (1, n), device=device) if kind == 'model'
                 else torch.randn(1, n, D, device=device))
            timing = time_train_step(module, x, warmup=1, iters=3, max_time_s=args.budget_s, measure_memory=True)
            row = dict(kind=kind, name=name, n=n, time_s=timing.median_s, min_s=timing.min_s, runs=timing.iters,
                       peak_mb=None if timing.peak_bytes is None else timing.peak_bytes / 2 ** 20)
            rows.append(row)
            prev = row
            log(f"{kind} {name} n={n}: {row['time_s']:.3f} s train step, peak {row['peak_mb'] or float('nan'):.0f} MB")
            del module, x
    return rows


def sequence_ratios(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    get = {(r['name'], r['n']): r for r in rows if 'time_s' in r}
    out: Dict[str, Optional[float]] = {}

    def ratio(a: str, b: str, n: int, key: str = 'time_s') -> Optional[float]:
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


def sequence_markdown(rows: List[Dict[str, Any]], lengths: Sequence[int]) -> str:
    lines = ['| kind | config | ' + ' | '.join(f'{n // 1024}k step s / act. MB' for n in lengths) + ' |',
             '|---|---|' + '---|' * len(lengths)]
    for kind, name in dict.fromkeys((r['kind'], r['name']) for r in rows):
        cells = []
        for n in lengths:
            r = next((r for r in rows if r['name'] == name and r['n'] == n), None)
            if r is None:
                cells.append('')
            elif 'skipped' in r:
                cells.append(f"skipped ({r['skipped']})")
            else:
                cells.append(f"{r['time_s']:.3f} / {'?' if r['peak_mb'] is None else format(r['peak_mb'], '.0f')}")
        lines.append(f'| {kind} | {name} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def _plot_lines(path: Path, series: Dict[str, List[tuple]], ylabels: Sequence[str], xlabel: str, title: str) -> None:
    """Two log-log panels (time, memory): ``series`` maps a label to its (x, time, memory) points."""
    import matplotlib  # optional dependency (the `bench` extra)
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, pts in series.items():
        style = '--' if label.startswith('model') else '-'
        for ax, column in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[column] if p[column] is not None else float('nan') for p in pts], style,
                    marker='o', label=label)
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which='both', alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + '.tmp.png')
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def run_sequence(args: argparse.Namespace, out_stem: Path, command: str, is_cli: bool) -> int:
    """``--suite sequence``."""
    if args.allocator == 'reuse' and not _bench_cpu.allocator_reuses_memory():
        if not is_cli:
            log('--allocator reuse restarts the process: run the tool as a command, or set '
                f'{_bench_cpu.REUSING_ALLOCATOR_ENV} in the environment before Python starts')
            return 2
        _bench_cpu.reexec_with_reusing_allocator()
    threads = args.threads or 1  # on a shared 2-core machine contended threads mostly wait
    torch.set_num_threads(threads)
    lengths = args.lengths or SEQUENCE_LENGTHS
    rows: List[Dict[str, Any]] = []
    for kind in ('layer', 'model'):
        if args.only in (None, kind):
            rows += _sequence_runs(kind, lengths, args)
    summary = sequence_ratios(rows)
    allocator = 'reuse' if _bench_cpu.allocator_reuses_memory() else 'glibc'
    machine = machine_description(args.device)
    table = sequence_markdown(rows, lengths)
    text = (f'## 1D long-short attention vs SDPA (training steps)\n\nProduced by `{command}`.\n\n'
            f'Measured on: {machine}; allocator {allocator}.\n\n{table}\n\n'
            + '\n'.join(f'- {k}: {v:.3f}' for k, v in summary.items()))
    print(text)
    report = dict(machine=machine, machine_info=machine_info(args.device), command=command, threads=threads,
                  allocator=allocator, rows=rows, ratios=summary)
    series = {f"{r['kind']}: {r['name']}": [] for r in rows if 'time_s' in r}
    for r in rows:
        if 'time_s' in r:
            series[f"{r['kind']}: {r['name']}"].append((r['n'], r['time_s'], r['peak_mb']))
    _write_reports(out_stem, report, text, lambda p: _plot_lines(
        p, series, ('training step time (s)', 'activation memory (MB)'), 'sequence length (tokens)',
        '1D long-short attention vs F.scaled_dot_product_attention'))
    return 0 if all(math.isfinite(r.get('time_s', 0.)) for r in rows) else 1


# --------------------------------------------------------------------------------------------------------------------
# hsw


def _hsw_model(label: str, length: int, flat_full_max: int, device: str) -> tuple:
    """The model of `label` for `length` tokens, and the factor its time is scaled by (8 for a 1-block flat)."""
    name, kwargs = HSW_MODELS[label]
    scale = 1
    if label == 'flat':
        kwargs = dict(kwargs, max_len=length)
        if length > flat_full_max:
            kwargs['depth'], scale = 1, 8
    torch.manual_seed(0)
    return seq.create_model(name, **kwargs).to(device).eval(), scale


def _hsw_length(length: int, labels: Sequence[str], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Times every model at one length (batch 1, random token ids) in alternating rounds; then one pass each for
    the peak memory. Each row keeps its times and the median of its per-round ratios to HSW."""
    x = torch.randint(0, 50265, (1, length), device=args.device)
    models = {label: _hsw_model(label, length, args.flat_full_max, args.device) for label in labels}
    t0 = time.perf_counter()
    timings = dict(zip(models, _bench_cpu.time_forward_interleaved(
        [m for m, _ in models.values()], x, warmup=1, iters=args.iters, max_time_s=args.budget_s * len(models))))
    times = {label: [t * models[label][1] for t in timings[label].times_s] for label in models}
    rows = []
    for label, (model, scale) in models.items():
        peak = peak_memory_forward(model, x, warmup=0)
        params = sum(p.numel() for p in model.parameters())
        if scale > 1:  # the parameters of the whole 8-block encoder
            params += (scale - 1) * sum(p.numel() for p in model.blocks[0].parameters())
        paired = [t / h for t, h in zip(times[label], times['HSW'])] if 'HSW' in times else []
        rows.append(dict(
            model=label, tokens=length, params=params, median_s=statistics.median(times[label]),
            min_s=min(times[label]), times_s=times[label],
            paired_over_hsw=statistics.median(paired) if paired else None,
            peak_mb=None if peak is None else peak / 2 ** 20, blocks_timed='1 of 8, time x 8' if scale > 1 else 'all'))
        log(f"{label} @ {length}: {rows[-1]['median_s']:.3f} s (x{scale}, {len(times[label])} rounds), "
            f"peak {rows[-1]['peak_mb']} MB")
    log(f'{length} tokens: {time.perf_counter() - t0:.0f} s')
    return rows


def hsw_markdown(rows: List[Dict[str, Any]], summary: List[Dict[str, Any]]) -> str:
    lines = ['| tokens | model | params | median s | peak MB | timed |', '|---|---|---|---|---|---|']
    for r in rows:
        peak = '-' if r['peak_mb'] is None else f"{r['peak_mb']:.0f}"
        lines.append(f"| {r['tokens']} | {r['model']} | {r['params']:,} | {r['median_s']:.3f} | {peak} | "
                     f"{r['blocks_timed']} |")
    lines += ['', 'Ratios: median over the alternating rounds of (model time / HSW time in the same round).', '',
              '| tokens | flat / HSW | target | HSW-LS / HSW | target |', '|---|---|---|---|---|']
    for s in summary:
        speedup = '-' if s['flat_over_hsw'] is None else f"{s['flat_over_hsw']:.1f}x"
        verdict = 'met' if s['flat_met'] else 'NOT met'
        target = '-' if s['flat_met'] is None else f">= {s['flat_target']:.0f}x: {verdict}"
        ls = '-' if s['ls_over_hsw'] is None else f"{s['ls_over_hsw']:.2f}x"
        ls_target = '-' if s['ls_over_hsw'] is None else f"<= {HSW_LS_TARGET}x: {'met' if s['ls_met'] else 'NOT met'}"
        lines.append(f"| {s['tokens']} | {speedup} | {target} | {ls} | {ls_target} |")
    return '\n'.join(lines)


def run_hsw(args: argparse.Namespace, out_stem: Path, command: str, is_cli: bool) -> int:
    """``--suite hsw``."""
    lengths = args.lengths or HSW_LENGTHS
    labels = args.names or list(HSW_MODELS)
    unknown = sorted(set(labels) - set(HSW_MODELS)) + [str(n) for n in lengths if n < 64]
    if unknown:
        log(f"--suite hsw: unknown --names or --lengths below 64: {', '.join(unknown)}; names: {', '.join(HSW_MODELS)}")
        return 2
    torch.set_num_threads(args.threads or 1)  # oversubscribed OpenMP threads cost more than they give when busy
    rows: List[Dict[str, Any]] = []
    for length in lengths:
        rows += _hsw_length(length, labels, args)
    summary = []
    for length in lengths:
        by = {r['model']: r for r in rows if r['tokens'] == length}
        flat_ratio = by['flat']['paired_over_hsw'] if 'HSW' in by and 'flat' in by else None
        ls_ratio = by['HSW-LS']['paired_over_hsw'] if 'HSW' in by and 'HSW-LS' in by else None
        target = HSW_TARGETS.get(length)
        summary.append(dict(
            tokens=length, flat_over_hsw=flat_ratio, flat_target=target,
            flat_met=None if flat_ratio is None or target is None else flat_ratio >= target,
            ls_over_hsw=ls_ratio, ls_met=None if ls_ratio is None else ls_ratio <= HSW_LS_TARGET))
    machine = machine_description(args.device)
    text = (f'## HSW vs flat full attention (inference, batch 1)\n\nProduced by `{command}`.\n\nMeasured on: '
            f'{machine}.\n\n{hsw_markdown(rows, summary)}')
    print(text)
    series: Dict[str, List[tuple]] = {}
    for r in rows:
        series.setdefault(r['model'], []).append((r['tokens'], r['median_s'], r['peak_mb']))
    _write_reports(out_stem, dict(machine=machine, machine_info=machine_info(args.device), command=command, rows=rows,
                                  summary=summary), text, lambda p: _plot_lines(
        p, series, ('forward time, s (batch 1)', 'peak memory of a forward, MB'), 'tokens',
        'HSW vs flat full attention (inference)'))
    return 0
