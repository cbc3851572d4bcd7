r"""Robustness of one or several models: ImageNet-C (mCE), ImageNet-A, ImageNet-R and ImageNet-9 (BG-gap).

    python tools/robustness.py --models cvt_ls_13 --checkpoint cvt_ls_13.pth --imagenet /data/imagenet \
        --imagenet-c /data/imagenet-c --imagenet-a /data/imagenet-a --imagenet-r /data/imagenet-r \
        --imagenet-9 /data/bg_challenge
    python tools/robustness.py --models resnet50.tv_in1k --pretrained --imagenet-c /data/imagenet-c --clean-error 23.85
    python tools/robustness.py --models cvt_ls_13 --checkpoint x.pth --corrupt-on-the-fly /data/imagenet/val \
        --corruptions gaussian_noise fog --severities 3

ImageNet-C (``<root>/<corruption>/<1..5>/<wnid>/``): raw top-1 error per corruption and severity, CE per corruption
(AlexNet = 100), mCE over the 15 corruptions, relative mCE (needs the clean error: ``--imagenet`` measures it,
``--clean-error`` gives it in %), the 4 extra corruptions as raw error; images are not resized (Hendrycks).
ImageNet-A/-R (``<root>/<wnid>/``): top-1/top-5 with the logits sliced to their 200 classes, with the model's eval
transform. ImageNet-9 (``<root>/<variant>/val/<NN_class>/``): accuracy per variant present (argmax over 1000, mapped
to 9 classes, unmapped = wrong) and BG-gap = mixed_same - mixed_rand; no resize.
``--corrupt-on-the-fly`` corrupts any class-folder val set like ImageNet-C was made (needs ``lsvision[corrupt]``);
those results are marked as such. A tools/train.py checkpoint is evaluated as its run validated it (input size,
preprocessing, classes, precision): a run trained at another size than 224 sees ImageNet-C and -9 images resized to
it, marked non-standard. Writes ``results.json``, ``results.md`` and ``imagenet_c.png`` to ``--out-dir``.
"""
import argparse
import sys
from typing import Any, Dict, Optional, Sequence

from lsvision.eval import (
    ALL_CORRUPTIONS,
    CORRUPTIONS,
    IN9_VARIANTS,
    SEVERITIES,
    EvalSettings,
    LayoutError,
    evaluate_corrupt_on_the_fly,
    evaluate_imagenet,
    evaluate_imagenet_9,
    evaluate_imagenet_ar,
    evaluate_imagenet_c,
)
from lsvision.eval.cli import add_model_args, run_and_report
from lsvision.eval.distributed import close_eval_processes, error_prefix


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     epilog=__doc__.split('\n\n', 1)[1], formatter_class=argparse.RawTextHelpFormatter)
    g = parser.add_argument_group('suites (any subset)')
    g.add_argument('--imagenet-c', default=None, help='ImageNet-C root (corruption folders)')
    g.add_argument('--corruptions', nargs='+', default=None, choices=list(ALL_CORRUPTIONS), metavar='NAME',
                   help='corruptions to evaluate (default: the 15 of mCE plus the extras present)')
    g.add_argument('--severities', nargs='+', type=int, default=list(SEVERITIES), choices=list(SEVERITIES))
    g.add_argument('--imagenet-a', default=None, help='ImageNet-A root (200 wnid folders)')
    g.add_argument('--imagenet-r', default=None, help='ImageNet-R root (200 wnid folders)')
    g.add_argument('--imagenet-9', default=None, help='ImageNet-9 (backgrounds challenge) root (variant folders)')
    g.add_argument('--in9-variants', nargs='+', default=None, choices=list(IN9_VARIANTS),
                   help='IN-9 variants to require (default: original, mixed_same, mixed_rand and those present)')
    g.add_argument('--imagenet', default=None, help='ImageNet-1K val, for the clean error of relative mCE')
    g.add_argument('--clean-error', type=float, default=None, help='clean top-1 error in %% (instead of --imagenet)')
    g.add_argument('--corrupt-on-the-fly', default=None, metavar='DIR',
                   help='class-folder val set to corrupt on the fly (optional extra lsvision[corrupt])')
    g.add_argument('--seed', type=int, default=0, help='seed of the on-the-fly corruptions')
    add_model_args(parser, 'output/robustness')
    args = parser.parse_args(argv)
    if not (args.imagenet_c or args.imagenet_a or args.imagenet_r or args.imagenet_9 or args.corrupt_on_the_fly):
        parser.error('give at least one suite: --imagenet-c, --imagenet-a, --imagenet-r, --imagenet-9 or '
                     '--corrupt-on-the-fly')
    if args.imagenet and args.clean_error is not None:
        parser.error('give the clean error either by --imagenet or by --clean-error, not both')
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)

    def evaluate(model: Any, settings: EvalSettings, run: Any) -> Dict[str, Any]:
        suites: Dict[str, Any] = {}
        clean_error = None if args.clean_error is None else args.clean_error / 100
        if args.imagenet:
            suites['imagenet'] = evaluate_imagenet(model, args.imagenet, settings, real=False)
            clean_error = 1 - suites['imagenet']['top1'] / 100
        if args.imagenet_c:
            suites['imagenet_c'] = evaluate_imagenet_c(model, args.imagenet_c, settings, args.corruptions,
                                                       args.severities, clean_error)
        if args.corrupt_on_the_fly:
            suites['imagenet_c_on_the_fly'] = evaluate_corrupt_on_the_fly(
                model, args.corrupt_on_the_fly, settings, args.corruptions or CORRUPTIONS, args.severities,
                clean_error, args.seed, run.class_names if run is not None else None)
        for subset in ('a', 'r'):
            root = getattr(args, f'imagenet_{subset}')
            if root:
                suites[f'imagenet_{subset}'] = evaluate_imagenet_ar(model, root, settings, subset)
        if args.imagenet_9:
            suites['imagenet_9'] = evaluate_imagenet_9(model, args.imagenet_9, settings, args.in9_variants)
        return suites

    data_paths = {f'--{name.replace("_", "-")}': getattr(args, name) for name in (
        'imagenet_c', 'imagenet_a', 'imagenet_r', 'imagenet_9', 'imagenet', 'corrupt_on_the_fly')}
    try:
        run_and_report(args, 'robustness', evaluate, argv, data_paths)
    except (LayoutError, ValueError, FileNotFoundError, ImportError) as e:
        print(f'{error_prefix()}error: {e}', file=sys.stderr)
        return 2
    finally:
        close_eval_processes()
    return 0


if __name__ == '__main__':
    sys.exit(main())
