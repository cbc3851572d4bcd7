"""Train any timm / lsvision model with timm's library (timm train.py's arguments, one YAML recipe per model).

    python tools/train.py                                   # the demo: a tiny CvT-LS on digits (docs/training.md)
    python tools/train.py -c configs/cvt_ls_13.yaml --data-dir /data/imagenet
    torchrun --nproc_per_node=8 tools/train.py -c configs/vil_ls_medium.yaml --data-dir /data/imagenet --amp
    python tools/train.py --resume output/train/<run>/recovery.pth.tar    # continue a killed run exactly
    python tools/train.py --resume auto --experiment <run> --epochs 400     # its latest checkpoint; flags win

Without --data-dir (and no --dataset), training uses scikit-learn's bundled digits, exported once to an
ImageFolder tree; with no model either, it runs configs/digits_demo.yaml.

A flag given on the command line beats the config (-c) and a resumed run's arguments, also where it sets another
dest for the same setting: `-c configs/cvt_ls_13.yaml --img-size 64` trains at 64 (the config's input_size becomes
[3, 64, 64]), `--no-amp` turns off the config's amp. The run directory's args.yaml records the values used.

Epochs are counted from 0 everywhere: the log's `epoch 0 (1 of 300)`, checkpoint-0.pth.tar, summary.csv's epoch
column, result.json's best_epoch, --start-epoch and --mixup-off-epoch (timm's numbering). docs/training_notes.md
has the details and torch.compile's timings.
"""
import logging
import sys

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.models import CheckpointMismatchError
from lsvision.models.papers import family_of
from lsvision.train import CheckpointWriteError, ConfigError, NonFiniteLossError, TrainSetupError, parse_args, run


def trained_model(result: dict) -> str:
    """What the run trained, from its result: the model name, or, when model_kwargs changed its architecture, the
    family built by that name's constructor; with the parameter count either way."""
    params = f"{result['params'] / 1e6:.2f}M parameters"
    if not result.get('model_kwargs'):
        return f"{result['model']} ({params})"
    try:
        family = f'a {family_of(result["model"]).title.split(" (")[0]}'
    except KeyError:  # a timm model
        family = 'a model'
    return f"{family} built by {result['model']}'s constructor with the run's model_kwargs ({params}; see args.yaml)"


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (NonFiniteLossError, CheckpointWriteError) as e:  # the run stopped; the message says where it stands
        logging.getLogger('train').error(str(e))
        return 1
    except (TrainSetupError, CheckpointMismatchError, FileNotFoundError) as e:  # explained in the message
        logging.getLogger('train').error(str(e))
        return 2
    if args.rank == 0:
        weights = 'EMA weights' if result['metrics_of'] == 'ema' else 'model weights'
        session = result['session']
        took = f"{result['total_seconds']:.0f}s" if result['total_seconds'] is not None else 'time not recorded'
        if session['resumed_from']:  # run totals, then this session's share
            took += f"; this session: {session['updates']} updates, {session['total_seconds']:.0f}s"
        print(f"\n{trained_model(result)}: val top-1 {result['top1']:.2f}% (top-5 {result['top5']:.2f}%, {weights}) "
              f"after {result['epochs_done']} epoch(s), {result['num_updates']} updates, {took}"
              + (' (stopped by --time-budget)' if result['stopped_by_time_budget'] else ''))
        print(f"checkpoint (these weights): {result['last_checkpoint']}")
        if result['best_checkpoint'] and result['best_epoch'] + 1 != result['epochs_done']:
            print(f"best: epoch {result['best_epoch']} ({args.eval_metric} {result['best_metric']:.4g}): "
                  f"{result['best_checkpoint']}")
        print(f'run directory: {result["output_dir"]} (args.yaml, summary.csv, result.json)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
