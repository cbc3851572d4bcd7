"""Run timm's own model tests (`tests/test_models.py` of the installed timm version) against lsvision's models.

    python contract/run.py                                     # the default subset (what `make contract` runs)
    python contract/run.py --models '*'                        # every lsvision model
    python contract/run.py --models 'cvt_*' -x -k 'forward'    # other arguments go to pytest

The test file comes from the sdist of exactly the installed timm version on the package index
(``pip download timm==<version> --no-deps --no-binary :all:``) and is cached in ``contract/.cache/`` (git-ignored),
so nothing of timm is committed and the tests always match the timm in use. pytest then runs it in this process with
:class:`plugin.TimmContract`, which restricts it to the selected models and prints a model x test matrix.
Exit status: pytest's (0 all passed, 1 failures, 4 usage error such as a pattern that matches no model), or 2 when
the test file cannot be fetched.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest
from plugin import MATRIX_TITLE, TimmContract, matrix_lines, write_atomic

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
CACHE_DIR = HERE / '.cache'
# one model per family, the smallest registered one (CvT-LS, CvT, ViL-LS, PVTv2-GRC, PVT-GRC, Swin-GRC, ViT/DeiT-GRC);
# Swin and DeiT have a fixed 224 input, so their forward/backward/fx and pruning tests take most of the time
DEFAULT_MODELS = ('cvt_ls_13,cvt_13,vil_ls_medium,pvt_v2_b0_grc,pvt_tiny_grc,swin_tiny_patch4_window7_224_grc,'
                  'deit_small_patch16_224_grc')
# CvT and CvT-LS return tokens from forward_features (cls token first, as timm's ViT): timm's non-standard cfg test
DEFAULT_NON_STD = 'cvt_*'


def fetch_timm_tests(version: str, cache_dir: Path = CACHE_DIR) -> Path:
    """Path of timm's ``tests/test_models.py`` for ``version``, taken from that version's sdist on first use.

    Raises:
        RuntimeError: pip cannot download the sdist, or the sdist has no ``tests/test_models.py``.
    """
    dest = cache_dir / f'timm-{version}' / 'test_models.py'
    if dest.is_file():
        return dest
    print(f'contract: fetching tests/test_models.py from the timm {version} sdist into {dest.parent}', file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, '-m', 'pip', 'download', f'timm=={version}', '--no-deps', '--no-binary', ':all:',
               '--quiet', '--dest', tmp]
        pip = subprocess.run(cmd, capture_output=True, text=True)
        sdists = sorted(Path(tmp).glob('timm-*.tar.gz'))
        if pip.returncode != 0 or not sdists:
            raise RuntimeError(
                f'could not download the timm {version} sdist ({" ".join(cmd[1:])} exited {pip.returncode}):\n'
                f'{pip.stderr.strip() or pip.stdout.strip()}\n'
                f"The runner needs the package index once per timm version; or put timm {version}'s "
                f'tests/test_models.py at {dest} yourself.')
        sdist = sdists[0]
        member = f'{sdist.name[:-len(".tar.gz")]}/tests/test_models.py'
        with tarfile.open(sdist) as tar:
            try:
                source = tar.extractfile(member).read()
            except KeyError:
                raise RuntimeError(f'{sdist.name} has no {member}: this timm version does not ship its tests') from None
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    write_atomic(dest.parent / 'SOURCE', f'{sdist.name} sha256:{digest} member:{member}\n'.encode())
    write_atomic(dest, source)
    return dest


def _source_of(test_file: Path) -> str:
    source = test_file.parent / 'SOURCE'
    return source.read_text().strip() if source.is_file() else f'{test_file} (no SOURCE: placed by hand)'


def split_patterns(text: str) -> List[str]:
    """fnmatch patterns from a comma or whitespace separated string."""
    return [p for p in re.split(r'[,\s]+', text) if p]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0], allow_abbrev=False,
        epilog='Other arguments (-x, -k EXPR, -m MARKEXPR, --durations=N, ...) are passed to pytest.')
    parser.add_argument('--models', default=DEFAULT_MODELS,
                        help=f"fnmatch patterns (comma/space separated) of the models to test; '*' = all "
                             f'(default: {DEFAULT_MODELS})')
    parser.add_argument('--exclude', default='', help='patterns of models never to test')
    parser.add_argument('--packages', default='lsvision',
                        help='modules to import; their registered timm models are the ones under test (default: '
                             'lsvision)')
    parser.add_argument('--non-std', default=DEFAULT_NON_STD,
                        help="patterns of token-output models that timm's NON_STD_FILTERS does not name already "
                             f'(default: {DEFAULT_NON_STD}; vit_*_grc and deit_*_grc match its vit_* and deit*)')
    parser.add_argument('--report', type=Path, help='also write the model x test outcomes to this JSON file')
    parser.add_argument('--jobs', type=int, default=1,
                        help='processes to run at once, each taking the next selected test as it is free (default: '
                             '1, this process)')
    parser.add_argument('--claim-dir', type=Path,
                        help='a folder shared by processes running the same selection: each test runs in the one '
                             'that claims it first (what --jobs gives its jobs)')
    args, pytest_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f'--jobs must be at least 1, not {args.jobs}')

    try:
        test_file = fetch_timm_tests(importlib.metadata.version('timm'))
    except RuntimeError as e:
        print(f'contract: {e}', file=sys.stderr)
        return 2

    sys.path.insert(0, str(REPO_ROOT))  # this checkout's lsvision, whatever else is installed
    if args.jobs > 1:
        return run_jobs(args, pytest_args)
    contract = TimmContract(
        packages=split_patterns(args.packages),
        models=split_patterns(args.models),
        exclude=split_patterns(args.exclude),
        non_std=split_patterns(args.non_std),
        report=args.report,
        tests_source=_source_of(test_file),
        claim_dir=args.claim_dir,
    )
    # importlib mode: the cached file imports as a plain module, with no clash with the project's own tests
    return int(pytest.main(
        ['-c', str(HERE / 'pytest.ini'), '--rootdir', str(HERE), '--import-mode=importlib', str(test_file),
         *pytest_args],
        plugins=[contract]))


def _merged_exit(codes: List[int]) -> int:
    """One exit status for several pytest runs: failures first; "no tests collected" (5) only if every job had none."""
    real = [c for c in codes if c != 5]
    return max(real) if real else 5


def run_jobs(args: argparse.Namespace, pytest_args: List[str]) -> int:
    """Runs the selection in ``args.jobs`` child processes that share a claim folder (``--claim-dir``: each takes
    the next test that no other has taken, so that they end together), prints each child's output once it ends and
    then the merged model x test matrix; ``--report`` gets the merged outcomes. This process imports neither torch
    nor the models: the children select them (and report a pattern that matches none)."""
    t0 = time.time()
    jobs = args.jobs
    # the cores shared out: torch threads that wait on each other while the other jobs hold the cores run many
    # times slower than one thread each
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    with tempfile.TemporaryDirectory(prefix='contract-jobs-') as tmp:
        (Path(tmp) / 'claims').mkdir()
        procs = []
        for i in range(jobs):
            log = open(Path(tmp) / f'job{i}.log', 'w+')
            cmd = [sys.executable, str(Path(__file__).resolve()), '--models', args.models, '--packages',
                   args.packages, '--exclude', args.exclude, '--non-std', args.non_std,
                   '--claim-dir', str(Path(tmp) / 'claims'), '--report', str(Path(tmp) / f'job{i}.json'),
                   *pytest_args]
            procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        codes = []
        for i, (proc, log) in enumerate(procs):
            codes.append(proc.wait())
            log.seek(0)
            print(f'===== contract job {i + 1}/{jobs} ({threads} torch threads; exit {codes[-1]}) =====')
            print(log.read(), end='', flush=True)
            log.close()
        reports = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob('job*.json'), key=lambda p: p.name)]
    if not reports:
        return _merged_exit(codes)
    outcomes, durations = {}, {}
    for report in reports:
        for model, by_test in report['outcomes'].items():
            for fn, outcome in by_test.items():  # a hub test is 'deselected' in every job; the others run in one
                if outcomes.get((fn, model)) in (None, 'deselected'):
                    outcomes[(fn, model)] = outcome
        for fn, s in report['durations_s'].items():
            durations[fn] = durations.get(fn, 0.0) + s
    deselected = reports[0]['deselected']  # every job collected and deselected the same tests
    ran = reports[0]['models']  # every job's selection, in timm's order
    print(f'===== {MATRIX_TITLE}, {jobs} jobs =====')
    print('\n'.join(matrix_lines(ran, outcomes, durations, deselected, time.time() - t0)))
    status = _merged_exit(codes)
    if args.report:
        merged = dict(reports[0], models=ran, exitstatus=status, deselected=deselected,
                      outcomes={m: {fn: o for (fn, model), o in sorted(outcomes.items()) if model == m} for m in ran},
                      durations_s={fn: round(s, 2) for fn, s in sorted(durations.items())})
        write_atomic(args.report, (json.dumps(merged, indent=2) + '\n').encode())
        print(f'  JSON report: {args.report}')
    return status


if __name__ == '__main__':
    sys.exit(main())
