"""pytest plugin that points timm's ``tests/test_models.py`` at the models of other packages (``contract/run.py``).

timm's test file builds every parametrize list from ``timm.list_models`` / ``timm.list_pretrained`` when it is
imported. Before that import (in ``pytest_configure``) the plugin imports the packages, which registers their models,
and wraps both functions so they only return the selected package models. Two of timm's name lists are widened:

* ``module=FEAT_INTER_FILTERS`` (the timm modules known to implement ``forward_intermediates``): the module limit is
  dropped, since package models live in package modules and all of lsvision's implement it;
* ``NON_STD_FILTERS`` (token-output models: ``test_model_default_cfgs_non_std`` instead of
  ``test_model_default_cfgs``, no ``features_only`` test), recognised by its ``'vit_*'`` entry wherever it is passed
  as ``filter`` or ``exclude_filters``: the ``non_std`` patterns are added to it.

Collection then keeps only tests parametrized with a package model (timm's hard-coded tests of its own models go),
minus the tests that download from the Hugging Face hub; the end of the run prints a model x test matrix.
"""
import fnmatch
import hashlib
import importlib
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

# tests that fetch files from the Hugging Face hub (test tensors or pretrained weights): not run, CI must not depend
# on the hub (and lsvision publishes no weights there)
HUB_TESTS = {
    'test_model_inference': 'needs timm test tensors from the hub',
    'test_model_load_pretrained': 'downloads pretrained weights',
    'test_model_features_pretrained': 'downloads pretrained weights',
}
_NON_STD_MARKER = 'vit_*'  # first entry of timm's NON_STD_FILTERS; test_models.py's other lists lack it
MATRIX_TITLE = 'timm contract: model x test (P pass, F fail, E error, S skip, - hub test, . not run)'
_LETTERS = {'passed': 'P', 'failed': 'F', 'error': 'E', 'skipped': 'S', 'deselected': '-'}


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temp file and a rename, so an interrupted or concurrent run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; these are plain data files
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _arch(name: str) -> str:
    return name.split('.', 1)[0]


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(_arch(name), p) for p in patterns)


def _is_non_std_list(value) -> bool:
    return isinstance(value, (list, tuple)) and _NON_STD_MARKER in value


def select_models(packages: Sequence[str], patterns: Sequence[str], exclude: Sequence[str] = ()) -> List[str]:
    """The timm models registered by ``packages`` that match ``patterns`` and not ``exclude``, in timm's order.

    Raises:
        ValueError: a package does not import, registers no model, or no model matches (the message says which).
    """
    import timm.models  # here, not at the top: `run.py --jobs` merges the jobs' reports without torch

    for package in packages:
        try:
            importlib.import_module(package)
        except Exception as e:
            raise ValueError(f'contract: importing {package!r} failed: {type(e).__name__}: {e}') from e
    roots = tuple(p.split('.')[0] for p in packages)
    ours = [n for n in timm.models.list_models() if timm.models.model_entrypoint(n).__module__.split('.')[0] in roots]
    if not ours:
        raise ValueError(f'contract: importing {list(packages)} registered no timm models')
    selected = [n for n in ours if _matches(n, patterns) and not _matches(n, exclude)]
    if not selected:
        raise ValueError(
            f'contract: no model of {list(packages)} matches --models {",".join(patterns)!r}'
            f'{" minus --exclude " + ",".join(exclude) if exclude else ""}; they have: {", ".join(ours)}')
    return selected


def matrix_lines(models: Sequence[str], outcomes: Dict[Tuple[str, str], str], durations: Dict[str, float],
                 deselected: Dict[str, int], wall_s: float) -> List[str]:
    """The model x test matrix the end of a run prints (one letter per outcome, a legend of the tests above)."""
    tests = sorted({fn for fn, _ in outcomes})
    lines = [f'  [{i:2d}] {fn}  ({durations.get(fn, 0.0):.1f}s)' for i, fn in enumerate(tests)]
    width = max(len(m) for m in models)
    lines.append(' ' * (width + 2) + ''.join(f'{i:>3d}' for i in range(len(tests))))
    for model in models:
        row = ''.join(f'{_LETTERS.get(outcomes.get((fn, model)), "."):>3s}' for fn in tests)
        lines.append(f'  {model:<{width}}{row}')
    lines += [f'  deselected, {reason}: {count}' for reason, count in sorted(deselected.items())]
    lines.append(f'  wall time: {wall_s:.1f}s')
    return lines


class TimmContract:
    """Selects package models for timm's test file and reports a model x test matrix.

    Args:
        packages: modules to import; every timm model whose entrypoint lives under one of them is a package model.
        models: fnmatch patterns selecting the package models to test (``['*']``: all).
        exclude: patterns of package models never to test.
        non_std: patterns of token-output models to add to timm's ``NON_STD_FILTERS``.
        report: optional JSON file for the outcomes.
        tests_source: where the test file came from, for the report header.
        claim_dir: a folder shared with other processes running the same selection (``run.py --jobs``): each
            test runs in the one process that claims it first (a file of that name, created exclusively), so the
            jobs take the next test as each is free, as pytest-xdist's workers do.
    """

    def __init__(self, packages: Sequence[str], models: Sequence[str], exclude: Sequence[str] = (),
                 non_std: Sequence[str] = (), report: Optional[Path] = None, tests_source: str = '?',
                 claim_dir: Optional[Path] = None):
        self.claim_dir = claim_dir
        self.packages = list(packages)
        self.patterns = list(models)
        self.exclude = list(exclude)
        self.non_std = list(non_std)
        self.report = report
        self.tests_source = tests_source
        self.models: List[str] = []
        self.outcomes: Dict[Tuple[str, str], str] = {}  # (test function, model) -> outcome
        self.durations: Dict[str, float] = defaultdict(float)  # test function -> seconds, all models
        self.deselected: Dict[str, int] = defaultdict(int)  # reason -> count
        self._item_keys: Dict[str, Tuple[str, str]] = {}  # nodeid -> (test function, model)
        self._originals = {}
        self._t0 = time.time()

    # --- selection -----------------------------------------------------------------------------------------------
    def pytest_configure(self, config: pytest.Config) -> None:
        if config.option.help or config.option.version:
            return
        try:
            self.models = select_models(self.packages, self.patterns, self.exclude)
        except ValueError as e:  # a usage error with the cause, not an INTERNALERROR traceback
            raise pytest.UsageError(str(e)) from e.__cause__
        self._wrap_timm_lists()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import timm
        for module in (timm, timm.models):
            for name, fn in self._originals.items():
                setattr(module, name, fn)

    def _wrap_timm_lists(self) -> None:
        import timm.models
        list_models, list_pretrained = timm.models.list_models, timm.models.list_pretrained
        self._originals = dict(list_models=list_models, list_pretrained=list_pretrained)
        selected = set(self.models)

        def contract_list_models(filter='', module='', exclude_filters='', **kwargs) -> List[str]:
            module = ''  # only FEAT_INTER_FILTERS is passed as module=: every package model has forward_intermediates
            if _is_non_std_list(filter):
                filter = [*filter, *self.non_std]
            if _is_non_std_list(exclude_filters):
                exclude_filters = [*exclude_filters, *self.non_std]
            names = list_models(filter=filter, module=module, exclude_filters=exclude_filters, **kwargs)
            return [n for n in names if _arch(n) in selected]

        def contract_list_pretrained(*args, **kwargs) -> List[str]:
            return [n for n in list_pretrained(*args, **kwargs) if _arch(n) in selected]

        for module in (timm, timm.models):  # test_models.py does `from timm import list_models, list_pretrained`
            module.list_models = contract_list_models
            module.list_pretrained = contract_list_pretrained

    def pytest_report_header(self, config: pytest.Config) -> List[str]:
        import torch

        import timm
        return [f'contract: timm {timm.__version__}, torch {torch.__version__}, tests from {self.tests_source}',
                f'contract: {len(self.models)} models of {",".join(self.packages)}: {", ".join(self.models)}']

    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: List[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            fn = getattr(item, 'originalname', item.name)
            callspec = getattr(item, 'callspec', None)
            model = callspec.params.get('model_name') if callspec else None
            if not isinstance(model, str) or _arch(model) not in self.models:
                reason = "timm's tests of its own models"
            elif fn in HUB_TESTS:
                reason = HUB_TESTS[fn]
                self.outcomes[(fn, _arch(model))] = 'deselected'
            else:
                keep.append(item)
                self._item_keys[item.nodeid] = (fn, _arch(model))
                continue
            drop.append(item)
            self.deselected[reason] += 1
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: Optional[pytest.Item]) -> Optional[bool]:
        """With a claim folder: run the test only if this process claims it first (True: another job has it)."""
        if self.claim_dir is None:
            return None
        claim = self.claim_dir / hashlib.sha1(item.nodeid.encode()).hexdigest()
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return True
        return None

    # --- reporting -----------------------------------------------------------------------------------------------
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        key = self._item_keys.get(report.nodeid)
        if key is None:
            return
        self.durations[key[0]] += report.duration
        if report.when == 'call' or report.outcome != 'passed':
            outcome = 'error' if report.failed and report.when != 'call' else report.outcome
            if self.outcomes.get(key) not in ('failed', 'error'):  # a failure in any phase wins
                self.outcomes[key] = outcome

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        if not self.outcomes:  # usage error or --collect-only: nothing ran
            return
        tr = terminalreporter
        tr.section(MATRIX_TITLE)
        for line in matrix_lines(self.models, self.outcomes, self.durations, self.deselected, time.time() - self._t0):
            tr.write_line(line)
        if self.report:
            self._write_report(exitstatus)
            tr.write_line(f'  JSON report: {self.report}')

    def _write_report(self, exitstatus: int) -> None:
        import timm
        data = dict(
            timm_version=timm.__version__,
            tests_source=self.tests_source,
            packages=self.packages,
            models=self.models,
            exitstatus=int(exitstatus),
            outcomes={m: {fn: o for (fn, model), o in sorted(self.outcomes.items()) if model == m}
                      for m in self.models},
            durations_s={fn: round(s, 2) for fn, s in sorted(self.durations.items())},
            deselected=dict(self.deselected),
        )
        write_atomic(self.report, (json.dumps(data, indent=2) + '\n').encode())
