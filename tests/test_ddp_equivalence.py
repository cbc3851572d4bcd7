"""The training loop computes the right updates: DDP equals one process, accumulation equals one big batch.

Each test compares the final weights (last.pth.tar) of two ways of training on the same samples, which must agree up
to float rounding, so a wrong gradient average across processes, a wrong per-rank data split, a wrong loss scale
for accumulated micro-batches or a mishandled last partial accumulation of an epoch changes the weights and fails.

Why these settings:
- The model is a tiny ViL-LS (LayerNorm only, a long-short attention stage and a full one). The CvT-LS of
  tests/test_train.py has BatchNorm in its conv projections: under DDP each rank normalises by the statistics of its
  own b samples, not of the global 2b, so its weights differ by ~3e-2 from the one-process run for a legitimate
  reason (and --sync-bn is ignored on CPU: torch's SyncBatchNorm runs on GPUs only).
- Plain SGD (nesterov momentum, no weight decay, a constant lr): its update is linear in the gradient, so a gradient
  off by a factor (mean vs sum over ranks, loss not divided by the accumulation steps) moves the weights. Adam would
  normalise such a factor away.
- No data or model randomness (--no-aug, no mixup / cutmix / random erasing / drop path) and no AMP: the ranks
  augment with seeds of their own, which would make the two runs see different pixels. No label smoothing: the
  reference loop of the accumulation test is plain cross-entropy.
- Data order: the sampler is torch's DistributedSampler (shuffle, seed + epoch): rank r takes positions r, r + W,
  ... of one permutation, so micro-batch k of 2 ranks x b samples holds positions [2bk, 2bk + 2b) of the same
  permutation that one process cuts into batches of 2b. 20 images: 10 per rank, no padding.
"""
import csv
import math
import os
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import TINY_VIL_LS_TWO_STAGES, model_kwargs_args, torchrun, write_two_class_images
from PIL import Image

import timm

from lsvision.train import load_checkpoint, parse_args, run

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / 'tools' / 'train.py'
SEED = 3
LR = 0.1
MOMENTUM = 0.9
EPOCHS = 2
PER_CLASS = 10  # 20 training images: 5 batches of 4, 5 micro-batches of 2 per rank
# the two-stage ViL-LS without BatchNorm, smaller: 16x16 input -> maps 4 (long-short, cls token) / 2 (full attention)
VIL_KWARGS = dict(TINY_VIL_LS_TWO_STAGES, img_size=16, embed_dims=(8, 16))
TINY_VIL = [
    '--model', 'vil_ls_medium', '--num-classes', '2', '--input-size', '3', '16', '16',
    '--model-kwargs', *model_kwargs_args(VIL_KWARGS),
    '--mean', '0.5', '0.5', '0.5', '--std', '0.5', '0.5', '0.5', '--crop-pct', '1.0', '--threads', '1',
    '--seed', str(SEED), '--epochs', str(EPOCHS), '-j', '0', '--progress', 'log', '--no-amp',
    # plain SGD at a constant lr
    '--opt', 'sgd', '--momentum', str(MOMENTUM), '--weight-decay', '0', '--lr', str(LR), '--sched', 'step',
    '--decay-epochs', '1000', '--warmup-epochs', '0', '--no-model-ema',
    # nothing random: the same pixels and the same network on every rank
    '--no-aug', '--aa', '', '--mixup', '0', '--cutmix', '0', '--reprob', '0', '--drop-path', '0', '--smoothing', '0',
]
# float rounding only (summation order of the all-reduce / of a larger batch): measured below 1e-6 for weights of
# magnitude ~1; the mutations these tests are meant to catch move the weights by 1e-3 and more
ATOL = RTOL = 1e-5


@pytest.fixture(scope='module')
def image_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('images')
    write_two_class_images(root, per_class=PER_CLASS)
    return root


def _args(image_root: Path, out: Path, name: str, *extra: str) -> List[str]:
    return [str(image_root), '--output', str(out), '--experiment', name, *TINY_VIL, *extra]


def _one_process(image_root: Path, out: Path, name: str, *extra: str) -> Path:
    run(parse_args(_args(image_root, out, name, *extra)))
    return out / name


def _two_processes(image_root: Path, out: Path, name: str, *extra: str) -> Tuple[Path, str]:
    """tools/train.py under torchrun: 2 processes, gloo, as tests/test_train.py runs it; (run directory, log)."""
    proc = torchrun(['--standalone', '--nproc_per_node=2', str(TRAIN), *_args(image_root, out, name, *extra)],
                    out / f'{name}_logs', dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert 'backend gloo' in proc.stderr
    return out / name, proc.stderr


def _largest_difference(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _assert_same_weights(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys()
    diff = _largest_difference(got, expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f'{what}: {k}: {m} (largest difference of all: {diff:.3g})')


def _epoch_losses(run_dir: Path) -> List[float]:
    with open(run_dir / 'summary.csv') as f:
        return [float(row['train_loss']) for row in csv.DictReader(f)]


def _state(run_dir: Path) -> dict:
    return load_checkpoint(str(run_dir / 'last.pth.tar'))


@pytest.mark.parametrize('accum', [1, 2])
def test_two_processes_of_batch_b_train_as_one_process_of_batch_2b(image_root, tmp_path, accum):
    """2 gloo processes x batch 2 give the weights of 1 process x batch 4, after 2 epochs of the same samples.

    Proves that DDP averages (not sums, not drops) the gradients of the ranks, that the ranks split each global batch
    between them (rank r: positions r, r + 2, ... of the permutation one process uses) and start from the same
    weights, and that the epoch's train loss is averaged over all samples of all ranks. With --grad-accum-steps 2 it
    also proves that the micro-batches run under `no_sync` still reach the all-reduce, including the epoch's last
    update of a single micro-batch (5 micro-batches: updates of 2, 2 and 1).
    """
    extra = ('--grad-accum-steps', str(accum))
    one = _one_process(image_root, tmp_path, 'one', '-b', '4', *extra)
    two, log = _two_processes(image_root, tmp_path, 'two', '-b', '2', *extra)
    a, b = _state(one), _state(two)
    _assert_same_weights(b['state_dict'], a['state_dict'], f'2 processes x 2 vs 1 x 4, accumulation {accum}')
    assert a['num_updates'] == b['num_updates'] == EPOCHS * (5 if accum == 1 else 3)
    assert 'weights identical on all 2 processes' in log  # rank 1 ends with rank 0's weights (its own check)
    losses_one, losses_two = _epoch_losses(one), _epoch_losses(two)
    assert len(losses_one) == len(losses_two) == EPOCHS
    assert all(math.isclose(lb, la, rel_tol=1e-5) for la, lb in zip(losses_one, losses_two)), (losses_one, losses_two)


def _dataset(root: Path):
    """The training images as tensors, normalised as the PrefetchLoader does ((x - 127.5) / 127.5), in the index
    order of timm's folder dataset (classes sorted, then file names)."""
    files = sorted((root / 'train').glob('*/*.png'))
    classes = sorted({f.parent.name for f in files})
    images = torch.stack([torch.from_numpy(np.array(Image.open(f).convert('RGB'))).permute(2, 0, 1) for f in files])
    labels = torch.tensor([classes.index(f.parent.name) for f in files])
    return images.float().sub(127.5).div(127.5), labels


def _reference_sgd(init: Dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor,
                   update_sizes: Sequence[int]):
    """Train from `init` with one plain forward/backward per update, on consecutive slices of each epoch's
    permutation (DistributedSampler, one process: randperm seeded with seed + epoch) of the given sizes.

    Returns the final state dict and each epoch's mean loss (over its samples). An update's loss is the mean over
    its own samples, whatever their number: a short last batch counts as a batch of that size.
    """
    model = timm.create_model('vil_ls_medium', num_classes=2, **VIL_KWARGS)
    model.load_state_dict(init)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)
    epoch_losses = []
    for epoch in range(EPOCHS):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SEED + epoch))
        start, loss_sum = 0, 0.0
        for size in update_sizes:
            idx = order[start:start + size]
            start += size
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * size
        epoch_losses.append(loss_sum / start)
    return model.state_dict(), epoch_losses


def test_accumulated_micro_batches_and_the_epoch_tail_train_as_one_batch(image_root, tmp_path):
    """--grad-accum-steps 2 with batch 4 gives the weights of one batch of 8 per update, and of one batch of 4 for
    the epoch's last update, which has a single micro-batch (20 images: 5 micro-batches, updates of 8, 8 and 4).

    Proves that each micro-batch loss is divided by the number of micro-batches of its update: by 2 in a full
    accumulation, by 1 in the epoch's partial tail, which is stepped at the epoch's end (not dropped, not carried
    into the next epoch). The reference is a plain SGD loop written here; that it reproduces the engine's run without
    accumulation first (5 updates of 4 per epoch) proves it sees the same samples, order, initial weights and
    optimizer, so what remains to differ in the second comparison is the accumulation.
    """
    torch.manual_seed(0)
    init = timm.create_model('vil_ls_medium', num_classes=2, **VIL_KWARGS).state_dict()
    init_path = tmp_path / 'init.pth'
    torch.save({'state_dict': init}, init_path)
    images, labels = _dataset(image_root)
    assert len(labels) == 2 * PER_CLASS

    start = ('--initial-checkpoint', str(init_path), '-b', '4')
    plain = _state(_one_process(image_root, tmp_path, 'plain', *start))
    expected, losses = _reference_sgd(init, images, labels, [4] * 5)
    _assert_same_weights(plain['state_dict'], expected, 'no accumulation vs the reference loop')
    assert plain['num_updates'] == EPOCHS * 5
    assert _largest_difference(expected, init) > 1e-2  # the weights moved: a comparison that can fail
    assert np.allclose(_epoch_losses(tmp_path / 'plain'), losses, rtol=1e-5)

    accum_dir = _one_process(image_root, tmp_path, 'accum', *start, '--grad-accum-steps', '2')
    accum = _state(accum_dir)
    expected, losses = _reference_sgd(init, images, labels, [8, 8, 4])
    _assert_same_weights(accum['state_dict'], expected, 'accumulation 2 x 4 (tail 1 x 4) vs batches of 8, 8, 4')
    assert accum['num_updates'] == EPOCHS * 3
    assert np.allclose(_epoch_losses(accum_dir), losses, rtol=1e-5)
