"""Time torch.compile on a model: the first call (the compile), the first call at a second input size and then at
the first size with one more image in the batch (a recompile each?), and the steady-state step at each size, against
eager. Modes: torch's default compile, `dynamic=True`, `torch._dynamo.mark_dynamic` on the batch and spatial dims
(`mark_dynamic`) or on the batch dim only (`mark_dynamic_batch`). Inference (no_grad forward) and a training step
(forward, cross-entropy, backward, SGD step) are measured separately; `graphs` counts the graphs dynamo compiled.

Every (mode, step) runs in a fresh process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR), so each first call
is a cold compile, as the first run of `tools/train.py --torchcompile` on a machine; `--warm-cache` keeps one cache
for all runs instead (what a second run on the same machine pays)::

    python tools/compile_times.py --model cvt_ls_13 --sizes 64 96 --batch-size 2 --threads 2
    python tools/compile_times.py --model cvt_ls_13 --sizes 64 96 --modes eager dynamic --steps infer \\
        --model-kwargs 'depths=(1,1,1)' --out output/compile_times.json

Prints one JSON line per run to stdout as it finishes, and a markdown table at the end (seconds; the steady state is
the median of `--iters` timed calls after two warm-up calls, alternating with eager calls of the same model in the
same process: `x eager` is the median of the ratios, which a varying machine load moves less than the times). The
dynamo recompile messages of each run go to its log file (`--out` with .log.<mode>.<step>).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

MODES = ('eager', 'default', 'dynamic', 'mark_dynamic', 'mark_dynamic_batch')
# which input dims each mark_dynamic mode marks (torch._dynamo.mark_dynamic before every call)
MARKED = {'mark_dynamic': (0, 2, 3), 'mark_dynamic_batch': (0,)}
STEPS = ('infer', 'train')


def _no_input_check() -> None:
    """Replace lsvision's `check_image_input` with a no-op in every module that imported it: its error messages are
    f-strings of the input's H and W, built before the check, and formatting a size makes dynamo specialize it."""
    for module in list(sys.modules.values()):
        if getattr(module, '__name__', '').startswith('lsvision') and hasattr(module, 'check_image_input'):
            module.check_image_input = lambda *args, **kwargs: None


def _measure(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One (mode, step) in this process: the first call at each point (batch, size), the compiled graphs after each,
    and the steady-state median at each size."""
    import torch
    import torch.nn.functional as F

    import timm
    from timm.utils import ParseKwargs

    import lsvision  # noqa: F401  (registers the lsvision models with timm)

    torch.set_num_threads(spec['threads'])
    torch._logging.set_logs(recompiles=True)  # the guard that failed, in the run's log
    if spec['no_input_check']:
        _no_input_check()
    ns = argparse.Namespace(kw={})
    ParseKwargs(['--k'], 'kw')(None, ns, spec['model_kwargs'])
    torch.manual_seed(0)
    model = timm.create_model(spec['model'], num_classes=10, **ns.kw)
    mode, train = spec['mode'], spec['step'] == 'train'
    model.train(train)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4) if train else None
    if mode == 'eager':
        runner = model
    else:
        runner = torch.compile(model, dynamic=True if mode == 'dynamic' else None)
    b, sizes = spec['batch_size'], spec['sizes']
    # first calls in order: the compile, a new size, then a new batch size (a smaller last batch, -vb)
    points = [(b, s) for s in sizes] + [(b + 1, sizes[0])]
    inputs = {p: torch.randn(p[0], 3, p[1], p[1]) for p in points}

    def step(x: torch.Tensor, fn: Any = runner) -> None:
        for dim in MARKED.get(mode, ()):
            torch._dynamo.mark_dynamic(x, dim)
        if train:
            F.cross_entropy(fn(x), torch.zeros(x.shape[0], dtype=torch.long)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                fn(x)

    def timed(x: torch.Tensor, fn: Any) -> float:
        t0 = time.perf_counter()
        step(x, fn)
        return time.perf_counter() - t0

    def graphs() -> int:
        return int(torch._dynamo.utils.counters['stats'].get('unique_graphs', 0))

    out: Dict[str, Any] = dict(spec, points=points, first_call_s=[], graphs_after=[], steady_s={},
                               torch=torch.__version__, load_before=os.getloadavg()[0])
    for p in points:
        t0 = time.perf_counter()
        step(inputs[p])
        out['first_call_s'].append(round(time.perf_counter() - t0, 2))
        out['graphs_after'].append(graphs())
    out['eager_s'], out['ratio'] = {}, {}
    for s in sizes:
        x = inputs[(b, s)]
        for _ in range(2):
            step(x)
            step(x, model)
        # compiled and eager calls alternate: the ratio holds under a varying machine load
        pairs = [(timed(x, runner), timed(x, model)) for _ in range(spec['iters'])]
        out['steady_s'][str(s)] = round(statistics.median(c for c, _ in pairs), 4)
        out['eager_s'][str(s)] = round(statistics.median(e for _, e in pairs), 4)
        out['ratio'][str(s)] = round(statistics.median(c / e for c, e in pairs), 3)
    out['graphs_final'] = graphs()  # more than after the first calls: a size compiled again later
    out['load_after'] = os.getloadavg()[0]  # the machine's 1-minute load: other work slows every number
    return out


def _table(rows: List[Dict[str, Any]]) -> str:
    sizes, b = rows[0]['sizes'], rows[0]['batch_size']
    head = (['step', 'mode'] + [f'first call b{b} {s} px (s)' for s in sizes]
            + [f'first call b{b + 1} {sizes[0]} px (s)', 'graphs']
            + [f'steady b{b} {s} px (ms; x eager)' for s in sizes])
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        if 'error' in r:
            lines.append(f"| {r['step']} | {r['mode']} | error: {r['error'][:200]} |" + ' |' * (len(head) - 3))
            continue
        cells = [r['step'], r['mode']] + [f'{t:.1f}' for t in r['first_call_s']] + [str(r['graphs_final'])]
        cells += [f"{1000 * r['steady_s'][str(s)]:.0f}" + (f" ({r['ratio'][str(s)]:.2f}x)" if 'ratio' in r else '')
                  for s in sizes]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='cvt_ls_13')
    parser.add_argument('--model-kwargs', nargs='*', default=[], metavar='K=V', help="timm's k=v constructor kwargs")
    parser.add_argument('--sizes', type=int, nargs='+', default=[64, 96], help='input sizes, first calls in order')
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--threads', type=int, default=2, help='torch intra-op threads')
    parser.add_argument('--iters', type=int, default=10, help='timed calls per size (steady state: the median)')
    parser.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    parser.add_argument('--steps', nargs='+', default=list(STEPS), choices=STEPS)
    parser.add_argument('--no-input-check', action='store_true',
                        help="replace lsvision's check_image_input by a no-op (its messages specialize H and W)")
    parser.add_argument('--warm-cache', action='store_true', help='one inductor cache for all runs (not emptied)')
    parser.add_argument('--out', default='', help='also write the results (JSON) here')
    parser.add_argument('--timeout', type=float, default=3600, help='seconds per run')
    parser.add_argument('--child', default='', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(json.loads(args.child))), flush=True)
        return 0
    from lsvision.runs import unknown_model_message
    unknown = unknown_model_message(args.model)
    if unknown:  # before any child process is started
        print(f'compile_times.py: error: {unknown}', file=sys.stderr)
        return 2
    rows = []
    cache = tempfile.mkdtemp(prefix='inductor-cache-') if args.warm_cache else None
    for step in args.steps:
        for mode in args.modes:
            spec = dict(model=args.model, model_kwargs=args.model_kwargs, sizes=args.sizes, batch_size=args.batch_size,
                        threads=args.threads, iters=args.iters, mode=mode, step=step,
                        no_input_check=args.no_input_check)
            run_cache = cache or tempfile.mkdtemp(prefix='inductor-cache-')
            try:
                proc = subprocess.run([sys.executable, __file__, '--child', json.dumps(spec)], capture_output=True,
                                      text=True, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=run_cache),
                                      timeout=args.timeout)
            finally:
                if not cache:
                    shutil.rmtree(run_cache, ignore_errors=True)
            if args.out:
                with open(f'{args.out}.log.{mode}.{step}', 'w') as f:
                    f.write(proc.stderr)
            lines = [line for line in proc.stdout.splitlines() if line.startswith('{')]
            row = json.loads(lines[-1]) if proc.returncode == 0 and lines else dict(
                spec, error=(proc.stderr.strip().splitlines() or ['no output'])[-1])
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, 'w') as f:
                    json.dump(rows, f, indent=1)
    print(_table(rows))
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
