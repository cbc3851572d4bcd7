"""Command-line plumbing shared by ``tools/validate.py`` and ``tools/robustness.py``: model selection and loading,
the per-model run, and the three outputs (JSON, markdown, PNG).

A checkpoint written by ``tools/train.py`` records its run (the ``args`` of the checkpoint, else the run folder's
``args.yaml``): the model is then built as the run built it (``num_classes``, ``in_chans``, global pool, model kwargs,
a fixed input size), evaluated as the run's validation evaluated it: its eval preprocessing (input size, crop,
interpolation, mean/std, image mode, normalisation on the device or in the loader), its precision (the run's ``amp`` /
``amp_dtype`` autocast), its memory format (``channels_last``) and its validation batch size; the ``folder`` suite
takes the run's classes. ``--model-kwargs``, the preprocessing flags, ``--amp`` / ``--no-amp`` and ``--batch-size``
beat the recorded values.
Reading the run is `lsvision.runs`' (which the training side shares); this module imports nothing of
``lsvision.train``.
"""
import argparse
import ast
import contextlib
import dataclasses
import logging
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import yaml

import timm
from timm.data import resolve_model_data_config
from timm.models import reparameterize_model

from ..reports import write_json, write_text
from ..runs import (
    TrainingRun,
    channels_of_image_mode,
    class_names_from_file,
    image_mode_for_channels,
    model_input_channels,
    normalization_for_channels,
    training_run,
    unknown_model_message,
    weights_error_message,
)
from ..runtime import set_threads, threads_help
from .distributed import JobProgress, check_paths, init_eval_processes
from .report import markdown_report, plot_corruptions
from .runner import EvalSettings, default_workers, file_sha256
from .suites import LayoutWarning

__all__ = [
    'add_model_args', 'resolve_model_names', 'load_model', 'settings_from_args', 'run_and_report', 'TrainingRun',
    'training_run', 'folder_classes', 'precision_of',
]

DEFAULT_BATCH_SIZE = 64


def add_model_args(parser: argparse.ArgumentParser, default_out: str) -> None:
    """Adds the model, loader, preprocessing and output options both tools share."""
    g = parser.add_argument_group('models (--model or --models)')
    g.add_argument('--model', default=None, help="one model name (timm's validate.py flag), e.g. cvt_ls_13")
    g.add_argument('--models', nargs='+', default=None,
                   help="model names or wildcards, e.g. cvt_ls_13 'cvt_ls_*' resnet50.tv_in1k (lsvision models first, "
                        'then timm.list_models)')
    g.add_argument('--checkpoint', nargs='+', default=None,
                   help='checkpoint file(s) (.pth/.pt/.safetensors), one per model in the order of --models')
    g.add_argument('--pretrained', action='store_true', help="load timm's pretrained weights (may download)")
    g.add_argument('--num-classes', type=int, default=None, metavar='N',
                   help="the model's class count (timm's validate.py flag; default: a tools/train.py checkpoint's "
                        "run, else the model's default); a checkpoint's head must have as many")
    g.add_argument('--model-kwargs', nargs='*', default=[], metavar='KEY=VALUE',
                   help='extra timm.create_model arguments, values parsed as YAML (e.g. depths=[1,1,1]); a '
                        "tools/train.py checkpoint's own run arguments are used without them")
    g = parser.add_argument_group('run')
    g.add_argument('--batch-size', type=int, default=None,
                   help=f"default: a tools/train.py run's validation batch size, else {DEFAULT_BATCH_SIZE}")
    g.add_argument('--workers', type=int, default=default_workers(),
                   help='data loader worker processes (0: load in the main one; default: 4, at most the usable cores)')
    g.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    precision = g.add_mutually_exclusive_group()
    precision.add_argument('--amp', default=None, choices=['bfloat16', 'float16'],
                           help="autocast dtype (default: a tools/train.py run's own amp / amp_dtype, else float32)")
    precision.add_argument('--no-amp', action='store_true',
                           help='evaluate in float32, also a checkpoint whose run validated under autocast')
    g.add_argument('--threads', type=int, default=0, help=threads_help())
    g.add_argument('--reparam', action='store_true',
                   help='evaluate the model folded for inference (timm.models.reparameterize_model)')
    g.add_argument('--img-size', type=int, default=None,
                   help="override the model's eval input size (every suite; ImageNet-C/-9 images are then resized "
                        'to it, marked non-standard; recorded as the protocol)')
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
        ValueError: a name timm does not know (with the closest names) or a wildcard that matches nothing.
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
            raise ValueError(unknown_model_message(pattern))
        names += [n for n in found if n not in names]
    return names


def _parse_kwargs(items: Sequence[str]) -> Dict[str, Any]:
    """KEY=VALUE pairs; values as Python literals, as train.py's --model-kwargs reads them (timm's ParseKwargs:
    ``depths=(1,1,1)``), else as YAML (``true``, ``[1, 1]``)."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key:
            raise ValueError(f'--model-kwargs takes KEY=VALUE, got {item!r}')
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = yaml.safe_load(value)
    return kwargs


def _model_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """``--model-kwargs`` with ``--num-classes`` (the two must agree where both give the class count)."""
    kwargs = _parse_kwargs(args.model_kwargs)
    num_classes = getattr(args, 'num_classes', None)
    if num_classes is not None:
        if kwargs.get('num_classes', num_classes) != num_classes:
            raise ValueError(f"--num-classes {num_classes} and --model-kwargs num_classes={kwargs['num_classes']} "
                             'disagree: give the class count once (--num-classes N)')
        kwargs['num_classes'] = num_classes
    return kwargs


def _checkpoint_head(name: str, path: str, kwargs: Dict[str, Any]) -> Optional[Tuple[str, int, int, bool]]:
    """The classifier weight of a checkpoint in the model's own key names, its class count, the class count of the
    model built with ``kwargs``, and whether the rest of the checkpoint fits that model; None where the file has no
    such key."""
    from lsvision.models import state_dict_mismatch
    try:
        state = timm.models.load_state_dict(path, use_ema=False, weights_only=True)
        meta = timm.create_model(name, device='meta', **kwargs)
    except Exception:  # noqa: BLE001  (the error being explained is the one to report)
        return None
    classifier = (getattr(meta, 'pretrained_cfg', None) or {}).get('classifier')
    key = f'{classifier}.weight'
    if not isinstance(classifier, str) or getattr(state.get(key), 'ndim', 0) < 1:
        return None

    def body(tensors: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in tensors.items() if not k.startswith(classifier + '.')}

    return (key, int(state[key].shape[0]), int(getattr(meta, 'num_classes', 0)),
            state_dict_mismatch(body(meta.state_dict()), body(state)) is None)


@contextlib.contextmanager
def _held_head_warnings() -> Iterator[None]:
    """Holds the checkpoint filters' warning that a head of another class count is not loaded: evaluation loads
    the head timm is told of, so such a head stops the load (with this module's message); the warning is let through
    only if the model loads after all."""
    logger = logging.getLogger('lsvision.models._checkpoint')
    held: List[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if 'head is not loaded' in record.getMessage():
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in held:  # reached only without an exception
        logger.handle(record)


def _checkpoint_mismatch_message(error: Exception, name: str, checkpoint: str, kwargs: Dict[str, Any],
                                 class_source: str) -> str:
    """The tool's message for a checkpoint that does not fit: in the tools' flags, with the checkpoint's own class
    count where its head is found."""
    head = _checkpoint_head(name, checkpoint, kwargs)
    if head is None:
        return f'{error} (give the arguments it was trained with as --model-kwargs KEY=VALUE)'
    key, n, model_classes, body_fits = head
    if body_fits:
        return (f'{checkpoint} holds a {n}-class head ({key}) and the model was built for {model_classes} classes '
                f"({class_source}); evaluation uses the checkpoint's own head: give --num-classes {n}")
    return (f'{error} (give the arguments it was trained with as --model-kwargs KEY=VALUE; its head has {n} classes: '
            f'--num-classes {n})')


def load_model(name: str, checkpoint: Optional[str] = None, pretrained: bool = False,
               model_kwargs: Optional[Dict[str, Any]] = None,
               run: Optional[TrainingRun] = None) -> Tuple[nn.Module, Dict[str, Any]]:
    """Creates a timm model, loads a checkpoint (through the model's own filter, weights_only) and describes it.

    Args:
        run: The training run the checkpoint records: the model is built with its arguments (``model_kwargs`` win).

    Raises:
        CheckpointMismatchError: the checkpoint does not fit the model; the message names the flags that fix it
            (``--num-classes N`` with the checkpoint's own count where only the head differs).

    Returns:
        the model in eval mode, and its identity for the results: name, pretrained tag, checkpoint path and sha256,
        parameter count and the create_model kwargs.
    """
    kwargs = dict(run.model_kwargs(name) if run else {}, **(model_kwargs or {}))
    if checkpoint:
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(f'checkpoint {checkpoint} not found')
        # source='' makes timm load this file even for models whose default weights live on the HF hub; the class
        # count goes into the cfg too, so that timm loads the checkpoint's head instead of leaving it out
        overlay = dict(file=os.path.abspath(checkpoint), source='')
        if kwargs.get('num_classes') is not None:
            overlay['num_classes'] = kwargs['num_classes']
        from lsvision.models import CheckpointMismatchError, explain_checkpoint_errors
        try:
            with _held_head_warnings(), explain_checkpoint_errors(name, checkpoint, kwargs):  # not torch's listing
                model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, **kwargs)
        except CheckpointMismatchError as e:
            class_source = ('--num-classes / --model-kwargs' if 'num_classes' in (model_kwargs or {}) else
                            "its training run's" if 'num_classes' in kwargs else f"{name}'s default")
            raise CheckpointMismatchError(
                _checkpoint_mismatch_message(e, name, checkpoint, kwargs, class_source)) from None
    else:
        try:
            model = timm.create_model(name, pretrained=pretrained, **kwargs)
        except (RuntimeError, OSError) as e:  # --pretrained: none released, or none reachable
            message = weights_error_message(e, name, (
                f'give a weights file of {name} as --checkpoint FILE (safetensors, a .pth state dict, or the released '
                'file downloaded by hand), or leave out --pretrained (random weights: a check of the pipeline only)'))
            if message is None:
                raise
            raise ValueError(message) from None
    cfg = getattr(model, 'pretrained_cfg', {}) or {}
    identity = dict(
        # `pretrained`: timm's weights were loaded; a checkpoint's weights are recorded by path and hash instead
        model=name, pretrained_tag=cfg.get('tag') if pretrained and not checkpoint else None,
        pretrained=bool(pretrained and not checkpoint),
        checkpoint=os.path.abspath(checkpoint) if checkpoint else None,
        checkpoint_sha256=file_sha256(checkpoint) if checkpoint else None,
        params=sum(p.numel() for p in model.parameters()), model_kwargs=kwargs,
        num_classes=getattr(model, 'num_classes', None))
    if run is not None:
        identity['training_run'] = run.source
    if not checkpoint and not pretrained:
        identity['note'] = 'random initialisation (no --checkpoint, no --pretrained)'
    return model.eval(), identity


def settings_from_args(args: argparse.Namespace) -> EvalSettings:
    overrides = {k: v for k, v in dict(img_size=args.img_size, crop_pct=args.crop_pct,
                                       interpolation=args.interpolation).items() if v is not None}
    """The command line's settings; `run_and_report` completes them per model (`precision_of`, the training run)."""
    return EvalSettings(batch_size=args.batch_size or DEFAULT_BATCH_SIZE, workers=args.workers,
                        device=torch.device(args.device), amp_dtype=getattr(torch, args.amp) if args.amp else None,
                        strict=args.strict, progress=not args.no_progress, data_overrides=overrides)


def folder_classes(class_map: Optional[str], run: Optional[TrainingRun]) -> List[str]:
    """The classes of the ``folder`` suite, in logit order: a class map file (a name per line), else the run's.

    Raises:
        ValueError: neither gives them (a checkpoint not written by tools/train.py, and no --class-map).
    """
    if class_map:
        return class_names_from_file(class_map)
    if run is not None and run.class_names:
        return run.class_names
    raise ValueError('the folder suite needs the classes the model was trained on, in the order of its logits: '
                     'give a tools/train.py checkpoint (its run records them) or --class-map FILE (one class folder '
                     'name per line)')


def precision_of(args: argparse.Namespace, run: Optional[TrainingRun], name: str,
                 device_type: str) -> Dict[str, Any]:
    """The precision ``name`` is evaluated in, and why: ``--amp`` / ``--no-amp``, else the run's validation autocast
    (``amp`` / ``amp_dtype``, see `TrainingRun.autocast_dtype`), else float32.

    Returns:
        ``autocast``: the autocast dtype name or None (float32); ``source``: where that came from.
    """
    if args.amp:
        return dict(autocast=args.amp, source='--amp')
    if getattr(args, 'no_amp', False):
        return dict(autocast=None, source='--no-amp')
    if run is not None and run.trained(name):
        dtype = run.autocast_dtype(device_type)
        return dict(autocast=dtype, source=f"training run: amp {str(bool(run.args.get('amp'))).lower()}"
                                           + (f', amp_dtype {dtype}' if dtype else ''))
    return dict(autocast=None, source='default')


def _run_settings(settings: EvalSettings, run: Optional[TrainingRun], name: str, batch_size: Optional[int],
                  precision: Dict[str, Any]) -> EvalSettings:
    """``settings`` for ``name``: the training run's eval preprocessing under the command line's overrides, its
    validation batch size unless ``batch_size`` is given, its loader normalisation and memory format, and
    ``precision``."""
    amp_dtype = getattr(torch, precision['autocast']) if precision['autocast'] else None
    if run is None or not run.trained(name):
        return dataclasses.replace(settings, amp_dtype=amp_dtype)
    overrides = run.data_overrides()
    if 'img_size' in settings.data_overrides:
        overrides.pop('input_size', None)  # timm's resolve_data_config would prefer it to the flag's img_size
    return dataclasses.replace(settings, data_overrides={**overrides, **settings.data_overrides}, amp_dtype=amp_dtype,
                               batch_size=batch_size or run.eval_batch_size() or settings.batch_size,
                               prefetcher=run.prefetcher() if settings.prefetcher is None else settings.prefetcher,
                               channels_last=bool(run.args.get('channels_last')),
                               input_img_mode=run.args.get('input_img_mode') or settings.input_img_mode)


def _fit_to_model_channels(settings: EvalSettings, model: nn.Module) -> EvalSettings:
    """``settings`` with images and normalisation of the model's input channels: images read in the mode of its
    channels when the run's (or the default RGB) has another count (grayscale 'L' for 1, timm's validate.py rule), an
    RGB mean/std averaged for a 1-channel model (`normalization_for_channels`), the input size's channels."""
    in_chans = model_input_channels(model)
    if in_chans is None:
        return settings
    mode = settings.input_img_mode
    if channels_of_image_mode(mode) != in_chans:
        mode = image_mode_for_channels(in_chans)
    overrides = dict(settings.data_overrides)
    cfg = resolve_model_data_config(model, args=dict(overrides, in_chans=in_chans))
    if in_chans != 3 or cfg['input_size'][0] != 3:  # timm reads in_chans from here, or takes a pretrained (3, H, W)
        overrides['input_size'] = (in_chans, *cfg['input_size'][1:])
    fitted = normalization_for_channels(cfg['mean'], cfg['std'], in_chans)
    if fitted:
        overrides['mean'], overrides['std'] = fitted
    return dataclasses.replace(settings, input_img_mode=mode, data_overrides=overrides)


def run_and_report(
        args: argparse.Namespace,
        tool: str,
        evaluate: Callable[[nn.Module, EvalSettings, Optional[TrainingRun]], Dict[str, Any]],
        argv: Optional[Sequence[str]] = None,
        data_paths: Optional[Dict[str, Optional[str]]] = None,
) -> Dict[str, Any]:
    """Runs ``evaluate(model, settings, run)`` for every model of ``args`` and writes results.json, results.md and
    (with ImageNet-C results) imagenet_c.png to ``args.out_dir``, each rewritten after every model. ``run`` is the
    training run a tools/train.py checkpoint records (None otherwise); its eval preprocessing is the model's
    settings' unless the command line overrides it.

    Under torchrun the processes share the images of every set (`lsvision.eval.distributed`); rank 0 writes the
    outputs (``"processes": N`` in the JSON) and shows the one progress bar.

    Args:
        data_paths: option name -> dataset path of the suites asked for; every process must be able to read them.

    Returns:
        the results dict (as written to the JSON).
    """
    import lsvision
    set_threads(args.threads or 0, log=os.environ.get('RANK', '0') == '0')
    if bool(args.model) == bool(args.models):
        raise ValueError('give the model with --model NAME (one) or --models NAME ... (several), not both')
    names = resolve_model_names([args.model] if args.model else args.models)
    checkpoints = args.checkpoint or [None] * len(names)
    if len(checkpoints) != len(names):
        raise ValueError(f'{len(checkpoints)} checkpoint(s) for {len(names)} model(s) ({", ".join(names)}); give one '
                         'per model, in the same order')
    processes = init_eval_processes(args.device)
    args.device = str(processes.device)
    if not processes.primary:  # rank 0 speaks for the job; the results list every process's findings
        warnings.simplefilter('ignore', LayoutWarning)
    check_paths(dict(data_paths or {}))
    settings = settings_from_args(args)
    settings.tracker = JobProgress(settings.progress)
    results: Dict[str, Any] = dict(
        tool=tool, command=list(argv if argv is not None else sys.argv[1:]), processes=processes.world_size,
        date=time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
        versions=dict(lsvision=lsvision.__version__, timm=timm.__version__, torch=torch.__version__),
        settings=dict(batch_size=args.batch_size, device=str(settings.device), amp=args.amp,
                      no_amp=getattr(args, 'no_amp', False),
                      data_overrides=settings.data_overrides, strict=settings.strict,
                      reparam=getattr(args, 'reparam', False)),
        models=[])
    json_path = os.path.join(args.out_dir, 'results.json')
    md_path = os.path.join(args.out_dir, 'results.md')
    png_path = os.path.join(args.out_dir, 'imagenet_c.png')
    for i, (name, ckpt) in enumerate(zip(names, checkpoints), 1):
        if processes.primary:
            print(f'[{i}/{len(names)}] {name}' + (f' ({ckpt})' if ckpt else '')
                  + (f' on {processes.world_size} processes' if processes.world_size > 1 else ''),
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        run = training_run(ckpt) if ckpt else None
        model, identity = load_model(name, ckpt, args.pretrained, _model_kwargs(args), run)
        if getattr(args, 'reparam', False):
            model = reparameterize_model(model)
            identity['reparam'] = True
        model.to(settings.device)
        identity['precision'] = precision_of(args, run, name, settings.device.type)
        model_settings = _fit_to_model_channels(
            _run_settings(settings, run, name, args.batch_size, identity['precision']), model)
        identity['batch_size'] = model_settings.batch_size
        if model_settings.input_img_mode != 'RGB':
            identity['input_img_mode'] = model_settings.input_img_mode
        if model_settings.channels_last:  # as the run validated
            model.to(memory_format=torch.channels_last)
            identity['channels_last'] = True
        identity['suites'] = evaluate(model, model_settings, run)
        identity['wall_time_s'] = round(time.perf_counter() - t0, 2)
        results['models'].append(identity)
        if processes.primary:
            write_json(json_path, results)
            write_text(md_path, markdown_report(results))
        del model
    settings.tracker.close()
    if not processes.primary:
        return results
    try:
        if plot_corruptions(results, png_path):
            results['plot'] = png_path
            write_json(json_path, results)
    except ImportError as e:  # matplotlib is the optional extra lsvision[eval]
        print(f"no PNG chart: {e} (pip install 'lsvision[eval]')", file=sys.stderr)
    print(markdown_report(results))
    print(f'Wrote {json_path}, {md_path}' + (f', {png_path}' if results.get('plot') else ''), file=sys.stderr)
    return results
