"""The training run behind tools/train.py: timm's data, model, optimizer, scheduler and EMA, plus a small loop.

What the loop adds to timm's pieces: exact mid-epoch resume (see lsvision.train.data), atomic checkpoints with
every piece of state, a stop on non-finite loss that leaves the last good checkpoint alone, a wall-clock budget,
and progress with speed and ETA.
"""
import argparse
import contextlib
import json
import logging
import os
import sys
import time
from datetime import datetime, timedelta
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data

from timm.data import Mixup, create_dataset, create_loader, create_transform, resolve_data_config
from timm.layers import convert_sync_batchnorm
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import create_model, safe_model_name
from timm.models import load_checkpoint as timm_load_checkpoint
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import (
    AverageMeter,
    ModelEmaV3,
    accuracy,
    dispatch_clip_grad,
    distribute_bn,
    get_outdir,
    init_distributed_device,
    setup_default_logging,
    update_summary,
)

from ..data.digits import export_digits
from .args import args_to_yaml
from .checkpoint import CheckpointKeeper, get_rng_state, load_checkpoint, save_atomic, set_rng_state
from .data import ResumableSampler, SeededTrainDataset, derive_seed, num_classes_of, seed_everything

__all__ = ['NonFiniteLossError', 'TrainSetupError', 'run']

_logger = logging.getLogger('train')


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class TrainSetupError(ValueError):
    """Arguments, data or checkpoint that cannot be used as given (the message says why and what to do)."""


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


def _progress_line(epoch: int, num_epochs: int, done: int, total: int, loss: AverageMeter, lr: float,
                   samples_per_s: float, eta_epoch: float, eta_run: float) -> str:
    return (f'epoch {epoch + 1}/{num_epochs} [{done}/{total}] loss {loss.val:.4f} (avg {loss.avg:.4f}) '
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


@torch.no_grad()
def validate(model: nn.Module, loader: torch.utils.data.DataLoader, args: argparse.Namespace, device: torch.device,
             autocast: Any) -> Dict[str, float]:
    """Loss, top-1 and top-5 over the whole validation set, summed across processes."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction='sum')
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top1 hits, top5 hits, count
    for input, target in loader:
        input, target = input.to(device), target.to(device)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        with autocast():
            output = model(input)
        output = output.float()
        k = min(5, output.shape[-1])
        top1, topk = accuracy(output, target, topk=(1, k))
        n = input.shape[0]
        totals += torch.tensor([criterion(output, target).item(), top1.item() * n / 100, topk.item() * n / 100, n],
                               dtype=torch.float64, device=device)
    if args.distributed:
        dist.all_reduce(totals)
    loss, top1, top5, n = totals.tolist()
    return {'loss': loss / n, 'top1': 100 * top1 / n, 'top5': 100 * top5 / n}


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Train `args.model` as `args` says; return the final metrics and the checkpoint paths."""
    setup_default_logging()
    start_time = time.time()
    args.data_dir = args.data_dir or args.data or ''
    if not args.device:
        args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    if args.log_wandb:
        _logger.warning('--log-wandb is not supported by lsvision; metrics go to summary.csv')
    if args.threads:
        torch.set_num_threads(args.threads)
    device = init_distributed_device(args)
    primary = args.rank == 0
    if args.distributed:
        _logger.info(f'process {args.rank}/{args.world_size} on {args.device}, backend {dist.get_backend()}')
    seed_everything(derive_seed(args.seed, args.rank))

    # data: the embedded digits when no dataset is named
    if not args.data_dir and not args.dataset:
        if primary:
            info = export_digits()
            _logger.info(f"no --data-dir: training on scikit-learn's digits ({info['num_train']} train / "
                         f"{info['num_val']} val images) exported to {info['root']}")
        if args.distributed:
            dist.barrier()
        args.data_dir = export_digits()['root']
    class_map = args.class_map or ''
    dataset_kwargs = dict(root=args.data_dir, class_map=class_map, download=args.dataset_download,
                          batch_size=args.batch_size, seed=args.seed)
    if args.input_img_mode:
        dataset_kwargs['input_img_mode'] = args.input_img_mode
    if args.input_key or args.target_key:
        dataset_kwargs.update(input_key=args.input_key, target_key=args.target_key)
    dataset_train = create_dataset(args.dataset, split=args.train_split, is_training=True,
                                   repeats=args.epoch_repeats, num_samples=args.train_num_samples, **dataset_kwargs)
    dataset_eval = create_dataset(args.dataset, split=args.val_split, is_training=False,
                                  num_samples=args.val_num_samples, **dataset_kwargs)
    if args.num_classes is None:
        args.num_classes = num_classes_of(dataset_train)
        if args.num_classes is None:
            raise TrainSetupError('cannot tell the number of classes of this dataset; pass --num-classes')

    # model
    in_chans = args.input_size[0] if args.input_size is not None else args.in_chans
    model_kwargs = dict(args.model_kwargs or {})
    if args.pretrained_path:
        model_kwargs['pretrained_cfg_overlay'] = dict(file=args.pretrained_path)
    model = create_model(
        args.model, pretrained=args.pretrained, in_chans=in_chans, num_classes=args.num_classes,
        drop_rate=args.drop, drop_path_rate=args.drop_path, drop_block_rate=args.drop_block, global_pool=args.gp,
        bn_momentum=args.bn_momentum, bn_eps=args.bn_eps, **model_kwargs)
    if args.initial_checkpoint:
        timm_load_checkpoint(model, args.initial_checkpoint, weights_only=True)
    if args.grad_checkpointing:
        model.set_grad_checkpointing(enable=True)
    if primary:
        _logger.info(f'model {safe_model_name(args.model)}: {sum(p.numel() for p in model.parameters()):,} params, '
                     f'{args.num_classes} classes')
    data_config = resolve_data_config(vars(args), model=model, verbose=primary)
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.distributed and args.sync_bn:
        if device.type == 'cuda':
            model = convert_sync_batchnorm(model)
        elif primary:
            _logger.warning(f'--sync-bn ignored on {device.type}: torch SyncBatchNorm runs on GPUs only; batch norm '
                            f'statistics are averaged across processes at each epoch end (--dist-bn {args.dist_bn})')

    # transforms and loaders
    dataset_train.transform = create_transform(
        data_config['input_size'], is_training=True, no_aug=args.no_aug, train_crop_mode=args.train_crop_mode,
        scale=args.scale, ratio=args.ratio, hflip=args.hflip, vflip=args.vflip, color_jitter=args.color_jitter,
        color_jitter_prob=args.color_jitter_prob, grayscale_prob=args.grayscale_prob or 0.,
        gaussian_blur_prob=args.gaussian_blur_prob or 0., auto_augment=args.aa,
        interpolation=args.train_interpolation, mean=data_config['mean'], std=data_config['std'],
        re_prob=args.reprob, re_mode=args.remode, re_count=args.recount, re_num_splits=0, use_prefetcher=False)
    sampler = ResumableSampler(dataset_train, num_replicas=args.world_size, rank=args.rank, seed=args.seed,
                               num_repeats=args.aug_repeats)
    loader_train = torch.utils.data.DataLoader(
        SeededTrainDataset(dataset_train, seed=args.seed, rank=args.rank), batch_size=args.batch_size,
        sampler=sampler, num_workers=args.workers, pin_memory=args.pin_mem, drop_last=True,
        persistent_workers=args.workers > 0)
    batches_per_epoch = sampler.full_len() // args.batch_size
    if batches_per_epoch == 0:
        raise TrainSetupError(f'the training split has {sampler.full_len()} samples per process, fewer than one batch '
                         f'of {args.batch_size}; lower --batch-size')
    loader_eval = create_loader(
        dataset_eval, input_size=data_config['input_size'], batch_size=args.validation_batch_size or args.batch_size,
        is_training=False, interpolation=data_config['interpolation'], mean=data_config['mean'],
        std=data_config['std'], num_workers=args.workers, distributed=args.distributed,
        crop_pct=data_config['crop_pct'], pin_memory=args.pin_mem, device=device, use_prefetcher=False)

    # loss, mixup
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
    criterion = criterion.to(device)

    # optimizer, precision, EMA, schedule
    _resolve_lr(args)
    optimizer = create_optimizer_v2(model, **optimizer_kwargs(cfg=args), **(args.opt_kwargs or {}))
    amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16
    if args.amp:
        def autocast():
            return torch.autocast(device_type=device.type, dtype=amp_dtype)
    else:
        autocast = contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type) if args.amp and amp_dtype == torch.float16 else None
    model_ema = None
    if args.model_ema:
        model_ema = ModelEmaV3(model, decay=args.model_ema_decay, use_warmup=args.model_ema_warmup,
                               device='cpu' if args.model_ema_force_cpu else None)
    updates_per_epoch = (batches_per_epoch + args.grad_accum_steps - 1) // args.grad_accum_steps
    tail_start = batches_per_epoch - (batches_per_epoch % args.grad_accum_steps or args.grad_accum_steps)
    lr_scheduler, num_epochs = create_scheduler_v2(
        optimizer, **scheduler_kwargs(args, decreasing_metric=args.eval_metric == 'loss'),
        updates_per_epoch=updates_per_epoch)

    # run directory, resume
    if args.resume and args.resume != 'auto':
        output_dir = os.path.dirname(os.path.abspath(args.resume))
    else:
        exp_name = args.experiment or '-'.join([
            datetime.now().strftime('%Y%m%d-%H%M%S'), safe_model_name(args.model), str(data_config['input_size'][-1])])
        # a new run never writes into an older run's directory; --resume auto continues in it. Rank 0 picks (and
        # creates) the directory, the others take its choice.
        output_dir = [get_outdir(args.output or './output/train', exp_name, inc=args.resume != 'auto')
                      if primary else None]
        if args.distributed:
            dist.broadcast_object_list(output_dir, src=0)
        output_dir = output_dir[0]
    keeper = CheckpointKeeper(output_dir, max_history=args.checkpoint_hist, decreasing=args.eval_metric == 'loss')
    resume_path = _find_resume(output_dir) if args.resume == 'auto' else args.resume
    start_epoch, start_batch, num_updates = 0, 0, 0
    loss_sum, loss_count = 0.0, 0
    if resume_path:
        ckpt = load_checkpoint(resume_path)
        if 'next_epoch' not in ckpt:
            raise TrainSetupError(f'{resume_path} is not a tools/train.py training checkpoint (no training state); '
                                  'load its weights with --initial-checkpoint instead of --resume')
        _unwrap(model).load_state_dict(ckpt['state_dict'])
        if model_ema is not None and 'state_dict_ema' in ckpt:
            model_ema.load_state_dict(ckpt['state_dict_ema'])
        if not args.no_resume_opt:
            optimizer.load_state_dict(ckpt['optimizer'])
            if scaler is not None and 'scaler' in ckpt:
                scaler.load_state_dict(ckpt['scaler'])
        start_epoch, start_batch, num_updates = ckpt['next_epoch'], ckpt['next_batch'], ckpt['num_updates']
        loss_sum, loss_count = ckpt.get('train_loss_sum', 0.0), ckpt.get('train_loss_count', 0)
        keeper.load_state_dict(ckpt.get('keeper', {}))
        set_rng_state(ckpt['rng'])
        if primary:
            _logger.info(f'resumed {resume_path}: epoch {start_epoch + 1}, batch {start_batch}, {num_updates} updates')
    elif args.start_epoch is not None:
        start_epoch = args.start_epoch
    if start_epoch > 0 or start_batch > 0:
        lr_scheduler.step(start_epoch)
        if args.sched_on_updates:
            lr_scheduler.step_update(num_updates)

    if args.distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == 'cuda' else None)
    if args.torchcompile:
        model = torch.compile(model, backend=args.torchcompile, mode=args.torchcompile_mode)

    if primary:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, 'args.yaml'), 'w') as f:
            f.write(args_to_yaml(args))
        _logger.info(f'run directory {output_dir}; {num_epochs} epochs x {batches_per_epoch} batches of '
                     f'{args.batch_size} x {args.world_size} process(es)')

    def checkpoint_state(next_epoch: int, next_batch: int, metric: Optional[float]) -> Dict[str, Any]:
        state = {
            'arch': args.model, 'epoch': next_epoch - 1 if next_batch == 0 else next_epoch,
            'next_epoch': next_epoch, 'next_batch': next_batch, 'num_updates': num_updates,
            'state_dict': _unwrap(model).state_dict(), 'optimizer': optimizer.state_dict(),
            'rng': get_rng_state(), 'keeper': keeper.state_dict(), 'metric': metric,
            'train_loss_sum': loss_sum, 'train_loss_count': loss_count, 'lsvision_checkpoint': 1,
        }
        if scaler is not None:
            state['scaler'] = scaler.state_dict()
        if model_ema is not None:
            state['state_dict_ema'] = model_ema.state_dict()
        return state

    use_bar = primary and (args.progress == 'bar' or (args.progress == 'auto' and sys.stderr.isatty()))
    steps_this_process = 0
    eval_metrics: Dict[str, float] = {}
    out_of_time = False
    epoch = start_epoch
    train_t0 = time.time()
    samples_seen = 0
    for epoch in range(start_epoch, num_epochs):
        first = start_batch if epoch == start_epoch else 0
        if first == 0:
            loss_sum, loss_count = 0.0, 0
        sampler.set_epoch(epoch, start=first * args.batch_size)
        if mixup_fn is not None and args.mixup_off_epoch and epoch >= args.mixup_off_epoch:
            mixup_fn.mixup_enabled = False
        model.train()
        loss_meter = AverageMeter()
        bar = None
        if use_bar:
            from tqdm import tqdm
            bar = tqdm(total=batches_per_epoch, initial=first, desc=f'epoch {epoch + 1}/{num_epochs}',
                       dynamic_ncols=True, file=sys.stderr)
        epoch_t0 = time.time()
        optimizer.zero_grad()
        for batch_idx, (input, target) in enumerate(loader_train, start=first):
            # model-side randomness (drop path, mixup) is a function of (seed, epoch, batch, rank) too
            seed_everything(derive_seed(args.seed, 1, epoch, batch_idx, args.rank))
            input, target = input.to(device), target.to(device)
            if mixup_fn is not None:
                input, target = mixup_fn(input, target)
            if args.channels_last:
                input = input.contiguous(memory_format=torch.channels_last)
            last_batch = batch_idx + 1 == batches_per_epoch
            need_update = last_batch or (batch_idx + 1) % args.grad_accum_steps == 0
            sync_ctx = contextlib.nullcontext
            if args.distributed and not need_update:
                sync_ctx = model.no_sync
            with sync_ctx():
                with autocast():
                    output = model(input)
                    loss = criterion(output, target)
                bad = torch.tensor(0. if torch.isfinite(loss).item() else 1., device=device)
                if args.distributed:
                    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
                if bad.item():
                    last_good = [p for p in (keeper.path('recovery.pth.tar'), keeper.path('last.pth.tar'))
                                 if os.path.isfile(p)]
                    raise NonFiniteLossError(
                        f'non-finite training loss ({loss.item()}) at epoch {epoch + 1}, batch {batch_idx} '
                        f'(lr {optimizer.param_groups[0]["lr"]:.3g}); no update was applied and no checkpoint '
                        'written. ' + (f'Last good checkpoint: {max(last_good, key=os.path.getmtime)}. '
                                       if last_good else 'No checkpoint was written yet. ')
                        + 'Try a lower --lr / --lr-base, --clip-grad 1.0, or --amp-dtype bfloat16.')
                # the epoch's last update may accumulate fewer batches (as timm's train.py)
                scaled = loss / (args.grad_accum_steps if batch_idx < tail_start else batches_per_epoch - tail_start)
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            loss_meter.update(loss.item(), input.shape[0])
            loss_sum += loss.item() * input.shape[0]
            loss_count += input.shape[0]
            samples_seen += input.shape[0] * args.world_size
            if not need_update:
                continue
            if scaler is not None:
                if args.clip_grad is not None:
                    scaler.unscale_(optimizer)
                    dispatch_clip_grad(model.parameters(), args.clip_grad, mode=args.clip_mode)
                scaler.step(optimizer)
                scaler.update()
            else:
                if args.clip_grad is not None:
                    dispatch_clip_grad(model.parameters(), args.clip_grad, mode=args.clip_mode)
                optimizer.step()
            optimizer.zero_grad()
            num_updates += 1
            steps_this_process += 1
            if model_ema is not None:
                model_ema.update(_unwrap(model), step=num_updates)
            lr_scheduler.step_update(num_updates=num_updates)

            elapsed = time.time() - epoch_t0
            done = batch_idx + 1
            if bar is not None:
                bar.update(done - bar.n)
                bar.set_postfix_str(f'loss {loss_meter.avg:.4f} lr {optimizer.param_groups[0]["lr"]:.3g}')
            elif primary and (done % args.log_interval == 0 or last_batch):
                rate = (done - first) / max(elapsed, 1e-9)
                eta_epoch = (batches_per_epoch - done) / max(rate, 1e-9)
                eta_run = eta_epoch + (num_epochs - epoch - 1) * batches_per_epoch / max(rate, 1e-9)
                _logger.info(_progress_line(epoch, num_epochs, done, batches_per_epoch, loss_meter,
                                            optimizer.param_groups[0]['lr'], rate * args.batch_size * args.world_size,
                                            eta_epoch, eta_run))
            if args.time_budget and time.time() - start_time > args.time_budget:
                out_of_time = True
            if (args.recovery_interval and num_updates % args.recovery_interval == 0 and not last_batch) or \
                    (out_of_time and not last_batch):
                if primary:
                    save_atomic(checkpoint_state(epoch, done, None), keeper.path('recovery.pth.tar'))
            if args.stop_after_steps and steps_this_process >= args.stop_after_steps:
                # testing hook: die like a killed process (no cleanup, no final checkpoint)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(3)
            if out_of_time:
                break
        if bar is not None:
            bar.close()

        if out_of_time and batch_idx + 1 < batches_per_epoch:
            if primary:
                _logger.info(f'time budget of {args.time_budget:.0f}s reached in epoch {epoch + 1} '
                             f'(batch {batch_idx + 1}/{batches_per_epoch}); evaluating now')
            break
        if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
            distribute_bn(model, args.world_size, args.dist_bn == 'reduce')
        eval_metrics = validate(model, loader_eval, args, device, autocast)
        if model_ema is not None:
            if args.distributed and args.dist_bn in ('broadcast', 'reduce'):
                distribute_bn(model_ema, args.world_size, args.dist_bn == 'reduce')
            eval_metrics = validate(model_ema, loader_eval, args, device, autocast)  # EMA metrics pick "best"
        train_loss = loss_sum / max(loss_count, 1)
        metric = eval_metrics[args.eval_metric]
        lr_scheduler.step(epoch + 1, metric)
        if primary:
            lr = optimizer.param_groups[0]['lr']
            summary = os.path.join(output_dir, 'summary.csv')
            update_summary(epoch, {'loss': train_loss}, eval_metrics, summary, lr=lr,
                           write_header=not os.path.isfile(summary))
            dropped = keeper.update(epoch, metric)
            keeper.save_epoch(checkpoint_state(epoch + 1, 0, metric), epoch, metric)
            keeper.remove(dropped)
            recovery = keeper.path('recovery.pth.tar')
            if os.path.isfile(recovery):
                os.remove(recovery)  # last.pth.tar is now the most advanced state
            _logger.info(f'epoch {epoch + 1}/{num_epochs}: train loss {train_loss:.4f}, val loss '
                         f'{eval_metrics["loss"]:.4f}, top-1 {eval_metrics["top1"]:.2f}%, top-5 '
                         f'{eval_metrics["top5"]:.2f}% ({time.time() - epoch_t0:.1f}s)')
        if out_of_time:
            break

    if out_of_time and (not eval_metrics or batch_idx + 1 < batches_per_epoch):
        eval_metrics = validate(model_ema if model_ema is not None else model, loader_eval, args, device, autocast)
        if primary:
            keeper.save_epoch(checkpoint_state(epoch, batch_idx + 1, None), epoch, None)
    result = dict(
        model=args.model, output_dir=output_dir, epochs_done=epoch + (0 if out_of_time else 1),
        num_updates=num_updates, stopped_by_time_budget=out_of_time,
        top1=eval_metrics.get('top1'), top5=eval_metrics.get('top5'), eval_loss=eval_metrics.get('loss'),
        best_metric=keeper.best_metric, best_epoch=keeper.best_epoch, last_checkpoint=keeper.path('last.pth.tar'),
        best_checkpoint=keeper.path('model_best.pth.tar') if keeper.best_epoch is not None else None,
        train_seconds=round(time.time() - train_t0, 1), total_seconds=round(time.time() - start_time, 1),
        samples_seen=samples_seen,
    )
    if primary:
        with open(os.path.join(output_dir, 'result.json'), 'w') as f:
            json.dump(result, f, indent=2)
    if args.distributed:
        _check_ranks_agree(model, args)
        dist.barrier()
        dist.destroy_process_group()
    return result
