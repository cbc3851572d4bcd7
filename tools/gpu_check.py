#!/usr/bin/env python3
"""The GPU check for the day a CUDA device is lent (`make gpu-check`): under 8 minutes on one H100 / H200.

What issues 53 and 59 need measured, most important first, each model and point in a fresh process (`lsvision.bench`:
torch.utils.benchmark, which synchronizes CUDA; peak `max_memory_allocated` above the memory in use before the first
step), within one time budget (`--budget-s`; every point has its own time-out, a point that no longer fits is skipped,
and the report is rewritten after every point, so a cut run leaves what it measured):

1. tests/test_cuda.py (the CUDA kernels and the flex path against the dense references).
2. cvt_ls_13 against cvt_13, eager, bf16 autocast, at issue 59's calibration points (the ones its fake-CUDA counts
   were set against): training steps (AdamW) at 224 b256, 384 b64 and 1024 b8, inference (no grad) at 224 b32 (the
   paper's) and 1024 b8; issue 53's time targets are among them.
3. torch.profiler of one step of each model, training at 384 b64 and inference at 224 b32: the CUDA kernels it
   really launches, by name, beside the counts of `tools/benchmark.py cuda-count`. Then the causal char-LM
   (`ls_lm_enwik8_small` against `full_lm_enwik8_small`, causal SDPA): training at 4096 b4 on the chunk path (the
   default) and on one FlexAttention call (`attn_kernel='flex'`: its position terms' gradients through Inductor's
   learnable-bias backward, which decides whether 'auto' should train on it), inference at 16384 b1 on the flex path
   (the default) and on the chunks.
4. The other CUDA candidates at 384 b64 training and 224 b32 inference: cvt_ls_13's span path (`span_kernel='span'`;
   the default, 'auto', runs the FlexAttention path on CUDA, segment order, 128-blocks, which the kernel counts
   favour: docs/benchmarks/cuda_counting.md) and both models under torch.compile (default mode); the floors (both
   models with every attention a no-op, `@noattn`).
5. The span path at 1024 b8; both models compiled with CUDA graphs ('reduce-overhead', as the FlexAttention
   maintainers advise for small batches) at 224 b32.
6. Swin-T, vil_ls_medium against its full-attention version, inference at 224 b256, the flex path's other token
   order and block size, compiled at 1024 b8.
7. With what is left of the budget: issue 54's detection-resolution benchmark (tools/benchmark.py detection,
   cvt_ls_13 against cvt_13, bf16) into docs/benchmarks/detection_gpu.{json,md}.

Writes docs/benchmarks/gpu.json and gpu.md (device, torch, commit, every point, the ratios against the issue's targets
and the floors). `--dry-run` runs all of it on the CPU at tiny sizes (tiny models, 64 px, batch 2, float32, so each
point differing only in size runs once, and one inference point of each other model and compile mode; in this
process; compiled points eagerly, `torch.compiler.set_stance('force_eager')`; test_cuda.py collected, not run; the
flex path's training points skipped: FlexAttention has no CPU backward; the detection command in this process) into a
scratch folder, so that the GPU session cannot fail on a typo (tests/test_gpu_check.py runs it).
"""
import argparse
import contextlib
import datetime
import functools
import io
import platform
import runpy
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # lsvision from this checkout when run as a script

from lsvision.bench import Job, measure, run_fresh  # noqa: E402
from lsvision.reports import write_json, write_text  # noqa: E402
from lsvision.runs import source_changed, source_commit  # noqa: E402

SWIN = 'swin_tiny_patch4_window7_224'
# the issue's targets: cvt_ls_13 / cvt_13 time at (kind, size, batch); activation memory <= 0.95 at every point
TIME_TARGETS = {('inference', 224, 32): 0.68, ('inference', 1024, 8): 0.4, ('train', 384, 64): 0.9,
                ('train', 1024, 8): 0.5}
MEMORY_TARGET = 0.95
# issue 59's table (the points whose fake-CUDA counts were set against the H100's steps), measured first
CALIBRATION = [('train', 224, 256), ('train', 384, 64), ('train', 1024, 8), ('inference', 224, 32),
               ('inference', 1024, 8)]
# the points profiled (torch.profiler: the CUDA kernels one step really launches), both models
PROFILED = [('train', 384, 64), ('inference', 224, 32)]
# the causal char-LM: long-short (its kernel: chunks or one FlexAttention call) and its causal-SDPA counterpart
CHAR_LM = ('ls_lm_enwik8_small', 'full_lm_enwik8_small')
# the models whose training and inference points both run in the dry run
DRY_RUN_BOTH_KINDS = ('cvt_ls_13', 'cvt_13', 'cvt_ls_13@noattn', 'cvt_13@noattn')
# tiny stand-ins of the dry run (lsvision's test configs)
TINY_KWARGS = {
    'cvt_13': dict(embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 1)),
    'cvt_ls_13': dict(embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 1), window_sizes=(4, 2, 2),
                      dp_ranks=(4, 2, 2)),
    'vil_ls_medium': dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 1, 1, 1)),
    SWIN: dict(embed_dim=32, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4)),
}
TINY_CHAR_LM = dict(dim=32, depth=1, num_heads=2, mlp_hidden=64, window_size=16, segment_size=4, mem_len=16)


def build_model(spec: str, kernel: str = 'auto', order: str = 'segment', block: int = 128, tiny: bool = False,
                img_size: Optional[int] = None) -> Any:
    """A model of `lsvision.bench.create_model`'s spec with its long-short kernel set (`set_span_kernel`)."""
    import lsvision  # noqa: F401  (registers the models in the measuring process)
    from lsvision.bench import create_model, split_spec
    from lsvision.layers import set_span_kernel
    name, _ = split_spec(spec)
    kwargs: Dict[str, Any] = dict(TINY_KWARGS.get(name, {})) if tiny else {}
    if name == SWIN and img_size is not None:
        kwargs['img_size'] = img_size  # timm's Swin is built for one input size
    model = create_model(spec, **kwargs)
    set_span_kernel(model, kernel, order, block)
    return model


def build_char_lm(name: str, kernel: str = 'auto', tiny: bool = False, max_len: int = 2048) -> Any:
    """A `lsvision.sequence` char-LM with its causal long-short layers' `attn_kernel` set."""
    import lsvision  # noqa: F401
    from lsvision import sequence
    from lsvision.layers import CausalLongShortAttention
    model = sequence.create_model(name, max_len=max_len, **(TINY_CHAR_LM if tiny else {}))
    for module in model.modules():
        if isinstance(module, CausalLongShortAttention):
            module.attn_kernel = kernel
    return model


def _point(model: str, kind: str, size: int, batch: int, kernel: str = 'auto', order: str = 'segment',
           block: int = 128, compile: Optional[str] = None) -> Dict[str, Any]:
    return dict(model=model, kind=kind, size=size, batch=batch, kernel=kernel, order=order, block=block,
                compile=compile)


def plan() -> List[Dict[str, Any]]:
    """Every point, most important first (see the module docstring)."""
    pair = ('cvt_ls_13', 'cvt_13')
    points = [_point(m, *t) for t in CALIBRATION for m in pair]
    # the real kernels of a step, to set beside the fake-CUDA counts (tools/benchmark.py cuda-count)
    points += [dict(_point(m, *t), profile=True) for t in PROFILED for m in pair]
    ls, full = CHAR_LM
    points += [_point(m, k, s, b, kernel=kernel) for k, s, b, other in (('train', 4096, 4, 'flex'),
                                                                        ('inference', 16384, 1, 'chunks'))
               for m, kernel in ((ls, 'auto'), (ls, other), (full, 'auto'))]
    targets = [('train', 384, 64), ('train', 1024, 8), ('inference', 224, 32), ('inference', 1024, 8)]
    # the candidates at one training and one inference point each, then the floors
    points += [_point('cvt_ls_13', *t, kernel='span') for t in (targets[0], targets[2])]
    points += [_point(m, *t, compile='default') for t in (targets[0], targets[2]) for m in pair]
    points += [_point(m, *t) for t in targets[:3] for m in ('cvt_ls_13@noattn', 'cvt_13@noattn')]
    points += [_point('cvt_ls_13', *t, kernel='span') for t in (targets[1], targets[3])]
    points += [_point(m, 'inference', 224, 32, compile='reduce-overhead') for m in pair]
    points += [_point(SWIN, 'train', 224, 256), _point(SWIN, 'inference', 224, 32)]
    points += [_point(m, k, 224, b) for k, b in (('train', 64), ('inference', 32))
               for m in ('vil_ls_medium', 'vil_ls_medium@full')]
    points += [_point(m, 'inference', 224, 256) for m in pair]
    points += [_point('cvt_ls_13', 'train', 1024, 8, kernel='flex', order=o, block=b)
               for o, b in (('raster', 128), ('segment', 64))]
    points += [_point(m, *t, compile='default') for t in (targets[1], targets[3]) for m in pair]
    points += [_point(SWIN, k, s, b) for k, s, b in (('train', 384, 64), ('inference', 224, 256))]
    return points


def label(p: Dict[str, Any]) -> str:
    flex = ', flex' if p['model'] in CHAR_LM else f", flex {p['order']} {p['block']}"
    kernel = {'auto': '', 'span': ', span path', 'chunks': ', chunk path'}.get(p['kernel'], flex)
    compiled = f", compiled {p['compile']}" if p['compile'] else ''
    return f"{p['model']}{kernel}{compiled} {p['kind']} {p['size']} b{p['batch']}"


def _job(p: Dict[str, Any], dry_run: bool, timeout_s: float) -> Job:
    tiny = dict(size=64, batch=2) if dry_run else {}
    size, batch = tiny.get('size', p['size']), tiny.get('batch', p['batch'])
    if p['model'] in CHAR_LM:  # token ids below the vocabulary's 208 (as tools/benchmark.py cuda-count)
        model = dict(build=functools.partial(build_char_lm, p['model'], p['kernel'], dry_run, size),
                     inputs=[((size,), 200)])
    else:
        model = dict(build=functools.partial(build_model, p['model'], p['kernel'], p['order'],
                                             16 if dry_run else p['block'], dry_run, size), img_size=size)
    return Job(label=label(p), **model, batch_size=batch, kind=p['kind'], device='cpu' if dry_run else 'cuda',
               amp=None if dry_run else 'bfloat16', compile=p['compile'], optimizer='adamw',
               warmup=1 if dry_run else 3, budget_s=0.05 if dry_run else 1.0, timeout_s=timeout_s, extra=dict(point=p))


def profile_step(job: Job) -> Dict[str, Any]:
    """torch.profiler of one step (training or inference) after warm-up: the operators with the most device (CPU:
    host) time, and the kernels the device ran (CUDA activity events, copies and fills included), by name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lsvision.bench import _inputs, _step
    device = torch.device(job.device)
    model = job.build().to(device)
    step = _step(model, _inputs(model, job, device), job, device)
    for _ in range(job.warmup):
        step()
    cuda = device.type == 'cuda'
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = 'cuda_time_total' if cuda else 'cpu_time_total'
    table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60)
    total_us = sum(getattr(e, 'device_time' if cuda else 'self_cpu_time_total', 0) for e in prof.key_averages())
    by_name = Counter(e.name for e in prof.events() if cuda and e.device_type == torch.autograd.DeviceType.CUDA)
    return dict(label=job.label, table=table, total_ms=total_us / 1e3, kernels=sum(by_name.values()), sort_by=key,
                kernels_by_name=dict(by_name.most_common()))


def _median_ms(row: Dict[str, Any]) -> Optional[float]:
    return row['timing']['median_s'] * 1e3 if 'timing' in row else None


def ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """cvt_ls_13 (each kernel and compile mode) against cvt_13 in the same mode at each point, with the issue's target
    and the floor (cvt_ls_13 with every attention a no-op, against cvt_13)."""
    by_key = {(r['point']['model'], r['point']['kernel'], r['point']['order'], r['point']['block'],
               r['point']['compile'], r['point']['kind'], r['point']['size'], r['point']['batch']): r
              for r in rows if 'timing' in r}
    out = []
    for (model, _, _, _, compiled, kind, size, batch), row in by_key.items():
        if model != 'cvt_ls_13':
            continue
        base = by_key.get(('cvt_13', 'auto', 'segment', 128, compiled, kind, size, batch))
        if base is None:
            continue
        floor = by_key.get(('cvt_ls_13@noattn', 'auto', 'segment', 128, None, kind, size, batch))
        peak, base_peak = row.get('peak_mib'), base.get('peak_mib')
        out.append(dict(
            point=f'{kind} {size} b{batch}', variant=label(row['point']).split(f' {kind}')[0],
            time_ratio=_median_ms(row) / _median_ms(base), target=TIME_TARGETS.get((kind, size, batch)),
            memory_ratio=peak / base_peak if peak and base_peak else None, memory_target=MEMORY_TARGET,
            floor_ratio=_median_ms(floor) / _median_ms(base) if floor and not compiled else None))
    return out


# the other comparisons of the issue: (model, against), eager, at every point both have
PAIRS = [('vil_ls_medium', 'vil_ls_medium@full'), ('cvt_ls_13', SWIN), CHAR_LM]


def pair_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Time and memory of each `PAIRS` model against its counterpart (eager, default kernel) at the same point."""
    eager = {(r['point']['model'], r['point']['kind'], r['point']['size'], r['point']['batch']): r for r in rows
             if 'timing' in r and r['point']['kernel'] == 'auto' and not r['point']['compile']}
    out = []
    for model, other in PAIRS:
        for (name, kind, size, batch), row in eager.items():
            base = eager.get((other, kind, size, batch))
            if name == model and base is not None:
                peak, base_peak = row.get('peak_mib'), base.get('peak_mib')
                out.append(dict(model=model, against=other, point=f'{kind} {size} b{batch}',
                                time_ratio=_median_ms(row) / _median_ms(base),
                                memory_ratio=peak / base_peak if peak and base_peak else None))
    return out


def _fmt(value: Optional[float], spec: str = '.2f') -> str:
    return '' if value is None else format(value, spec)


def write_report(out_dir: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]], tests: Dict[str, Any],
                 profiles: List[Dict[str, Any]]) -> None:
    """gpu.json and gpu.md in `out_dir`, atomically (rewritten after every point)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rat, pairs = ratios(rows), pair_ratios(rows)
    write_json(out_dir / 'gpu.json', dict(meta, tests=tests, results=rows, ratios=rat, pairs=pairs,
                                          profiles=profiles,
                                          time_targets={f'{k} {s} b{b}': v for (k, s, b), v in TIME_TARGETS.items()},
                                          memory_target=MEMORY_TARGET))
    lines = [
        '# GPU check (issue 53)', '',
        f"`{meta['command']}` on {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}"
        f"{' (dry run: CPU, tiny models, float32; no number here means anything)' if meta['dry_run'] else ''}. "
        'bf16 autocast; training steps with AdamW; medians of torch.utils.benchmark blocked_autorange, each point in '
        'a fresh process; peak memory above the memory in use before the first step (CUDA max_memory_allocated).', '',
        f"tests/test_cuda.py: exit code {tests.get('returncode')} ({tests.get('summary', '')})", '',
        f"Detection at 800x1333 / 1024x1024 (issue 54, [detection_gpu.md](detection_gpu.md)): "
        f"{meta.get('detection', 'not yet run')}", '',
        '## cvt_ls_13 against cvt_13', '',
        '| point | cvt_ls_13 variant | time ratio | target | floor (no attention) | memory ratio |',
        '|---|---|---:|---:|---:|---:|']
    for r in rat:
        lines.append(f"| {r['point']} | {r['variant']} | {_fmt(r['time_ratio'])} | {_fmt(r['target'])} | "
                     f"{_fmt(r['floor_ratio'])} | {_fmt(r['memory_ratio'])} (<= {MEMORY_TARGET}) |")
    lines += ['', '## Every point', '', '| point | median ms | p10-p90 ms | peak MiB | error |',
              '|---|---:|---:|---:|---|']
    for r in rows:
        t = r.get('timing')
        spread = f"{t['p10_s'] * 1e3:.1f}-{t['p90_s'] * 1e3:.1f}" if t else ''
        lines.append(f"| {r['label']} | {_fmt(_median_ms(r), '.1f')} | {spread} | {_fmt(r.get('peak_mib'), '.0f')} | "
                     f"{r.get('error', '')[:160]} |")
    lines += ['', '## Other comparisons (eager)', '', '| model | against | point | time ratio | memory ratio |',
              '|---|---|---|---:|---:|']
    lines += [f"| {r['model']} | {r['against']} | {r['point']} | {_fmt(r['time_ratio'])} | {_fmt(r['memory_ratio'])} |"
              for r in pairs]
    for prof in profiles:
        lines += ['', f"## torch.profiler: {prof['label']}", '',
                  f"{prof['kernels']} CUDA kernels, {prof['total_ms']:.1f} ms (sorted by {prof['sort_by']})", '',
                  '```', prof['table'], '```']
    write_text(out_dir / 'gpu.md', '\n'.join(lines) + '\n')


def run_tests(dry_run: bool, timeout_s: float) -> Dict[str, Any]:
    """tests/test_cuda.py (dry run: collected only, which catches import errors and typos in the test file)."""
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'tests/test_cuda.py']
    if dry_run:
        cmd.append('--collect-only')
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(returncode=None, summary=f'over its time-out of {timeout_s:.0f} s')
    lines = proc.stdout.strip().splitlines()
    return dict(returncode=proc.returncode, summary=lines[-1] if lines else proc.stderr[-300:], tail=lines[-40:])


def run_points(points: List[Dict[str, Any]], args: argparse.Namespace, start: float, out_dir: Path,
               meta: Dict[str, Any], tests: Dict[str, Any]) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Every point that fits in the budget (each in a fresh process; the dry run in this one), the report rewritten
    after each. Returns the rows and the profile summaries."""
    deadline = start + args.budget_s
    rows: List[Dict[str, Any]] = []
    profiles: List[Dict[str, Any]] = []
    for p in points:
        slow = p['compile'] is not None or p['kernel'] == 'flex' or p['model'] in CHAR_LM  # the flex compile
        timeout = args.compiled_timeout_s if slow else args.point_timeout_s
        left = deadline - time.monotonic()
        if args.dry_run and p['kernel'] == 'flex' and p['kind'] == 'train':
            rows.append(dict(label=label(p), point=p, error='skipped: FlexAttention has no CPU backward'))
            continue
        if left < min(timeout, 30.):
            rows.append(dict(label=label(p), point=p, error=f'skipped: {left:.0f} s of the budget left'))
            continue
        job = _job(p, args.dry_run, min(timeout, left))
        t0 = time.monotonic()
        # each point in a fresh process; the dry run runs them all in this one (its children would import torch
        # ~20 times: lsvision.bench's fresh-process plumbing has tests of its own)
        run = (lambda job, fn=measure: fn(job)) if args.dry_run else run_fresh
        try:
            if p.get('profile'):
                profiles.append(run(job, profile_step))
                row = dict(label=label(p) + ' (profiled)', point=p, profiled=True)
            else:
                row = run(job)
        except Exception as e:  # one point's failure (time-out, out of memory) is its row, and the check goes on
            row = dict(label=label(p), point=p, error=str(e)[-500:])
        row['wall_s'] = round(time.monotonic() - t0, 1)
        rows.append(row)
        ms = _median_ms(row)
        result = 'error ' + row['error'] if 'error' in row else 'profiled' if ms is None else f'{ms:.1f} ms'
        print(f"{row['label']}: {result} ({row['wall_s']} s, {time.monotonic() - start:.0f} s in)", flush=True)
        write_report(out_dir, meta, rows, tests, profiles)
    return rows, profiles


def detection_command(dry_run: bool, out_dir: Path) -> List[str]:
    """Issue 54's resolution benchmark (tools/benchmark.py detection: backbone + FPN at 800x1333 and 1024x1024,
    cvt_ls_13 against cvt_13) on the GPU, bf16; the dry run: one tiny inference point on the CPU."""
    cmd = [sys.executable, str(ROOT / 'tools/benchmark.py'), 'detection', '--models', 'cvt_ls_13',
           '--baseline', 'cvt_13', '--out', str(out_dir), '--name', 'detection_gpu', '--repeats', '1']
    if dry_run:
        return cmd + ['--sizes', '64x64', '--bench', 'inference', '--warmup', '0', '--budget-s', '0']
    return cmd + ['--device', 'cuda', '--amp', 'bfloat16', '--warmup', '1', '--budget-s', '2']


def run_detection(dry_run: bool, out_dir: Path, deadline: float) -> str:
    """The detection benchmark with what is left of the budget (last: issue 53's points come first)."""
    left = deadline - time.monotonic()
    if left < (1 if dry_run else 60):
        return (f'not run: {left:.0f} s of the budget left (run tools/benchmark.py detection --device cuda '
                '--amp bfloat16)')
    cmd = detection_command(dry_run, out_dir)
    if dry_run:  # the same command line in this process, which has imported what the tool imports (its measuring
        # processes are still fresh ones); the GPU run keeps the subprocess and its time-out
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = runpy.run_path(cmd[1])['main'](cmd[2:])
        return 'wrote detection_gpu.md' if code == 0 else f'failed: {err.getvalue().strip()[-300:]}'
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(left, 60.))
    except subprocess.TimeoutExpired:
        return 'over the budget (its report holds the sizes it finished)'
    return 'wrote detection_gpu.md' if proc.returncode == 0 else f'failed: {proc.stderr.strip()[-300:]}'


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dry-run', action='store_true',
                        help='run everything on the CPU at tiny sizes (writes into --out-dir; default a scratch dir)')
    parser.add_argument('--out-dir', default=None, help='default docs/benchmarks (dry run: output/gpu_check_dry_run)')
    parser.add_argument('--budget-s', type=float, default=450., help='seconds for the whole check (default 7.5 min)')
    parser.add_argument('--tests-timeout-s', type=float, default=150.)
    parser.add_argument('--point-timeout-s', type=float, default=75., help='time-out of an eager point')
    parser.add_argument('--compiled-timeout-s', type=float, default=200., help='time-out of a compiled or flex point')
    parser.add_argument('--list', action='store_true', help='list the points in order and exit')
    args = parser.parse_args(argv)
    points = plan()
    if args.dry_run:  # at one tiny size, points that differ in size and batch only are the same: the first runs
        seen = set()
        keep = []
        # outside the cvt_ls_13 / cvt_13 points (whose training and inference both feed the ratios) one point of
        # each model and compile mode checks the code, an inference one (compiled points run eagerly here anyway)
        one_kind = [p for p in points if p['compile'] or p['model'] not in DRY_RUN_BOTH_KINDS]
        for p in sorted(points, key=lambda p: p in one_kind and p['kind'] == 'train'):
            ignored = ('size', 'batch', 'kind') if p in one_kind else ('size', 'batch')
            key = tuple((k, v) for k, v in p.items() if k not in ignored)
            if key not in seen:
                seen.add(key)
                keep.append(p)
        points = keep
    if args.list:
        print('\n'.join(label(p) for p in points))
        return 0
    start = time.monotonic()
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        print('gpu-check needs a CUDA device (--dry-run runs it on the CPU at tiny sizes)', file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or ROOT / ('output/gpu_check_dry_run' if args.dry_run else 'docs/benchmarks'))
    meta = dict(device=platform.processor() or 'cpu' if args.dry_run else torch.cuda.get_device_name(),
                torch=torch.__version__, commit=source_commit(), dirty=source_changed(), dry_run=args.dry_run,
                date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
                command='python tools/gpu_check.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
                budget_s=args.budget_s)
    tests = run_tests(args.dry_run, min(args.tests_timeout_s, args.budget_s / 3))
    print(f"tests/test_cuda.py: {tests['summary']}", flush=True)
    # the dry run's compiled points run eagerly: inductor on the CPU is not what it checks
    with torch.compiler.set_stance('force_eager') if args.dry_run else contextlib.nullcontext():
        rows, profiles = run_points(points, args, start, out_dir, meta, tests)
    meta['detection'] = run_detection(args.dry_run, out_dir, start + args.budget_s)
    print(f"detection benchmark: {meta['detection']}", flush=True)
    meta['wall_s'] = round(time.monotonic() - start, 1)
    write_report(out_dir, meta, rows, tests, profiles)
    print(f'wrote {out_dir / "gpu.md"} and gpu.json ({meta["wall_s"]} s)')
    return 0 if tests.get('returncode') == 0 else 1


if __name__ == '__main__':
    sys.exit(main())
