"""What a tools/train.py run records, read back by whoever evaluates or continues it, and the model-name checks of
every tool.

A checkpoint written by tools/train.py holds the run's arguments (``args``: timm's dest names) and its classes in
logit order (``class_names``); the run folder holds the same as ``args.yaml`` and ``class_names.txt``. This module
reads them (`training_run`) and answers what evaluation needs to evaluate the checkpoint as training did: the model's
create_model arguments, the eval preprocessing, the classes and the autocast precision.

Both ``lsvision.eval`` and ``lsvision.train`` may import it; it imports neither (only the models and the sequence
registry, for the names of `unknown_model_message`).
"""
import argparse
import difflib
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.nn as nn
import yaml
from PIL import Image

import timm
from timm.data.readers.class_map import load_class_map
from timm.models import get_pretrained_cfg
from timm.utils.misc import natural_key

__all__ = [
    'source_commit', 'source_changed',
    'RUN_DATA_KEYS', 'TrainingRun', 'training_run', 'class_names_from_file', 'class_names_of_run',
    'fixed_input_size_kwargs', 'close_names', 'unknown_name_message', 'unknown_model_message', 'name_choice',
    'image_mode_for_channels', 'channels_of_image_mode', 'normalization_for_channels', 'model_input_channels',
    'weights_error_message',
]

# the run arguments that set the eval preprocessing (timm's resolve_data_config reads them as given to train.py)
RUN_DATA_KEYS = ('input_size', 'img_size', 'crop_pct', 'crop_mode', 'interpolation', 'mean', 'std')


@dataclass
class TrainingRun:
    """What a tools/train.py checkpoint records of the run that wrote it.

    Attributes:
        args: The run's arguments (timm's dest names), as the checkpoint or the run's args.yaml hold them.
        source: Where they were read (the checkpoint, or the args.yaml path).
        class_names: The classes in the order of the model's logits, when the run says (its ``class_names``, or
            its class map file, or the class folders of its training split in timm's order); else None.
    """
    args: Dict[str, Any]
    source: str
    class_names: Optional[List[str]] = None

    def trained(self, name: str) -> bool:
        """Whether the run trained the model ``name`` (its settings apply to it)."""
        return self.args.get('model') == name

    def model_kwargs(self, name: str) -> Dict[str, Any]:
        """The create_model arguments the run built ``name`` with (none when the run trained another model)."""
        a = self.args
        if not self.trained(name):
            return {}
        kwargs = dict(a.get('model_kwargs') or {})
        for key, dest in (('num_classes', 'num_classes'), ('global_pool', 'gp')):
            if a.get(dest) is not None:
                kwargs.setdefault(key, a[dest])
        in_chans = a['input_size'][0] if a.get('input_size') else a.get('in_chans')
        if in_chans and in_chans != 3:
            kwargs.setdefault('in_chans', in_chans)
        fixed_input_size_kwargs(argparse.Namespace(model=name, input_size=a.get('input_size'),
                                                   img_size=a.get('img_size')), kwargs)
        return kwargs

    def data_overrides(self) -> Dict[str, Any]:
        """The run's eval preprocessing settings (input size, crop, interpolation, mean/std)."""
        return {k: self.args[k] for k in RUN_DATA_KEYS if self.args.get(k) is not None}

    def autocast_dtype(self, device_type: str) -> Optional[str]:
        """The autocast dtype of the run's validation on ``device_type`` ('bfloat16' / 'float16'), None for float32.

        tools/train.py validates under its training autocast: ``amp`` on, ``amp_dtype`` as recorded, or when none
        is recorded its default for the device (bfloat16 on CPU, float16 on CUDA).
        """
        if not self.args.get('amp'):
            return None
        return self.args.get('amp_dtype') or ('bfloat16' if device_type == 'cpu' else 'float16')

    def prefetcher(self) -> bool:
        """Whether the run's loaders normalised on the device (timm's PrefetchLoader; off with ``no_prefetcher``)."""
        return not self.args.get('no_prefetcher')

    def eval_batch_size(self) -> Optional[int]:
        """The batch size of the run's validation (``validation_batch_size``, else ``batch_size``)."""
        return self.args.get('validation_batch_size') or self.args.get('batch_size')


def class_names_from_file(path: str) -> List[str]:
    """Class names in label order from a class map file (timm's format: a ``.txt`` of one name per line, or ``.pkl``),
    read with timm's ``load_class_map``."""
    class_to_idx = load_class_map(path)
    return [name for name, _ in sorted(class_to_idx.items(), key=lambda item: item[1])]


def _class_folders(folder: str) -> List[str]:
    """The class folders of a training split in the order of timm's folder reader (natural sort, hidden ones out)."""
    names = [e for e in os.listdir(folder) if not e.startswith('.') and os.path.isdir(os.path.join(folder, e))]
    return sorted(names, key=natural_key)


def class_names_of_run(args: Dict[str, Any], run_folder: str) -> Optional[List[str]]:
    """The run's classes: recorded (checkpoint, else the run folder's class_names.txt), else its class map file, else
    its training folder's classes."""
    if args.get('class_names'):
        return list(args['class_names'])
    for path in (os.path.join(run_folder, 'class_names.txt'), args.get('class_map')):
        if path and os.path.isfile(path):
            return class_names_from_file(path)
    data_dir = args.get('data_dir')
    if data_dir and not args.get('dataset'):
        for split in (args.get('train_split') or 'train', 'train'):
            folder = os.path.join(data_dir, split)
            if os.path.isdir(folder):
                return _class_folders(folder)
    return None


def training_run(checkpoint: str) -> Optional[TrainingRun]:
    """The run a tools/train.py checkpoint records (its ``args``, else ``args.yaml`` beside it); None for other
    checkpoints (timm's, the authors', safetensors)."""
    from lsvision.models import checkpoint_record
    run_folder = os.path.dirname(os.path.abspath(checkpoint))
    record = checkpoint_record(checkpoint)
    recorded, source = record.get('args'), checkpoint
    if isinstance(recorded, dict):
        if record.get('class_names'):
            recorded = dict(recorded, class_names=list(record['class_names']))
    else:
        source = os.path.join(run_folder, 'args.yaml')
        if not os.path.isfile(source):
            return None
        with open(source) as f:
            recorded = yaml.safe_load(f)
        if not isinstance(recorded, dict) or 'model' not in recorded:
            return None
    return TrainingRun(args=recorded, source=source, class_names=class_names_of_run(recorded, run_folder))


def fixed_input_size_kwargs(args: argparse.Namespace, model_kwargs: Dict[str, Any]) -> bool:
    """For a model with a fixed input size (Swin, ViT), pass --img-size / --input-size to it as timm's `img_size=`
    (models of any input size need nothing). Returns whether `img_size` was added.

    Args:
        args: ``model``, ``input_size`` (C, H, W) and ``img_size``, as tools/train.py's arguments name them.
        model_kwargs: The create_model arguments, completed in place.

    Raises:
        ValueError: ``model_kwargs['img_size']`` contradicts --img-size / --input-size.
    """
    size = args.input_size[1:] if args.input_size else ([args.img_size] * 2 if args.img_size else None)
    if size is None:
        return False
    try:
        cfg = get_pretrained_cfg(args.model)
    except RuntimeError:  # an invalid tag: create_model says so
        return False
    if cfg is None or not cfg.fixed_input_size:
        return False
    size = tuple(size)
    if 'img_size' in model_kwargs:
        given = model_kwargs['img_size']
        given = tuple(given) if isinstance(given, (list, tuple)) else (given, given)
        if given != size:
            raise ValueError(f'--model-kwargs img_size={model_kwargs["img_size"]} but the data is {size[0]}x'
                             f'{size[1]} (--img-size / --input-size); give one size')
        return False
    if size == tuple(cfg.input_size[1:]):
        return False
    model_kwargs['img_size'] = size[0] if size[0] == size[1] else size
    return True


_IMAGE_MODES = {1: 'L', 3: 'RGB', 4: 'RGBA'}  # the PIL mode images are read in for a model of N input channels


def image_mode_for_channels(in_chans: int) -> str:
    """The PIL mode a model of ``in_chans`` input channels reads its images in: 'L' for 1, 'RGB' for 3 (timm's
    train.py and validate.py rule), 'RGBA' for 4.

    Raises:
        ValueError: No PIL mode of that many channels is read from an image file.
    """
    if in_chans not in _IMAGE_MODES:
        raise ValueError(f'the model takes {in_chans} input channels, and no image file reads as {in_chans} channels '
                         '(1: grayscale L, 3: RGB, 4: RGBA); create it with in_chans=1, 3 or 4')
    return _IMAGE_MODES[in_chans]


def channels_of_image_mode(mode: str) -> int:
    """How many channels images read in the PIL ``mode`` have ('L' 1, 'RGB' 3, ...).

    Raises:
        ValueError: ``mode`` is not a PIL image mode.
    """
    try:
        return Image.getmodebands(mode)
    except (KeyError, ValueError):
        raise ValueError(f"{mode!r} is not a PIL image mode (e.g. 'L' grayscale, 'RGB', 'RGBA')") from None


def normalization_for_channels(mean: Sequence[float], std: Sequence[float],
                               in_chans: int) -> Optional[Tuple[List[float], List[float]]]:
    """None when ``mean`` and ``std`` have one value per input channel; for a 1-channel model normalised with 3
    values (an RGB model's pretrained config), their averages.

    Raises:
        ValueError: Any other count, with the flags that set them.
    """
    if len(mean) == in_chans and len(std) == in_chans:
        return None
    if in_chans == 1 and len(mean) == len(std) == 3:
        return [sum(mean) / 3], [sum(std) / 3]
    raise ValueError(f'the model takes {in_chans} input channels but the normalisation has {len(mean)} mean and '
                     f'{len(std)} std values ({list(mean)}, {list(std)}); give --mean and --std with {in_chans} '
                     'values each (or one value each, used for every channel)')


def model_input_channels(model: nn.Module) -> Optional[int]:
    """The input channels of a timm image model: its ``in_chans``, else its patch embedding's input channels, else
    its first convolution's when that takes 1, 3 or 4 (an image stem; a first-registered convolution of more channels
    is not one); None otherwise."""
    if isinstance(getattr(model, 'in_chans', None), int):
        return model.in_chans
    proj = getattr(getattr(model, 'patch_embed', None), 'proj', None)
    if isinstance(proj, nn.Conv2d):
        return proj.in_channels
    first = next((m.in_channels for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return first if first in _IMAGE_MODES else None


def close_names(name: str, known: Sequence[str], n: int = 5) -> List[str]:
    """The names of ``known`` closest to ``name`` (difflib's ratio of at least 0.6; a pretrained tag is ignored)."""
    return difflib.get_close_matches(name.split('.')[0], list(known), n=n, cutoff=0.6)


def unknown_name_message(name: str, known: Sequence[str], what: str = 'model', listing: str = '') -> str:
    """``unknown <what> 'name'; did you mean a, b?`` with the closest of ``known``, then ``listing`` (where to find
    all names; default: all of ``known``)."""
    close = close_names(name, known)
    listing = listing or f'known: {", ".join(known)}'
    return f'unknown {what} {name!r}; ' + (f'did you mean {", ".join(close)}? ({listing})' if close else listing)


def unknown_model_message(name: str) -> Optional[str]:
    """None when timm can create ``name`` (any registered model, lsvision's included, or an ``hf-hub:`` /
    ``local-dir:`` name); else the error to show: the closest image model names, and, for a sequence model's name,
    that it is created with ``lsvision.sequence.create_model`` instead."""
    import lsvision.models  # noqa: F401  (registers the image models with timm)
    import lsvision.sequence as sequence
    if name.startswith(('hf-hub:', 'hf_hub:', 'local-dir:')) or timm.is_model(name):
        return None
    if sequence.is_model(name):
        return (f'{name!r} is a sequence model (lsvision.sequence.create_model), not an image model; the image '
                "models are timm's (timm.list_models('*cvt_ls*') lists lsvision's)")
    return unknown_name_message(name, timm.list_models(), 'model',
                                "timm.list_models('*part-of-the-name*') lists the names")


def weights_error_message(error: BaseException, model: str, fix: str) -> Optional[str]:
    """A tool's message for released weights that cannot be had, without a traceback: the problem, the fix in the
    tool's own flags (``fix``), then the library's message (the Python route, for library users).

    Args:
        error: What creating the model raised.
        model: The model name the tool was given.
        fix: The tool's flags that fix it, e.g. ``--pretrained-path FILE ..., or --no-pretrained ...``.

    Returns:
        The message; None when ``error`` is not about unavailable weights (none released, or not downloadable here
        and not in the cache).
    """
    from lsvision.models._pretrained import NoPretrainedWeightsError, PretrainedDownloadError
    if isinstance(error, NoPretrainedWeightsError) or (
            isinstance(error, RuntimeError) and 'No pretrained weights exist' in str(error)):  # timm's own models
        problem = f'{model} has no released weights'
    elif isinstance(error, PretrainedDownloadError):
        problem = (f'the released weights of {model} could not be downloaded (no network, or the hub does not '
                   'answer) and are not in the cache')
    else:
        return None
    return f'{problem}. Fix: {fix}.\nIn Python (library users): {error}'


def name_choice(known: Sequence[str], what: str = 'model') -> Callable[[str], str]:
    """An argparse ``type`` that takes one of ``known`` and answers anything else with "did you mean" (argparse's
    ``choices`` only lists them all)."""
    def parse(text: str) -> str:
        if text in known:
            return text
        raise argparse.ArgumentTypeError(unknown_name_message(text, known, what, f'choose from {", ".join(known)}'))
    return parse


def _git(*args: str) -> str:
    """A git command's output in this lsvision checkout ('' outside one, or when git fails)."""
    try:
        out = subprocess.run(['git', *args], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ''


def source_changed() -> bool:
    """Whether tracked files of this checkout differ from its commit."""
    return bool(_git('status', '--porcelain', '--untracked-files=no'))


def source_commit(mark_changes: bool = False) -> str:
    """The short git commit of this lsvision checkout, for a report's provenance ('unknown' outside a git checkout),
    with '+changes' appended when ``mark_changes`` and tracked files differ from it (`source_changed`)."""
    commit = _git('rev-parse', '--short', 'HEAD') or 'unknown'
    return commit + '+changes' if mark_changes and commit != 'unknown' and source_changed() else commit
