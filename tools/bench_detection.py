#!/usr/bin/env python3
"""Backbone + FPN at detection resolution: forward and AdamW training step at 800 x 1333 and 1024 x 1024, cvt_ls_13
against cvt_13 and PVT-Small (plain and GRC); time, peak memory and ratios to cvt_13, each model in its own process.

Writes NAME.{json,csv,md} (default docs/benchmarks/detection.*):

    python tools/bench_detection.py --threads 2 --repeats 2                      # the CPU report
    python tools/bench_detection.py --device cuda --amp bfloat16 --name detection_gpu   # on a GPU
"""
import argparse
import re
import shlex
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from lsvision import bench
from lsvision.detection.bench import BASELINE, IMAGE_SIZES, MODELS, report_markdown, run_suite
from lsvision.runs import source_commit, unknown_model_message

ROOT = Path(__file__).resolve().parents[1]
TITLE = 'Backbone + FPN at detection resolution: long-short attention against full and spatial-reduction attention'


def parse_size(text: str) -> Tuple[int, int]:
    """``HxW`` (e.g. ``800x1333``) for ``--sizes``."""
    try:
        h, w = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise argparse.ArgumentTypeError(f'{text!r} is not HEIGHTxWIDTH, e.g. 800x1333') from None
    if h < 32 or w < 32:
        raise argparse.ArgumentTypeError(f'{text!r}: both sides must be at least 32')
    return h, w


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--models', nargs='+', default=list(MODELS), help='backbones (timm names)')
    parser.add_argument('--baseline', default=BASELINE, help='the model the ratios are to')
    parser.add_argument('--sizes', nargs='+', type=parse_size, default=list(IMAGE_SIZES), metavar='HxW',
                        help='image sizes')
    parser.add_argument('--bench', choices=['inference', 'train', 'both'], default='both',
                        help='forward, AdamW training step, or both')
    parser.add_argument('--device', default='cpu', help='cpu or cuda')
    parser.add_argument('--amp', choices=sorted(bench.AMP_DTYPES), default=None, help='autocast dtype')
    parser.add_argument('--repeats', type=int, default=2, help='fresh processes per model, size and kind')
    parser.add_argument('--budget-s', type=float, default=1.0, help='seconds of timed passes per process')
    parser.add_argument('--warmup', type=int, default=1, help='untimed passes first')
    parser.add_argument('--threads', type=int, default=None, help='torch threads per process')
    parser.add_argument('--out', type=Path, default=ROOT / 'docs' / 'benchmarks', help='folder of the reports')
    parser.add_argument('--name', default='detection', help='file name of the reports (without suffix)')
    parser.add_argument('--note', default='', help='a sentence for the report (e.g. how loaded the machine was)')
    parser.add_argument('--from-json', type=Path, default=None, metavar='JSON',
                        help="write the markdown of a report's JSON again with this tool's layout (measures nothing; "
                             'its command, commit, machine and note are kept)')
    return parser


def rerender(path: Path) -> int:
    """``--from-json``: the markdown of a stored report (its rows, command, commit, machine, note), beside it."""
    data = bench.read_report(path)
    settings = data['settings']
    note = settings.get('note', '') + ('' if settings.get('complete', True) else ' Partial: ' + ', '.join(
        sorted({r['image'] for r in data['rows']})) + ' measured so far.')
    note += f' This markdown was written from {path.name} by `python tools/bench_detection.py --from-json`.'
    # the machine line the run printed (load average at its start), from its markdown; else the JSON's (at its end)
    old = path.with_suffix('.md').read_text() if path.with_suffix('.md').is_file() else ''
    line = re.search(r'^Measured on: (.*)\.$', old, flags=re.M)
    machine = line.group(1) if line else f"{data['machine']} (the load average when the JSON was written)"
    text = report_markdown(data['rows'], TITLE, settings['command'], settings['commit'], machine, note.strip())
    bench.write_atomic(path.with_suffix('.md'), lambda tmp: tmp.write_text(text))
    print(text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.from_json is not None:
        return rerender(args.from_json)
    for name in dict.fromkeys([*args.models, args.baseline]):  # before any measuring process starts
        unknown = unknown_model_message(name)
        if unknown:
            print(f'bench_detection.py: error: {unknown}', file=sys.stderr)
            return 2
    command = 'python tools/bench_detection.py ' + shlex.join(sys.argv[1:] if argv is None else argv)
    commit = source_commit()
    machine = bench.machine_description(args.device)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    log(f'Machine: {machine}')
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings.update(command=command, commit=commit)

    def write(rows: List[dict], done: bool = False) -> str:
        """The reports of the rows so far (after each size: a long run keeps what it measured)."""
        sizes = sorted({r['image'] for r in rows})
        note = args.note + ('' if done else f" Partial: {', '.join(sizes)} measured so far.")
        text = report_markdown(rows, TITLE, command, commit, machine, note.strip())
        bench.write_reports(rows, args.out / args.name, text, {**settings, 'complete': done}, args.device)
        log(f'Wrote {args.out / args.name}.{{json,csv,md}}' + ('' if done else ' (partial)'))
        return text

    kinds = ['inference', 'train'] if args.bench == 'both' else [args.bench]
    rows = run_suite(args.models, args.sizes, args.baseline, kinds, args.device, args.amp, args.repeats,
                     args.budget_s, args.warmup, args.threads, log=log, on_size=write)
    print(write(rows, done=True))
    return 0


if __name__ == '__main__':
    sys.exit(main())
