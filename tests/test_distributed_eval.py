"""Evaluation under torchrun (gloo, CPU): every image scored by exactly one process, numbers equal to one process.

The launches are torchrun's own code run in the test process (``_helpers.torchrun``: its parser, elastic agent and
``--run-path``, workers forked from a forkserver with torch imported), but for node 1 of the two-"node" launches, a
real ``torchrun`` command. Each launch still costs seconds, so the suites share launches: one ``torchrun --nproc-
per-node 2`` of validate.py (ImageNet + ReaL, V2), one two-"node" launch of robustness.py (two torchrun processes,
``--nnodes 2 --nproc-per-node 1``, static rendezvous) over ImageNet, -C, -A, -R, -9 and corruptions on the fly, one
two-"node" launch where node 1 lacks a dataset, one ``torchrun --nproc-per-node 2`` of train.py on the digits and
one of validate.py's folder suite on its checkpoint. The trees carry macOS junk files and an unreadable image, and
one ImageNet-C set holds a single image (one process gets none of it).

Batch size 1 everywhere: the tiny model's logits of an image then do not depend on which images share its batch, so
one process and two give bitwise-equal logits and the results must be equal, not close.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _helpers import EVAL_CVT_LS, free_port, load_tool, model_kwargs_args, save_eval_checkpoint, torchrun
from eval_fixtures import (
    add_mac_junk,
    make_imagenet,
    make_imagenet_9,
    make_imagenet_ar,
    make_imagenet_c,
    make_v2,
    truncate,
)

import lsvision  # noqa: F401  (registers cvt_ls_13)
from lsvision.eval.distributed import shard_range

ROOT = Path(__file__).resolve().parents[1]
TINY = model_kwargs_args(EVAL_CVT_LS)
CORRUPTIONS = ('gaussian_noise', 'contrast', 'speckle_noise')
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1')


@pytest.fixture(scope='module')
def trees(tmp_path_factory) -> Dict[str, Any]:
    root = tmp_path_factory.mktemp('dist_eval')
    save_eval_checkpoint(root / 'tiny.safetensors')
    imagenet = make_imagenet(root / 'imagenet')
    truncate(next((root / 'imagenet' / 'val').rglob('ILSVRC2012_val_00000004.JPEG')))
    c = make_imagenet_c(root / 'c', CORRUPTIONS)
    shutil.rmtree(next((c / 'contrast' / '3').rglob('ILSVRC2012_val_00000002.JPEG')).parent)  # 1 image, 2 processes
    truncate(next((c / 'gaussian_noise' / '2').rglob('ILSVRC2012_val_00000002.JPEG')))
    a = make_imagenet_ar(root / 'a', 'a')['root']
    truncate(sorted(a.rglob('*.jpg'))[-1])
    trees = dict(ckpt=root / 'tiny.safetensors', imagenet=imagenet['root'], real_json=imagenet['real_json'],
                 v2=make_v2(root / 'v2'), c=c, a=a, r=make_imagenet_ar(root / 'r', 'r')['root'],
                 in9=make_imagenet_9(root / 'bg')[0])
    for key in ('imagenet', 'v2', 'c', 'a', 'r', 'in9'):
        add_mac_junk(trees[key])
    return trees


def _model_args(trees: Dict[str, Any]) -> List[str]:
    return ['--models', 'cvt_ls_13', '--checkpoint', str(trees['ckpt']), '--model-kwargs', *TINY, '--batch-size',
            '1', '--workers', '0', '--threads', '1', '--device', 'cpu']


def _validate_args(trees: Dict[str, Any]) -> List[str]:
    return ['--imagenet', str(trees['imagenet']), '--real-labels', str(trees['real_json']), '--imagenet-v2',
            str(trees['v2']), *_model_args(trees)]


def _robustness_args(trees: Dict[str, Any]) -> List[str]:
    return ['--imagenet', str(trees['imagenet']), '--imagenet-c', str(trees['c']), '--corruptions', *CORRUPTIONS,
            '--imagenet-a', str(trees['a']), '--imagenet-r', str(trees['r']), '--imagenet-9', str(trees['in9']),
            '--corrupt-on-the-fly', str(trees['imagenet']), *_model_args(trees)]


def _torchrun(*args: str) -> List[str]:
    return [sys.executable, '-m', 'torch.distributed.run', *args]


def _two_nodes(script: str, node_args: List[List[str]], log_dir: Path, timeout: int = 240
               ) -> List[subprocess.CompletedProcess]:
    """Two torchrun agents on this machine as two one-process "nodes" (static rendezvous on a free port): node 1 a
    ``torchrun`` command, node 0 torchrun's code in this process (``_helpers.torchrun``)."""
    port = free_port()

    def node(rank: int) -> List[str]:
        return ['--nnodes', '2', '--nproc-per-node', '1', '--node-rank', str(rank), '--master-addr', '127.0.0.1',
                '--master-port', str(port), str(ROOT / 'tools' / script), *node_args[rank]]

    log_dir.mkdir(parents=True)
    with open(log_dir / 'node1.out', 'w+') as out, open(log_dir / 'node1.err', 'w+') as err:  # files: no pipe fills
        node1 = subprocess.Popen(_torchrun(*node(1)), stdout=out, stderr=err, text=True, env=ENV)
        try:
            node0 = torchrun(node(0), log_dir / 'node0', ENV)
        finally:
            node1.wait(timeout=timeout)
        out.seek(0), err.seek(0)
        return [node0, subprocess.CompletedProcess(node1.args, node1.returncode, out.read(), err.read())]


def _one_process(tool: str, args: List[str], out: Path) -> Dict[str, Any]:
    with pytest.warns():  # the fixtures' layout and the unreadable images warn
        assert load_tool(tool).main([*args, '--no-progress', '--out-dir', str(out)]) == 0
    return json.loads((out / 'results.json').read_text())


def _assert_same_results(got: Dict[str, Any], expected: Dict[str, Any], processes: int) -> None:
    assert got['processes'] == processes and expected['processes'] == 1
    for g, e in zip(got['models'], expected['models'], strict=True):
        assert g['suites'] == e['suites']


def test_shard_range_covers_every_index_once():
    for n in (0, 1, 5, 7, 50):
        for world in (1, 2, 3, 8):
            shards = [shard_range(n, rank, world) for rank in range(world)]
            assert [i for s in shards for i in s] == list(range(n))  # contiguous, rank order, no padding
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert [len(shard_range(1, rank, 3)) for rank in range(3)] == [1, 0, 0]


def test_validate_two_processes_equals_one(trees, tmp_path):
    proc = torchrun(['--standalone', '--nproc-per-node', '2', str(ROOT / 'tools' / 'validate.py'),
                     *_validate_args(trees), '--out-dir', str(tmp_path / 'two')], tmp_path / 'logs', ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / 'two' / 'results.json').read_text())
    expected = _one_process('validate', _validate_args(trees), tmp_path / 'one')
    _assert_same_results(got, expected, 2)
    inet = got['models'][0]['suites']['imagenet']
    assert (inet['images'], inet['count'], len(inet['skipped'])) == (6, 5, 1)  # the junk files are not images
    assert inet['real']['count'] == 4
    # written once, by rank 0: the markdown is printed once, and one progress bar counted every image
    assert proc.stdout.count('| model |') == expected_tables(tmp_path / 'one' / 'results.md')
    assert (tmp_path / 'two' / 'results.md').read_text() == (tmp_path / 'one' / 'results.md').read_text()
    assert 'on 2 processes' in proc.stderr and '36/36' in proc.stderr  # 6 ImageNet + 3 x 10 V2 images


def expected_tables(md: Path) -> int:
    return md.read_text().count('| model |')


def test_robustness_two_nodes_equals_one_process(trees, tmp_path):
    args = [*_robustness_args(trees), '--out-dir', str(tmp_path / 'two')]
    procs = _two_nodes('robustness.py', [args, args], tmp_path / 'logs')
    for p in procs:
        assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads((tmp_path / 'two' / 'results.json').read_text())
    expected = _one_process('robustness', _robustness_args(trees), tmp_path / 'one')
    _assert_same_results(got, expected, 2)
    suites = got['models'][0]['suites']
    c = suites['imagenet_c']
    assert c['corruptions']['contrast']['severities']['3']['count'] == 1  # rank 1 had nothing of this set
    assert [os.path.basename(s['file']) for s in c['skipped']] == ['ILSVRC2012_val_00000002.JPEG']
    assert (suites['imagenet_a']['count'], len(suites['imagenet_a']['skipped'])) == (3, 1)
    assert suites['imagenet_9']['bg_gap'] == expected['models'][0]['suites']['imagenet_9']['bg_gap']
    fly = suites['imagenet_c_on_the_fly']['corruptions']['contrast']['severities']['3']
    assert (fly['count'], len(fly['skipped'])) == (5, 1)  # corrupted per image (seeded by its pixels), not by order
    assert not procs[1].stdout  # node 1 (rank 1) writes and prints nothing
    assert (tmp_path / 'two' / 'imagenet_c.png').is_file()


def test_a_node_without_the_dataset_fails_the_job_naming_rank_and_path(trees, tmp_path):
    missing = tmp_path / 'not_mounted' / 'imagenet-a'
    base = [*_model_args(trees), '--out-dir', str(tmp_path / 'out')]
    procs = _two_nodes('robustness.py', [['--imagenet-a', str(trees['a']), *base],
                                         ['--imagenet-a', str(missing), *base]], tmp_path / 'logs', timeout=120)
    assert all(p.returncode != 0 for p in procs)
    for p in procs:  # both processes stop with the same message, before reading an image
        assert f'rank 1 on {socket.gethostname()}: --imagenet-a {missing} does not exist' in p.stderr, p.stderr
    assert not (tmp_path / 'out' / 'results.json').exists()


def test_train_in_loop_top1_under_ddp_equals_one_process_validate(tmp_path):
    out = tmp_path / 'train'
    proc = torchrun(['--standalone', '--nproc-per-node', '2', str(ROOT / 'tools' / 'train.py'), '--epochs', '1',
                     '--warmup-epochs', '0', '--time-budget', '0', '-j', '0', '--output', str(out)],
                    tmp_path / 'train_logs', ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert 'validation: 359 images scored by 2 processes (each image once)' in proc.stderr
    result = json.loads((out / 'digits_demo' / 'result.json').read_text())
    from lsvision.data import export_digits
    val = Path(export_digits()['root']) / 'val'
    model = ['--model', 'cvt_ls_13', '--checkpoint', result['last_checkpoint'], '--workers', '0', '--threads', '1']
    res = _one_process_quiet('validate', ['--data-dir', str(val), *model], tmp_path / 'val')
    folder = res['models'][0]['suites']['folder']
    assert folder['count'] == 359
    assert folder['top1'] == pytest.approx(result['model_metrics']['top1'], abs=1e-9)

    # the folder suite under torchrun, with junk files and an unreadable image: the same as one process (on five
    # images of each class: batch size 1 makes each image a step of its own)
    junk_val = tmp_path / 'digits_val'
    for class_dir in sorted(val.iterdir()):
        (junk_val / class_dir.name).mkdir(parents=True)
        for image in sorted(class_dir.glob('*.png'))[:5]:
            shutil.copy(image, junk_val / class_dir.name / image.name)
    add_mac_junk(junk_val)
    truncate(sorted(junk_val.rglob('*.png'))[-1], keep=0.5)
    args = ['--data-dir', str(junk_val), *model, '--batch-size', '1']
    proc = torchrun(['--standalone', '--nproc-per-node', '2', str(ROOT / 'tools' / 'validate.py'), *args,
                     '--out-dir', str(tmp_path / 'two')], tmp_path / 'val_logs', ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / 'two' / 'results.json').read_text())
    expected = _one_process('validate', args, tmp_path / 'one')
    _assert_same_results(got, expected, 2)
    folder = got['models'][0]['suites']['folder']
    assert (folder['count'], len(folder['skipped'])) == (49, 1)
    assert sum(row['count'] for row in folder['per_class'].values()) == 49


def _one_process_quiet(tool: str, args: List[str], out: Path) -> Dict[str, Any]:
    assert load_tool(tool).main([*args, '--no-progress', '--out-dir', str(out)]) == 0
    return json.loads((out / 'results.json').read_text())
