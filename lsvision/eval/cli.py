"""Command-line plumbing shared by ``tools/validate.py`` and ``tools/robustness.py``: model selection and loading,
the per-model run, and the three outputs (JSON, markdown, PNG).
"""
import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import yaml

import timm
from timm.models import reparameterize_model

from .report import markdown_report, plot_corruptions, write_json, write_markdown
from .runner import EvalSettings, default_workers, file_sha256

__all__ = ['add_model_args', 'resolve_model_names', 'load_model', 'settings_from_args', 'run_and_report']


def add_model_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """Adds the model, loader, preprocessing and output options both tools share."""
    g = parser.add_argument_group('models')
    g.add_argument('--models', nargs='+', required=True,
                   help="model names or wildcards, e.g. cvt_ls_13 'cvt_ls_*' resnet50.tv_in1k (lsvision models first, "
                        'then timm.list_models)')
    g.add_argument('--checkpoint', nargs='+', default=None,
                   help='checkpoint file(s) (.pth/.pt/.safetensors), one per model in the order of --models')
    g.add_argument('--pretrained', action='store_true', help="load timm's pretrained weights (may download)")
    g.add_argument('--model-kwargs', nargs='*', default=[], metavar='KEY=VALUE',
                   help='extra timm.create_model arguments, values parsed as YAML (e.g. depths=[1,1,1])')
    g = parser.add_argument_group('run')
    g.add_argument('--batch-size', type=int, default=64)
    g.add_argument('--workers', type=int, default=default_workers(),
                   help='data loader worker processes (0: load in the main one; default: 4, at most the usable cores)')
    g.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    g.add_argument('--amp', default=None, choices=['bfloat16', 'float16'], help='autocast dtype')
    g.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    g.add_argument('--reparam', action='store_true',
                   help='evaluate the model folded for inference (timm.models.reparameterize_model)')
    g.add_argument('--img-size', type=int, default=None,
                   help="override the model's eval input size (ImageNet/ReaL/V2/A/R; recorded as the protocol)")
    g.add_argument('--crop-pct', type=float, default=None, help="override the model's eval crop_pct (same suites)")
    g.add_argument('--interpolation', default=None, help="override the model's eval interpolation (same suites)")
    g.add_argument('--strict', action='store_true',
                   help='treat layout and image warnings as errors: image counts that differ from the real dataset, '
                        'unreadable images (else left out and listed), ImageNet-C/-9 images that are not 224x224')
    g.add_argument('--no-progress', action='store_true', help='no progress bars')
    g.add_argument('--out-dir', default=default_out, help=f'where the JSON, markdown and PNG go ({default_out})')


def resolve_model_names(patterns: Sequence[str]) -> List[str]:
    """Model names from names or wildcards: lsvision's registered models first, then all of timm's.

    Raises:
        ValueError: a name timm does not know or a wildcard that matches nothing.
    """
    import lsvision.models  # registers the lsvision models with timm
    names: List[str] = []
    for pattern in patterns:
        if any(ch in pattern for ch in '*?['):
            found = lsvision.models.list_models(pattern) or timm.list_models(pattern)
            if not found:
                raise ValueError(f'no model matches {pattern!r}')
        elif timm.is_model(pattern):
            found = [pattern]
        else:
            raise ValueError(f'unknown model {pattern!r}; lsvision models: {", ".join(lsvision.models.list_models())}')
        names += [n for n in found if n not in names]
    return names


def _parse_kwargs(items: Sequence[str]) -> Dict[str, Any]:
    kwargs = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise ValueError(f'--model-kwargs takes KEY=VALUE, got {item!r}')
        kwargs[key] = yaml.safe_load(value)
    return kwargs


def load_model(name: str, checkpoint: Optional[str] = None, pretrained: bool = False,
               model_kwargs: Optional[Dict[str, Any]] = None) -> Tuple[nn.Module, Dict[str, Any]]:
    """Creates a timm model, loads a checkpoint (through the model's own filter, weights_only) and describes it.

    Returns:
        the model in eval mode, and its identity for the results: name, pretrained tag, checkpoint path and sha256,
        parameter count and the create_model kwargs.
    """
    kwargs = dict(model_kwargs or {})
    if checkpoint:
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f'checkpoint {checkpoint} not found')
        # source='' makes timm load this file even for models whose default weights live on the HF hub
        overlay = dict(file=os.path.abspath(checkpoint), source='')
        from lsvision.models import explain_checkpoint_errors
        with explain_checkpoint_errors(name, checkpoint, kwargs):  # both architectures, not torch's key listing
            model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
    else:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    cfg = getattr(model, 'pretrained_cfg', {}) or {}
    identity = dict(
        # `pretrained`: timm's weights were loaded; a checkpoint's weights are recorded by path and hash instead
        model=name, pretrained_tag=cfg.get('tag') if pretrained and not checkpoint else None,
        pretrained=bool(pretrained and not checkpoint),
        checkpoint=os.path.abspath(checkpoint) if checkpoint else None,
        checkpoint_sha256=file_sha256(checkpoint) if checkpoint else None,
        params=sum(p.numel() for p in model.parameters()), model_kwargs=kwargs,
        num_classes=getattr(model, 'num_classes', None))
    if not checkpoint and not pretrained:
        identity['note'] = 'random initialisation (no --checkpoint, no --pretrained)'
    return model.eval(), identity


def settings_from_args(args: argparse.Namespace) -> EvalSettings:
    overrides = {k: v for k, v in dict(img_size=args.img_size, crop_pct=args.crop_pct,
                                       interpolation=args.interpolation).items() if v is not None}
    return EvalSettings(batch_size=args.batch_size, workers=args.workers, device=torch.device(args.device),
                        amp_dtype=getattr(torch, args.amp) if args.amp else None, strict=args.strict,
                        progress=not args.no_progress, data_overrides=overrides)


def run_and_report(
        args: argparse.Namespace,
        tool: str,
        evaluate: Callable[[nn.Module, EvalSettings], Dict[str, Any]],
        argv: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """Runs ``evaluate(model, settings)`` for every model of ``args`` and writes results.json, results.md and (with
    ImageNet-C results) imagenet_c.png to ``args.out_dir``, each rewritten after every model.

    Returns:
        the results dict (as written to the JSON).
    """
    import lsvision
    if args.threads:
        torch.set_num_threads(args.threads)
    names = resolve_model_names(args.models)
    checkpoints = args.checkpoint or [None] * len(names)
    if len(checkpoints) != len(names):
        raise ValueError(f'{len(checkpoints)} checkpoint(s) for {len(names)} model(s) ({", ".join(names)}); give one '
                         'per model, in the same order')
    settings = settings_from_args(args)
    results: Dict[str, Any] = dict(
        tool=tool, command=list(argv if argv is not None else sys.argv[1:]),
        date=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
        versions=dict(lsvision=lsvision.__version__, timm=timm.__version__, torch=torch.__version__),
        settings=dict(batch_size=settings.batch_size, device=str(settings.device), amp=args.amp,
                      data_overrides=settings.data_overrides, strict=settings.strict,
                      reparam=getattr(args, 'reparam', False)),
        models=[])
    json_path = os.path.join(args.out_dir, 'results.json')
    md_path = os.path.join(args.out_dir, 'results.md')
    png_path = os.path.join(args.out_dir, 'imagenet_c.png')
    for i, (name, ckpt) in enumerate(zip(names, checkpoints), 1):
        print(f'[{i}/{len(names)}] {name}' + (f' ({ckpt})' if ckpt else ''), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        model, identity = load_model(name, ckpt, args.pretrained, _parse_kwargs(args.model_kwargs))
        if getattr(args, 'reparam', False):
            model = reparameterize_model(model)
            identity['reparam'] = True
        model.to(settings.device)
        identity['suites'] = evaluate(model, settings)
        identity['wall_time_s'] = round(time.perf_counter() - t0, 2)
        results['models'].append(identity)
        write_json(results, json_path)
        write_markdown(markdown_report(results), md_path)
        del model
    try:
        if plot_corruptions(results, png_path):
            results['plot'] = png_path
            write_json(results, json_path)
    except ImportError as e:  # matplotlib is the optional extra lsvision[eval]
        print(f"no PNG chart: {e} (pip install 'lsvision[eval]')", file=sys.stderr)
    print(markdown_report(results))
    print(f'Wrote {json_path}, {md_path}' + (f', {png_path}' if results.get('plot') else ''), file=sys.stderr)
    return results
