r"""Top-1/top-5 of one or several models on any image folder, ImageNet-1K (with ReaL) and the ImageNetV2 variants.

    python tools/validate.py --data-dir my_data/val --model cvt_ls_13 --checkpoint output/train/my_run/last.pth.tar
    python tools/validate.py --models cvt_ls_13 --checkpoint cvt_ls_13.pth --imagenet /data/imagenet
    python tools/validate.py --models 'cvt_ls_*' --checkpoint a.pth b.pth c.pth d.pth \
        --imagenet /data/imagenet/val --imagenet-v2 /data/imagenetv2
    python tools/validate.py --models resnet50.tv_in1k --pretrained --imagenet-v2 /data/imagenetv2

Layouts: ``--data-dir`` is any folder of class folders (``<dir>/<class>/<image>``), suite ``folder``: count, top-1,
top-5, mean cross-entropy and per-class top-1 over the classes the model was trained on. A tools/train.py checkpoint
brings its run (its recorded arguments, else the ``args.yaml`` beside it): the classes, num_classes, the input size
and the other model arguments, the eval preprocessing, the precision (the run's amp autocast; ``--no-amp`` for
float32) and the validation batch size come from there, so top-1 and loss are the run's last validation numbers; the
folder must hold exactly those classes (``--allow-missing-classes``: some of them).
``--imagenet`` is ``val/<wnid>/ILSVRC2012_val_XXXXXXXX.JPEG`` (or its parent); ``--imagenet-v2`` holds the
extracted ``imagenetv2-{matched-frequency,threshold0.7,top-images}-format-val/<0..999>/`` folders (or is one of
them). ReaL uses the labels bundled with timm and needs the full 50,000 val images (``--real-labels`` for another
file). Preprocessing is each model's eval transform (timm ``resolve_model_data_config``), recorded in the output.
Writes ``results.json``, ``results.md`` to ``--out-dir``; the tables also go to stdout.
"""
import argparse
import sys
from typing import Any, Dict, Optional, Sequence

from lsvision.eval import V2_VARIANTS, EvalSettings, LayoutError, evaluate_folder, evaluate_imagenet, evaluate_v2
from lsvision.eval.cli import add_model_args, folder_classes, run_and_report
from lsvision.eval.distributed import close_eval_processes, error_prefix
from lsvision.runs import TrainingRun


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     epilog=__doc__.split('\n\n', 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    g = parser.add_argument_group('suites (any subset)')
    g.add_argument('--data-dir', default=None,
                   help="any image folder of class folders (<dir>/<class>/<image>), e.g. a training run's val split")
    g.add_argument('--class-map', default=None,
                   help="the model's classes, one per line in logit order (default: the training run's)")
    g.add_argument('--allow-missing-classes', action='store_true',
                   help="score a --data-dir that holds only some of the model's classes (the others are listed as "
                        'missing; labels still come from the class names)')
    g.add_argument('--imagenet', default=None, help='ImageNet-1K val folder (wnid class folders) or its parent')
    g.add_argument('--real-labels', default=None,
                   help="ReaL labels json (default: timm's bundled copy); giving one makes ReaL mandatory")
    g.add_argument('--no-real', action='store_true', help='skip ReaL')
    g.add_argument('--imagenet-v2', default=None, help='folder with the ImageNetV2 variant folders')
    g.add_argument('--v2-variants', nargs='+', default=None, choices=list(V2_VARIANTS),
                   help='variants to require (default: all present)')
    add_model_args(parser, 'output/validate')
    args = parser.parse_args(argv)
    if not (args.data_dir or args.imagenet or args.imagenet_v2):
        parser.error('give at least one suite: --data-dir, --imagenet and/or --imagenet-v2')
    if bool(args.model) == bool(args.models):
        parser.error('give the model with --model NAME (one) or --models NAME ... (several)')
    if args.no_real and args.real_labels:
        parser.error('--no-real and --real-labels contradict each other')
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    def evaluate(model: Any, settings: EvalSettings, run: Optional[TrainingRun]) -> Dict[str, Any]:
        suites: Dict[str, Any] = {}
        if args.data_dir:
            suites['folder'] = evaluate_folder(model, args.data_dir, settings, folder_classes(args.class_map, run),
                                               args.allow_missing_classes)
        if args.imagenet:
            real = False if args.no_real else (True if args.real_labels else None)
            suites['imagenet'] = evaluate_imagenet(model, args.imagenet, settings, real=real,
                                                   real_json=args.real_labels)
        if args.imagenet_v2:
            suites['imagenet_v2'] = evaluate_v2(model, args.imagenet_v2, settings, args.v2_variants)
        return suites

    data_paths = dict(zip(('--data-dir', '--class-map', '--imagenet', '--real-labels', '--imagenet-v2'),
                          (args.data_dir, args.class_map, args.imagenet, args.real_labels, args.imagenet_v2)))
    try:
        run_and_report(args, 'validate', evaluate, argv, data_paths)
    except (LayoutError, ValueError, KeyError, FileNotFoundError) as e:
        print(f'{error_prefix()}error: {e}', file=sys.stderr)
        return 2
    finally:
        close_eval_processes()
    return 0


if __name__ == '__main__':
    sys.exit(main())
