"""Training and evaluation of Semantic FPN / UperNet segmentors: the run behind `tools/segment.py`.

Training follows mmsegmentation's iteration-based runner as the PVT Semantic FPN recipe uses it: AdamW (timm's
optimizer factory), a poly schedule (timm's `PolyLRScheduler`, power 0.9, stepped on updates, optional linear
warmup) over a fixed number of iterations, a checkpoint every `checkpoint_interval` iterations, evaluation every
`eval_interval`. The data is drawn epoch by epoch (`DistributedSampler`, reshuffled per epoch from the seed; the last
incomplete batch of an epoch dropped so every batch has its full size), each sample's augmentation seeded by (seed,
epoch, index). Under torchrun every process takes a shard of each epoch, the model is wrapped in DDP (with SyncBN in
the heads on CUDA, as mmsegmentation's SyncBN configs), and the GRC caches are averaged after every optimizer step. A
checkpoint holds everything a resumed run needs (weights, optimizer, scaler, schedule and data position, every
process's RNG state), so `--resume` continues as if never stopped.

Evaluation scores every image once (a contiguous shard per process, batch 1, whole-image or sliding-window
inference) and sums the per-class counts of all processes (`inference.evaluate_segmentor`).
"""
import argparse
import difflib
import inspect
import logging
import math
import os
import platform
import time
from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.utils.data
import yaml

import timm
from timm.optim import create_optimizer_v2
from timm.scheduler import PolyLRScheduler

from ..data.coco_shapes import generate_semantic_shapes
from ..reports import machine_description, markdown_table, write_json, write_text
from ..runs import source_commit
from ..runtime import ProgressClock
from ..train.checkpoint import CheckpointKeeper, load_checkpoint
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
from ..train.engine import all_reduce_grc_caches, optimizer_update
from . import models
from .data import (
    ADE20K_CLASSES,
    CITYSCAPES_CLASSES,
    SegmentationDataset,
    TrainPipeline,
    ade20k_pairs,
    cityscapes_pairs,
    collate_segmentation,
    folder_pairs,
)
from .inference import evaluate_segmentor

__all__ = ['SegmentationSetupError', 'NonFiniteLossError', 'DATASETS', 'build_segmentor', 'class_names_of', 'run',
           'markdown_report']

_logger = logging.getLogger('segment')

DATASETS = ('ade20k', 'cityscapes', 'folder')


class SegmentationSetupError(ValueError):
    """Arguments or files that cannot make a run; the message says what to change."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the last checkpoint is the last good state."""


def class_names_of(args: argparse.Namespace) -> List[str]:
    """The classes of `args.dataset`: ADE20K's 150, Cityscapes' 19, or a folder's (`--class-names`, else
    `<data-dir>/classes.txt`, one name a line)."""
    if args.dataset == 'ade20k':
        return list(ADE20K_CLASSES)
    if args.dataset == 'cityscapes':
        return list(CITYSCAPES_CLASSES)
    if args.class_names:
        return list(args.class_names)
    path = os.path.join(args.data_dir, 'classes.txt')
    if not os.path.isfile(path):
        raise SegmentationSetupError(f'--dataset folder needs its classes: give --class-names NAME ... (in label '
                                     f'order) or write {path} with one class name a line')
    with open(path) as f:
        names = [line.strip() for line in f if line.strip()]
    if not names:
        raise SegmentationSetupError(f'{path} lists no class (one class name a line, in label order)')
    return names


def _pairs(args: argparse.Namespace, split: str) -> List[Tuple[str, str]]:
    if args.dataset == 'ade20k':
        return ade20k_pairs(args.data_dir, split)
    if args.dataset == 'cityscapes':
        return cityscapes_pairs(args.data_dir, split)
    return folder_pairs(os.path.join(args.data_dir, 'images', split), os.path.join(args.data_dir, 'masks', split))


def build_segmentor(args: argparse.Namespace, num_classes: int) -> models.Segmentor:
    """The segmentor of `args.segmentor` on `args.model` (lsvision.segmentation.models)."""
    if args.segmentor not in models.SEGMENTORS:
        raise SegmentationSetupError(f'--segmentor {args.segmentor!r}: choose one of {", ".join(models.SEGMENTORS)}')
    if not timm.is_model(args.model):
        close = difflib.get_close_matches(args.model, timm.list_models(), n=3)
        raise SegmentationSetupError(f'--model {args.model!r} is no timm / lsvision model'
                                     + (f'; did you mean {", ".join(close)}?' if close else ''))
    build = getattr(models, args.segmentor)
    takes = [k for k in inspect.signature(build).parameters if k not in ('name', 'num_classes', 'backbone_weights',
                                                                         'model_kwargs')]
    unknown = sorted(set(args.head_kwargs or {}) - set(takes))
    if unknown:
        raise SegmentationSetupError(f'--head-kwargs {", ".join(unknown)}: the {args.segmentor} head takes '
                                     f'{", ".join(takes)}')
    try:
        return build(args.model, num_classes, backbone_weights=args.backbone_weights or None,
                     model_kwargs=dict(args.model_kwargs or {}), **dict(args.head_kwargs or {}))
    except (RuntimeError, OSError) as e:  # 'pretrained': none released, or none reachable
        message = backbone_weights_message(e, args.model)
        if message is None:
            raise
        raise SegmentationSetupError(message) from None


def _datasets(args: argparse.Namespace, names: List[str], model: models.Segmentor
              ) -> Tuple[Optional[SegmentationDataset], SegmentationDataset]:
    """The train split (None for --eval-only) and the val split."""
    common = dict(class_names=names, reduce_zero_label=args.dataset == 'ade20k', mean=model.mean, std=model.std,
                  skip_bad=args.skip_bad_images)
    val = SegmentationDataset(_pairs(args, args.val_split), test_scale=tuple(args.test_scale) if args.test_scale
                              else None, name=f'{args.data_dir} ({args.val_split})', **common)
    if args.eval_only:
        return None, val
    pipeline = TrainPipeline(scale=tuple(args.train_scale), ratio_range=tuple(args.ratio_range),
                             crop_size=tuple(args.crop_size), cat_max_ratio=args.cat_max_ratio,
                             photometric=args.photometric)
    train = SegmentationDataset(_pairs(args, args.train_split), pipeline=pipeline, seed=args.seed,
                                name=f'{args.data_dir} ({args.train_split})', **common)
    return train, val


class _Training:
    """The state of a training run: model (DDP-wrapped under torchrun), optimizer, scheduler, scaler, progress."""

    def __init__(self, args: argparse.Namespace, device: torch.device, model: nn.Module, train: SegmentationDataset):
        self.args, self.device, self.train_set = args, device, train
        head = model.decode_head
        if args.batch_size < 2 and isinstance(head, models.UPerHead) and 1 in [p[0].output_size for p in head.ppm] \
                and isinstance(head.bottleneck[1], nn.BatchNorm2d) and not (args.distributed and device.type == 'cuda'):
            raise SegmentationSetupError(
                "--batch-size 1: UperNet's pyramid pooling has a 1 x 1 cell, which BatchNorm cannot normalize from one "
                'image in training; use --batch-size 2 or more, or --head-kwargs norm=gn')
        self.grc = models.grc_layers(model)
        for layer in self.grc:  # one averaging per optimizer step below instead of one per layer and forward
            layer.sync_cache = False
        if args.distributed:
            if device.type == 'cuda':  # mmsegmentation's SyncBN in the heads (SyncBatchNorm runs on CUDA only)
                model.decode_head = nn.SyncBatchNorm.convert_sync_batchnorm(model.decode_head)
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda'
                                                        else None, find_unused_parameters=args.find_unused_parameters)
        self.model = model
        self.sampler = torch.utils.data.DistributedSampler(train, num_replicas=args.world_size, rank=args.rank,
                                                           shuffle=True, seed=args.seed)
        self.batches_per_epoch = len(self.sampler) // args.batch_size
        if not self.batches_per_epoch:
            raise SegmentationSetupError(f'the train split has {len(train)} images, fewer than one batch of '
                                         f'{args.batch_size} per process ({args.world_size} processes): lower '
                                         '--batch-size')
        # weight decay on every parameter, as mmsegmentation's plain AdamW of the PVT recipe
        self.optimizer = create_optimizer_v2(unwrap(model), opt=args.opt, lr=args.lr, weight_decay=args.weight_decay,
                                             filter_bias_and_bn=False)
        self.scheduler = PolyLRScheduler(self.optimizer, t_initial=args.iters, power=args.poly_power,
                                         lr_min=args.min_lr, warmup_t=args.warmup_iters,
                                         warmup_lr_init=args.lr * args.warmup_ratio, t_in_epochs=False)
        self.scheduler.step_update(0)
        use_scaler = args.amp and amp_dtype(args, device) == 'float16'
        self.scaler = torch.amp.GradScaler(device.type) if use_scaler else None
        self.iters, self.epoch, self.batch, self.history = 0, 0, 0, []
        self.loss_sum, self.loss_count = 0.0, 0  # since the last log line

    def loader(self) -> torch.utils.data.DataLoader:
        """This epoch's batches from `self.batch` on; the loader's own generator (seeded per epoch and process)
        seeds its workers, so no draw from the global random stream differs between a resumed and a straight run."""
        self.sampler.set_epoch(self.epoch)
        self.train_set.set_epoch(self.epoch)
        size = self.args.batch_size
        indices = list(self.sampler)[self.batch * size:self.batches_per_epoch * size]
        generator = torch.Generator().manual_seed(derive_seed(self.args.seed, self.epoch, self.args.rank))
        return torch.utils.data.DataLoader(self.train_set, batch_size=size, sampler=indices,
                                           num_workers=self.args.workers, collate_fn=collate_segmentation,
                                           pin_memory=self.device.type == 'cuda', generator=generator)

    def state_dict(self, keeper: CheckpointKeeper) -> Dict[str, Any]:
        return dict(training_state(self.model, self.optimizer, self.scaler), iters=self.iters, epoch=self.epoch,
                    batch=self.batch, loss=[self.loss_sum, self.loss_count], history=self.history,
                    keeper=keeper.state_dict(), args=recorded_args(self.args), arch=self.args.model,
                    segmentor=self.args.segmentor)

    def load_state_dict(self, ckpt: Dict[str, Any], keeper: CheckpointKeeper) -> None:
        load_training_state(ckpt, self.model, self.optimizer, self.scaler, self.args, _logger)
        self.iters, self.epoch, self.batch = ckpt['iters'], ckpt['epoch'], ckpt['batch']
        self.loss_sum, self.loss_count = ckpt['loss']
        self.history = ckpt['history']
        keeper.load_state_dict(ckpt.get('keeper', {}))
        self.scheduler.step_update(self.iters)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer update on a batch; returns its loss (the only wait for the device)."""
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        with autocast(self.args, self.device):
            logits = self.model(images)
        loss = models.segmentation_loss(logits, labels)
        value = float(loss.detach())
        if not math.isfinite(value):  # before the update: the weights stay those of the last good step
            raise NonFiniteLossError(
                f"the training loss is {value} at iteration {self.iters + 1}: the run directory's last.pth.tar (if "
                'one was written) holds the last good state. Lower --lr, set --clip-grad, or use --no-amp')
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        optimizer_update(self.optimizer, self.scaler, self.model.parameters(), self.args.clip_grad or None, 'norm')
        all_reduce_grc_caches(self.grc)
        self.iters += 1
        self.scheduler.step_update(self.iters)
        return value


def _evaluate(args: argparse.Namespace, model: nn.Module, val: SegmentationDataset, device: torch.device
              ) -> Dict[str, Any]:
    return evaluate_segmentor(evaluation_model(model, args), val, device, args.test_mode, args.test_crop,
                              args.test_stride, args.workers, autocast(args, device), args.log_interval,
                              args.log_interval_s)


def _save(run: _Training, keeper: CheckpointKeeper, miou: Optional[float]) -> None:
    """last.pth.tar (and the best and top-k iterations' links by mIoU); a collective: every process calls it."""
    dropped = keeper.update(run.iters, miou)
    state = run.state_dict(keeper)
    if run.args.rank == 0:
        keeper.save_epoch(state, run.iters, miou)
        keeper.remove(dropped)


def _fit(args: argparse.Namespace, run: _Training, val: SegmentationDataset, keeper: CheckpointKeeper
         ) -> Tuple[Optional[Dict[str, Any]], bool]:
    """The iterations from where the run stands: the last evaluation (None if none ran) and whether the time budget
    stopped training."""
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    evaluation, stopped, t0, done_before = None, False, time.perf_counter(), run.iters
    clock = ProgressClock(args.log_interval, args.log_interval_s)
    run.model.train()
    while run.iters < args.iters and not stopped:
        for images, labels in run.loader():
            run.loss_sum += run.step(images, labels)
            run.loss_count += 1
            run.batch += 1
            if args.rank == 0 and clock.due(run.iters, force=run.iters == args.iters):
                rate = (run.iters - done_before) / (time.perf_counter() - t0)
                _logger.info(f'iter {run.iters}/{args.iters}: loss {run.loss_sum / run.loss_count:.4f}, lr '
                             f'{run.optimizer.param_groups[0]["lr"]:.3g}, {rate * args.batch_size:.2f} img/s per '
                             f'process, ETA {timedelta(seconds=round((args.iters - run.iters) / rate))}')
            if run.iters % args.log_interval == 0 or run.iters == args.iters:  # by count: a resumed run's history too
                run.history.append(dict(iter=run.iters, train_loss=run.loss_sum / run.loss_count))
                run.loss_sum, run.loss_count = 0.0, 0
            stopped = deadline is not None and agree(time.monotonic() > deadline, run.device)
            last = run.iters == args.iters or stopped
            evaluation = None
            if last or (args.eval_interval and run.iters % args.eval_interval == 0):
                evaluation = _evaluate(args, run.model, val, run.device)
                run.history.append(dict(iter=run.iters, **{k: evaluation[k] for k in ('aAcc', 'mIoU', 'mAcc')}))
                if args.rank == 0:
                    _logger.info(f'iter {run.iters}: mIoU {100 * evaluation["mIoU"]:.2f}, mAcc '
                                 f'{100 * evaluation["mAcc"]:.2f}, aAcc {100 * evaluation["aAcc"]:.2f}')
                run.model.train()
            if last or (args.checkpoint_interval and run.iters % args.checkpoint_interval == 0):
                if run.batch == run.batches_per_epoch:  # the epoch is done: a resumed run starts the next one
                    run.epoch, run.batch = run.epoch + 1, 0
                _save(run, keeper, evaluation['mIoU'] if evaluation else None)
            if args.stop_after_updates and run.iters >= args.stop_after_updates:
                raise SystemExit(f'stopped after {run.iters} iterations (--stop-after-updates)')
            if last:
                break
        else:
            if run.batch == run.batches_per_epoch:  # not yet moved on by a checkpoint at the epoch's end
                run.epoch, run.batch = run.epoch + 1, 0
    return evaluation, stopped


def _log_data(name: str, ds: SegmentationDataset) -> None:
    _logger.info(f'{name}: {len(ds)} images, {ds.num_classes} classes'
                 + (f'; {len(ds.left_out)} bad images left out: ' + '; '.join(str(p) for p in ds.problems[:5])
                    if ds.left_out else ''))


def _demo_data(args: argparse.Namespace) -> None:
    """No --data-dir: the generated shapes as an image / mask folder pair (written once by rank 0, in the cache)."""
    root = [None]
    if args.rank == 0:
        root = [generate_semantic_shapes()['root']]
        _logger.info(f'no --data-dir: the generated shapes in {root[0]}')
    if args.distributed:
        torch.distributed.broadcast_object_list(root, src=0)
    args.dataset, args.data_dir, args.train_split, args.val_split = 'folder', root[0], 'train', 'val'


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Trains (unless `args.eval_only`) and evaluates; writes the run directory's checkpoints and reports.

    Returns:
        The report (also `result.json` and `report.md` in the run directory, written by rank 0).
    """
    device = setup_run(args)
    if not args.data_dir:
        _demo_data(args)
    if args.dataset not in DATASETS:
        raise SegmentationSetupError(f'--dataset {args.dataset!r}: choose one of {", ".join(DATASETS)}')
    default_splits = ('training', 'validation') if args.dataset == 'ade20k' else ('train', 'val')
    args.train_split, args.val_split = args.train_split or default_splits[0], args.val_split or default_splits[1]
    names = class_names_of(args)
    model = build_segmentor(args, len(names)).to(device)
    train, val = _datasets(args, names, model)
    for name, ds in (('train', train), ('val', val)):
        if ds is not None and args.rank == 0:
            _log_data(name, ds)
    if args.eval_only:
        return _evaluate_only(args, model, val, device)
    out_dir = run_directory(args, 'output/segment', args.segmentor)
    run_state = _Training(args, device, model, train)
    keeper = CheckpointKeeper(out_dir, max_history=args.checkpoint_hist)
    if args.resume:
        ckpt = load_checkpoint(args.resume)
        if 'iters' not in ckpt:
            raise SegmentationSetupError(f'{args.resume} is not a tools/segment.py training checkpoint; evaluate its '
                                         'weights with --eval-only --checkpoint')
        run_state.load_state_dict(ckpt, keeper)
        if args.rank == 0:
            _logger.info(f'resumed {args.resume}: iteration {run_state.iters}')
    elif args.rank == 0:
        write_text(os.path.join(out_dir, 'args.yaml'), yaml.safe_dump(recorded_args(args), sort_keys=False))
    untrained = None
    if args.eval_untrained and not args.resume:  # the same initialization, before any update
        untrained = _json_safe(_evaluate(args, run_state.model, val, device))
        if args.rank == 0:
            _logger.info(f'untrained: mIoU {100 * untrained["mIoU"]:.2f}, aAcc {100 * untrained["aAcc"]:.2f}')
    t0 = time.perf_counter()
    evaluation, stopped = _fit(args, run_state, val, keeper)
    metrics = evaluation or _evaluate(args, run_state.model, val, device)
    report = _report(args, metrics, val, train, dict(
        untrained_metrics=untrained, iters_done=run_state.iters, stopped_by_time_budget=stopped,
        train_seconds=round(time.perf_counter() - t0, 1),
        history=run_state.history, output_dir=out_dir, last_checkpoint=os.path.join(out_dir, 'last.pth.tar')))
    if args.rank == 0:
        _write_reports(out_dir, report)
    return report


def _evaluate_only(args: argparse.Namespace, model: nn.Module, val: SegmentationDataset,
                   device: torch.device) -> Dict[str, Any]:
    eval_only_weights(args, model, 'segmentor', ('segmentor', 'model'), ('segmentor', 'model', 'head_kwargs'),
                      SegmentationSetupError, _logger)
    report = _report(args, _evaluate(args, model, val, device), val, None, dict(checkpoint=args.checkpoint or None))
    if args.rank == 0 and args.output:
        os.makedirs(args.output, exist_ok=True)
        _write_reports(args.output, report)
    return report


def _json_safe(metrics: Dict[str, Any]) -> Dict[str, Any]:
    """NaN (a class nowhere in the split) as None, which JSON can hold."""
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v
    return {k: [clean(x) for x in v] if isinstance(v, list) else clean(v) for k, v in metrics.items()}


def _report(args: argparse.Namespace, metrics: Dict[str, Any], val: SegmentationDataset,
            train: Optional[SegmentationDataset], extra: Dict[str, Any]) -> Dict[str, Any]:
    def data(ds: SegmentationDataset) -> Dict[str, Any]:
        return dict(name=ds.name, images=len(ds), left_out=len(ds.left_out), problems=[str(p) for p in ds.problems])
    return dict(
        model=args.model, segmentor=args.segmentor, dataset=args.dataset, metrics=_json_safe(metrics), val=data(val),
        train=data(train) if train is not None else None, inference=dict(
            mode=args.test_mode, test_scale=args.test_scale, crop=args.test_crop if args.test_mode == 'slide' else None,
            stride=args.test_stride if args.test_mode == 'slide' else None),
        args=recorded_args(args), commit=source_commit(), machine=machine_description(args.device),
        processes=args.world_size, host=platform.node(), finished=f'{datetime.now():%Y-%m-%d %H:%M:%S}', **extra)


def _write_reports(folder: str, report: Dict[str, Any]) -> None:
    write_json(os.path.join(folder, 'result.json'), report)
    write_text(os.path.join(folder, 'report.md'), markdown_report(report))


def _pct(v: Optional[float]) -> str:
    return '-' if v is None else f'{100 * v:.2f}'


def markdown_report(report: Dict[str, Any]) -> str:
    """The report as markdown: mIoU, mAcc, aAcc, then IoU and accuracy per class, in percent ('-': a class in
    neither label nor prediction (IoU) or in no label (Acc), left out of the means)."""
    m, val, inference = report['metrics'], report['val'], report['inference']
    how = inference['mode'] + (f' (crop {inference["crop"]}, stride {inference["stride"]})'
                               if inference['mode'] == 'slide' else '')
    lines = [f'# {report["segmentor"]} on {report["model"]}', '',
             f'{val["name"]}: {val["images"]} images, {m["pixels"]} labelled pixels; {how} inference, percent '
             "(mmsegmentation's counting: per-class areas summed over the split).", '',
             markdown_table(['mIoU', 'mAcc', 'aAcc', 'classes scored'],
                            [[_pct(m['mIoU']), _pct(m['mAcc']), _pct(m['aAcc']), str(m['classes_scored'])]],
                            left_columns=0), '',
             markdown_table(['class', 'IoU', 'Acc'], [[name, _pct(iou), _pct(acc)] for name, iou, acc in
                                                      zip(m['classes'], m['IoU'], m['Acc'])]), '']
    if val['left_out']:
        lines += [f'Left out as bad input ({val["left_out"]} images): ' + '; '.join(val['problems'][:10]), '']
    if report.get('iters_done') is not None:
        lines.append(f'Trained {report["iters_done"]} iterations, {report["train_seconds"]:.0f} s'
                     + (' (stopped by the time budget)' if report['stopped_by_time_budget'] else '') + '.')
    lines += [f'Commit {report["commit"]}, {report["processes"]} process(es) on {report["machine"]}.', '']
    return '\n'.join(lines)
