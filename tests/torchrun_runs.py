"""Several runs of the tools in one torchrun launch (each launch starts torchrun's agent and its workers, each of
which imports torch, timm and lsvision: 10-20 s on 2 busy cores before a run starts).

    torchrun --nproc_per_node=2 tests/torchrun_runs.py train.py <arguments> ::: train.py <arguments> ...

Each run is ``tools/<tool>.main(arguments)`` in every worker, one after the other: the tool joins torchrun's process
group at its start and leaves it at its end, as when torchrun starts it. Before each run every worker prints
:func:`marker` to stdout and stderr (flushed), so that a test can cut the launch's output into the runs' outputs with
:func:`split_runs`. The launch exits with the first run's non-zero exit code (it stops there), else 0.
"""
import sys
from typing import Dict, List

SEPARATOR = ':::'


def marker(index: int) -> str:
    return f'=== torchrun_runs: run {index} ==='


def split_runs(text: str, runs: int) -> List[str]:
    """The output of each of ``runs`` runs (what every worker printed after the run's marker), in order."""
    parts: Dict[int, List[str]] = {i: [] for i in range(runs)}
    current = None
    for line in text.splitlines(keepends=True):
        index = next((i for i in range(runs) if line.strip() == marker(i)), None)
        if index is not None:
            current = index
        elif current is not None:
            parts[current].append(line)
    return [''.join(parts[i]) for i in range(runs)]


def launch_args(*runs: List[str]) -> List[str]:
    """The script's arguments for ``runs`` (each: the tool's file name, then its arguments)."""
    out: List[str] = []
    for i, run in enumerate(runs):
        out += ([SEPARATOR] if i else []) + list(run)
    return out


def main(argv: List[str]) -> int:
    from _helpers import load_tool
    runs: List[List[str]] = [[]]
    for word in argv:
        if word == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(word)
    for index, (tool, *args) in enumerate(runs):
        for stream in (sys.stdout, sys.stderr):
            print(marker(index), file=stream, flush=True)
        code = load_tool(tool.removesuffix('.py')).main(args)
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            return code
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
