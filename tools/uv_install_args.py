"""Print the uv options that make ``uv pip install`` look where this machine's pip looks (the Makefile's install).

uv reads no pip configuration, so `make install` passes it what pip would use: index URLs, find-links and
constraint files from ``pip config list`` (its files and ``PIP_*`` variables; an ``install`` section or a variable
wins over ``global``, as in pip), and pip's choice of the best version across all indexes
(``--index-strategy unsafe-best-match``). On a machine with no pip configuration only that last option is printed.

Usage (the Makefile): ``eval uv pip install $(python tools/uv_install_args.py) ...``
"""
from __future__ import annotations

import ast
import shlex
import subprocess
import sys
from typing import Dict, List

# pip option -> uv option; each value of a list option (space or newline separated) becomes one flag
_UV_FLAGS = {
    'index-url': '--index-url',
    'extra-index-url': '--extra-index-url',
    'find-links': '--find-links',
    'constraint': '--constraint',
}
_SCOPE_RANK = {'global': 0, 'install': 1, ':env:': 2}  # later wins, as pip applies them


def pip_options(config_list: str) -> Dict[str, List[str]]:
    """The effective value of each option ``_UV_FLAGS`` knows, from the text of ``pip config list``.

    Args:
        config_list: lines such as ``global.extra-index-url='file:///a file:///b'`` or ``:env:.find-links='/w'``.

    Returns:
        Option name -> its values, from the highest-ranked scope that sets it.
    """
    chosen: Dict[str, tuple] = {}
    for line in config_list.splitlines():
        key, sep, raw = line.partition('=')
        scope, _, name = key.rpartition('.')
        if not sep or name not in _UV_FLAGS or scope not in _SCOPE_RANK:
            continue
        rank = _SCOPE_RANK[scope]
        if name not in chosen or rank >= chosen[name][0]:
            chosen[name] = (rank, ast.literal_eval(raw).split())
    return {name: values for name, (_, values) in chosen.items()}


def uv_args(options: Dict[str, List[str]]) -> List[str]:
    """uv flags for pip's options, plus pip's rule of taking the best match over all indexes."""
    args = ['--index-strategy', 'unsafe-best-match']
    for name, values in options.items():
        for value in values:
            args += [_UV_FLAGS[name], value]
    return args


def main() -> None:
    listed = subprocess.run([sys.executable, '-m', 'pip', 'config', 'list'], capture_output=True, text=True)
    print(shlex.join(uv_args(pip_options(listed.stdout if listed.returncode == 0 else ''))))


if __name__ == '__main__':
    main()
