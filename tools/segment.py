"""Train and evaluate Semantic FPN / UperNet on lsvision backbones (ADE20K, Cityscapes, image / mask folders).

    python tools/segment.py                                  # the demo: generated shapes, a tiny CvT-LS, CPU, minutes
    python tools/segment.py -c configs/segmentation/semantic_fpn_cvt_ls_13_ade20k_40k.yaml --data-dir /data/ade
    torchrun --nproc_per_node=8 tools/segment.py -c configs/segmentation/semantic_fpn_pvt_small_ade20k_40k.yaml \\
        --data-dir /data/ADEChallengeData2016 --backbone-weights pvt_small.pth --amp
    python tools/segment.py --resume output/segment/<run>/last.pth.tar        # continue a stopped run exactly
    python tools/segment.py --eval-only --checkpoint output/segment/<run>/last.pth.tar --test-mode slide

--dataset ade20k: --data-dir is ADEChallengeData2016 (images/ and annotations/, splits training and validation);
cityscapes: leftImg8bit/ and gtFine/ with the *_labelTrainIds.png masks (splits train and val); folder:
<data-dir>/images/<split>/ and <data-dir>/masks/<split>/<name>.png, classes from --class-names or
<data-dir>/classes.txt. Without --data-dir (and no config), the demo preset configs/segmentation/
semantic_fpn_shapes_demo.yaml runs on generated shapes. A flag given on the command line beats the config, and a
resumed run's recorded arguments. The run directory gets args.yaml, last.pth.tar (and the best iterations'
checkpoints), result.json and report.md (mIoU, mAcc, aAcc and per-class IoU). docs/segmentation.md has the details.
"""
import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from timm.utils import ParseKwargs

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.models import CheckpointMismatchError
from lsvision.runtime import PROGRESS_HELP, PROGRESS_SECONDS
from lsvision.segmentation.data import SegmentationDataError
from lsvision.segmentation.engine import DATASETS, NonFiniteLossError, SegmentationSetupError, run
from lsvision.segmentation.models import SEGMENTORS
from lsvision.train.args import ConfigError, Flag, add_amp_arguments, add_dense_run_arguments
from lsvision.train.dense import parse_tool_args, tool_main, tool_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, 'configs', 'segmentation', 'semantic_fpn_shapes_demo.yaml')


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser(__doc__, DEMO_CONFIG, ROOT)
    group = parser.add_argument_group('Data')
    group.add_argument('--dataset', default='ade20k', choices=DATASETS)
    group.add_argument('--data-dir', default='', metavar='DIR', help="the dataset's root ('' = the demo's shapes)")
    group.add_argument('--train-split', default='', help="'' = training (ADE20K), train (Cityscapes, folder)")
    group.add_argument('--val-split', default='', help="'' = validation (ADE20K), val (Cityscapes, folder)")
    group.add_argument('--class-names', nargs='+', default=None, metavar='NAME',
                       help='--dataset folder: the classes in label order (default: <data-dir>/classes.txt)')
    group.add_argument('--skip-bad-images', action=Flag, default=False,
                       help='leave images whose mask is missing, unreadable, of another size or with labels that '
                            'are no class out of training and evaluation (counted and named in the report) instead '
                            'of stopping')
    group.add_argument('--crop-size', type=int, nargs=2, default=[512, 512], metavar=('H', 'W'))
    group.add_argument('--train-scale', type=int, nargs=2, default=[2048, 512], metavar=('LONG', 'SHORT'),
                       help='training rescale bounds, times a random ratio in --ratio-range (aspect ratio kept)')
    group.add_argument('--ratio-range', type=float, nargs=2, default=[0.5, 2.0])
    group.add_argument('--cat-max-ratio', type=float, default=0.75,
                       help="random crops are retried while one class covers more than this share (mmseg's)")
    group.add_argument('--photometric', action=Flag, default=True, help="mmsegmentation's PhotoMetricDistortion")
    group.add_argument('--test-scale', type=int, nargs='*', default=[2048, 512], metavar='EDGE',
                       help='evaluation rescale (LONG SHORT, aspect ratio kept; none: each image at its size)')
    group.add_argument('--test-mode', default='whole', choices=('whole', 'slide'))
    group.add_argument('--test-crop', type=int, nargs=2, default=[512, 512], metavar=('H', 'W'),
                       help='slide mode: window size')
    group.add_argument('--test-stride', type=int, nargs=2, default=[341, 341], metavar=('H', 'W'),
                       help='slide mode: window step')
    group = parser.add_argument_group('Model')
    group.add_argument('--model', default='', help='backbone: a timm / lsvision model name with a feature pyramid')
    group.add_argument('--segmentor', default='semantic_fpn', choices=SEGMENTORS)
    group.add_argument('--backbone-weights', default='',
                       help="'' (random), 'pretrained' (released weights) or a checkpoint file")
    group.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs,
                       help='backbone constructor kwargs, k=v')
    group.add_argument('--head-kwargs', nargs='*', default={}, action=ParseKwargs,
                       help='head kwargs, k=v (semantic_fpn: fpn_channels, channels, dropout, norm; upernet: '
                            'channels, pool_scales, dropout, norm)')
    group = parser.add_argument_group('Optimization')
    group.add_argument('--iters', type=int, default=40000, help='training iterations (optimizer updates)')
    group.add_argument('-b', '--batch-size', type=int, default=2, help='images per process')
    group.add_argument('--opt', default='adamw', help='timm optimizer name')
    group.add_argument('--lr', type=float, default=1e-4)
    group.add_argument('--weight-decay', type=float, default=1e-4)
    group.add_argument('--poly-power', type=float, default=0.9)
    group.add_argument('--min-lr', type=float, default=0.0)
    group.add_argument('--warmup-iters', type=int, default=0, help='updates of linear warmup')
    group.add_argument('--warmup-ratio', type=float, default=1e-6, help='warmup starts at lr x this')
    group.add_argument('--clip-grad', type=float, default=None, help='gradient norm clip (unset = none)')
    add_amp_arguments(group)
    group = add_dense_run_arguments(parser, 'output/segment')
    group.add_argument('--eval-interval', type=int, default=4000, help='evaluate every N iterations (and at the end)')
    group.add_argument('--checkpoint-interval', type=int, default=4000, help='save last.pth.tar every N iterations')
    group.add_argument('--eval-untrained', action=Flag, default=False,
                       help='also evaluate the model before training (reported beside the trained one)')
    group.add_argument('--checkpoint-hist', type=int, default=3, help='best evaluated checkpoints kept (by mIoU)')
    group.add_argument('--log-interval', type=int, default=50,
                       help='a progress line every N iterations (and the mean loss in the history)')
    group.add_argument('--log-interval-s', type=float, default=PROGRESS_SECONDS, metavar='SECONDS', help=PROGRESS_HELP)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The arguments a checkpoint records (--resume, or --checkpoint), then the config (-c), then the command line:
    the later wins."""
    args = parse_tool_args(
        build_parser(), argv, 'segment.py', DEMO_CONFIG,
        no_data='no data: give --data-dir (an ADE20K or Cityscapes root, or an image / mask folder pair with --dataset '
                'folder), or run the demo on generated data: python tools/segment.py',
        no_model='no backbone: give --model (e.g. cvt_ls_13) or a recipe, -c configs/segmentation/'
                 'semantic_fpn_cvt_ls_13_ade20k_40k.yaml')
    if args.test_scale and len(args.test_scale) != 2:
        raise ConfigError(f'--test-scale takes two edges, LONG SHORT (or none), got {args.test_scale}')
    return args


def summary(report: Dict[str, Any]) -> List[str]:
    """What the tool prints: the metrics (and the untrained model's), and where the run directory is."""
    lines = []
    for name, key in (('', 'metrics'), ('untrained: ', 'untrained_metrics')):
        m = report.get(key)
        if m:
            lines.append(f'{name}mIoU {100 * m["mIoU"]:.2f}  mAcc {100 * m["mAcc"]:.2f}  aAcc {100 * m["aAcc"]:.2f}  '
                         f'({m["images"]} images, {m["classes_scored"]} classes scored)')
    if report.get('output_dir'):
        lines.append(f'run directory: {report["output_dir"]} (result.json, report.md, last.pth.tar)')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return tool_main(argv, parse_args, run, 'segment', (NonFiniteLossError,), (
        SegmentationSetupError, SegmentationDataError, CheckpointMismatchError, FileNotFoundError), summary)


if __name__ == '__main__':
    sys.exit(main())
