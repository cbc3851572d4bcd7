"""Command line and YAML configs of `tools/train.py`, with timm train.py's argument names (argparse dests).

A config is a flat YAML mapping of dest names (`batch_size`, `lr_base`, `warmup_epochs`, ...), as timm's
train.py reads it and as every run's own `args.yaml` is written, so a past run replays with `-c args.yaml`.
Unlike timm, keys are validated: an unknown key or a value of the wrong type is an error that names the key.
"""
import argparse
import dataclasses
import difflib
import logging
import os
import sys
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

import yaml

from timm.utils import ParseKwargs

from lsvision.models._helpers import checkpoint_record
from lsvision.runtime import PROGRESS_HELP, PROGRESS_SECONDS, threads_help

__all__ = ['ConfigError', 'Flag', 'build_parser', 'load_config', 'validate_config', 'recorded_run_args',
           'tool_defaults', 'demo_preset_help', 'add_dense_run_arguments', 'add_amp_arguments', 'parse_args',
           'args_to_dict', 'args_to_yaml', 'config_keys', 'given_flags', 'resumed_settings', 'DIGITS_DEMO_CONFIG']

# the preset used when no data and no model are given (the README's first command)
DIGITS_DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                  'configs', 'digits_demo.yaml')


class MergeKwargs(ParseKwargs):
    """timm's `k=v` parser, merged into the mapping the config gave (a flag overrides one kwarg, not all)."""

    def __call__(self, parser, namespace, values, option_string=None):
        base = dict(getattr(namespace, self.dest, None) or {})
        super().__call__(parser, namespace, values, option_string)
        base.update(getattr(namespace, self.dest))
        setattr(namespace, self.dest, base)


class Flag(argparse.Action):
    """A boolean flag with its negation, so the command line can undo a config's `true`: `--amp` / `--no-amp`, and
    for flags named `--no-x` (timm's `--no-aug`, `--no-resume-opt`), `--x` sets them back to false."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: bool = False, help: Optional[str] = None):
        names, self.negations = [], set()
        for name in option_strings:
            negation = ('--' + name[5:]) if name.startswith('--no-') else ('--no-' + name[2:])
            names.append(name)
            if name.startswith('--'):
                names.append(negation)
                self.negations.add(negation)
        super().__init__(names, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negations)

    def format_usage(self) -> str:
        return ' | '.join(self.option_strings)


class ConfigError(ValueError):
    """A config file that cannot be used as it is (unknown key, wrong type, unreadable YAML)."""


def build_parser() -> argparse.ArgumentParser:
    """The training arguments; dest names are timm train.py's, so timm's optimizer/scheduler kwargs helpers work."""
    parser = argparse.ArgumentParser(
        description='Train a timm / lsvision model (timm train.py arguments; -c configs/<model>.yaml for a recipe)',
        epilog='Epochs are counted from 0 everywhere: the log (epoch 0 (1 of 300)), checkpoint-<epoch>.pth.tar, '
               "summary.csv's epoch column, result.json's best_epoch, --start-epoch and --mixup-off-epoch. "
               'See docs/training_notes.md.',
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('-c', '--config', default='', metavar='FILE',
                        help='flat YAML of argument dest names; a flag given on the command line beats it, also '
                             'where the flag sets another dest for the same setting (--img-size / --in-chans beat '
                             'input_size, the data argument beats data_dir, --lr-base* beat lr, --drop-path beats '
                             '--model-kwargs drop_path_rate, ...)')

    group = parser.add_argument_group('Dataset parameters')
    group.add_argument('data', nargs='?', metavar='DIR', const=None, help='dataset root (same as --data-dir)')
    group.add_argument('--data-dir', metavar='DIR', default='',
                       help="dataset root ('' with --dataset '' = the embedded digits demo data)")
    group.add_argument('--dataset', metavar='NAME', default='',
                       help="dataset type + name ('' = image folder, or torch/cifar10, torch/imagenet, ...)")
    group.add_argument('--train-split', metavar='NAME', default='train')
    group.add_argument('--val-split', metavar='NAME', default='validation')
    group.add_argument('--train-num-samples', default=None, type=int, metavar='N')
    group.add_argument('--val-num-samples', default=None, type=int, metavar='N')
    group.add_argument('--dataset-download', action=Flag, default=False,
                       help='allow download of torch/ datasets')
    group.add_argument('--class-map', default='', type=str, metavar='FILENAME',
                       help='path to class-to-index mapping file (txt, one folder name a line)')
    group.add_argument('--input-img-mode', default=None, type=str)
    group.add_argument('--input-key', default=None, type=str)
    group.add_argument('--target-key', default=None, type=str)

    group = parser.add_argument_group('Model parameters')
    group.add_argument('--model', default='', type=str, metavar='MODEL', help='timm model name')
    group.add_argument('--pretrained', action=Flag, default=False)
    group.add_argument('--pretrained-path', default=None, type=str,
                       help='load this file as pretrained weights (implies --pretrained; a head of another class '
                            'count is left out); the log names what was left out')
    group.add_argument('--initial-checkpoint', default='', type=str, metavar='PATH',
                       help='start from these weights (all of them must fit the model; the EMA weights when the file '
                            'has them); the log says what was loaded')
    group.add_argument('--resume', default='', type=str, metavar='PATH',
                       help="resume the full training state from a checkpoint ('auto' = latest in the output dir)")
    group.add_argument('--no-resume-opt', action=Flag, default=False,
                       help='do not restore optimizer, scheduler and scaler when resuming')
    group.add_argument('--num-classes', type=int, default=None, metavar='N')
    group.add_argument('--gp', default=None, type=str, metavar='POOL', help='global pool type')
    group.add_argument('--img-size', type=int, default=None, metavar='N')
    group.add_argument('--in-chans', type=int, default=None, metavar='N')
    group.add_argument('--input-size', default=None, nargs=3, type=int, metavar='N')
    group.add_argument('--crop-pct', default=None, type=float, metavar='N')
    group.add_argument('--mean', type=float, nargs='+', default=None, metavar='MEAN')
    group.add_argument('--std', type=float, nargs='+', default=None, metavar='STD')
    group.add_argument('--interpolation', default='', type=str, metavar='NAME')
    group.add_argument('-b', '--batch-size', type=int, default=128, metavar='N', help='batch size per process')
    group.add_argument('-vb', '--validation-batch-size', type=int, default=None, metavar='N')
    group.add_argument('--drop-last', action=Flag, default=True,
                       help="drop each epoch's partial last training batch (timm's train.py); --no-drop-last keeps "
                            'it (cut to an even size under Mixup / CutMix), so a small folder loses no image')
    group.add_argument('--channels-last', action=Flag, default=False)
    group.add_argument('--grad-accum-steps', type=int, default=1, metavar='N')
    group.add_argument('--grad-checkpointing', action=Flag, default=False)
    group.add_argument('--model-kwargs', nargs='*', default={}, action=MergeKwargs,
                       help='constructor kwargs, k=v (a mapping in YAML; flags update it key by key)')

    group = parser.add_argument_group('Device, precision and compile')
    group.add_argument('--device', default='', type=str, help="'cuda', 'cpu', ... ('' = cuda if available)")
    group.add_argument('--amp', action=Flag, default=False, help='mixed precision (torch.autocast)')
    group.add_argument('--amp-dtype', default=None, type=str, choices=('float16', 'bfloat16'),
                       help='float16 uses a loss scaler, bfloat16 does not (unset = bfloat16 on CPU, float16 '
                            'elsewhere; CPU autocast is fast only in bfloat16 on CPUs with AVX512-BF16 or AMX)')
    group.add_argument('--grc-sync-cache', action=Flag, default=True,
                       help='under torchrun, average the GRC caches of GRC models over the processes after every '
                            'optimizer step (one all-reduce; otherwise DDP keeps rank 0 caches); no effect on '
                            'other models')
    group.add_argument('--torchcompile', nargs='?', type=str, default=None, const='inductor',
                       help="torch.compile the model (optional backend): torch's default shapes, with the batch dim "
                            'of validation inputs marked dynamic (the smaller last batch needs no second compile); '
                            'the first training step and the first validation each compile (minutes on a CPU), and '
                            'another input size compiles again (the models specialize H and W; dynamic=True would '
                            'not help): see docs/training_notes.md')
    group.add_argument('--torchcompile-mode', type=str, default=None)

    group = parser.add_argument_group('Optimizer parameters')
    group.add_argument('--opt', default='sgd', type=str, metavar='OPTIMIZER')
    group.add_argument('--opt-eps', default=None, type=float, metavar='EPSILON')
    group.add_argument('--opt-betas', default=None, type=float, nargs='+', metavar='BETA')
    group.add_argument('--momentum', type=float, default=0.9, metavar='M')
    group.add_argument('--weight-decay', type=float, default=2e-5)
    group.add_argument('--clip-grad', type=float, default=None, metavar='NORM')
    group.add_argument('--clip-mode', type=str, default='norm', choices=('norm', 'value', 'agc'))
    group.add_argument('--layer-decay', type=float, default=None)
    group.add_argument('--layer-decay-min-scale', type=float, default=0)
    group.add_argument('--layer-decay-no-opt-scale', type=float, default=None)
    group.add_argument('--opt-kwargs', nargs='*', default={}, action=MergeKwargs)

    group = parser.add_argument_group('Learning rate schedule parameters')
    group.add_argument('--sched', type=str, default='cosine', metavar='SCHEDULER')
    group.add_argument('--sched-on-updates', action=Flag, default=False)
    group.add_argument('--lr', type=float, default=None, metavar='LR',
                       help="learning rate; unset = lr_base * global batch / lr_base_size (a config's lr, e.g. a "
                            "run's args.yaml, is used as it is unless --lr-base* is on the command line)")
    group.add_argument('--lr-base', type=float, default=0.1, metavar='LR')
    group.add_argument('--lr-base-size', type=int, default=256, metavar='DIV')
    group.add_argument('--lr-base-scale', type=str, default='', metavar='SCALE',
                       help="'linear' or 'sqrt' ('' = sqrt for adam*/lamb/lars, else linear)")
    group.add_argument('--lr-noise', type=float, nargs='+', default=None, metavar='pct, pct')
    group.add_argument('--lr-noise-pct', type=float, default=0.67)
    group.add_argument('--lr-noise-std', type=float, default=1.0)
    group.add_argument('--lr-cycle-mul', type=float, default=1.0)
    group.add_argument('--lr-cycle-decay', type=float, default=0.5)
    group.add_argument('--lr-cycle-limit', type=int, default=1)
    group.add_argument('--lr-k-decay', type=float, default=1.0)
    group.add_argument('--warmup-lr', type=float, default=1e-5)
    group.add_argument('--min-lr', type=float, default=0)
    group.add_argument('--epochs', type=int, default=300)
    group.add_argument('--epoch-repeats', type=float, default=0.)
    group.add_argument('--start-epoch', default=None, type=int,
                       help='epoch a new run starts at, counted from 0 (--resume starts where its checkpoint stopped)')
    group.add_argument('--decay-milestones', default=[90, 180, 270], type=int, nargs='+')
    group.add_argument('--decay-epochs', type=float, default=90)
    group.add_argument('--warmup-epochs', type=int, default=5)
    group.add_argument('--warmup-steps', type=int, default=0, metavar='N',
                       help='linear warmup over the first N optimizer updates instead of --warmup-epochs (0 = use '
                            '--warmup-epochs); needs --sched-on-updates')
    group.add_argument('--warmup-prefix', action=Flag, default=False)
    group.add_argument('--cooldown-epochs', type=int, default=0)
    group.add_argument('--patience-epochs', type=int, default=10)
    group.add_argument('--decay-rate', '--dr', type=float, default=0.1)

    group = parser.add_argument_group('Augmentation and regularization parameters')
    group.add_argument('--no-aug', action=Flag, default=False)
    group.add_argument('--train-crop-mode', type=str, default=None)
    group.add_argument('--scale', type=float, nargs='+', default=[0.08, 1.0], metavar='PCT')
    group.add_argument('--ratio', type=float, nargs='+', default=[3. / 4., 4. / 3.], metavar='RATIO')
    group.add_argument('--hflip', type=float, default=0.5)
    group.add_argument('--vflip', type=float, default=0.)
    group.add_argument('--color-jitter', type=float, default=0.4, metavar='PCT')
    group.add_argument('--color-jitter-prob', type=float, default=None, metavar='PCT')
    group.add_argument('--grayscale-prob', type=float, default=None, metavar='PCT')
    group.add_argument('--gaussian-blur-prob', type=float, default=None, metavar='PCT')
    group.add_argument('--aa', type=str, default=None, metavar='NAME', help='auto augment, e.g. rand-m9-mstd0.5-inc1')
    group.add_argument('--aug-repeats', type=float, default=0, help='repeated augmentation (needs distributed)')
    group.add_argument('--bce-loss', action=Flag, default=False)
    group.add_argument('--bce-sum', action=Flag, default=False)
    group.add_argument('--bce-target-thresh', type=float, default=None)
    group.add_argument('--bce-pos-weight', type=float, default=None)
    group.add_argument('--reprob', type=float, default=0., metavar='PCT', help='random erase prob')
    group.add_argument('--remode', type=str, default='pixel')
    group.add_argument('--recount', type=int, default=1)
    group.add_argument('--resplit', action=Flag, default=False,
                       help='random erasing spares the first half of each batch (timm; needs the prefetcher)')
    group.add_argument('--mixup', type=float, default=0.0)
    group.add_argument('--cutmix', type=float, default=0.0)
    group.add_argument('--cutmix-minmax', type=float, nargs='+', default=None)
    group.add_argument('--mixup-prob', type=float, default=1.0)
    group.add_argument('--mixup-switch-prob', type=float, default=0.5)
    group.add_argument('--mixup-mode', type=str, default='batch')
    group.add_argument('--mixup-off-epoch', default=0, type=int, metavar='N',
                       help='turn mixup / cutmix off from epoch N on (counted from 0; 0 = never)')
    group.add_argument('--smoothing', type=float, default=0.1, help='label smoothing')
    group.add_argument('--train-interpolation', type=str, default='random')
    group.add_argument('--drop', type=float, default=0.0, metavar='PCT', help='dropout rate')
    group.add_argument('--drop-path', type=float, default=None, metavar='PCT', help='drop path rate')
    group.add_argument('--drop-block', type=float, default=None, metavar='PCT')

    group = parser.add_argument_group('Batch norm parameters')
    group.add_argument('--bn-momentum', type=float, default=None)
    group.add_argument('--bn-eps', type=float, default=None)
    group.add_argument('--sync-bn', action=Flag, default=False, help='SyncBatchNorm across processes')
    group.add_argument('--dist-bn', type=str, default='reduce', help="'broadcast', 'reduce' or ''")

    group = parser.add_argument_group('Model exponential moving average parameters')
    group.add_argument('--model-ema', action=Flag, default=False, help='track an EMA (ModelEmaV3)')
    group.add_argument('--model-ema-force-cpu', action=Flag, default=False)
    group.add_argument('--model-ema-decay', type=float, default=0.9998)
    group.add_argument('--model-ema-warmup', action=Flag, default=False)

    group = parser.add_argument_group('Miscellaneous parameters')
    group.add_argument('--seed', type=int, default=42, metavar='S')
    group.add_argument('--log-interval', type=int, default=50, metavar='N',
                       help='every N batches: read the loss (the only wait for the device), log a progress line')
    group.add_argument('--log-interval-s', type=float, default=PROGRESS_SECONDS, metavar='SECONDS',
                       help=PROGRESS_HELP + '; one process only: under torchrun the lines come every --log-interval '
                            'batches')
    group.add_argument('--recovery-interval', '--checkpoint-interval-steps', type=int, default=0, metavar='N',
                       help='also save a resumable mid-epoch checkpoint every N optimizer updates (0 = off)')
    group.add_argument('--checkpoint-hist', type=int, default=10, metavar='N', help='top-k checkpoints kept')
    group.add_argument('-j', '--workers', type=int, default=4, metavar='N')
    group.add_argument('--threads', type=int, default=0, metavar='N', help=threads_help())
    group.add_argument('--pin-mem', action=Flag, default=None,
                       help='pinned host memory for the loaders, for asynchronous copies (unset = on with CUDA)')
    group.add_argument('--no-prefetcher', action=Flag, default=False,
                       help="normalise and randomly erase in the loader workers instead of on the device (timm's "
                            'PrefetchLoader)')
    group.add_argument('--output', default='', type=str, metavar='PATH', help="output root ('' = output/train)")
    group.add_argument('--experiment', default='', type=str, metavar='NAME', help='run directory name')
    group.add_argument('--eval-metric', default='top1', type=str, choices=('top1', 'top5', 'loss'))
    group.add_argument('--log-wandb', action=Flag, default=False,
                       help="log summary.csv's columns to Weights & Biases too (needs `pip install wandb`)")
    group.add_argument('--time-budget', type=float, default=0, metavar='SECONDS',
                       help='stop training after this many seconds of this session, then evaluate and save (0 = no '
                            'limit); a resumed run gets the whole budget again')
    group.add_argument('--progress', type=str, default='auto', choices=('auto', 'bar', 'log'),
                       help="'bar' (tqdm), 'log' (a line every --log-interval steps), 'auto' = bar on a terminal")
    group.add_argument('--stop-after-steps', type=int, default=0, metavar='N',
                       help=argparse.SUPPRESS)  # testing: exit hard (no cleanup) after N updates in this process
    group.add_argument('--local_rank', default=0, type=int, help=argparse.SUPPRESS)
    return parser


def _type_error(key: str, value: Any, expected: str, path: str) -> ConfigError:
    return ConfigError(f'config {path}: {key}: expected {expected}, got {value!r} ({type(value).__name__})')


def validate_config(cfg: Dict[str, Any], parser: argparse.ArgumentParser, path: str = '<config>',
                    tool: str = 'train.py') -> Dict[str, Any]:
    """Check a config mapping against the parser (of `tools/<tool>`) and return it with values converted to the
    flags' types.

    Raises:
        ConfigError: naming the first unknown key (with the closest known names) or the key with a bad value.
    """
    if not isinstance(cfg, dict):
        raise ConfigError(f'config {path}: expected a mapping of argument names to values, got {type(cfg).__name__}')
    actions = {a.dest: a for a in parser._actions if a.dest not in ('help', 'config')}
    out = {}
    for key, value in cfg.items():
        key = str(key)
        if key not in actions:
            close = difflib.get_close_matches(key.replace('-', '_'), list(actions), n=3)
            hint = f'; did you mean {", ".join(close)}?' if close else ''
            raise ConfigError(f'config {path}: unknown key {key!r} (keys are {tool} argument names with '
                              f'underscores, see `python tools/{tool} --help`){hint}')
        action = actions[key]
        if value is None:
            out[key] = value
            continue
        if isinstance(action, ParseKwargs):
            if not isinstance(value, dict):
                raise _type_error(key, value, 'a mapping', path)
        elif isinstance(action, (Flag, argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise _type_error(key, value, 'true or false', path)
        elif action.nargs in ('+', '*') or isinstance(action.nargs, int):
            if not isinstance(value, (list, tuple)):
                raise _type_error(key, value, 'a list', path)
            if isinstance(action.nargs, int) and len(value) != action.nargs:
                raise _type_error(key, value, f'a list of {action.nargs}', path)
            value = [_convert(key, v, action, path) for v in value]
        else:
            value = _convert(key, value, action, path)
            if action.choices is not None and value not in action.choices:
                raise _type_error(key, value, f'one of {list(action.choices)}', path)
        out[key] = value
    return out


def _convert(key: str, value: Any, action: argparse.Action, path: str) -> Any:
    kind = action.type
    if kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise _type_error(key, value, kind.__name__, path)
        try:
            converted = kind(value)
        except ValueError:
            raise _type_error(key, value, kind.__name__, path) from None
        if kind is int and isinstance(value, float) and value != converted:
            raise _type_error(key, value, 'int', path)
        return converted
    if kind is str and not isinstance(value, str):
        raise _type_error(key, value, 'a string', path)
    return value


def load_config(path: str, parser: Optional[argparse.ArgumentParser] = None, tool: str = 'train.py'
                ) -> Dict[str, Any]:
    """Read and validate a flat YAML config (yaml.safe_load) of `tools/<tool>` (its `parser`)."""
    parser = parser or build_parser()
    if not os.path.isfile(path):
        raise ConfigError(f'config file not found: {path}')
    with open(path) as f:
        try:
            cfg = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f'config {path} is not valid YAML: {e}') from None
    return validate_config(cfg or {}, parser, path, tool)


def recorded_run_args(flag: str, path: str, parser: argparse.ArgumentParser, required: bool,
                      tool: str) -> Dict[str, Any]:
    """The arguments a `tools/<tool>` checkpoint records, checked against its `parser` ({} for other weights files
    unless `required`)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file (give a run directory's last.pth.tar)")
    from .checkpoint import load_checkpoint
    recorded = load_checkpoint(path).get('args')
    if not isinstance(recorded, dict):
        if required:
            raise ConfigError(f'{flag} {path} is not a tools/{tool} checkpoint (it records no run arguments)')
        return {}
    return validate_config(recorded, parser, path, tool)


def add_dense_run_arguments(parser: argparse.ArgumentParser, output_root: str) -> argparse._ArgumentGroup:
    """The 'Run' flags of the dense-prediction tools (device, workers, seed, resume, evaluation-only, output, time
    budget); returns the group for the tool's own."""
    group = parser.add_argument_group('Run')
    group.add_argument('--device', default='', help="'' = cuda if available")
    group.add_argument('-j', '--workers', type=int, default=2)
    group.add_argument('--threads', type=int, default=0, help=threads_help())
    group.add_argument('--seed', type=int, default=42)
    group.add_argument('--find-unused-parameters', action=Flag, default=False, help="DDP's option")
    group.add_argument('--resume', default='', metavar='PATH', help="a run's last.pth.tar: continue it exactly")
    group.add_argument('--eval-only', action=Flag, default=False, help='evaluate --checkpoint on the val split')
    group.add_argument('--checkpoint', default='', metavar='PATH', help='weights for --eval-only')
    group.add_argument('--output', default='', help=f"output root ('' = {output_root}; --eval-only: its report "
                                                    "folder, '' = none)")
    group.add_argument('--experiment', default='', help='run directory name')
    group.add_argument('--time-budget', type=float, default=0, metavar='SECONDS',
                       help='stop training after this many seconds of this session, then evaluate and save (0 = no '
                            'limit); a resumed run gets the whole budget again')
    group.add_argument('--stop-after-updates', type=int, default=0,
                       help=argparse.SUPPRESS)  # testing: stop (SystemExit) after N updates, as if killed
    return group


def add_amp_arguments(group: argparse._ArgumentGroup) -> None:
    """--amp and --amp-dtype (lsvision.train.dense.autocast reads them)."""
    group.add_argument('--amp', action=Flag, default=False, help='mixed precision (torch.autocast)')
    group.add_argument('--amp-dtype', default=None, choices=('float16', 'bfloat16'),
                       help='unset = bfloat16 on CPU, float16 (with a loss scaler) elsewhere')


def _flag_value(value: Any) -> str:
    """A config value as it is written on the command line."""
    if isinstance(value, dict):
        return ' '.join(f"{k}={str(v).replace(' ', '')}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ' '.join(map(str, value))
    return str(value) if value != '' else "''"


def demo_preset_help(demo_config: str, root: str, data: str = 'generated shapes') -> str:
    """A dense-prediction tool's --help epilog: its demo preset's settings as flags (the defaults listed above it are
    those of a --data-dir run)."""
    with open(demo_config) as f:
        cfg = yaml.safe_load(f) or {}
    flags = ', '.join(f"--{k.replace('_', '-')} {_flag_value(v)}" for k, v in cfg.items() if k != 'data_dir')
    return (f'Without --data-dir, -c and a run to continue (--resume, or a --checkpoint that records its arguments), '
            f'the demo preset {os.path.relpath(demo_config, root)} replaces these defaults (on {data}): {flags}.')


def tool_defaults(parser: argparse.ArgumentParser, argv: Sequence[str], tool: str, demo_config: str = ''
                  ) -> Tuple[Dict[str, Any], str]:
    """The defaults of a dense-prediction tool (`tools/<tool>`: detect.py, segment.py) before its command line: the
    arguments a checkpoint records (--resume; or --checkpoint: the model it holds, not its output place), then the
    config (-c; `demo_config` when neither a checkpoint, --data-dir nor --help is given), the later winning.

    Returns:
        The defaults and the config path ('' for none).
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument('-c', '--config', default='')
    first.add_argument('-h', '--help', action='store_true')
    for flag in ('--resume', '--checkpoint', '--data-dir'):
        first.add_argument(flag, default='')
    known, _ = first.parse_known_args(list(argv))
    cfg: Dict[str, Any] = {}
    if known.resume:
        cfg.update(recorded_run_args('--resume', known.resume, parser, True, tool))
    elif known.checkpoint:
        recorded = recorded_run_args('--checkpoint', known.checkpoint, parser, False, tool)
        cfg.update({k: v for k, v in recorded.items() if k not in ('output', 'experiment')})
    # --help alone lists the defaults of a --data-dir run (a tool may name its demo preset in its epilog)
    config = known.config or ('' if cfg or known.resume or known.data_dir or known.help else demo_config)
    if config:
        cfg.update(load_config(config, parser, tool))
    return cfg, config


def _resumed_run_config(resume: str, output: str, experiment: str,
                        parser: argparse.ArgumentParser) -> Tuple[Dict[str, Any], str]:
    """The arguments of the run that `--resume` continues, and where they come from: the checkpoint's own record
    (`args`), else the run directory's args.yaml. ({}, '') for `--resume auto` with no earlier run (a new run).

    Raises:
        ConfigError: the checkpoint does not exist, or neither it nor its run directory records the arguments.
    """
    if resume == 'auto':
        path = os.path.join(output or './output/train', experiment, 'args.yaml')
        return (load_config(path, parser), path) if experiment and os.path.isfile(path) else ({}, '')
    if not os.path.isfile(resume):
        raise ConfigError(f'--resume {resume}: no such checkpoint file')
    recorded = checkpoint_record(resume).get('args')  # only this small record is read here, the tensors later
    if isinstance(recorded, dict):  # else an older or foreign checkpoint: fall back to args.yaml
        return validate_config(recorded, parser, resume), resume
    path = os.path.join(os.path.dirname(os.path.abspath(resume)), 'args.yaml')
    if os.path.isfile(path):
        return load_config(path, parser), path
    return {}, ''


def _given_on_command_line(argv: Sequence[str]) -> Dict[str, Any]:
    """The dests the command line sets itself, with their values (a config's and the defaults left out; for
    `--model-kwargs`, only the kwargs given there)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(list(argv))
    return vars(given)


def given_flags(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Set[str]:
    """The dests that `argv` sets itself (those left at their defaults excluded): what a resumed run of
    tools/train_lm.py or train_mt.py takes from the command line rather than from its checkpoint."""
    unset = object()
    dests = vars(parser.parse_args(argv))
    given = parser.parse_args(argv, argparse.Namespace(**{k: unset for k in dests}))
    return {k for k, v in vars(given).items() if v is not unset}


def resumed_settings(cfg: Any, saved: Dict[str, Any], given: Optional[Collection[str]], fixed: Collection[str],
                     stop: Collection[str], flag: Callable[[str], str], what: str, log: logging.Logger) -> Any:
    """The config (a dataclass) of a resumed tools/train_lm.py or train_mt.py run: the checkpoint's (`saved`), with the
    fields `given` on the resuming command taken from `cfg`, except the `fixed` ones (the model, data, optimization:
    `what`), which stay the checkpoint's, with a warning that names each given one that differs (its `flag`). Stopping
    limits (`stop`) given replace all of the checkpoint's.

    given: the fields the command line set (`given_flags`); None: those that differ from the dataclass's defaults.
    """
    kind = type(cfg)
    fields = {f.name for f in dataclasses.fields(kind)}
    first = kind(**{k: v for k, v in saved.items() if k in fields})
    if given is None:
        default = kind()
        given = {k for k in fields if getattr(cfg, k) != getattr(default, k)}
    given = (set(given) & fields) | {'output', 'resume'}
    if given & set(stop):
        given |= set(stop)
    kept = [k for k in sorted(given & set(fixed)) if getattr(cfg, k) != getattr(first, k)]
    if kept:
        log.warning("resumed with the checkpoint's " + ', '.join(f'{flag(k)} {getattr(first, k)}' for k in kept)
                    + ' (given: ' + ', '.join(f'{flag(k)} {getattr(cfg, k)}' for k in kept) + f'): a resumed run '
                    f'keeps its {what}; to change them start a new run (another --output, without --resume)')
    return dataclasses.replace(first, **{k: getattr(cfg, k) for k in given - set(fixed)})


# a create_model argument that --model-kwargs can carry, and the flag that passes it too
_MODEL_KWARG_FLAGS = {'num_classes': 'num_classes', 'in_chans': 'in_chans', 'drop_rate': 'drop',
                      'drop_path_rate': 'drop_path', 'drop_block_rate': 'drop_block', 'global_pool': 'gp',
                      'bn_momentum': 'bn_momentum', 'bn_eps': 'bn_eps', 'grc_sync_cache': 'grc_sync_cache'}
# settings that feed the lr when --lr is unset (a config's `lr`, e.g. a replayed args.yaml's, would hide them)
_LR_FROM = ('lr_base', 'lr_base_size', 'lr_base_scale')


def _flag(dest: str) -> str:
    return '--' + dest.replace('_', '-')


def _let_flags_win(args: argparse.Namespace, given: Dict[str, Any], cfg: Dict[str, Any]) -> None:
    """Where two dests express one setting, give the command line's value to both, so that a flag beats a config's
    value of the other dest too (argparse alone only lets a flag beat its own dest's value).

    The pairs: `--img-size` / `--in-chans` and `input_size` (which timm reads first); the positional data dir and
    `--data-dir`; `--lr-base*` and a config's `lr` (which is used as given; the command line's base settings make
    it derived again); a create_model argument in `--model-kwargs` (`drop_path_rate`, `img_size`, ...) and its
    flag (`--drop-path`, `--img-size`, ...); `--pretrained-path` and `--pretrained` (the path means load it, unless
    `pretrained` is given or set by the config).

    Raises:
        ConfigError: the command line gives one setting twice, with two values.
    """
    _fold_model_kwargs(args, given)
    _resolve_input_size(args, given)
    if 'data' in given and 'data_dir' in given and args.data != args.data_dir:
        raise ConfigError(f'the data dir is given twice: {args.data} and --data-dir {args.data_dir}; give one')
    if 'data' in given:
        args.data_dir = args.data
    elif 'data_dir' in given:
        args.data = args.data_dir
    if 'lr' not in given and any(k in given for k in _LR_FROM):
        args.lr = None
    if args.pretrained_path and 'pretrained' not in given and 'pretrained' not in cfg:
        args.pretrained = True


def _fold_model_kwargs(args: argparse.Namespace, given: Dict[str, Any]) -> None:
    """Move each create_model argument of --model-kwargs into its flag's dest (create_model gets it once), unless
    the flag is on the command line and the kwarg is not (then the flag wins and the kwarg is dropped)."""
    given_kwargs = given.get('model_kwargs', {})
    kwargs = dict(args.model_kwargs or {})
    for key, dest in _MODEL_KWARG_FLAGS.items():
        if key not in kwargs:
            continue
        value = kwargs.pop(key)
        if dest in given and key not in given_kwargs:
            continue
        if dest in given and value != given[dest]:
            raise ConfigError(f'--model-kwargs {key}={value} and {_flag(dest)} {given[dest]} disagree; give one')
        setattr(args, dest, value)
        if key in given_kwargs:
            given[dest] = value
    args.model_kwargs = kwargs


def _resolve_input_size(args: argparse.Namespace, given: Dict[str, Any]) -> None:
    """The input size that the command line gives (--input-size, --img-size, --in-chans, --model-kwargs img_size)
    beats a config's `input_size`, `img_size`, `in_chans` and model kwarg `img_size`: all are set to it.

    Raises:
        ConfigError: two of those flags disagree.
    """
    said: List[Tuple[str, Optional[int], Optional[Tuple[int, int]]]] = []  # (flag and value, channels, (H, W))
    if 'input_size' in given:
        c, h, w = given['input_size']
        said.append((f'--input-size {c} {h} {w}', c, (h, w)))
    if 'img_size' in given:
        said.append((f'--img-size {given["img_size"]}', None, (given['img_size'],) * 2))
    if 'in_chans' in given:
        said.append((f'--in-chans {given["in_chans"]}', given['in_chans'], None))
    if 'img_size' in given.get('model_kwargs', {}):
        size = given['model_kwargs']['img_size']
        hw = tuple(size) if isinstance(size, (list, tuple)) else (size, size)
        said.append((f'--model-kwargs img_size={size}', None, hw))
    chans = {c for _, c, _ in said if c is not None}
    sizes = {hw for _, _, hw in said if hw is not None}
    if len(chans) > 1 or len(sizes) > 1:
        raise ConfigError(f'the input size is given twice, with two values: {", ".join(t for t, _, _ in said)}; '
                          'give one')
    if not said:
        return
    (c,), (hw,) = chans or {None}, sizes or {None}
    if args.input_size is not None or 'input_size' in given:
        old = args.input_size
        args.input_size = [c or old[0], *(hw or old[1:])]
    if c is not None:
        args.in_chans = None if 'input_size' in given else c
    if hw is not None:
        args.img_size = hw[0] if hw[0] == hw[1] and 'input_size' not in given else None
        if 'img_size' in (args.model_kwargs or {}):
            args.model_kwargs['img_size'] = hw[0] if hw[0] == hw[1] else hw


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse `-c` first, apply the config as defaults, then let the command line override it.

    With `--resume`, the resumed run's arguments (`_resumed_run_config`) come first, then `-c`, then the command
    line; `args.resume_overrides` lists what differs from the run (`name: old -> new`), for the log. With neither
    data nor a model given, the digits demo preset (configs/digits_demo.yaml) is the config.

    Raises:
        ConfigError: an unusable config, a `--resume` whose run arguments cannot be found (with no --model), or a
            --model other than the resumed run's.
    """
    parser = build_parser()
    config_parser = argparse.ArgumentParser(add_help=False)
    for flag, dest in (('-c', 'config'), ('--resume', 'resume'), ('--output', 'output'),
                       ('--experiment', 'experiment')):
        config_parser.add_argument(flag, dest=dest, default='')
    argv = list(sys.argv[1:] if argv is None else argv)
    known, _ = config_parser.parse_known_args(argv)
    run_cfg, run_source = {}, ''
    if known.resume:
        run_cfg, run_source = _resumed_run_config(known.resume, known.output, known.experiment, parser)
    cfg: Dict[str, Any] = dict(run_cfg)
    if known.config:
        cfg.update(load_config(known.config, parser))
    parser.set_defaults(**cfg)
    args = parser.parse_args(argv)
    _let_flags_win(args, _given_on_command_line(argv), cfg)
    if known.resume and known.resume != 'auto' and not run_source and not args.model:
        raise ConfigError(f'--resume {known.resume}: the checkpoint records no arguments and there is no args.yaml '
                          "beside it; give the run's arguments too (-c <its config> or --model ...)")
    if run_cfg.get('model') and args.model != run_cfg['model']:
        raise ConfigError(f'--resume {known.resume}: that run trains {run_cfg["model"]}, not --model {args.model}; '
                          'drop --model (and -c) to resume it, or start a new run from its weights with '
                          '--initial-checkpoint')
    if not known.config and not run_source and not args.model and not (args.data or args.data_dir) \
            and not args.dataset:
        args = parse_args(['-c', DIGITS_DEMO_CONFIG] + argv)
    args.resume_config = run_source
    args.resume_overrides = [f'{k}: {_plain(v)!r} -> {_plain(getattr(args, k))!r}' for k, v in run_cfg.items()
                             if k in _REPLAYED and _plain(v) != _plain(getattr(args, k))]
    return args


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# recorded in args.yaml and in checkpoints, replayed by --resume (not the test hooks, nor --resume itself)
_NOT_REPLAYED = ('stop_after_steps', 'local_rank', 'resume')


def args_to_dict(args: argparse.Namespace) -> Dict[str, Any]:
    """The run's arguments as plain values (lists, not tuples), as args.yaml and checkpoints record them."""
    return {k: _plain(getattr(args, k)) for k in _REPLAYED if hasattr(args, k)}


def args_to_yaml(args: argparse.Namespace) -> str:
    """The run's arguments as a replayable flat YAML (what args.yaml holds; test-only flags left out)."""
    return yaml.safe_dump(args_to_dict(args), default_flow_style=False, sort_keys=False)


def config_keys() -> List[str]:
    return [a.dest for a in build_parser()._actions if a.dest not in ('help', 'config')]


_REPLAYED = [k for k in config_keys() if k not in _NOT_REPLAYED]
