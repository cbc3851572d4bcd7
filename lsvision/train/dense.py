"""The run pieces that the dense-prediction tools share (tools/detect.py, tools/segment.py): process setup, AMP,
the time budget's agreement across processes, the run directory, the arguments a checkpoint records, and the
weights an evaluation loads.

They know no task: lsvision.detection.engine and lsvision.segmentation.engine build their runs on them.
"""
import argparse
import contextlib
import logging
import os
import sys
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist
import torch.nn as nn

from timm.utils import distribute_bn, init_distributed_device, setup_default_logging

from ..eval.distributed import all_gather, rank_and_world
from ..runtime import set_threads
from .args import ConfigError, demo_preset_help, tool_defaults
from .checkpoint import CheckpointWriteError, get_rng_state, load_checkpoint, set_rng_state
from .data import derive_seed, seed_everything

__all__ = ['setup_run', 'unwrap', 'evaluation_model', 'amp_dtype', 'autocast', 'agree', 'recorded_args',
           'run_directory', 'load_eval_weights', 'eval_only_weights', 'backbone_weights_message', 'tool_parser',
           'parse_tool_args', 'tool_main', 'training_state', 'load_training_state']

# what a checkpoint and args.yaml do not record: this machine's place in the job, and the tool's run controls
_NOT_RECORDED = {'distributed', 'rank', 'world_size', 'local_rank', 'device_id', 'device', 'config', 'resume',
                 'eval_only', 'checkpoint', 'stop_after_updates'}


def setup_run(args: argparse.Namespace) -> torch.device:
    """Logging, the device ('' = cuda if available), threads (`lsvision.runtime.set_threads`: 0 = auto), torchrun's
    process group (timm's `init_distributed_device`: args.distributed / rank / world_size) and the seeds (per
    process)."""
    setup_default_logging()
    if not args.device:
        args.device = 'cuda' if torch.cuda.is_available() else 'cpu'
    set_threads(args.threads, log=os.environ.get('RANK', '0') == '0')
    device = init_distributed_device(args)
    seed_everything(derive_seed(args.seed, args.rank))
    return device


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def evaluation_model(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """The model to score (out of DDP). Under torchrun every process first takes rank 0's BatchNorm running
    statistics, which its checkpoints hold: in training each process's follow its own batches (DDP sends rank 0's
    only at each forward, and SyncBatchNorm runs on CUDA only), and N processes must score as one."""
    if args.distributed:
        distribute_bn(model, args.world_size, reduce=False)
    return unwrap(model)


def amp_dtype(args: argparse.Namespace, device: torch.device) -> str:
    """--amp-dtype, else bfloat16 on the CPU and float16 (with a loss scaler) elsewhere."""
    return args.amp_dtype or ('bfloat16' if device.type == 'cpu' else 'float16')


def autocast(args: argparse.Namespace, device: torch.device) -> Any:
    """torch.autocast of --amp (a null context without it)."""
    if not args.amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, amp_dtype(args, device)))


def agree(flag: bool, device: torch.device) -> bool:
    """True on every process when it is true on any (a time budget must stop all processes at the same step)."""
    if rank_and_world()[1] == 1:
        return flag
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def recorded_args(args: argparse.Namespace) -> Dict[str, Any]:
    """The arguments a checkpoint and args.yaml record (the run's, not this machine's: no device, no torchrun
    place)."""
    return {k: v for k, v in vars(args).items() if k not in _NOT_RECORDED and not k.startswith('_')}


def training_state(model: nn.Module, optimizer: Any, scaler: Optional[Any]) -> Dict[str, Any]:
    """What every training checkpoint holds: weights, optimizer and loss-scaler states, and each process's random
    stream (`rng`, one per process: a collective, every process calls it)."""
    return dict(state_dict=unwrap(model).state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict() if scaler else None, rng=all_gather(get_rng_state()))


def load_training_state(ckpt: Dict[str, Any], model: nn.Module, optimizer: Any, scaler: Optional[Any],
                        args: argparse.Namespace, logger: logging.Logger) -> None:
    """Restores :func:`training_state`: this process takes its own random stream (a warning where the checkpoint
    was written by another number of processes)."""
    unwrap(model).load_state_dict(ckpt['state_dict'])
    optimizer.load_state_dict(ckpt['optimizer'])
    if scaler is not None and ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt['rng']
    if len(rng) != args.world_size:
        logger.warning(f'the checkpoint was written by {len(rng)} processes, this run has {args.world_size}: the '
                       'data order and sampling continue, not exactly as before')
    set_rng_state(rng[args.rank % len(rng)])


def run_directory(args: argparse.Namespace, default_root: str, kind: str) -> str:
    """The run's folder: the resumed checkpoint's, else `--output` (or `default_root`) / `--experiment` (or a
    dated name with `kind` and the model); rank 0 creates it and every process gets its path."""
    if args.resume:
        return os.path.dirname(os.path.abspath(args.resume))
    name = args.experiment or f'{datetime.now():%Y%m%d-%H%M%S}-{kind}-{args.model}'
    out = [os.path.join(args.output or default_root, name) if args.rank == 0 else None]
    if args.distributed:
        dist.broadcast_object_list(out, src=0)
    if args.rank == 0:
        os.makedirs(out[0], exist_ok=True)
    return out[0]


def load_eval_weights(model: nn.Module, path: str, mismatch: Callable[[Dict[str, Any], str], Exception]) -> None:
    """Loads a checkpoint's `state_dict` (or a bare state dict) into `model`; a file of another model raises
    `mismatch(the arguments it records, the first line of torch's error)`."""
    ckpt = load_checkpoint(path)
    try:
        unwrap(model).load_state_dict(ckpt.get('state_dict', ckpt))
    except RuntimeError as e:
        raise mismatch(ckpt.get('args') or {}, str(e).splitlines()[0]) from None


def eval_only_weights(args: argparse.Namespace, model: nn.Module, what: str, flags: Sequence[str],
                      recorded_flags: Sequence[str], error: Type[Exception], logger: logging.Logger) -> None:
    """The weights an `--eval-only` run scores: `--checkpoint`'s, else the untrained `what` (rank 0 warns). A file
    of another model is an `error` that names `flags` (argument names) as given and `recorded_flags` as recorded."""
    if not args.checkpoint:
        if args.rank == 0:
            logger.warning(f'--eval-only without --checkpoint scores the untrained {what} (backbone weights: '
                           f'{args.backbone_weights or "random"})')
        return

    def mismatch(recorded: Dict[str, Any], message: str) -> Exception:
        given = ' '.join(f'{_flag(k)} {getattr(args, k)}' for k in flags)
        held = ' '.join(f'{_flag(k)} {recorded.get(k, "?")}' for k in recorded_flags)
        return error(f'--checkpoint {args.checkpoint} holds another {what} than {given} with these settings (it '
                     f'records {held}): drop the flags and -c that change the {what}, so that the recorded ones are '
                     f'used. ({message})')
    load_eval_weights(model, args.checkpoint, mismatch)


def _flag(dest: str) -> str:
    return '--' + dest.replace('_', '-')


def backbone_weights_message(error: BaseException, model: str) -> Optional[str]:
    """The message of a dense-prediction tool for `--backbone-weights pretrained` that cannot be had (none released,
    or not downloadable here): the fix in the tools' flags (`lsvision.runs.weights_error_message`); None for another
    error."""
    from ..runs import weights_error_message
    return weights_error_message(error, model, (
        f'give a weights file of {model}, --backbone-weights FILE (safetensors, a .pth state dict, a '
        "tools/train.py checkpoint, or the released file downloaded by hand), or start from random weights, "
        "--backbone-weights ''"))


def tool_parser(doc: str, demo_config: str, root: str) -> argparse.ArgumentParser:
    """A dense-prediction tool's parser: its docstring's first line, the demo preset (`demo_config`, a file under
    `root`) in the epilog, and `-c` (a recipe from the preset's folder)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], epilog=demo_preset_help(demo_config, root),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('-c', '--config', default='', metavar='FILE',
                        help='flat YAML of argument names with underscores '
                             f'({os.path.relpath(os.path.dirname(demo_config), root)}/*.yaml); a flag given on the '
                             'command line beats it')
    return parser


def parse_tool_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]], tool: str, demo_config: str,
                    no_data: str, no_model: str) -> argparse.Namespace:
    """A dense-prediction tool's arguments: those a checkpoint records (`--resume`, or `--checkpoint`: the model it
    holds, not its output place), then the config (`-c`), then the command line; the later wins. No `--data-dir`
    (unless the demo preset runs) or no `--model`: a ConfigError, its message `no_data` or `no_model`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, config = tool_defaults(parser, argv, tool, demo_config)
    parser.set_defaults(**cfg)
    args = parser.parse_args(argv)
    args.config = config
    if not args.data_dir and config != demo_config:
        raise ConfigError(no_data)
    if not args.model:
        raise ConfigError(no_model)
    return args


def tool_main(argv: Optional[Sequence[str]], parse_args: Callable[[Optional[Sequence[str]]], argparse.Namespace],
              run: Callable[[argparse.Namespace], Dict[str, Any]], log_name: str,
              failures: Tuple[Type[Exception], ...], usage_errors: Tuple[Type[Exception], ...],
              summary: Callable[[Dict[str, Any]], List[str]]) -> int:
    """A dense-prediction tool's main: parse, run, print the report's `summary` lines on rank 0.

    Returns:
        0; 1 for a run that failed (`failures`: a non-finite loss; a checkpoint that could not be written); 2 for
        arguments, data or files that cannot make a run (ConfigError, `usage_errors`), with the message.
    """
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    log = logging.getLogger(log_name)
    try:
        report = run(args)
    except (*failures, CheckpointWriteError) as e:
        log.error(str(e))
        return 1
    except usage_errors as e:
        log.error(str(e))
        return 2
    if args.rank == 0:
        for line in summary(report):
            print(line)
    return 0
