"""Run `make demo` (`python tools/train.py`, configs/digits_demo.yaml) once and record what it printed and its
result.json, with the commit and the machine, as docs/benchmarks/digits_demo.json and .md: the numbers that README.md
and docs/training.md quote (tests/test_demo.py checks the quotes against the record and the demo against it).

    python tools/record_demo.py                       # writes docs/benchmarks/digits_demo.{json,md}
    python tools/record_demo.py --out /tmp/demo       # elsewhere
    python tools/record_demo.py --no-time-budget      # all 8 epochs however busy the machine (--time-budget 0)

A run that its time budget stopped (a machine too busy for the demo's 160 s) is not recorded: its numbers are not
those of the whole demo. With --no-time-budget the demo trains its 8 epochs however long they take (its numbers do
not depend on the time: the same as `make demo` where the budget is not reached; the times are the busy machine's).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

import torch
import yaml

from lsvision.reports import machine_description, markdown_table, write_json, write_text
from lsvision.runs import source_commit

ROOT = Path(__file__).resolve().parents[1]
RESULT_KEYS = ('model', 'model_kwargs', 'params', 'top1', 'top5', 'eval_loss', 'metrics_of', 'epochs_done',
               'num_updates', 'stopped_by_time_budget', 'train_seconds', 'total_seconds')


def run_demo(out_dir: Path, flags: List[str]) -> dict:
    """`python tools/train.py --output OUT_DIR [flags]`, as `make demo` runs it: its printed summary and result.json.
    Its log (stderr, the progress) goes to this process's stderr as it runs."""
    command = [sys.executable, str(ROOT / 'tools' / 'train.py'), '--output', str(out_dir), *flags]
    proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f'the demo failed (exit status {proc.returncode}; its log is above)')
    result = json.loads((out_dir / 'digits_demo' / 'result.json').read_text())
    printed = [line for line in proc.stdout.splitlines() if line.strip()][0]  # the summary line
    return dict({k: result[k] for k in RESULT_KEYS}, printed=printed)


def markdown(record: dict) -> str:
    """The record as a page: where and when it was made, and the numbers the docs quote."""
    rows = [['printed', f"`{record['printed']}`"], ['val top-1 (%)', f"{record['top1']:.2f}"],
            ['parameters', f"{record['params']:,}"], ['epochs, updates', f"{record['epochs_done']}, "
                                                                         f"{record['num_updates']}"],
            ['training time (s)', f"{record['train_seconds']}"], ['whole run (s)', f"{record['total_seconds']}"]]
    return (f"# `make demo`\n\nWritten by `python tools/record_demo.py` at commit `{record['commit']}` on "
            f"{record['date']}, {record['machine']}.\n\n" + markdown_table(['', 'demo'], rows, left_columns=2) + '\n')


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', type=Path, default=ROOT / 'docs' / 'benchmarks' / 'digits_demo',
                        help='path of the record without suffix (.json and .md are written)')
    parser.add_argument('--no-time-budget', action='store_true',
                        help='train all 8 epochs however long they take (tools/train.py --time-budget 0)')
    args = parser.parse_args(argv)
    commit = source_commit(mark_changes=True)
    flags = ['--time-budget', '0'] if args.no_time_budget else []
    with tempfile.TemporaryDirectory() as tmp:
        record = run_demo(Path(tmp), flags)
    if record['stopped_by_time_budget']:
        print('error: the time budget stopped the demo (a busy machine); not recorded. Run it again when the '
              'machine is quieter, or with --no-time-budget.', file=sys.stderr)
        return 1
    config = yaml.safe_load((ROOT / 'configs' / 'digits_demo.yaml').read_text())
    torch.set_num_threads(config['threads'])  # the machine line names the demo's thread count, not this process's
    record.update(command=' '.join(['python tools/train.py', *flags]), commit=commit, machine=machine_description(),
                  load_average=round(os.getloadavg()[0], 1),  # the last minute's, also in the machine line
                  date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))
    write_json(args.out.with_suffix('.json'), record)
    write_text(args.out.with_suffix('.md'), markdown(record))
    print(markdown(record))
    return 0


if __name__ == '__main__':
    sys.exit(main())
