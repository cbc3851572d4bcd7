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
        pretrained: Load the released weights, for a model that has them (`txl_wt103_large`: the Hugging Face Hub's
            `transfo-xl/transfo-xl-wt103`, fetched through huggingface_hub's cache as timm fetches Hub weights;
            `HF_HUB_OFFLINE=1` reads only the cache); the others raise.
        **kwargs: The entrypoint's arguments.

    Raises:
        ValueError: `name` is not a registered sequence model (the message lists close names).
        NoPretrainedWeightsError: `pretrained=True` for a model without released weights (the message says how to
            load a checkpoint instead).
        PretrainedDownloadError: The weights could not be fetched and are not in the cache.
    """
    if name not in _model_entrypoints:
        close = [n for n in _model_entrypoints if name.split('_')[0] in n][:8]
        hint = f' Close names: {", ".join(close)}.' if close else ''
        raise ValueError(
            f'Unknown sequence model {name!r}.{hint} See lsvision.sequence.list_models() for all of them '
            f'(image models are created with timm.create_model).')
    entrypoint = _model_entrypoints[name]
    hub_id = getattr(entrypoint, 'hf_hub_id', None)
    if pretrained and hub_id is None:
        from lsvision.models._pretrained import NoPretrainedWeightsError
        with_weights = ', '.join(n for n, fn in sorted(_model_entrypoints.items()) if getattr(fn, 'hf_hub_id', None))
        raise NoPretrainedWeightsError(
            f'{name} has no released weights (of the sequence models only {with_weights} has). Create it with '
            'pretrained=False and train it, or load a checkpoint into it: an official NVIDIA/transformer-ls LRA or '
            'char-LM checkpoint or a Transformer-XL one with lsvision.sequence.convert.load_official_checkpoint('
            'model, path), a file of your own with model.load_state_dict(safetensors.torch.load_file(path)).')
    model = entrypoint(**kwargs)
    if pretrained:
        from .convert import load_official_checkpoint
        load_official_checkpoint(model, _hub_weights(name, hub_id))
    return model


def _hub_weights(name: str, hub_id: str) -> str:
    """The path of `hub_id`'s weights in the Hugging Face cache, downloaded when they are not there (safetensors
    first, then pytorch_model.bin, timm's order); without an answer from the Hub, the cached file."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    from lsvision.models._pretrained import (
        HF_WEIGHTS_FILE,
        HF_WEIGHTS_FILES,
        PretrainedDownloadError,
        _cached_hub_weights,
        _hub_unreachable,
    )
    error = _hub_unreachable(hub_id)
    if error is None:  # the Hub answers, or HF_HUB_OFFLINE: hf_hub_download reads (or fills) the cache
        for filename in HF_WEIGHTS_FILES:
            try:
                return hf_hub_download(hub_id, filename)
            except EntryNotFoundError as e:  # not in the repository (or, offline, not in the cache): the next name
                error = e
            except OSError as e:
                error = e
                break
    cached = _cached_hub_weights(hub_id)
    if cached is not None:
        return cached
    offline = ('HF_HUB_OFFLINE is set, so only the cache was read' if constants.HF_HUB_OFFLINE else
               'on a machine without network, HF_HUB_OFFLINE=1 reads only the cache')
    raise PretrainedDownloadError(
        f"could not fetch the weights of {name} from the Hugging Face Hub repository '{hub_id}' "
        f'({type(error).__name__}: {error}; {offline}). Where there is a network, `hf download {hub_id} '
        f'{HF_WEIGHTS_FILE}` fills the cache this machine reads ({constants.HF_HUB_CACHE}; HF_HUB_CACHE moves it); '
        f'or load a downloaded file with lsvision.sequence.convert.load_official_checkpoint('
        f"lsvision.sequence.create_model('{name}'), '/path/to/{HF_WEIGHTS_FILE}').") from error
