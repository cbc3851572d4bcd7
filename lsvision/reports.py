"""Report files, written once for every tool and loop: atomic writes (JSON, text, plots), markdown tables, the machine
line, and the JSON + CSV + markdown set of a table of rows.

A low layer: it imports torch and the standard library only, so evaluation, training, detection and the measuring
code all write through it.
"""
import contextlib
import csv
import io
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

__all__ = ['csv_text', 'machine_description', 'markdown_lines', 'markdown_table', 'plot', 'write_atomic',
           'write_json', 'write_reports', 'write_text']

PathLike = Union[str, os.PathLike]


def write_atomic(path: PathLike, write: Callable[[Path], Any]) -> Path:
    """Writes a file atomically: ``write(tmp)`` to a temporary file beside it (same suffix, for writers that choose
    the format by it; permissions as the umask gives), then ``os.replace`` (the folder is created). A crash never
    leaves half a file, and a failed write removes its temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f'.tmp-{os.getpid()}-{path.name}')
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: PathLike, text: str) -> Path:
    """Writes text (markdown, YAML, ...) atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json(path: PathLike, data: Any) -> Path:
    """Writes JSON (indented, a final newline) atomically."""
    return write_text(path, json.dumps(data, indent=2) + '\n')


def machine_description(device: Optional[str] = None) -> str:
    """Where a measurement ran, in one line: CPU, cores, torch threads, versions, the load average (and the GPU)."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open('/proc/cpuinfo') as f:
        cpu = next((line.split(':', 1)[1].strip() for line in f if line.lower().startswith('model name')), cpu)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    text = (f'{cpu}, {cores} cores, torch {torch.__version__} with {torch.get_num_threads()} threads, Python '
            f'{platform.python_version()}, {platform.system()} {platform.machine()}')
    if hasattr(os, 'getloadavg'):
        text += ', load average ' + ' / '.join(f'{x:.2f}' for x in os.getloadavg())
    if device is not None and torch.device(device).type == 'cuda' and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        text = f'{props.name} ({props.total_memory / 2 ** 30:.1f} GiB, CUDA {torch.version.cuda}); host: {text}'
    return text


def markdown_lines(header: Sequence[str], rows: Sequence[Sequence[str]], left_columns: int = 1,
                   numeric: Optional[Sequence[int]] = None) -> List[str]:
    """A markdown table, line by line; ``numeric`` columns (indices; default: all but the first ``left_columns``)
    right-aligned."""
    numeric = range(left_columns, len(header)) if numeric is None else numeric
    align = ['---:' if i in numeric else '---' for i in range(len(header))]
    return ['| ' + ' | '.join(line) + ' |' for line in [header, align, *rows]]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], left_columns: int = 1,
                   numeric: Optional[Sequence[int]] = None) -> str:
    """:func:`markdown_lines` as one string."""
    return '\n'.join(markdown_lines(header, rows, left_columns, numeric))


def csv_text(rows: Sequence[Dict[str, Any]]) -> str:
    """The scalar fields of the rows as CSV (lists joined by 'x'; nested dicts stay in the JSON)."""
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items() if not isinstance(v, dict)))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, keys, extrasaction='ignore', lineterminator='\n')
    writer.writeheader()
    writer.writerows({k: 'x'.join(map(str, v)) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    return buf.getvalue()


def write_reports(rows: Sequence[Dict[str, Any]], stem: PathLike, markdown: str, settings: Dict[str, Any],
                  device: str = 'cpu', formats: Sequence[str] = ('json', 'csv', 'md')) -> List[Path]:
    """Writes ``stem.json`` (machine, settings, rows), ``stem.csv`` and ``stem.md`` (``markdown``)."""
    stem = Path(stem)
    paths = []
    if 'json' in formats:
        paths.append(write_json(stem.with_suffix('.json'), dict(
            machine=machine_description(device), settings=settings, rows=list(rows))))
    for fmt, text in (('csv', csv_text(rows)), ('md', markdown)):
        if fmt in formats:
            paths.append(write_text(stem.with_suffix('.' + fmt), text))
    return paths


def plot(series: Dict[str, List[Tuple[float, Optional[float], Optional[float]]]], path: PathLike, title: str,
         xlabel: str = 'input size (pixels per side)', ylabels: Sequence[str] = ('time per image (ms)',
                                                                                   'memory (MiB)')) -> Path:
    """Two log-log panels, time and memory against ``x``: one line per series label, points ``(x, time, memory)``
    (None where not measured, left out like zeros); a label containing 'train' is dashed. Writes the PNG atomically."""
    import matplotlib  # the `bench` extra
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for i, (label, pts) in enumerate(series.items()):
        for ax, col in zip(axes, (1, 2)):
            xy = sorted((p[0], p[col]) for p in pts if p[col])  # a log scale shows no zeros
            if xy:
                ax.plot(*zip(*xy), '--' if 'train' in label else '-', marker='o', color=f'C{i % 10}', label=label)
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale('log', base=2)
        ax.set_yscale('log')
        ax.set_xlabel(xlabel + ', log scale')
        ax.set_ylabel(ylabel + ', log scale')
        ax.grid(True, which='major', alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
    return Path(path)
