"""The training run behind tools/train.py: timm's data, model, optimizer, scheduler and EMA, plus a small loop.

What the loop adds to timm's pieces: exact mid-epoch resume (see lsvision.train.data), atomic checkpoints with
every piece of state, a stop on non-finite loss that leaves the last good checkpoint alone, a wall-clock budget,
and progress with speed and ETA.

Ready for a GPU: batches come through timm's PrefetchLoader (uint8 from the workers, normalised and randomly erased
on the device, pinned memory and non-blocking copies on CUDA), and the loop never waits for the device on a
micro-batch: the loss is summed on the device and read (one all-reduce, one `.item()`-like read) only at a log
step, a checkpoint or the epoch end, where the non-finite check happens too. Under torchrun the GRC caches are
averaged once per optimizer step, outside DDP's `no_sync` (`all_reduce_grc_caches`).
"""
import argparse
import contextlib
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data

from timm.data import ImageDataset, Mixup, create_dataset, create_loader, create_transform, resolve_data_config
from timm.data.dataset_factory import _search_split
from timm.data.loader import PrefetchLoader, fast_collate
from timm.layers import convert_sync_batchnorm
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, get_pretrained_cfg, safe_model_name
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import (
    ModelEmaV3,
    dispatch_clip_grad,
    distribute_bn,
    get_outdir,
    init_distributed_device,
    setup_default_logging,
    update_summary,
)

from .. import runs
from ..data.digits import export_digits
from ..eval.dataset import META_LABEL, EvalImageDataset, ImageChecks
from ..eval.distributed import DatasetShard, all_gather, shard_range
from ..eval.runner import usable_cores
from ..layers import GatedRecurrentCache
from ..models import check_state_dict_fits, explain_checkpoint_errors, read_checked_state_dict
from ..runs import image_mode_for_channels, normalization_for_channels, weights_error_message
from ..runtime import PROGRESS_SECONDS, ProgressClock, set_threads
from .args import args_to_dict, args_to_yaml
from .checkpoint import CheckpointKeeper, get_rng_state, load_checkpoint, save_atomic, set_rng_state
from .data import (
    ResumableSampler,
    SeededTrainDataset,
    SplitScan,
    TrainBatchSampler,
    TrainSetupError,
    class_counts_text,
    class_names_of,
    derive_seed,
    num_classes_of,
    scan_split,
    seed_everything,
    skipped_files_text,
    split_problems,
)
from .weights import describe_load, file_num_classes, file_tensor_shapes, recorded_loads

__all__ = [
    'NonFiniteLossError', 'TrainSetupError', 'all_reduce_grc_caches', 'epoch_label', 'fixed_input_size_kwargs', 'run',
    'train_step', 'backward_micro_batch', 'micro_batches_of_update', 'optimizer_update', 'long_warmup_warning',
]

_logger = logging.getLogger('train')


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class _NonFiniteWindow(Exception):
    """A loss read by `_LossWindow.read` was not finite: at `batch_idx` (from 0), with `loss` (None: another
    process saw it)."""

    def __init__(self, batch_idx: int, loss: Optional[float]):
        super().__init__(batch_idx, loss)
        self.batch_idx, self.loss = batch_idx, loss


def _resolve_lr(args: argparse.Namespace) -> None:
    """lr = lr_base * global batch / lr_base_size (sqrt scaling for adaptive optimizers), as timm's train.py."""
    if args.lr is not None:
        return
    global_batch = args.batch_size * args.world_size * args.grad_accum_steps
    ratio = global_batch / args.lr_base_size
    scale = args.lr_base_scale or ('sqrt' if any(o in args.opt.lower() for o in ('ada', 'lamb', 'lars')) else 'linear')
    args.lr = args.lr_base * (ratio ** 0.5 if scale == 'sqrt' else ratio)
    if args.rank == 0:
        _logger.info(f'lr {args.lr:.3g} = lr_base {args.lr_base} x ({global_batch} / {args.lr_base_size}) '
                     f'[{scale} scaling, global batch {global_batch}]')


def _unwrap(model: nn.Module) -> nn.Module:
    model = getattr(model, '_orig_mod', model)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _find_resume(output_dir: str) -> str:
    """'auto': the most advanced of last.pth.tar and recovery.pth.tar in the run directory ('' if none)."""
    best, best_pos = '', None
    for name in ('last.pth.tar', 'recovery.pth.tar'):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            ckpt = load_checkpoint(path)
            pos = (ckpt['next_epoch'], ckpt['next_batch'])
            if best_pos is None or pos > best_pos:
                best, best_pos = path, pos
    return best


def _metrics_text(model_metrics: Dict[str, float], ema_metrics: Optional[Dict[str, float]]) -> str:
    """Validation metrics for the log, labelled: the model's, and the EMA's (which pick "best") when there is one."""
    def text(m: Dict[str, float]) -> str:
        return f'val loss {m["loss"]:.4f}, top-1 {m["top1"]:.2f}%, top-5 {m["top5"]:.2f}%'
    if ema_metrics is None:
        return text(model_metrics)
    return f'model: {text(model_metrics)}; EMA (picks best): {text(ema_metrics)}'


def epoch_label(epoch: int, num_epochs: int) -> str:
    """How the log names an epoch: its number, counted from 0 as in checkpoint-<epoch>.pth.tar, summary.csv,
    result.json's best_epoch and --start-epoch, then which of the run's epochs it is: `epoch 0 (1 of 300)`."""
    return f'epoch {epoch} ({epoch + 1} of {num_epochs})'


def _progress_line(epoch: int, num_epochs: int, done: int, total: int, loss: float, epoch_loss: float, lr: float,
                   samples_per_s: float, eta_epoch: float, eta_run: float) -> str:
    """`loss` is the mean since the last progress line, `epoch_loss` the epoch's so far (all processes)."""
    return (f'{epoch_label(epoch, num_epochs)} [{done}/{total}] loss {loss:.4f} (avg {epoch_loss:.4f}) '
            f'lr {lr:.3g} {samples_per_s:.1f} img/s ETA epoch {timedelta(seconds=int(eta_epoch))} '
            f'run {timedelta(seconds=int(eta_run))}')


@torch.no_grad()
def _check_ranks_agree(model: nn.Module, args: argparse.Namespace) -> None:
    """Compare a fingerprint (sum and sum of squares of every float tensor) of each process's weights."""
    tensors = [t for t in _unwrap(model).state_dict().values() if t.is_floating_point()]
    local = torch.stack([torch.stack([t.double().sum(), t.double().pow(2).sum()]) for t in tensors]).flatten().cpu()
    gathered = [torch.empty_like(local) for _ in range(args.world_size)]
    dist.all_gather(gathered, local) if dist.get_backend() == 'gloo' else _all_gather_cuda(gathered, local)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    if args.rank == 0:
        if diff == 0:
            _logger.info(f'weights identical on all {args.world_size} processes')
        else:
            _logger.warning(f'weights differ across the {args.world_size} processes (largest fingerprint '
                            f'difference {diff:.3g}); check buffers updated outside DDP')


def _all_gather_cuda(gathered: list, local: torch.Tensor) -> None:
    device = torch.device('cuda', torch.cuda.current_device())
    out = [g.to(device) for g in gathered]
    dist.all_gather(out, local.to(device))
    for g, o in zip(gathered, out):
        g.copy_(o.cpu())


def _check_model_name(name: str) -> None:
    """An unknown model name is an error that lists the closest registered names (before any data is read)."""
    message = runs.unknown_model_message(name)
    if message is not None:
        raise TrainSetupError(message)


def _is_folder(args: argparse.Namespace) -> bool:
    """Whether the dataset is an image folder (timm's folder reader, or torchvision's ImageFolder)."""
    return args.dataset.lower() in ('', 'folder', 'image_folder', 'torch/folder', 'torch/image_folder')


def _check_splits(args: argparse.Namespace) -> Tuple[str, str]:
    """Refuse a folder dataset whose splits timm would resolve to overlapping folders; returns (train folder, val
    folder), ('', '') for other datasets.

    timm's split search falls back to the dataset root when a split folder is missing: with no `val/` folder the run
    would validate on the root, training images included; with no `train/` folder it would train on the root,
    validation images included.
    """
    if not _is_folder(args):
        return '', ''
    root = os.path.abspath(args.data_dir)
    if not os.path.isdir(root):
        what = 'is a file, not a folder' if os.path.exists(root) else 'does not exist'
        raise TrainSetupError(
            f'data folder {root} {what}. Give the dataset root (the first argument or --data-dir) holding '
            f'{args.train_split}/<class>/ and val/<class>/ image folders, or --dataset torch/<name> for a '
            'torchvision dataset; with no data argument at all the digits demo runs')
    train_root = os.path.abspath(_search_split(root, args.train_split))
    val_root = os.path.abspath(_search_split(root, args.val_split))
    if val_root == root:
        raise TrainSetupError(
            f'no validation split in {root}: there is no {args.val_split!r} folder (nor val/, validation/, eval/), and '
            'validating on the dataset root would score the training images. Put held-out images in '
            f'{os.path.join(root, "val")}/<class>/, or name the folder with --val-split NAME')
    if train_root in (root, val_root):
        raise TrainSetupError(
            f'no training split in {root}: there is no {args.train_split!r} folder (nor train/, training/), and '
            f'training on {train_root} would train on the validation images {val_root}. Put the training images in '
            f'{os.path.join(root, "train")}/<class>/, or name the folder with --train-split NAME')
    return train_root, val_root


def _check_folder_classes(args: argparse.Namespace, train_root: str, val_root: str, primary: bool
                          ) -> Tuple[SplitScan, SplitScan, Optional[Dict[str, int]]]:
    """The two splits' class folders must agree (`split_problems`), checked before anything is built; logs the
    images per class of each split.

    Returns:
        The two scans and the --class-map (None without one).

    Raises:
        TrainSetupError: naming every mismatched, empty or unmapped folder, with the fix.
    """
    train, val = scan_split(train_root), scan_split(val_root)
    class_map = None
    if args.class_map:
        from timm.data.readers.class_map import load_class_map
        if not os.path.isfile(args.class_map) and not os.path.isfile(os.path.join(train_root, args.class_map)):
            raise TrainSetupError(f'--class-map {args.class_map}: no such file (nor in {train_root}); give a .txt file '
                                  'with one class folder name a line, in label order')
        class_map = load_class_map(args.class_map, train_root)
    problems = split_problems(train, val, class_map, args.class_map)
    if problems:
        raise TrainSetupError('the training and validation folders do not hold the same classes: '
                              + '; '.join(problems))
    if primary:
        _logger.info(f'training split {train_root}: {class_counts_text(train)}')
        _logger.info(f'validation split {val_root}: {class_counts_text(val)}')
        for scan in (train, val):
            if scan.skipped:  # as validate.py names them
                _logger.warning(skipped_files_text(scan))
    return train, val, class_map


def _check_num_classes(args: argparse.Namespace, dataset_train: Any) -> None:
    """num_classes from the data when unset; one that the config or --num-classes gives must be the data's.

    Raises:
        TrainSetupError: the class count cannot be told, or differs from the one given.
    """
    found = num_classes_of(dataset_train)
    if args.num_classes is None:
        if found is None:
            raise TrainSetupError('cannot tell the number of classes of this dataset; pass --num-classes')
        args.num_classes = found
    elif found is not None and args.num_classes != found:
        names = class_names_of(dataset_train) or []
        where = f' {args.data_dir}' if args.data_dir else ''
        raise TrainSetupError(
            f'num_classes {args.num_classes} (from --num-classes or the config) but the dataset{where} has {found} '
            f'classes' + (f' ({", ".join(names[:8])}{", ..." if len(names) > 8 else ""})' if names else '')
            + f': the model would have {args.num_classes} outputs for {found} classes. Pass --num-classes {found}, '
            'or leave num_classes unset (it is then taken from the data)')


def fixed_input_size_kwargs(args: argparse.Namespace, model_kwargs: Dict[str, Any]) -> bool:
    """`lsvision.runs.fixed_input_size_kwargs` (the rule evaluation shares), its contradiction a TrainSetupError."""
    try:
        return runs.fixed_input_size_kwargs(args, model_kwargs)
    except ValueError as e:
        raise TrainSetupError(str(e)) from None


def _in_chans(args: argparse.Namespace) -> Optional[int]:
    """The model's input channels as the run gives them: --input-size's first, else --in-chans (None: the model's)."""
    return args.input_size[0] if args.input_size else args.in_chans


def _build_model(args: argparse.Namespace, primary: bool) -> Tuple[nn.Module, Dict[str, Any]]:
    """create_model as the arguments say, with --pretrained / --pretrained-path and --initial-checkpoint loaded, and a
    line for each saying what was loaded (`describe_load`). Returns the model and the kwargs it was built with.

    Raises:
        TrainSetupError: --img-size / --input-size for a model that takes no img_size.
        CheckpointMismatchError: a file that does not fit the model (short message, both architectures named).
    """
    in_chans = _in_chans(args)
    model_kwargs = dict(args.model_kwargs or {})
    file_shapes, entry = {}, ''
    if args.pretrained_path:
        if not args.pretrained and primary:
            _logger.warning(f'--pretrained-path {args.pretrained_path} is not loaded: pretrained is false (the '
                            'config or --no-pretrained)')
        file_shapes, entry = file_tensor_shapes(args.pretrained_path)
        overlay = dict(file=args.pretrained_path)
        try:
            classifier = get_pretrained_cfg(args.model).classifier
        except (RuntimeError, AttributeError):
            classifier = None
        classes = file_num_classes(file_shapes, classifier)
        if classes:  # timm drops the file's head when this differs from num_classes; unset, it is the released
            overlay['num_classes'] = classes  # weights' count (1000), which would drop a head that fits
        model_kwargs['pretrained_cfg_overlay'] = overlay
    sized = fixed_input_size_kwargs(args, model_kwargs)
    explained = contextlib.nullcontext()
    if args.pretrained_path:
        explained = explain_checkpoint_errors(args.model, args.pretrained_path, dict(
            in_chans=in_chans, num_classes=args.num_classes, global_pool=args.gp,
            **{k: v for k, v in model_kwargs.items() if k != 'pretrained_cfg_overlay'}))
    try:
        with explained, recorded_loads() as loads:
            model = create_model(
                args.model, pretrained=args.pretrained, in_chans=in_chans, num_classes=args.num_classes,
                drop_rate=args.drop, drop_path_rate=args.drop_path, drop_block_rate=args.drop_block,
                global_pool=args.gp, bn_momentum=args.bn_momentum, bn_eps=args.bn_eps, **model_kwargs)
    except TypeError as e:
        if sized and 'img_size' in str(e):
            raise TrainSetupError(f'{args.model} takes only its fixed input size and no img_size argument; drop '
                                  '--img-size / --input-size') from None
        raise
    except (RuntimeError, OSError) as e:  # no released weights, or none reachable: the fix in train.py's flags
        message = weights_error_message(e, args.model, (
            f'give a weights file of {args.model}, --pretrained-path FILE (safetensors, a .pth state dict, or the '
            'released file downloaded by hand), or train from random weights, --no-pretrained'))
        if message is None:
            raise
        raise TrainSetupError(message) from None
    if args.pretrained and primary:
        cfg = getattr(model, 'pretrained_cfg', None) or {}
        source = args.pretrained_path or cfg.get('hf_hub_id') or cfg.get('url') or 'its pretrained cfg'
        _logger.info(describe_load('pretrained weights', source, model, loads, file_shapes, entry))
    if args.initial_checkpoint:
        _, entry = file_tensor_shapes(args.initial_checkpoint)
        with recorded_loads() as loads:
            model.load_state_dict(read_checked_state_dict(model, args.initial_checkpoint, args.model))
        if primary:
            _logger.info(describe_load('initial checkpoint', args.initial_checkpoint, model, loads, entry=entry))
    return model, model_kwargs


def _warn_slow_cpu_amp(amp_dtype: str) -> None:
    """CPU autocast is fast only in bfloat16 on CPUs with native bfloat16 (AVX512-BF16, AMX); otherwise it runs
    several times slower than float32 (a train step of cvt_ls_13 on an AVX2 CPU: 0.3 img/s in bfloat16 or float16
    against 3.0 in float32)."""
    try:
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        native = False
    if amp_dtype == 'float16':
        _logger.warning('--amp-dtype float16 on CPU runs several times slower than bfloat16 or float32; use '
                        '--amp-dtype bfloat16, or --no-amp')
    elif not native:
        _logger.warning('this CPU has no native bfloat16 (AVX512-BF16 / AMX): bfloat16 autocast runs several times '
                        'slower than float32 here; --no-amp trains faster')


@torch.no_grad()
def all_reduce_grc_caches(layers: Sequence[GatedRecurrentCache]) -> None:
    """Average the caches of GRC layers over the default process group in one flattened all-reduce.

    A training loop under DDP calls it once per optimizer step, outside `no_sync`, with the layers' own
    per-forward sync (`sync_cache`) off: one collective per step instead of one per layer per micro-batch.

    Args:
        layers: The GatedRecurrentCache modules of the model (the same on every process, in the same order).
    """
    if not layers or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    caches = [m.cache for m in layers]  # read now: .to() and load_state_dict may have replaced the buffers
    flat = torch.cat([c.reshape(-1) for c in caches])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for cache, new in zip(caches, flat.split([c.numel() for c in caches])):
        cache.copy_(new.view_as(cache))


def _grc_layers_to_sync(model: nn.Module, args: argparse.Namespace,
                        model_kwargs: Dict[str, Any]) -> Tuple[List[GatedRecurrentCache], bool]:
    """The GRC layers whose caches the loop averages after every optimizer step under torchrun ([] when off, or
    not distributed), and whether the model has GRC layers at all.

    --grc-sync-cache (or --model-kwargs grc_sync_cache=...) decides. The layers' own per-forward all-reduce is
    turned off either way: it would run for every layer on every micro-batch, also inside DDP's `no_sync`.
    """
    grcs = [m for m in model.modules() if isinstance(m, GatedRecurrentCache)]
    for m in grcs:
        m.sync_cache = False
    if not args.distributed or not grcs:
        return [], bool(grcs)
    enabled = bool(model_kwargs.get('grc_sync_cache', args.grc_sync_cache))
    if args.rank == 0:
        if enabled:
            _logger.info(f'GRC cache sync on: after every optimizer step one all-reduce averages the caches of the '
                         f'{len(grcs)} GRC layers over {args.world_size} processes, so all processes keep the '
                         'cache of the global batch')
        else:
            _logger.warning(f'GRC cache sync off: DDP broadcasts rank 0 buffers at each forward, so the {len(grcs)} '
                            "GRC caches follow rank 0's batches only (--grc-sync-cache to average them)")
    return (grcs if enabled else []), True


class _SeededBatchErasing:
    """timm's batch RandomErasing (run by the PrefetchLoader on the device), seeded per batch from (seed, epoch,
    batch, rank): a resumed run erases the same pixels as an uninterrupted one, whatever the prefetch order.

    Args:
        erasing: The PrefetchLoader's RandomErasing.
        seed: Base seed of the run.
        rank: This process's rank.
    """

    def __init__(self, erasing: nn.Module, seed: int, rank: int):
        self.erasing = erasing
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        self.batch = 0

    def start(self, epoch: int, batch: int) -> None:
        """The next batch erased is `batch` of `epoch`."""
        self.epoch, self.batch = epoch, batch

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        seed_everything(derive_seed(self.seed, 2, self.epoch, self.batch, self.rank))
        self.batch += 1
        return self.erasing(input)


class _LossWindow:
    """The training loss summed on the device, read by the host only when asked (a log step, a checkpoint, the
    epoch end): then one all-reduce across processes and one read, which also tells whether any loss was
    non-finite and whether any process ran out of its time budget (so all processes stop at the same batch).

    Args:
        device: Where the sums live.
        distributed: All-reduce the sums at a read.
    """

    def __init__(self, device: torch.device, distributed: bool):
        self.device = device
        self.distributed = distributed
        self.epoch_sum, self.epoch_count = 0.0, 0  # read totals of the epoch (all processes)
        self._reset()

    def _reset(self) -> None:
        # loss * samples, samples, non-finite losses, out of time; the first non-finite batch (or -1) and its loss
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=self.device)
        self.bad_loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def add(self, loss: torch.Tensor, n: int, batch_idx: int) -> None:
        """Add a micro-batch's mean loss over `n` samples (no host sync)."""
        loss = loss.detach().float()
        finite = torch.isfinite(loss)
        newly_bad = finite.logical_not() & (self.first_bad < 0)
        self.first_bad = torch.where(newly_bad, batch_idx, self.first_bad)
        self.bad_loss = torch.where(newly_bad, loss, self.bad_loss)
        self.sums[:3] += torch.stack([loss.double() * n, torch.full_like(self.sums[0], n),
                                      finite.logical_not().double()])

    def read(self, out_of_time: bool = False) -> Tuple[float, bool]:
        """Fold the window into the epoch totals; return (the window's mean loss, whether any process is out of
        time).

        Raises:
            _NonFiniteWindow: A loss of the window was NaN or infinite.
        """
        if out_of_time:
            self.sums[3] = 1.
        if self.distributed:
            dist.all_reduce(self.sums)
        loss_sum, count, bad, late = self.sums.tolist()
        if bad:  # the error path may sync more
            local = int(self.first_bad.item())
            first_bad = torch.tensor(local if local >= 0 else torch.iinfo(torch.int64).max, device=self.device)
            if self.distributed:  # the earliest bad batch of any process
                dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
            raise _NonFiniteWindow(int(first_bad.item()), self.bad_loss.item() if local >= 0 else None)
        self.epoch_sum += loss_sum
        self.epoch_count += int(count)
        self._reset()
        return loss_sum / max(count, 1), bool(late)

    @property
    def epoch_mean(self) -> float:
        return self.epoch_sum / max(self.epoch_count, 1)


@torch.no_grad()
def validate(model: nn.Module, loader: torch.utils.data.DataLoader, args: argparse.Namespace, device: torch.device,
             autocast: Any, images: Optional[EvalImageDataset] = None) -> Dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation set, summed across processes.

    Under torchrun each process's ``loader`` holds its own shard of the set (no padding), so every image is scored
    exactly once and the result equals one process's evaluation of the same weights. With ``images`` (an image
    folder read by `EvalImageDataset`), an unreadable image is left out and named, never replaced by another, as
    tools/validate.py does.

    Raises:
        TrainSetupError: no validation image could be read.
    """
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction='sum')
    checks = ImageChecks('validation', images) if images is not None else None
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1 hits, top5 hits, count
    clock = ProgressClock(None, getattr(args, 'log_interval_s', PROGRESS_SECONDS))
    for batch_idx, (input, target) in enumerate(loader):  # on the device already with the prefetcher
        if clock.due(batch_idx) and batch_idx and getattr(args, 'rank', 0) == 0:
            _logger.info(f'validation: {batch_idx}/{len(loader)} batches of this process')
        if checks is not None:  # [label, index, readable, width, height] per image: keep the readable ones
            keep = checks.keep(target)
            target = target[keep.to(target.device), META_LABEL]
            input = input[keep.to(input.device)]
            if not len(target):
                continue
        input, target = input.to(device, non_blocking=True), target.to(device, non_blocking=True)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        if args.torchcompile:  # one graph for every batch size: the last batch, usually smaller, does not recompile
            torch._dynamo.maybe_mark_dynamic(input, 0)
        with autocast():
            output = model(input)
        output = output.float()
        # hits counted exactly (timm's `accuracy` returns float32 percentages, off in the 7th digit)
        hits = output.topk(min(5, output.shape[-1]), dim=1).indices.eq(target[:, None])
        n = input.shape[0]
        # summed on the device: one read at the end, not one per batch
        totals += torch.stack([criterion(output, target).double(), hits[:, 0].sum().double(),
                               hits.any(dim=1).sum().double(), torch.full((), n, dtype=torch.float64, device=device)])
    if args.distributed:
        dist.all_reduce(totals)
    loss, top1, top5, n = totals.tolist()
    skipped = []
    if checks is not None:
        checks.merge(all_gather(checks.state()))  # the unreadable images of every process, in file order
        skipped = checks.skipped
    if getattr(args, 'rank', 0) == 0:
        _logger.info(f'validation: {int(n)} images scored' + (f' by {args.world_size} processes (each image once)'
                                                             if args.distributed else '')
                     + (f'; {len(skipped)} unreadable left out: ' + ', '.join(f'{s["file"]} ({s["reason"]})'
                                                                          for s in skipped[:5])
                        + (', ...' if len(skipped) > 5 else '') if skipped else ''))
    if not n:
        raise TrainSetupError('no validation image could be read' + (f' (e.g. {skipped[0]["file"]}: '
                                                                      f'{skipped[0]["reason"]})' if skipped else ''))
    return {'loss': loss / n, 'top1': 100 * top1 / n, 'top5': 100 * top5 / n}


def _setup(args: argparse.Namespace) -> torch.device:
    """Checks the arguments that need no data, joins torchrun's process group and seeds this process."""
    setup_default_logging()
    args.data_dir = args.data_dir or args.data or ''
    if not args.device:
        args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.log_wandb and importlib.util.find_spec('wandb') is None:
        raise TrainSetupError('--log-wandb needs the wandb package: pip install wandb (then `wandb login`, or '
                              'WANDB_MODE=offline to log locally), or drop --log-wandb (summary.csv has the same '
                              'columns)')
    if args.resplit and args.no_prefetcher:
        raise TrainSetupError('--resplit leaves the first half of each batch unerased, which the prefetcher does; '
                              'drop --no-prefetcher or --resplit')
    if args.warmup_steps and not args.sched_on_updates:
        raise TrainSetupError(f'--warmup-steps {args.warmup_steps} counts optimizer updates, so the schedule must step '
                              'on updates: add --sched-on-updates (or use --warmup-epochs)')
    set_threads(args.threads, log=os.environ.get('RANK', '0') == '0')
    _check_model_name(args.model)
    device = init_distributed_device(args)
    if args.pin_mem is None:  # pinned host memory makes the copies to a GPU asynchronous
        args.pin_mem = device.type == 'cuda'
    if args.distributed:
        _logger.info(f'process {args.rank}/{args.world_size} on {args.device}, backend {dist.get_backend()}')
    seed_everything(derive_seed(args.seed, args.rank))
    return device


def _check_input_channels(args: argparse.Namespace) -> None:
    """Sets ``args.input_img_mode`` to the mode of the model's input channels when it is not given (as timm's
    train.py: 'L' for --in-chans 1), or says how a given mode, --mean / --std and the channels disagree."""
    in_chans = _in_chans(args) or 3
    for flag, values in (('--mean', args.mean), ('--std', args.std)):
        if values is not None and len(values) not in (1, in_chans):
            raise TrainSetupError(f'{flag} has {len(values)} values but the model takes {in_chans} input channel(s) '
                                  f'(--in-chans / --input-size): give {in_chans} value(s), or one for every channel')
    if args.input_img_mode:
        try:
            given = runs.channels_of_image_mode(args.input_img_mode)
        except ValueError as e:
            raise TrainSetupError(f'--input-img-mode: {e}') from None
        if given != in_chans:
            raise TrainSetupError(
                f'--input-img-mode {args.input_img_mode} reads images as {given} channel(s), but the model takes '
                f'{in_chans} (--in-chans / --input-size): leave --input-img-mode out or set --in-chans {given}')
        return
    try:
        mode = image_mode_for_channels(in_chans)
    except ValueError as e:
        raise TrainSetupError(f'{e}, or give --input-img-mode with a PIL mode of {in_chans} channels') from None
    args.input_img_mode = mode if in_chans != 3 else None  # None: timm's default, RGB


def _datasets(args: argparse.Namespace, primary: bool) -> Tuple[Any, Any, Optional[List[str]]]:
    """(train dataset, val dataset, class names in logit order); the embedded digits when no dataset is named."""
    if not args.data_dir and not args.dataset:
        if primary:
            info = export_digits()
            _logger.info(f"no --data-dir: training on scikit-learn's digits ({info['num_train']} train / "
                         f"{info['num_val']} val images) exported to {info['root']}")
        if args.distributed:
            dist.barrier()
        args.data_dir = export_digits()['root']
    train_root, val_root = _check_splits(args)
    if train_root:
        train_scan, val_scan, class_map = _check_folder_classes(args, train_root, val_root, primary)
    _check_input_channels(args)
    if train_root and args.dataset.lower() in ('', 'folder', 'image_folder') and not args.input_key:
        # timm's folder reader over the scans just made (the same samples and classes; each split walked once); the
        # validation labels are the training split's, never its own folders' order
        class_to_idx = class_map or {name: i for i, name in enumerate(train_scan.counts)}
        dataset_train = train_scan.dataset(class_to_idx, args.input_img_mode)
        dataset_eval = val_scan.dataset(class_to_idx, args.input_img_mode)
    else:
        dataset_kwargs = dict(root=args.data_dir, class_map=args.class_map or '', download=args.dataset_download,
                              batch_size=args.batch_size, seed=args.seed)
        if args.input_img_mode:
            dataset_kwargs['input_img_mode'] = args.input_img_mode
        if args.input_key or args.target_key:
            dataset_kwargs.update(input_key=args.input_key, target_key=args.target_key)
        dataset_train = create_dataset(args.dataset, split=args.train_split, is_training=True,
                                       repeats=args.epoch_repeats, num_samples=args.train_num_samples,
                                       **dataset_kwargs)
        train_classes = getattr(getattr(dataset_train, 'reader', None), 'class_to_idx', None)
        if train_root and train_classes:  # validation labels are the training split's
            dataset_kwargs['class_map'] = dict(train_classes)
        dataset_eval = create_dataset(args.dataset, split=args.val_split, is_training=False,
                                      num_samples=args.val_num_samples, **dataset_kwargs)
    _check_num_classes(args, dataset_train)
    return dataset_train, dataset_eval, class_names_of(dataset_train)  # class names: for validate.py's folder suite


def _model_on_device(args: argparse.Namespace, device: torch.device, primary: bool
                     ) -> Tuple[nn.Module, List[GatedRecurrentCache], bool, Dict[str, Any]]:
    """(the model on its device, the GRC layers whose caches are synced, whether it has GRC layers, its data
    config)."""
    model, model_kwargs = _build_model(args, primary)
    grc_layers, has_grc = _grc_layers_to_sync(model, args, model_kwargs)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    if primary:
        _logger.info(f'model {safe_model_name(args.model)}: {sum(p.numel() for p in model.parameters()):,} params, '
                     f'{args.num_classes} classes')
    data_config = resolve_data_config(vars(args), model=model, verbose=primary)
    try:
        fitted = normalization_for_channels(data_config['mean'], data_config['std'], data_config['input_size'][0])
    except ValueError as e:
        raise TrainSetupError(str(e)) from None
    if fitted:  # recorded in the run's args, so that evaluation normalises as training did
        data_config['mean'], data_config['std'] = tuple(fitted[0]), tuple(fitted[1])
        args.mean, args.std = fitted
        if primary:
            _logger.info(f'the model takes 1 input channel: normalised with mean {fitted[0][0]:.4f}, std '
                         f'{fitted[1][0]:.4f} (the averages of its RGB values; --mean / --std set them)')
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.distributed and args.sync_bn:
        if device.type == 'cuda':
            model = convert_sync_batchnorm(model)
        elif primary:
            _logger.warning(f'--sync-bn ignored on {device.type}: torch SyncBatchNorm runs on GPUs only; batch norm '
                            f'statistics are averaged across processes at each epoch end (--dist-bn {args.dist_bn})')
    return model, grc_layers, has_grc, data_config


@dataclass
class _Loaders:
    """The training loader (its resumable sampler, the seeded batch erasing) and the validation loader, with the
    dataset of validation images (an image folder's: scored once each, unreadable ones named; else None)."""
    train: Any
    sampler: ResumableSampler
    batch_erasing: Optional[_SeededBatchErasing]
    batches_per_epoch: int
    eval: Any
    eval_images: Optional[EvalImageDataset] = None


def _workers(args: argparse.Namespace, primary: bool) -> int:
    """Loader workers per process: --workers, but not more than the CPU cores this process may use (above them
    torch warns and the workers only compete for the cores)."""
    cores = usable_cores()
    if args.workers <= cores:
        return args.workers
    if primary:
        _logger.info(f'loader workers: {cores} (--workers {args.workers} capped at the {cores} usable CPU cores)')
    return cores


def _epoch_text(batch_sampler: TrainBatchSampler, args: argparse.Namespace) -> str:
    """What one epoch trains on: batches, images, and the images it leaves out (and why)."""
    total, used = batch_sampler.sampler.full_len(), batch_sampler.used_per_epoch()
    per = ' per process' if args.world_size > 1 else ''
    text = (f'each epoch: {batch_sampler.batches_per_epoch()} batches of up to {args.batch_size}{per}, {used} of '
            f'{total} training images{per}')
    if used == total:
        return text + ' (none left out)'
    why = ('drop_last drops the partial last batch; --no-drop-last keeps it' if args.drop_last
           else 'Mixup / CutMix need an even last batch')
    return text + f'; {total - used} left out ({why}), different ones each epoch'


def _train_loader(args: argparse.Namespace, dataset_train: Any, data_config: Dict[str, Any], device: torch.device,
                  workers: int, primary: bool) -> Tuple[Any, ResumableSampler, TrainBatchSampler,
                                                        Optional[_SeededBatchErasing]]:
    """The training transform and loader: a resumable seeded order in batches (`TrainBatchSampler`), and timm's
    PrefetchLoader with its seeded random erasing."""
    prefetch = not args.no_prefetcher
    dataset_train.transform = create_transform(
        data_config['input_size'], is_training=True, no_aug=args.no_aug, train_crop_mode=args.train_crop_mode,
        scale=args.scale, ratio=args.ratio, hflip=args.hflip, vflip=args.vflip, color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob, grayscale_prob=args.grayscale_prob or 0.,
        gaussian_blur_prob=args.gaussian_blur_prob or 0., auto_augment=args.aa,
        interpolation=args.train_interpolation, mean=data_config['mean'], std=data_config['std'],
        re_prob=args.reprob, re_mode=args.remode, re_count=args.recount, re_num_splits=0, use_prefetcher=prefetch)
    sampler = ResumableSampler(dataset_train, num_replicas=args.world_size, rank=args.rank, seed=args.seed,
                               num_repeats=args.aug_repeats)
    mixup = args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None
    batch_sampler = TrainBatchSampler(sampler, args.batch_size, args.drop_last, multiple_of=2 if mixup else 1)
    loader_train = torch.utils.data.DataLoader(
        SeededTrainDataset(dataset_train, seed=args.seed, rank=args.rank), batch_sampler=batch_sampler,
        num_workers=workers, pin_memory=args.pin_mem, persistent_workers=workers > 0,
        collate_fn=fast_collate if prefetch else None)
    batch_erasing = None
    if prefetch:  # uint8 batches, normalised (and randomly erased) on the device, as timm's train.py
        loader_train = PrefetchLoader(
            loader_train, mean=data_config['mean'], std=data_config['std'], channels=data_config['input_size'][0],
            device=device, re_prob=args.reprob, re_mode=args.remode, re_count=args.recount,
            re_num_splits=2 if args.resplit else 0)
        if loader_train.random_erasing is not None:
            batch_erasing = loader_train.random_erasing = _SeededBatchErasing(
                loader_train.random_erasing, args.seed, args.rank)
    if primary:
        _logger.info('data: ' + ('timm PrefetchLoader (normalisation' + (', random erasing' if args.reprob else '')
                                 + f' on {device.type})' if prefetch else 'normalised in the loader workers')
                     + f', pin_memory {args.pin_mem}, {workers} loader worker(s)')
    if batch_sampler.batches_per_epoch() == 0:
        raise TrainSetupError(f'the training split has {sampler.full_len()} samples per process, fewer than one batch '
                              f'of {args.batch_size}; lower --batch-size, or --no-drop-last to train on a partial '
                              'batch')
    if primary:
        _logger.info(_epoch_text(batch_sampler, args))
    return loader_train, sampler, batch_sampler, batch_erasing


def _loaders(args: argparse.Namespace, dataset_train: Any, dataset_eval: Any, data_config: Dict[str, Any],
             device: torch.device, primary: bool) -> _Loaders:
    """The transforms and loaders: a resumable seeded training order, and a validation shard per process."""
    workers = _workers(args, primary)
    loader_train, sampler, batch_sampler, batch_erasing = _train_loader(args, dataset_train, data_config, device,
                                                                        workers, primary)
    # under torchrun each process scores its own contiguous shard of the val set: timm's distributed sampler would
    # pad the set to a multiple of the processes and score the padding twice. Iterable (streaming) datasets split
    # themselves across processes in timm's readers. An image folder's images are read by lsvision.eval's dataset,
    # which marks an unreadable image instead of replacing it with the next one (timm's ImageDataset does).
    eval_set, eval_images = dataset_eval, None
    samples = getattr(getattr(dataset_eval, 'reader', None), 'samples', None)
    if _is_folder(args) and isinstance(dataset_eval, ImageDataset) and samples is not None:
        eval_set = eval_images = EvalImageDataset(
            dataset_eval.reader.root, samples, input_img_mode=dataset_eval.input_img_mode or 'RGB',
            indices=shard_range(len(samples), args.rank, args.world_size) if args.distributed else None)
    elif args.distributed and not isinstance(dataset_eval, torch.utils.data.IterableDataset):
        eval_set = DatasetShard(dataset_eval, shard_range(len(dataset_eval), args.rank, args.world_size))
    loader_eval = create_loader(
        eval_set, input_size=data_config['input_size'], batch_size=args.validation_batch_size or args.batch_size,
        is_training=False, interpolation=data_config['interpolation'], mean=data_config['mean'],
        std=data_config['std'], num_workers=workers, distributed=args.distributed and eval_set is dataset_eval,
        crop_pct=data_config['crop_pct'], pin_memory=args.pin_mem, device=device, use_prefetcher=not args.no_prefetcher)
    return _Loaders(loader_train, sampler, batch_erasing, batch_sampler.batches_per_epoch(), loader_eval, eval_images)


def _loss_and_mixup(args: argparse.Namespace, device: torch.device) -> Tuple[nn.Module, Optional[Mixup]]:
    """The training criterion (timm's losses, as timm's train.py picks them) and Mixup/CutMix (or None)."""
    mixup_fn = None
    mixup_active = args.mixup > 0 or args.cutmix > 0. or args.cutmix_minmax is not None
    if mixup_active:
        mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                         prob=args.mixup_prob, switch_prob=args.mixup_switch_prob, mode=args.mixup_mode,
                         label_smoothing=args.smoothing, num_classes=args.num_classes)
    if args.bce_loss:
        criterion = BinaryCrossEntropy(smoothing=0 if mixup_active else args.smoothing,
                                       target_threshold=args.bce_target_thresh, sum_classes=args.bce_sum,
                                       pos_weight=args.bce_pos_weight)
    elif mixup_active:
        criterion = SoftTargetCrossEntropy()
    elif args.smoothing:
        criterion = LabelSmoothingCrossEntropy(smoothing=args.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    return criterion.to(device), mixup_fn


@dataclass
class _Optimization:
    """The optimizer and what drives it: autocast, the float16 loss scaler, the EMA and the lr schedule."""
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], Any]
    scaler: Optional[torch.amp.GradScaler]
    model_ema: Optional[ModelEmaV3]
    lr_scheduler: Any
    num_epochs: int


def _optimization(args: argparse.Namespace, model: nn.Module, device: torch.device, primary: bool,
                  batches_per_epoch: int) -> _Optimization:
    """timm's optimizer, precision, EMA and schedule (stepped per update with gradient accumulation)."""
    _resolve_lr(args)
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **(args.opt_kwargs or {}))
    scales = sorted({group.get('lr_scale', 1.0) for group in optimizer.param_groups})
    if args.layer_decay and primary:
        _logger.info(f'layer-wise lr decay {args.layer_decay}: {len(scales)} layer groups, from the head at lr '
                     f'{args.lr:.3g} down to {scales[0]:.2g} x lr at the stem')
    if args.amp_dtype is None:
        args.amp_dtype = 'bfloat16' if device.type == 'cpu' else 'float16'
    if args.amp and device.type == 'cpu' and primary:
        _warn_slow_cpu_amp(args.amp_dtype)
    if args.amp and primary:
        _logger.info(f'AMP: {args.amp_dtype} autocast on {device.type}'
                     + (' with a loss scaler' if args.amp_dtype == 'float16' else '') + ' (--no-amp: float32)')
    amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16
    autocast = (partial(torch.autocast, device_type=device.type, dtype=amp_dtype) if args.amp
                else contextlib.nullcontext)
    scaler = torch.amp.GradScaler(device.type) if args.amp and amp_dtype == torch.float16 else None
    model_ema = None
    if args.model_ema:
        model_ema = ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=args.model_ema_warmup,
                               device='cpu' if args.model_ema_force_cpu else None)
    updates_per_epoch = (batches_per_epoch + args.grad_accum_steps - 1) // args.grad_accum_steps
    sched_kwargs = scheduler_kwargs(args, decreasing_metric=args.eval_metric == 'loss')
    if args.warmup_steps:  # timm counts warmup in epochs: this many epochs are warmup_steps updates
        sched_kwargs['warmup_epochs'] = args.warmup_steps / updates_per_epoch
    lr_scheduler, num_epochs = create_scheduler_v2(optimizer, **sched_kwargs, updates_per_epoch=updates_per_epoch)
    if primary:
        _warn_long_warmup(args, num_epochs, updates_per_epoch)
    return _Optimization(optimizer, autocast, scaler, model_ema, lr_scheduler, num_epochs)


def long_warmup_warning(flag: str, warmup: float, total: float, unit: str, start_lr: float, lr: float,
                        fix: str = '') -> Optional[str]:
    """The warning for a warm-up not shorter than the run (None for a shorter one or none): the lr rises from
    `start_lr` and never reaches `lr`. `flag` is the warm-up's flag and value (e.g. '--warmup-steps 500'), `total`
    the run's length in `unit`, `fix` more advice after 'lower <flag>'. Every training tool warns with it."""
    if warmup <= 0 or warmup < total:
        return None
    return (f'{flag} is not shorter than the run ({total:g} {unit}): the lr rises from {start_lr:g} and never '
            f'reaches {lr:.3g}; lower {flag.split()[0]}' + (f' {fix}' if fix else ''))


def _warn_long_warmup(args: argparse.Namespace, num_epochs: int, updates_per_epoch: int) -> None:
    """A warmup as long as the run never reaches the lr (the ImageNet recipes' 5 epochs on a folder of a few
    batches); the line says what the warmup is in updates."""
    if args.warmup_steps:
        warmup, total, flag = args.warmup_steps, num_epochs * updates_per_epoch, f'--warmup-steps {args.warmup_steps}'
        unit = 'updates'
    else:
        warmup, total, flag = args.warmup_epochs, num_epochs, f'--warmup-epochs {args.warmup_epochs}'
        unit = 'epochs'
    message = long_warmup_warning(flag, warmup, total, unit, args.warmup_lr, args.lr)
    if message:
        _logger.warning(message)
    elif warmup > 0:
        _logger.info(f'lr warmup: {warmup} {unit} ({warmup * (1 if args.warmup_steps else updates_per_epoch)} of the '
                     f"run's {num_epochs * updates_per_epoch} updates) from {args.warmup_lr:g} to {args.lr:.3g}")


def _run_directory(args: argparse.Namespace, data_config: Dict[str, Any], primary: bool) -> str:
    """The run's directory: a resumed checkpoint's, else a new one rank 0 picks (and creates) for all processes."""
    if args.resume and args.resume != 'auto':
        return os.path.dirname(os.path.abspath(args.resume))
    exp_name = args.experiment or '-'.join([
        datetime.now().strftime('%Y%m%d-%H%M%S'), safe_model_name(args.model), str(data_config['input_size'][-1])])
    # a new run never writes into an older run's directory; --resume auto continues in it
    output_dir = [get_outdir(args.output or './output/train', exp_name, inc=args.resume != 'auto')
                  if primary else None]
    if args.distributed:
        dist.broadcast_object_list(output_dir, src=0)
    return output_dir[0]


_NO_TIME = dict(train_seconds=0.0, total_seconds=0.0, samples_seen=0)


@dataclass
class _Progress:
    """Where the run stands: the next epoch and batch, the updates made, the epoch's loss totals so far."""
    epoch: int = 0
    batch: int = 0
    num_updates: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    resumed_from: Optional[str] = None
    # the earlier sessions' totals up to the checkpoint (train_seconds, total_seconds, samples_seen); None when the
    # checkpoint predates them
    earlier: Optional[Dict[str, float]] = field(default_factory=lambda: dict(_NO_TIME))


def _resume(args: argparse.Namespace, resume_path: str, model: nn.Module, opt: _Optimization,
            keeper: CheckpointKeeper, primary: bool) -> _Progress:
    """Loads a training checkpoint's full state (weights, EMA, optimizer, scaler, keeper, RNG); its progress."""
    ckpt = load_checkpoint(resume_path)
    if 'next_epoch' not in ckpt:
        raise TrainSetupError(f'{resume_path} is not a tools/train.py training checkpoint (no training state); '
                              'load its weights with --initial-checkpoint instead of --resume')
    arch = ckpt.get('arch')
    if arch and arch != args.model:
        raise TrainSetupError(
            f'{resume_path} is a checkpoint of {arch}, not of --model {args.model}; resume it without --model '
            "(the run's arguments are restored), or start a new run from its weights with --initial-checkpoint")
    check_state_dict_fits(_unwrap(model), ckpt['state_dict'], args.model, arch, source=resume_path)
    _unwrap(model).load_state_dict(ckpt['state_dict'])
    if opt.model_ema is not None and 'state_dict_ema' in ckpt:
        opt.model_ema.load_state_dict(ckpt['state_dict_ema'])
    if not args.no_resume_opt:
        opt.optimizer.load_state_dict(ckpt['optimizer'])
        if opt.scaler is not None and 'scaler' in ckpt:
            opt.scaler.load_state_dict(ckpt['scaler'])
    progress = _Progress(ckpt['next_epoch'], ckpt['next_batch'], ckpt['num_updates'],
                         ckpt.get('train_loss_sum', 0.0), ckpt.get('train_loss_count', 0), resume_path,
                         ckpt.get('run_totals'))
    keeper.load_state_dict(ckpt.get('keeper', {}))
    set_rng_state(ckpt['rng'])
    if primary:
        _logger.info(f'resumed {resume_path}: at {epoch_label(progress.epoch, opt.num_epochs)}, {progress.batch} of '
                     f'its batches done, {progress.num_updates} updates')
        if getattr(args, 'resume_config', ''):
            overrides = getattr(args, 'resume_overrides', [])
            _logger.info(f'arguments of the run restored from {args.resume_config}; given on the command line: '
                         + ('; '.join(overrides) if overrides else 'none'))
    return progress


def _distributed_model(args: argparse.Namespace, model: nn.Module, device: torch.device, has_grc: bool,
                       grc_layers: Sequence[GatedRecurrentCache], primary: bool) -> nn.Module:
    """The model wrapped for torchrun (DDP) and torch.compile, as asked."""
    if args.distributed:
        # DDP's buffer broadcast sends rank 0's buffers before every forward (they are synced at DDP's creation
        # either way). It is only needed for buffers nothing else keeps equal: batch norm statistics are averaged at
        # each evaluation (--dist-bn) and the GRC caches after each optimizer step, so then it is off (no collective
        # per micro-batch); with --dist-bn '' or --no-grc-sync-cache it stays on, and rank 0's buffers win, as in
        # timm's train.py.
        broadcast_buffers = args.dist_bn not in ('reduce', 'broadcast') or (has_grc and not grc_layers)
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None,
                                                    forward_sync_buffers=broadcast_buffers)
        if primary:
            _logger.info('DDP buffer broadcast ' + ('on: rank 0 buffers are sent before every forward' if
                         broadcast_buffers else f'off: batch norm statistics are averaged at each evaluation '
                         f'(--dist-bn {args.dist_bn})' + (', GRC caches after each optimizer step' if grc_layers
                                                          else '')))
    if args.torchcompile:
        model = torch.compile(model, backend=args.torchcompile, mode=args.torchcompile_mode)
    return model


def _write_run_files(args: argparse.Namespace, output_dir: str, class_names: Optional[List[str]]) -> None:
    """args.yaml (a config that replays the run) and class_names.txt (the classes in logit order)."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, 'args.yaml'), 'w') as f:
        f.write(args_to_yaml(args))
    if class_names:
        with open(os.path.join(output_dir, 'class_names.txt'), 'w') as f:
            f.write(''.join(f'{name}\n' for name in class_names))


def micro_batches_of_update(batch_idx: int, batches_per_epoch: int, grad_accum_steps: int) -> int:
    """How many micro-batches the optimizer update of batch ``batch_idx`` accumulates: ``grad_accum_steps``, but
    the epoch's last update may accumulate fewer (the remainder), as timm's train.py."""
    tail_start = batches_per_epoch - (batches_per_epoch % grad_accum_steps or grad_accum_steps)
    return grad_accum_steps if batch_idx < tail_start else batches_per_epoch - tail_start


def backward_micro_batch(model: nn.Module, criterion: nn.Module, input: torch.Tensor, target: torch.Tensor,
                         autocast: Callable[[], Any], scaler: Optional[torch.amp.GradScaler],
                         micro_batches: int) -> torch.Tensor:
    """Forward, loss and backward of one micro-batch; returns its (unscaled) mean loss.

    The loss is divided by the ``micro_batches`` its update accumulates, so the accumulated gradient is that of
    their mean loss (one big batch); under float16 the scaler multiplies it before the backward.
    """
    with autocast():
        output = model(input)
        loss = criterion(output, target)
    scaled = loss / micro_batches
    if scaler is not None:
        scaler.scale(scaled).backward()
    else:
        scaled.backward()
    return loss


def optimizer_update(optimizer: torch.optim.Optimizer, scaler: Optional[torch.amp.GradScaler],
                     parameters: Any, clip_grad: Optional[float], clip_mode: str) -> None:
    """One optimizer step on the accumulated gradients (unscaled first, then clipped if asked), then zeroes them."""
    if scaler is not None:
        if clip_grad is not None:
            scaler.unscale_(optimizer)
            dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
        scaler.step(optimizer)
        scaler.update()
    else:
        if clip_grad is not None:
            dispatch_clip_grad(parameters, clip_grad, mode=clip_mode)
        optimizer.step()
    optimizer.zero_grad()


def train_step(model: nn.Module, criterion: nn.Module, opt: _Optimization, input: torch.Tensor,
               target: torch.Tensor, batch_idx: int, batches_per_epoch: int, args: argparse.Namespace
               ) -> Tuple[torch.Tensor, bool]:
    """One micro-batch: its backward (gradients accumulated, without DDP's all-reduce until the update's last
    micro-batch) and, at the end of an accumulation or of the epoch, the optimizer update.

    Returns:
        (the micro-batch's mean loss, whether the optimizer stepped).
    """
    need_update = batch_idx + 1 == batches_per_epoch or (batch_idx + 1) % args.grad_accum_steps == 0
    sync_ctx = model.no_sync if args.distributed and not need_update else contextlib.nullcontext
    with sync_ctx():
        loss = backward_micro_batch(model, criterion, input, target, opt.autocast, opt.scaler,
                                    micro_batches_of_update(batch_idx, batches_per_epoch, args.grad_accum_steps))
    if need_update:
        optimizer_update(opt.optimizer, opt.scaler, model.parameters(), args.clip_grad, args.clip_mode)
    return loss, need_update


def _top_lr(optimizer: torch.optim.Optimizer) -> float:
    """The lr the log reports: the largest of the parameter groups' (the head's under --layer-decay, where the
    groups below it get less)."""
    return max(group['lr'] for group in optimizer.param_groups)


class _Run:
    """The training loop of a set-up run: epochs of train steps, evaluation, summary and checkpoints.

    Args:
        args: The run's arguments.
        device: This process's device.
        model: The model as trained (DDP / compiled as asked).
        loaders: Training and validation loaders.
        criterion: The training loss.
        mixup_fn: Mixup/CutMix, or None.
        opt: Optimizer, precision, EMA and schedule.
        grc_layers: GRC layers whose caches are averaged after each update.
        keeper: The checkpoint files.
        output_dir: The run directory.
        progress: Where the run starts (a resumed one: where it stopped).
        class_names: The classes in logit order (saved in checkpoints).
        start_time: When the run started (for --time-budget).
    """

    def __init__(self, args: argparse.Namespace, device: torch.device, model: nn.Module, loaders: _Loaders,
                 criterion: nn.Module, mixup_fn: Optional[Mixup], opt: _Optimization,
                 grc_layers: Sequence[GatedRecurrentCache], keeper: CheckpointKeeper, output_dir: str,
                 progress: _Progress, class_names: Optional[List[str]], start_time: float):
        self.args, self.device, self.model, self.loaders = args, device, model, loaders
        self.criterion, self.mixup_fn, self.opt, self.grc_layers = criterion, mixup_fn, opt, grc_layers
        self.keeper, self.output_dir, self.class_names, self.start_time = keeper, output_dir, class_names, start_time
        self.primary = args.rank == 0
        self.num_epochs = opt.num_epochs
        self.batches_per_epoch = loaders.batches_per_epoch
        self.start_epoch, self.start_batch = progress.epoch, progress.batch
        self.num_updates = progress.num_updates
        self.progress = progress
        self.train_t0: Optional[float] = None  # when this session's first epoch began
        self.losses = _LossWindow(device, args.distributed)
        self.losses.epoch_sum, self.losses.epoch_count = progress.loss_sum, progress.loss_count
        self.use_bar = self.primary and (args.progress == 'bar' or (args.progress == 'auto' and sys.stderr.isatty()))
        self.log_wandb = args.log_wandb and self.primary
        self.steps_this_process = 0
        self.samples_seen = 0
        # a progress line every --log-interval batches, or after --log-interval-s seconds (one process only: the
        # loss read is a collective under torchrun, so every process must log at the same batches)
        self.clock = ProgressClock(args.log_interval, None if args.distributed else args.log_interval_s)
        self.out_of_time = False
        self.step_lr = 0.0  # the lr of the latest update: progress lines and summary.csv
        self.eval_metrics: Dict[str, float] = {}  # of the weights that pick "best": the EMA's when there is one
        self.model_metrics: Dict[str, float] = {}
        self.ema_metrics: Optional[Dict[str, float]] = None

    def checkpoint_state(self, next_epoch: int, next_batch: int, metric: Optional[float]) -> Dict[str, Any]:
        """Everything a resumed run needs (the loss window must have been read: its totals are saved)."""
        args, opt = self.args, self.opt
        state = {
            'arch': args.model, 'epoch': next_epoch - 1 if next_batch == 0 else next_epoch,
            'next_epoch': next_epoch, 'next_batch': next_batch, 'num_updates': self.num_updates,
            'state_dict': _unwrap(self.model).state_dict(), 'optimizer': opt.optimizer.state_dict(),
            'rng': get_rng_state(), 'keeper': self.keeper.state_dict(), 'metric': metric,
            'train_loss_sum': self.losses.epoch_sum, 'train_loss_count': self.losses.epoch_count,
            'run_totals': self.run_totals(), 'lsvision_checkpoint': 1,
            'args': args_to_dict(args),  # what --resume <this file> restores
            'class_names': self.class_names,  # the classes in logit order (tools/validate.py --data-dir)
        }
        if opt.scaler is not None:
            state['scaler'] = opt.scaler.state_dict()
        if opt.model_ema is not None:
            state['state_dict_ema'] = opt.model_ema.state_dict()
        return state

    def non_finite(self, e: _NonFiniteWindow, epoch: int, done: int) -> NonFiniteLossError:
        keeper = self.keeper
        last_good = [p for p in (keeper.path('recovery.pth.tar'), keeper.path('last.pth.tar')) if os.path.isfile(p)]
        return NonFiniteLossError(
            f'non-finite training loss ({"nan or inf" if e.loss is None else e.loss}) at '
            f'{epoch_label(epoch, self.num_epochs)}, batch {e.batch_idx + 1}/{self.batches_per_epoch} '
            f'(lr {_top_lr(self.opt.optimizer):.3g}); found at batch '
            f'{done}/{self.batches_per_epoch} (the loss is read every --log-interval {self.args.log_interval} '
            'batches), no checkpoint written since. '
            + (f'Last good checkpoint: {max(last_good, key=os.path.getmtime)}. ' if last_good
               else 'No checkpoint was written yet. ')
            + 'Try a lower --lr / --lr-base, --clip-grad 1.0, or --amp-dtype bfloat16.')

    def evaluate(self) -> None:
        """Validates the model (and the EMA); the EMA's metrics pick "best" when there is one (as timm)."""
        args, model_ema = self.args, self.opt.model_ema
        if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
            distribute_bn(self.model, args.world_size, args.dist_bn == 'reduce')
        raw = validate(self.model, self.loaders.eval, args, self.device, self.opt.autocast, self.loaders.eval_images)
        if model_ema is None:
            self.eval_metrics, self.model_metrics, self.ema_metrics = raw, raw, None
            return
        if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
            distribute_bn(model_ema, args.world_size, args.dist_bn == 'reduce')
        ema = validate(model_ema, self.loaders.eval, args, self.device, self.opt.autocast, self.loaders.eval_images)
        self.eval_metrics, self.model_metrics, self.ema_metrics = ema, raw, ema

    def _after_update(self) -> None:
        """What follows each optimizer step: GRC caches, the update count, the EMA, the per-update schedule."""
        all_reduce_grc_caches(self.grc_layers)  # once per update, outside no_sync; before the EMA copies them
        self.num_updates += 1
        self.steps_this_process += 1
        if self.opt.model_ema is not None:
            self.opt.model_ema.update(_unwrap(self.model), step=self.num_updates)
        self.opt.lr_scheduler.step_update(num_updates=self.num_updates)

    def _log_and_save(self, epoch: int, batch_idx: int, first: int, epoch_t0: float, bar: Any) -> None:
        """After an update: reads the loss window at log steps (progress line, non-finite check, time budget) and
        writes the recovery checkpoint when due."""
        args = self.args
        done = batch_idx + 1
        last_batch = done == self.batches_per_epoch
        log_step = self.clock.due(done, force=last_batch)
        save_recovery = bool(args.recovery_interval) and self.num_updates % args.recovery_interval == 0 \
            and not last_batch
        # one process alone may not stop (the others would wait for it): under torchrun the time budget is
        # checked at the log steps, where all processes compare it
        late = bool(args.time_budget) and time.time() - self.start_time > args.time_budget
        if log_step or save_recovery or (late and not args.distributed):
            try:
                window_loss, self.out_of_time = self.losses.read(late)  # the host waits for the device here only
            except _NonFiniteWindow as e:
                raise self.non_finite(e, epoch, done) from None
            elapsed = time.time() - epoch_t0
            if bar is not None:
                bar.set_postfix_str(f'loss {self.losses.epoch_mean:.4f} lr {self.step_lr:.3g}', refresh=False)
            elif self.primary and log_step:
                rate = (done - first) / max(elapsed, 1e-9)
                eta_epoch = (self.batches_per_epoch - done) / max(rate, 1e-9)
                eta_run = eta_epoch + (self.num_epochs - epoch - 1) * self.batches_per_epoch / max(rate, 1e-9)
                _logger.info(_progress_line(epoch, self.num_epochs, done, self.batches_per_epoch, window_loss,
                                            self.losses.epoch_mean, self.step_lr,
                                            rate * args.batch_size * args.world_size, eta_epoch, eta_run))
        if bar is not None:
            bar.update(done - bar.n)
        if (save_recovery or self.out_of_time) and not last_batch and self.primary:
            save_atomic(self.checkpoint_state(epoch, done, None), self.keeper.path('recovery.pth.tar'))

    def train_epoch(self, epoch: int) -> Tuple[int, float]:
        """Trains one epoch (from its first batch not yet done); returns (the last batch index, the epoch's start
        time). Stops early when the time budget runs out (``self.out_of_time``)."""
        args, loaders = self.args, self.loaders
        first = self.start_batch if epoch == self.start_epoch else 0
        if first == 0:
            self.losses.epoch_sum, self.losses.epoch_count = 0.0, 0
        loaders.sampler.set_epoch(epoch, start=first * args.batch_size)
        if loaders.batch_erasing is not None:
            loaders.batch_erasing.start(epoch, first)
        if self.mixup_fn is not None and args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
            self.mixup_fn.mixup_enabled = False
        self.model.train()
        self.step_lr = _top_lr(self.opt.optimizer)
        bar = None
        if self.use_bar:
            from tqdm import tqdm
            bar = tqdm(total=self.batches_per_epoch, initial=first, desc=epoch_label(epoch, self.num_epochs),
                       dynamic_ncols=True, file=sys.stderr)
        epoch_t0 = time.time()
        self.opt.optimizer.zero_grad()
        batch_idx = first
        for batch_idx, (input, target) in enumerate(loaders.train, start=first):
            # model-side randomness (drop path, mixup) is a function of (seed, epoch, batch, rank) too
            seed_everything(derive_seed(args.seed, 1, epoch, batch_idx, args.rank))
            # no-ops after the prefetcher; asynchronous from pinned memory without it
            input = input.to(self.device, non_blocking=args.pin_mem)
            target = target.to(self.device, non_blocking=args.pin_mem)
            if self.mixup_fn is not None:
                input, target = self.mixup_fn(input, target)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            lr = _top_lr(self.opt.optimizer)  # of this batch's update, if it makes one
            loss, updated = train_step(self.model, self.criterion, self.opt, input, target, batch_idx,
                                       self.batches_per_epoch, args)
            self.losses.add(loss, input.shape[0], batch_idx)  # on the device: no wait for it here
            self.samples_seen += input.shape[0] * args.world_size
            if not updated:
                continue
            self.step_lr = lr
            self._after_update()
            self._log_and_save(epoch, batch_idx, first, epoch_t0, bar)
            if args.stop_after_steps and self.steps_this_process >= args.stop_after_steps:
                # testing hook: die like a killed process (no cleanup, no final checkpoint)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)
            if self.out_of_time:
                break
        if bar is not None:
            bar.close()
        return batch_idx, epoch_t0

    def end_epoch(self, epoch: int, epoch_t0: float) -> None:
        """Evaluates, steps the epoch schedule and (rank 0) writes summary.csv and the epoch's checkpoints."""
        self.evaluate()
        train_loss = self.losses.epoch_mean
        metric = self.eval_metrics[self.args.eval_metric]
        self.opt.lr_scheduler.step(epoch + 1, metric)
        if not self.primary:
            return
        summary = os.path.join(self.output_dir, 'summary.csv')
        columns = dict(self.model_metrics, **{f'ema_{k}': v for k, v in (self.ema_metrics or {}).items()})
        update_summary(epoch, {'loss': train_loss}, columns, summary, lr=self.step_lr,
                       write_header=not os.path.isfile(summary), log_wandb=self.log_wandb)
        keeper = self.keeper
        dropped = keeper.update(epoch, metric)
        keeper.save_epoch(self.checkpoint_state(epoch + 1, 0, metric), epoch, metric)
        keeper.remove(dropped)
        recovery = keeper.path('recovery.pth.tar')
        if os.path.isfile(recovery):
            os.remove(recovery)  # last.pth.tar is now the most advanced state
        _logger.info(f'{epoch_label(epoch, self.num_epochs)}: train loss {train_loss:.4f}, lr {self.step_lr:.3g}; '
                     + _metrics_text(self.model_metrics, self.ema_metrics) + f' ({time.time() - epoch_t0:.1f}s)')

    def fit(self) -> Dict[str, Any]:
        """The epochs from the start (or resume) point to the end or the time budget; returns the result."""
        epoch = self.start_epoch
        batch_idx = 0
        self.train_t0 = time.time()
        for epoch in range(self.start_epoch, self.num_epochs):
            batch_idx, epoch_t0 = self.train_epoch(epoch)
            if self.out_of_time and batch_idx + 1 < self.batches_per_epoch:
                if self.primary:
                    _logger.info(f'time budget of {self.args.time_budget:.0f}s reached in '
                                 f'{epoch_label(epoch, self.num_epochs)} (batch {batch_idx + 1}/'
                                 f'{self.batches_per_epoch}); evaluating now')
                break
            self.end_epoch(epoch, epoch_t0)
            if self.out_of_time:
                break
        if self.out_of_time and (not self.eval_metrics or batch_idx + 1 < self.batches_per_epoch):
            self.evaluate()
            if self.primary:
                _logger.info(_metrics_text(self.model_metrics, self.ema_metrics))
                self.keeper.save_epoch(self.checkpoint_state(epoch, batch_idx + 1, None), epoch, None)
        return self.result(epoch)

    def session_totals(self) -> Dict[str, float]:
        """This session's training time (from its first epoch), wall time (from its start) and samples."""
        now = time.time()
        return dict(train_seconds=round(now - (self.train_t0 or now), 1),
                    total_seconds=round(now - self.start_time, 1), samples_seen=self.samples_seen)

    def run_totals(self) -> Optional[Dict[str, float]]:
        """The run's totals so far: the earlier sessions' (up to the checkpoint this one resumed) plus this one's;
        None when the resumed checkpoint predates them."""
        earlier = self.progress.earlier
        if earlier is None:
            return None
        return {k: round(earlier[k] + v, 1) if k != 'samples_seen' else earlier[k] + v
                for k, v in self.session_totals().items()}

    def result(self, epoch: int) -> Dict[str, Any]:
        """The run's outcome (result.json): metrics, checkpoints, and run totals (epochs, updates, times, samples:
        every session's, up to the checkpoint each resumed; null where a resumed checkpoint predates them), with
        this session's own numbers under ``session``."""
        keeper, metrics = self.keeper, self.eval_metrics
        run = self.run_totals() or dict.fromkeys(_NO_TIME)
        session = dict(self.session_totals(), resumed_from=self.progress.resumed_from,
                       updates=self.num_updates - self.progress.num_updates)
        return dict(
            model=self.args.model, model_kwargs=dict(self.args.model_kwargs or {}),
            params=sum(p.numel() for p in self.model.parameters()),
            output_dir=self.output_dir, epochs_done=epoch + (0 if self.out_of_time else 1),
            num_updates=self.num_updates, stopped_by_time_budget=self.out_of_time,
            top1=metrics.get('top1'), top5=metrics.get('top5'), eval_loss=metrics.get('loss'),
            metrics_of='ema' if self.ema_metrics is not None else 'model', model_metrics=self.model_metrics,
            ema_metrics=self.ema_metrics, best_metric=keeper.best_metric, best_epoch=keeper.best_epoch,
            last_checkpoint=keeper.path('last.pth.tar'),
            best_checkpoint=keeper.path('model_best.pth.tar') if keeper.best_epoch is not None else None,
            train_seconds=run['train_seconds'], total_seconds=run['total_seconds'], samples_seen=run['samples_seen'],
            session=session,
        )


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Train `args.model` as `args` says; return the final metrics and the checkpoint paths."""
    start_time = time.time()
    device = _setup(args)
    primary = args.rank == 0
    dataset_train, dataset_eval, class_names = _datasets(args, primary)
    model, grc_layers, has_grc, data_config = _model_on_device(args, device, primary)
    loaders = _loaders(args, dataset_train, dataset_eval, data_config, device, primary)
    criterion, mixup_fn = _loss_and_mixup(args, device)
    opt = _optimization(args, model, device, primary, loaders.batches_per_epoch)

    output_dir = _run_directory(args, data_config, primary)
    keeper = CheckpointKeeper(output_dir, max_history=args.checkpoint_hist, decreasing=args.eval_metric == 'loss')
    resume_path = _find_resume(output_dir) if args.resume == 'auto' else args.resume
    progress = _Progress()
    if resume_path:
        progress = _resume(args, resume_path, model, opt, keeper, primary)
    elif args.start_epoch is not None:
        progress.epoch = args.start_epoch
    if progress.epoch > 0 or progress.batch > 0:
        opt.lr_scheduler.step(progress.epoch)
        if args.sched_on_updates:
            opt.lr_scheduler.step_update(progress.num_updates)
    model = _distributed_model(args, model, device, has_grc, grc_layers, primary)

    if primary:
        _write_run_files(args, output_dir, class_names)
        _logger.info(f'run directory {output_dir}; {opt.num_epochs} epochs x {loaders.batches_per_epoch} batches of '
                     f'{args.batch_size} x {args.world_size} process(es)')
    if args.log_wandb and primary:
        import wandb
        wandb.init(project='lsvision', name=os.path.basename(output_dir), dir=output_dir, config=args_to_dict(args))
    trainer = _Run(args, device, model, loaders, criterion, mixup_fn, opt, grc_layers, keeper, output_dir, progress,
                   class_names, start_time)
    result = trainer.fit()
    if primary:
        with open(os.path.join(output_dir, 'result.json'), 'w') as f:
            json.dump(result, f, indent=2)
    if trainer.log_wandb:
        wandb.finish()
    if args.distributed:
        _check_ranks_agree(model, args)
        dist.barrier()
        dist.destroy_process_group()
    return result
