"""Training and evaluation of torchvision detectors on COCO-format data: the run behind `tools/detect.py`.

Training follows mmdetection's epoch-based runner as the PVT paper's detection recipes use it: AdamW (timm's
optimizer factory), a linear warmup over the first updates and step decay at given epochs (timm's
`MultiStepLRScheduler`, stepped on updates), a checkpoint after every epoch. Under torchrun every process takes a
shard of each epoch (`DistributedSampler`, reshuffled per epoch from the seed), the model is wrapped in DDP, and the
GRC caches are averaged after every optimizer step (`all_reduce_grc_caches`). A checkpoint holds everything a resumed
run needs (weights, optimizer, scaler, schedule position, every process's RNG state), so `--resume` continues as if
never stopped, from the end of an epoch or from a mid-epoch `recovery.pth.tar` (`--recovery-interval`).

Evaluation scores every image once: each process takes a contiguous shard of the images (batch 1, as mmdetection's
test loop, so no image is padded to another's size), the detections are gathered, and rank 0 scores them with
pycocotools (`coco_eval.coco_evaluate`) and shares the numbers.
"""
import argparse
import contextlib
import difflib
import logging
import math
import os
import platform
import time
from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
import yaml
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

import timm
from timm.optim import create_optimizer_v2
from timm.scheduler import MultiStepLRScheduler

from ..data.coco_shapes import default_coco_shapes_root, generate_coco_shapes
from ..eval.distributed import DatasetShard, all_gather, rank_and_world, shard_range
from ..reports import machine_description, markdown_table, write_json, write_text
from ..runs import source_commit
from ..runtime import ProgressClock
from ..train.checkpoint import CheckpointKeeper, load_checkpoint, save_atomic
from ..train.data import derive_seed
from ..train.dense import (
    agree,
    amp_dtype,
    autocast,
    backbone_weights_message,
    eval_only_weights,
    evaluation_model,
    load_training_state,
    recorded_args,
    run_directory,
    setup_run,
    training_state,
    unwrap,
)
from ..train.engine import all_reduce_grc_caches, long_warmup_warning, optimizer_update
from . import models
from .coco_eval import STAT_NAMES, coco_evaluate, detections_to_coco
from .data import CocoDataError, CocoInstances, collate_detection, describe_degenerate_box

__all__ = ['DetectionSetupError', 'NonFiniteLossError', 'DETECTORS', 'build_detector', 'evaluate_detector',
           'coco_split_paths', 'run', 'markdown_report']

_logger = logging.getLogger('detect')

DETECTORS = ('mask_rcnn', 'faster_rcnn', 'retinanet')


class DetectionSetupError(ValueError):
    """Arguments or files that cannot make a run; the message says what to change."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the last checkpoint is the last good state."""


def coco_split_paths(data_dir: str, split: str) -> Tuple[str, str]:
    """COCO's layout: (`<data_dir>/annotations/instances_<split>.json`, `<data_dir>/<split>`)."""
    return os.path.join(data_dir, 'annotations', f'instances_{split}.json'), os.path.join(data_dir, split)


def build_detector(args: argparse.Namespace, num_classes: int) -> nn.Module:
    """The detector of `args.detector` on `args.model` (lsvision.detection.models), with its transform's sizes."""
    if args.detector not in DETECTORS:
        raise DetectionSetupError(f'--detector {args.detector!r}: choose one of {", ".join(DETECTORS)}')
    if not timm.is_model(args.model):
        close = difflib.get_close_matches(args.model, timm.list_models(), n=3)
        raise DetectionSetupError(f'--model {args.model!r} is no timm / lsvision model'
                                  + (f'; did you mean {", ".join(close)}?' if close else ''))
    kwargs = dict(min_size=args.min_size, max_size=args.max_size, **(args.detector_kwargs or {}))
    weights, model_kwargs = args.backbone_weights or None, dict(args.model_kwargs or {})
    try:
        if not args.fpn_channels:
            return getattr(models, args.detector)(args.model, num_classes=num_classes, backbone_weights=weights,
                                                  model_kwargs=model_kwargs, **kwargs)
        backbone = models.backbone_with_fpn(args.model, weights, model_kwargs, out_channels=args.fpn_channels,
                                            levels='retinanet' if args.detector == 'retinanet' else 'rcnn')
    except (RuntimeError, OSError) as e:  # 'pretrained': none released, or none reachable
        message = backbone_weights_message(e, args.model)
        if message is None:
            raise
        raise DetectionSetupError(message) from None
    return _narrow_detector(args.detector, backbone, num_classes, kwargs)


def _narrow_detector(detector: str, backbone: models.BackboneWithFPN, num_classes: int,
                     kwargs: Dict[str, Any]) -> nn.Module:
    """A detector whose FPN and heads have `backbone.out_channels` channels instead of torchvision's 256 (and a
    box head of 4x that instead of 1024): torchvision's own head modules, sized for a CPU demo."""
    c = backbone.out_channels
    kwargs = models._normalization(backbone, kwargs)
    if detector == 'retinanet':
        return RetinaNet(backbone, num_classes=num_classes, **kwargs)
    kwargs.update(box_head=TwoMLPHead(c * 7 * 7, 4 * c), box_predictor=FastRCNNPredictor(4 * c, num_classes))
    if detector == 'faster_rcnn':
        return FasterRCNN(backbone, num_classes=None, **kwargs)
    return MaskRCNN(backbone, num_classes=None, mask_head=MaskRCNNHeads(c, (c,) * 4, 1),
                    mask_predictor=MaskRCNNPredictor(c, c, num_classes), **kwargs)


@torch.no_grad()
def evaluate_detector(model: nn.Module, dataset: CocoInstances, device: torch.device,
                      iou_types: Tuple[str, ...] = ('bbox', 'segm'), workers: int = 0,
                      autocast: Any = None, log_every: int = 0, log_every_s: Optional[float] = None
                      ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Scores a detector on a COCO-format split: every image once (a shard per process), rank 0's COCOeval. A
    progress line every `log_every` images or `log_every_s` seconds (0 / None: never by that rule).

    Returns:
        Per iou type COCOeval's numbers (`coco_eval.coco_evaluate`), with `images` (the images scored) and
        `detections` (their count), the same on every process; and the detections (COCO's result format, in
        the split's image order), on every process.
    """
    model.eval()
    indices = shard_range(len(dataset))
    # a generator of its own: the loader's seed is not drawn from the global stream, which training continues
    loader = torch.utils.data.DataLoader(DatasetShard(dataset, indices), batch_size=1, num_workers=workers,
                                         collate_fn=collate_detection, generator=torch.Generator())
    detections, t0 = [], time.perf_counter()
    clock = ProgressClock(log_every, log_every_s)
    for step, (images, targets) in enumerate(loader):
        with autocast or contextlib.nullcontext():
            outputs = model([image.to(device, non_blocking=True) for image in images])
        for output, target in zip(outputs, targets):
            detections.extend(detections_to_coco(output, target['image_id'], dataset.category_ids))
        if rank_and_world()[0] == 0 and clock.due(step + 1):
            rate = (step + 1) / (time.perf_counter() - t0)
            _logger.info(f'eval: {step + 1}/{len(indices)} images of this process, {rate:.1f} img/s, ETA '
                         f'{timedelta(seconds=round((len(indices) - step - 1) / rate))}')
    detections = [d for part in all_gather(detections) for d in part]
    result = [None]
    if rank_and_world()[0] == 0:
        result = [coco_evaluate(dataset.coco, detections, iou_types, image_ids=dataset.image_ids)]
        for scores in result[0].values():
            scores.update(images=len(dataset), detections=len(detections))
    if rank_and_world()[1] > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0], detections


def _demo_data(args: argparse.Namespace) -> None:
    """No --data-dir: the generated shapes (written once by rank 0, in the cache)."""
    root = default_coco_shapes_root()
    if args.rank == 0:
        _logger.info(f'no --data-dir: the generated COCO-format shapes in {root}')
        generate_coco_shapes(root)
    if args.distributed:
        dist.barrier()
    args.data_dir, args.train_split, args.val_split = root, 'train', 'val'


def _datasets(args: argparse.Namespace) -> Tuple[Optional[CocoInstances], CocoInstances]:
    """The train split (None for --eval-only) and the val split, with the same categories."""
    if not args.data_dir:
        _demo_data(args)
    val = CocoInstances(*coco_split_paths(args.data_dir, args.val_split), skip_bad=args.skip_bad_images)
    if args.eval_only:
        return None, val
    train = CocoInstances(*coco_split_paths(args.data_dir, args.train_split), train=True,
                          skip_bad=args.skip_bad_images, drop_empty=args.drop_empty, seed=args.seed)
    if train.category_ids != val.category_ids:
        raise CocoDataError(f'the train split has categories {train.category_ids} and the val split '
                            f'{val.category_ids}: both annotation files must list the same categories')
    return train, val


def _log_data(name: str, ds: CocoInstances) -> None:
    s = ds.stats
    _logger.info(f'{name}: {s.images} images, {s.annotations} annotations ({s.crowd} crowd and {s.degenerate_boxes} '
                 f'degenerate boxes not trained on), {s.empty_images} without a box'
                 + (f' ({s.dropped_empty_images} of them left out of training)' if s.dropped_empty_images else '')
                 + (f'; {len(s.left_out_images)} bad images left out: ' + '; '.join(str(p) for p in ds.problems[:5])
                    if s.left_out_images else ''))
    if s.degenerate_boxes:
        _logger.warning(f'{name}: {_degenerate_boxes(s)} ({_DEGENERATE_USE[name]})')


# what becomes of a degenerate box in each split
_DEGENERATE_USE = dict(train='no training target; an image with no other box trains as background',
                       val='COCOeval reads them as the file gives them')


def _degenerate_boxes(stats: Any) -> str:
    """The degenerate boxes of a split: their count and the first few, named."""
    examples = stats['degenerate_examples'] if isinstance(stats, dict) else stats.degenerate_examples
    count = stats['degenerate_boxes'] if isinstance(stats, dict) else stats.degenerate_boxes
    more = f' ... and {count - len(examples)} more' if count > len(examples) else ''
    return f'{count} degenerate box(es): ' + '; '.join(describe_degenerate_box(e) for e in examples) + more


class _Training:
    """The state of a training run: model (DDP-wrapped under torchrun), optimizer, scheduler, scaler, progress."""

    def __init__(self, args: argparse.Namespace, device: torch.device, model: nn.Module, train: CocoInstances):
        self.args, self.device, self.train_set = args, device, train
        self.grc = models.grc_layers(model)
        for layer in self.grc:  # one averaging per optimizer step below instead of one per layer and forward
            layer.sync_cache = False
        if args.distributed:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda'
                                                        else None, find_unused_parameters=args.find_unused_parameters)
        self.model = model
        self.sampler = torch.utils.data.DistributedSampler(train, num_replicas=args.world_size, rank=args.rank,
                                                           shuffle=True, seed=args.seed)
        self.updates_per_epoch = math.ceil(len(self.sampler) / args.batch_size)
        # weight decay on every parameter, biases and norms included, as mmdetection's plain AdamW of the PVT recipes
        self.optimizer = create_optimizer_v2(unwrap(model), opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                             filter_bias_and_bn=False)
        self.scheduler = MultiStepLRScheduler(
            self.optimizer, decay_t=[m * self.updates_per_epoch for m in args.decay_milestones],
            decay_rate=args.decay_rate, warmup_t=args.warmup_iters, warmup_lr_init=args.lr * args.warmup_ratio,
            t_in_epochs=False)
        use_scaler = args.amp and amp_dtype(args, device) == 'float16'
        self.scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        self.epoch, self.num_updates, self.history = 0, 0, []
        self.batch, self.loss_sums = 0, {}  # batches of this epoch done, and their summed losses
        self.warmup_checked = False

    def check_warmup(self, session_updates: int = 0, seconds: float = 0.) -> None:
        """Warn (rank 0, once) when --warmup-iters is not shorter than the run: its --epochs, or with a time budget
        the updates this session is projected to make at its pace (after `session_updates` in `seconds`)."""
        args = self.args
        if args.rank != 0 or self.warmup_checked or args.warmup_iters <= 0:
            return
        total = args.epochs * self.updates_per_epoch
        note = f'--epochs {args.epochs} of {self.updates_per_epoch} updates'
        if args.time_budget:
            if not session_updates or seconds <= 0:
                return
            pace = self.num_updates + int(session_updates / seconds * max(args.time_budget - seconds, 0.))
            if pace < total:
                total, note = pace, f'about {pace} in --time-budget {args.time_budget:g} at this pace'
        self.warmup_checked = True
        message = long_warmup_warning(f'--warmup-iters {args.warmup_iters}', args.warmup_iters, total, 'updates',
                                      args.lr * args.warmup_ratio, args.lr, f'(the run: {note})')
        if message:
            _logger.warning(message)

    def _loader(self) -> torch.utils.data.DataLoader:
        """This epoch's batches from `self.batch` on: the sampler's order for the epoch, its first batches skipped
        when resuming mid-epoch. The loader's own generator (seeded per epoch and process) seeds its workers, so no
        draw from the global random stream differs between a resumed and an uninterrupted run."""
        self.sampler.set_epoch(self.epoch)
        self.train_set.set_epoch(self.epoch)
        indices = list(self.sampler)[self.batch * self.args.batch_size:]
        generator = torch.Generator().manual_seed(derive_seed(self.args.seed, self.epoch, self.args.rank))
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.args.batch_size, sampler=indices,
                                           num_workers=self.args.workers, collate_fn=collate_detection,
                                           pin_memory=self.device.type == 'cuda', generator=generator)

    def state_dict(self, keeper: CheckpointKeeper) -> Dict[str, Any]:
        return dict(training_state(self.model, self.optimizer, self.scaler), next_epoch=self.epoch,
                    next_batch=self.batch, loss_sums=dict(self.loss_sums), num_updates=self.num_updates,
                    history=self.history, keeper=keeper.state_dict(),
                    args=recorded_args(self.args), arch=self.args.model, detector=self.args.detector)

    def load_state_dict(self, ckpt: Dict[str, Any], keeper: CheckpointKeeper) -> None:
        load_training_state(ckpt, self.model, self.optimizer, self.scaler, self.args, _logger)
        self.epoch, self.num_updates, self.history = ckpt['next_epoch'], ckpt['num_updates'], ckpt['history']
        self.batch, self.loss_sums = ckpt.get('next_batch', 0), dict(ckpt.get('loss_sums', {}))
        keeper.load_state_dict(ckpt.get('keeper', {}))
        self.scheduler.step_update(self.num_updates)

    def step(self, images: List[torch.Tensor], targets: List[Dict[str, Any]]) -> Dict[str, float]:
        """One optimizer update on a batch; returns the losses (the only wait for the device)."""
        images = [image.to(self.device, non_blocking=True) for image in images]
        targets = [{k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in t.items()}
                   for t in targets]
        with autocast(self.args, self.device):
            losses = self.model(images, targets)
        loss = sum(losses.values())
        values = {k: float(v.detach()) for k, v in losses.items()}  # one read of the device per update
        values['loss'] = float(loss.detach())
        if not math.isfinite(values['loss']):  # before the update: the weights stay those of the last good step
            raise NonFiniteLossError(
                f'the training loss is {values["loss"]} at update {self.num_updates + 1} (epoch {self.epoch}): '
                f"{values}; the run directory's last.pth.tar (if an epoch finished) holds the last good epoch. Lower "
                '--lr, set --clip-grad, or use --no-amp')
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()  # gradients: None since the last update
        optimizer_update(self.optimizer, self.scaler, self.model.parameters(), self.args.clip_grad or None, 'norm')
        all_reduce_grc_caches(self.grc)
        self.num_updates += 1
        self.scheduler.step_update(self.num_updates)
        return values

    def train_epoch(self, deadline: Optional[float], keeper: CheckpointKeeper) -> Tuple[Dict[str, float], bool]:
        """The rest of this epoch (or until `deadline`): its mean losses and whether the deadline stopped it. Every
        --recovery-interval updates, and where the deadline stops it, a mid-epoch checkpoint (`recovery.pth.tar`) to
        resume from."""
        self.model.train()
        t0, done_before, stopped = time.perf_counter(), self.batch, False
        clock = ProgressClock(self.args.log_interval, self.args.log_interval_s)
        for images, targets in self._loader():
            values = self.step(images, targets)
            self.batch += 1
            for k, v in values.items():
                self.loss_sums[k] = self.loss_sums.get(k, 0.0) + v
            if self.args.rank == 0 and clock.due(self.batch, force=self.batch == self.updates_per_epoch):
                self._log_progress(values, (self.batch - done_before) / (time.perf_counter() - t0))
                self.check_warmup(self.batch - done_before, time.perf_counter() - t0)
            stopped = deadline is not None and agree(time.monotonic() > deadline, self.device)
            recover = self.args.recovery_interval and self.batch % self.args.recovery_interval == 0
            if (recover or stopped) and self.batch < self.updates_per_epoch:  # stopped by the budget: resumable too
                state = self.state_dict(keeper)  # a collective: every process builds it
                if self.args.rank == 0:
                    save_atomic(state, keeper.path('recovery.pth.tar'))
            if self.args.stop_after_updates and self.num_updates >= self.args.stop_after_updates:
                raise SystemExit(f'stopped after {self.num_updates} updates (--stop-after-updates)')
            if stopped:
                break
        means = {k: v / max(self.batch, 1) for k, v in self.loss_sums.items()}
        self.batch, self.loss_sums = 0, {}
        return means, stopped

    def _log_progress(self, values: Dict[str, float], rate: float) -> None:
        _logger.info(f'epoch {self.epoch} ({self.epoch + 1} of {self.args.epochs}) {self.batch}/'
                     f'{self.updates_per_epoch}: loss {values["loss"]:.4f} (mean '
                     f'{self.loss_sums["loss"] / self.batch:.4f}), lr {self.optimizer.param_groups[0]["lr"]:.3g}, '
                     f'{rate * self.args.batch_size:.2f} img/s per process, epoch ETA '
                     f'{timedelta(seconds=round((self.updates_per_epoch - self.batch) / rate))}')


def _iou_types(args: argparse.Namespace) -> Tuple[str, ...]:
    return ('bbox', 'segm') if args.detector == 'mask_rcnn' else ('bbox',)


def _evaluate(args: argparse.Namespace, model: nn.Module, val: CocoInstances, device: torch.device
              ) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    return evaluate_detector(evaluation_model(model, args), val, device, _iou_types(args), args.workers,
                             autocast(args, device), args.log_interval, args.log_interval_s)


def _fit(args: argparse.Namespace, run: _Training, val: CocoInstances, keeper: CheckpointKeeper
         ) -> Tuple[Optional[Tuple[Dict[str, Any], List[Dict[str, Any]]]], bool]:
    """The epochs from where the run stands: the last evaluation (None if the run was done already) and whether the
    time budget stopped training. A checkpoint after every epoch (rank 0 writes it)."""
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    evaluation, stopped = None, False
    while run.epoch < args.epochs and not stopped:
        t0 = time.perf_counter()
        losses, stopped = run.train_epoch(deadline, keeper)
        last = stopped or run.epoch + 1 == args.epochs
        evaluation = None
        if last or (args.eval_interval and (run.epoch + 1) % args.eval_interval == 0):
            evaluation = _evaluate(args, run.model, val, run.device)
        metrics = evaluation[0] if evaluation else {}
        run.history.append(dict(epoch=run.epoch, train_seconds=round(time.perf_counter() - t0, 1),
                                updates=run.num_updates, **{f'train_{k}': v for k, v in losses.items()},
                                **{f'{t}_{n}': metrics[t][n] for t in metrics for n in STAT_NAMES}))
        if args.rank == 0 and metrics:
            _logger.info(f'epoch {run.epoch}: ' + ', '.join(f'{t} AP {m["AP"]:.4f} (AP50 {m["AP50"]:.4f})'
                                                            for t, m in metrics.items()))
        box_ap = metrics['bbox']['AP'] if metrics else None
        dropped = keeper.update(run.epoch, box_ap)
        run.epoch += 1
        state = run.state_dict(keeper)  # a collective (every process's RNG state): all processes build it
        if args.rank == 0:
            keeper.save_epoch(state, run.epoch - 1, box_ap)
            keeper.remove(dropped)
    return evaluation, stopped


def _write_reports(folder: str, report: Dict[str, Any], detections: List[Dict[str, Any]]) -> None:
    """result.json, report.md and detections.json (COCO's result format) in `folder`, atomically."""
    write_json(os.path.join(folder, 'result.json'), report)
    write_text(os.path.join(folder, 'report.md'), markdown_report(report))
    write_json(os.path.join(folder, 'detections.json'), detections)


def _start_or_resume(args: argparse.Namespace, run_state: _Training, keeper: CheckpointKeeper, out_dir: str) -> None:
    if not args.resume:
        if args.rank == 0:
            write_text(os.path.join(out_dir, 'args.yaml'), yaml.safe_dump(recorded_args(args), sort_keys=False))
        return
    ckpt = load_checkpoint(args.resume)
    if 'next_epoch' not in ckpt:
        raise DetectionSetupError(f'{args.resume} is not a tools/detect.py training checkpoint; evaluate its '
                                  'weights with --eval-only --checkpoint')
    run_state.load_state_dict(ckpt, keeper)
    if args.rank == 0:
        _logger.info(f'resumed at update {run_state.num_updates} (epoch {run_state.epoch}, batch {run_state.batch} of '
                     f'it) from {args.resume}')


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Trains (unless `args.eval_only`) and evaluates; writes the run directory's checkpoints and reports.

    Returns:
        The report (also `result.json`, `report.md` and the detections, `detections.json`, in the run directory,
        written by rank 0).
    """
    device = setup_run(args)
    train, val = _datasets(args)
    for name, ds in (('train', train), ('val', val)):
        if ds is not None and args.rank == 0:
            _log_data(name, ds)
    num_classes = args.num_classes or val.num_classes
    val.check_num_classes(num_classes)
    model = build_detector(args, num_classes).to(device)
    if args.eval_only:
        return _evaluate_only(args, model, val, device)
    out_dir = run_directory(args, 'output/detect', args.detector)
    run_state = _Training(args, device, model, train)
    keeper = CheckpointKeeper(out_dir, max_history=args.checkpoint_hist)
    _start_or_resume(args, run_state, keeper, out_dir)
    run_state.check_warmup()
    t0 = time.perf_counter()
    evaluation, stopped = _fit(args, run_state, val, keeper)
    metrics, detections = evaluation or _evaluate(args, run_state.model, val, device)
    report = _report(args, metrics, val, train, dict(
        epochs_done=run_state.epoch, num_updates=run_state.num_updates, stopped_by_time_budget=stopped,
        train_seconds=round(time.perf_counter() - t0, 1), history=run_state.history, output_dir=out_dir,
        last_checkpoint=os.path.join(out_dir, 'last.pth.tar')))
    if args.rank == 0:
        _write_reports(out_dir, report, detections)
    return report


def _evaluate_only(args: argparse.Namespace, model: nn.Module, val: CocoInstances,
                   device: torch.device) -> Dict[str, Any]:
    eval_only_weights(args, model, 'detector', ('detector', 'model'), ('detector', 'model', 'fpn_channels'),
                      DetectionSetupError, _logger)
    metrics, detections = _evaluate(args, model, val, device)
    report = _report(args, metrics, val, None, dict(checkpoint=args.checkpoint or None))
    if args.rank == 0 and args.output:
        os.makedirs(args.output, exist_ok=True)
        _write_reports(args.output, report, detections)
    return report


def _report(args: argparse.Namespace, metrics: Dict[str, Any], val: CocoInstances, train: Optional[CocoInstances],
            extra: Dict[str, Any]) -> Dict[str, Any]:
    def data(ds: CocoInstances) -> Dict[str, Any]:
        return dict(annotation_file=ds.ann_file, image_dir=ds.image_dir, **vars(ds.stats),
                    problems=[str(p) for p in ds.problems])
    return dict(
        model=args.model, detector=args.detector, metrics=metrics, val=data(val),
        train=data(train) if train is not None else None, args=recorded_args(args),
        commit=source_commit(), machine=machine_description(args.device), processes=args.world_size,
        host=platform.node(), finished=f'{datetime.now():%Y-%m-%d %H:%M:%S}', **extra)


def markdown_report(report: Dict[str, Any]) -> str:
    """The report as markdown: COCOeval's numbers per iou type, in percent, and where they come from."""
    names = {'bbox': 'box', 'segm': 'mask'}
    rows = [[names[t]] + [('-' if m[n] < 0 else f'{100 * m[n]:.1f}') for n in STAT_NAMES[:6]]
            for t, m in report['metrics'].items()]
    val = report['val']
    lines = [f'# {report["detector"]} on {report["model"]}', '',
             f'COCOeval (pycocotools) on {val["annotation_file"]}: {val["images"]} images, percent.', '',
             markdown_table(['', *STAT_NAMES[:6]], rows), '']
    if val['left_out_images']:
        lines += [f'Left out as bad input ({len(val["left_out_images"])} images): '
                  + '; '.join(val['problems'][:10]), '']
    for split in ('train', 'val'):
        if (report.get(split) or {}).get('degenerate_boxes'):
            lines += [f'{split.capitalize()} split: {_degenerate_boxes(report[split])} ({_DEGENERATE_USE[split]}).',
                      '']
    if report.get('epochs_done') is not None:
        lines.append(f'Trained {report["epochs_done"]} epoch(s), {report["num_updates"]} updates, '
                     f'{report["train_seconds"]:.0f} s' + (' (stopped by the time budget)' if
                                                           report['stopped_by_time_budget'] else '') + '.')
    lines += [f'Commit {report["commit"]}, {report["processes"]} process(es) on {report["machine"]}.', '']
    return '\n'.join(lines)
