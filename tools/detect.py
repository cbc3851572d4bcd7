"""Train and evaluate Mask R-CNN (Faster R-CNN, RetinaNet) on lsvision backbones on COCO-format data.

    python tools/detect.py                                   # the demo: generated shapes, a tiny CvT-LS, CPU, minutes
    python tools/detect.py -c configs/detection/mask_rcnn_cvt_ls_13_1x.yaml --data-dir /data/coco
    torchrun --nproc_per_node=8 tools/detect.py -c configs/detection/mask_rcnn_pvt_small_grc_1x.yaml \\
        --data-dir /data/coco --backbone-weights pretrained --amp
    python tools/detect.py --resume output/detect/<run>/last.pth.tar          # continue a stopped run exactly
    python tools/detect.py --eval-only --checkpoint output/detect/<run>/last.pth.tar    # the detector it records

--data-dir is a COCO tree: annotations/instances_<split>.json and an image folder <split>/ for --train-split and
--val-split (train2017 and val2017 by default). Without --data-dir (and no config), the demo preset
configs/detection/mask_rcnn_shapes_demo.yaml runs on a generated shapes dataset. A flag given on the command line
beats the config, and a resumed run's recorded arguments. The run directory gets args.yaml, last.pth.tar (and the
best epochs' checkpoints), result.json and report.md (COCOeval's box and mask AP). docs/detection.md has the details.
"""
import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from timm.utils import ParseKwargs

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.detection.coco_eval import STAT_NAMES
from lsvision.detection.data import CocoDataError
from lsvision.detection.engine import DETECTORS, DetectionSetupError, NonFiniteLossError, run
from lsvision.models import CheckpointMismatchError
from lsvision.runtime import PROGRESS_HELP, PROGRESS_SECONDS
from lsvision.train.args import Flag, add_amp_arguments, add_dense_run_arguments
from lsvision.train.dense import parse_tool_args, tool_main, tool_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, 'configs', 'detection', 'mask_rcnn_shapes_demo.yaml')


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser(__doc__, DEMO_CONFIG, ROOT)
    group = parser.add_argument_group('Data')
    group.add_argument('--data-dir', default='', metavar='DIR',
                       help="COCO tree with annotations/instances_<split>.json and <split>/ ('' = the generated "
                            'shapes of the demo)')
    group.add_argument('--train-split', default='train2017')
    group.add_argument('--val-split', default='val2017')
    group.add_argument('--skip-bad-images', action=Flag, default=False,
                       help='leave images with missing, unreadable or wrongly sized files or malformed annotations '
                            'out of training and evaluation (named in the log and the report) instead of stopping')
    group.add_argument('--drop-empty', action=Flag, default=False,
                       help="train only on images with a box (mmdetection's filter_empty_gt); evaluation keeps all")
    group = parser.add_argument_group('Model')
    group.add_argument('--model', default='', help='backbone: a timm / lsvision model name with feature maps '
                                                   '(needed with --data-dir, unless a config gives it)')
    group.add_argument('--detector', default='mask_rcnn', choices=DETECTORS)
    group.add_argument('--backbone-weights', default='',
                       help="'' (random), 'pretrained' (released weights) or a checkpoint file")
    group.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs,
                       help='backbone constructor kwargs, k=v')
    group.add_argument('--detector-kwargs', nargs='*', default={}, action=ParseKwargs,
                       help='torchvision detector kwargs, k=v (box_batch_size_per_image=..., ...)')
    group.add_argument('--fpn-channels', type=int, default=0,
                       help="FPN and head channels (0 = torchvision's: 256, box head 1024); small for a CPU demo")
    group.add_argument('--num-classes', type=int, default=None, help='background included (unset = from the data)')
    group.add_argument('--min-size', type=int, default=800, help="the detector's resize: shorter side")
    group.add_argument('--max-size', type=int, default=1333, help="the detector's resize: longest side at most")
    group = parser.add_argument_group('Optimization')
    group.add_argument('--epochs', type=int, default=12)
    group.add_argument('-b', '--batch-size', type=int, default=2, help='images per process')
    group.add_argument('--opt', default='adamw', help='timm optimizer name')
    group.add_argument('--lr', type=float, default=1e-4)
    group.add_argument('--weight-decay', type=float, default=1e-4)
    group.add_argument('--clip-grad', type=float, default=None, help='gradient norm clip (unset = none)')
    group.add_argument('--decay-milestones', type=int, nargs='+', default=[8, 11], help='epochs of lr x decay-rate')
    group.add_argument('--decay-rate', type=float, default=0.1)
    group.add_argument('--warmup-iters', type=int, default=500, help='updates of linear warmup')
    group.add_argument('--warmup-ratio', type=float, default=0.001, help='warmup starts at lr x this')
    add_amp_arguments(group)
    group = add_dense_run_arguments(parser, 'output/detect')
    group.add_argument('--eval-interval', type=int, default=1, help='evaluate every N epochs (and after the last)')
    group.add_argument('--checkpoint-hist', type=int, default=3, help='best epoch checkpoints kept (by box AP)')
    group.add_argument('--log-interval', type=int, default=20, help='a progress line every N updates')
    group.add_argument('--log-interval-s', type=float, default=PROGRESS_SECONDS, metavar='SECONDS', help=PROGRESS_HELP)
    group.add_argument('--recovery-interval', type=int, default=0, metavar='N',
                       help='also save a mid-epoch checkpoint, recovery.pth.tar, every N updates (0 = off); '
                            '--resume it to continue exactly')
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The arguments a checkpoint records (--resume, or --checkpoint: the detector it holds, not its output place),
    then the config (-c), then the command line: the later wins."""
    return parse_tool_args(
        build_parser(), argv, 'detect.py', DEMO_CONFIG,
        no_data='no data: give --data-dir, a COCO tree with annotations/instances_<split>.json and an image folder per '
                'split (or run the demo on generated data: python tools/detect.py)',
        no_model='no backbone: give --model (e.g. cvt_ls_13) or a recipe, -c configs/detection/'
                 'mask_rcnn_cvt_ls_13_1x.yaml')


def summary(report: Dict[str, Any]) -> List[str]:
    """What the tool prints: COCOeval's box (and mask) AP, and where the run directory is."""
    lines = []
    for iou_type, name in (('bbox', 'box'), ('segm', 'mask')):
        m = report['metrics'].get(iou_type)
        if m:  # COCOeval's -1: no object of that size
            numbers = '  '.join(f'{k} ' + (f'{100 * m[k]:.1f}' if m[k] >= 0 else '-') for k in STAT_NAMES[:6])
            lines.append(f'{name} {numbers}  ({m["images"]} images, pycocotools COCOeval)')
    if report.get('output_dir'):
        lines.append(f'run directory: {report["output_dir"]} (result.json, report.md, last.pth.tar)')
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    return tool_main(argv, parse_args, run, 'detect', (NonFiniteLossError,), (
        DetectionSetupError, CocoDataError, CheckpointMismatchError, FileNotFoundError), summary)


if __name__ == '__main__':
    sys.exit(main())
