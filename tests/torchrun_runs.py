"""Several runs of the tools in one torchrun launch (each launch starts torchrun's agent and its workers, each of
which imports torch, timm and lsvision: 10-20 s on 2 busy cores before a run starts).

    torchrun --nproc_per_node=2 tests/torchrun_runs.py train.py <arguments> ::: train.py <arguments> ...

Each run is ``tools/<tool>.main(arguments)`` in every worker, one after the other: the tool joins torchrun's process
group at its start and leaves it at its end, as when torchrun starts it; every run after the first meets on a store of
its own (:func:`fresh_store`). Before each run every worker prints
:func:`marker` to stdout and stderr (flushed), so that a test can cut the launch's output into the runs' outputs with
:func:`split_runs`. The launch exits with the first run's non-zero exit code (it stops there), else 0.
"""
import datetime
import os
import sys
from typing import Callable, Dict, List, Optional

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


def fresh_store(index: int, agent: tuple) -> None:
    """Points run ``index`` (> 0) of this worker at a rendezvous store of its own: once a process group is destroyed,
    torch names the next default group as it named the last, so on torchrun's store the ranks could read each
    other's addresses of the run before (gloo then fails to connect). Rank 0 hosts the new store on a free port,
    which it tells the others through torchrun's store (``agent``: its address and port)."""
    import torch.distributed as dist
    from _helpers import free_port
    store = dist.TCPStore(agent[0], agent[1], is_master=False, timeout=datetime.timedelta(seconds=300))
    key = f'torchrun_runs/port/{index}'
    if os.environ['RANK'] == '0':
        store.set(key, str(free_port()))
    os.environ['MASTER_PORT'] = store.get(key).decode()
    os.environ['TORCHELASTIC_USE_AGENT_STORE'] = 'False'  # env:// then makes rank 0 host a store at MASTER_PORT


def main(argv: List[str], after_run: Optional[Callable[[int], None]] = None) -> int:
    """Runs the runs of ``argv``; ``after_run(index)`` is called after each run that succeeds."""
    from _helpers import load_tool
    runs: List[List[str]] = [[]]
    for word in argv:
        if word == SEPARATOR:
            runs.append([])
        else:
            runs[-1].append(word)
    agent = (os.environ.get('MASTER_ADDR', ''), int(os.environ.get('MASTER_PORT', '0')))
    for index, (tool, *args) in enumerate(runs):
        if index and 'TORCHELASTIC_RUN_ID' in os.environ:
            fresh_store(index, agent)
        for stream in (sys.stdout, sys.stderr):
            print(marker(index), file=stream, flush=True)
        code = load_tool(tool.removesuffix('.py')).main(args)
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            return code
        if after_run is not None:
            after_run(index)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
