"""A small model registry for sequence models, shaped like timm's (`create_model`, `list_models`, `register_model`).

Sequence models are not image models, so they stay out of timm's registry (and its image-model test suite).
"""
import fnmatch
from typing import Any, Callable, Dict, List, Union

import torch.nn as nn

_model_entrypoints: Dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Decorator: registers `fn` under its own name as a sequence model entrypoint."""
    name = fn.__name__
    if name in _model_entrypoints:
        raise ValueError(f'sequence model {name!r} is registered twice ({fn.__module__})')
    _model_entrypoints[name] = fn
    return fn


def list_models(filter: Union[str, List[str]] = '') -> List[str]:
    """Sorted names of the registered sequence models, optionally filtered by fnmatch wildcards."""
    names = sorted(_model_entrypoints)
    if not filter:
        return names
    patterns = [filter] if isinstance(filter, str) else list(filter)
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]


def is_model(name: str) -> bool:
    """True if `name` is a registered sequence model."""
    return name in _model_entrypoints


def create_model(name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Builds the registered sequence model `name`; keyword arguments go to its entrypoint (as timm.create_model).

    Args:
        name: A registered sequence model.
        pretrained: Accepted for timm's signature; no sequence model has released weights, so True raises.
        **kwargs: The entrypoint's arguments.

    Raises:
        ValueError: `name` is not a registered sequence model (the message lists close names).
        NoPretrainedWeightsError: `pretrained=True` (the message says how to load a checkpoint instead).
    """
    if name not in _model_entrypoints:
        close = [n for n in _model_entrypoints if name.split('_')[0] in n][:8]
        hint = f' Close names: {", ".join(close)}.' if close else ''
        raise ValueError(
            f'Unknown sequence model {name!r}.{hint} See lsvision.sequence.list_models() for all of them '
            f'(image models are created with timm.create_model).')
    if pretrained:
        from lsvision.models._pretrained import NoPretrainedWeightsError
        raise NoPretrainedWeightsError(
            f'{name} has no released weights (no sequence model of lsvision has). Create it with pretrained=False and '
            'train it, or load a checkpoint into it: an official NVIDIA/transformer-ls LRA or char-LM checkpoint with '
            'lsvision.sequence.convert.load_official_checkpoint(model, path), a file of your own with '
            'model.load_state_dict(safetensors.torch.load_file(path)).')
    return _model_entrypoints[name](**kwargs)
