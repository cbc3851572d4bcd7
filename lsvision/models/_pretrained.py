"""Pretrained weights through timm's own machinery, with errors that say what to do.

timm resolves a model's pretrained cfg (tag, ``pretrained_cfg_overlay``), fetches the weights (``hf_hub_id`` through
huggingface_hub's cache, ``url`` through torch.hub's) and loads them through the family's checkpoint filter. What this
module adds, around ``build_model_with_cfg``:

* a model without released weights raises :class:`NoPretrainedWeightsError`, naming its model card and the
  ``pretrained_cfg_overlay=dict(file=...)`` line for a file of one's own (timm: "No pretrained weights exist");
* a missing overlay file names its path (timm: a ``FileNotFoundError`` without a message);
* a failed download (no network) raises :class:`PretrainedDownloadError`, naming the hub id or URL and where a file
  downloaded by hand goes; for Hub weights, one request without retries (huggingface_hub's own metadata call) first
  checks that the Hub answers, so that a machine without network fails in about a second, or loads the weights it has
  cached, instead of spending about 23 s per file name in huggingface_hub's retries (``HF_HUB_OFFLINE=1`` skips the
  network altogether);
* a file of another architecture keeps the family filter's mismatch message, prefixed with where the file came from;
* :func:`load_checkpoint_file` and :func:`load_into_model` serve timm's ``custom_load`` hook (a family's
  ``load_pretrained``): authors' ``.pth`` files read with ``weights_only=True`` (numpy scalars allowed, nothing
  else), the classifier dropped with a warning when the class count differs, the input conv adapted to ``in_chans``.
"""
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, TypeVar

import torch
import torch.nn as nn
from safetensors.torch import load_file as load_safetensors

from timm.models import adapt_input_conv, build_model_with_cfg, get_arch_pretrained_cfgs
from timm.models._builder import resolve_pretrained_cfg
from timm.models._hub import get_cache_dir, hf_split

from ._helpers import CheckpointMismatchError

__all__ = [
    'NoPretrainedWeightsError', 'PretrainedDownloadError', 'build_model', 'load_checkpoint_file', 'load_into_model',
    'load_pretrained_file', 'model_card', 'weights_source',
]

_logger = logging.getLogger(__name__)

ModelT = TypeVar('ModelT', bound=nn.Module)

HF_WEIGHTS_FILE = 'pytorch_model.bin'  # what timm fetches from a hub repo without model.safetensors
HF_WEIGHTS_FILES = ('model.safetensors', HF_WEIGHTS_FILE)  # timm's order


class NoPretrainedWeightsError(RuntimeError):
    """``pretrained=True`` on a model whose authors released no weights (and no file given)."""


class PretrainedDownloadError(OSError):
    """The released weights could not be fetched (no network, hub or URL unreachable, nothing in the cache)."""


def model_card(name: str) -> str:
    """Where a model's card is: ``model_cards/<name>.md`` of the lsvision repository."""
    return f'its model card, model_cards/{name}.md in the lsvision repository'


def _own_file_line(name: str) -> str:
    return f"timm.create_model('{name}', pretrained=True, pretrained_cfg_overlay=dict(file='/path/to/weights.pth'))"


def weights_source(cfg: Dict[str, Any]) -> Tuple[str, Any]:
    """Where timm will take a resolved pretrained cfg's weights from, in its order: ``('state_dict', ...)``,
    ``('file', path)``, ``('hf-hub', hub_id)``, ``('url', url or (url, cache file name))`` or ``('', None)``."""
    for key, kind in (('state_dict', 'state_dict'), ('file', 'file'), ('hf_hub_id', 'hf-hub'), ('url', 'url')):
        if cfg.get(key):
            return kind, cfg[key]
    return '', None


def _url_cache_file(url: Any) -> str:
    """The file torch.hub / timm cache a URL's download under (``(url, name)`` pairs name their own)."""
    if isinstance(url, (list, tuple)):
        return os.path.join(get_cache_dir(), url[1])
    return os.path.join(get_cache_dir(), os.path.basename(url.split('?')[0]))


def _describe(kind: str, loc: Any) -> str:
    if kind == 'hf-hub':
        return f"the Hugging Face Hub repository '{loc}'"
    if kind == 'url':
        return f'{loc[0] if isinstance(loc, (list, tuple)) else loc} (cached as {_url_cache_file(loc)})'
    return f'{loc}' if kind == 'file' else 'the given state_dict'


def _hub_unreachable(hub_id: str) -> Optional[BaseException]:
    """Why the Hub does not answer for ``hub_id`` now, or None (it answered, or ``HF_HUB_OFFLINE`` is set).

    One HEAD request through huggingface_hub's ``get_hf_file_metadata``, which does not retry (proxies, ``HF_ENDPOINT``
    and tokens as the download would use them). An HTTP error is an answer (the download reports it); no answer at
    all (no route, no DNS, a timeout after ``HF_HUB_ETAG_TIMEOUT`` seconds) is returned.
    """
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError
    if constants.HF_HUB_OFFLINE:
        return None
    repo, revision = hf_split(hub_id)
    try:
        get_hf_file_metadata(hf_hub_url(repo, HF_WEIGHTS_FILE, revision=revision),
                             timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError:
        return None
    except Exception as e:  # the HTTP client's connection errors have no public common base
        return e
    return None


def _cached_hub_weights(hub_id: str) -> Optional[str]:
    """The weights file of ``hub_id`` in the Hugging Face cache that timm would load (safetensors first), or None."""
    from huggingface_hub import try_to_load_from_cache
    repo, revision = hf_split(hub_id)
    cached = (try_to_load_from_cache(repo, f, revision=revision) for f in HF_WEIGHTS_FILES)
    return next((path for path in cached if isinstance(path, str)), None)


def _download_help(name: str, kind: str, loc: Any, error: BaseException) -> str:
    """What failed, and where a file downloaded by hand goes."""
    if kind == 'hf-hub':
        from huggingface_hub import constants
        repo = str(loc).split('@')[0]
        offline = ('HF_HUB_OFFLINE is set, so only the cache was read' if constants.HF_HUB_OFFLINE else
                   'on a machine without network, HF_HUB_OFFLINE=1 reads only the cache and never waits for the Hub')
        return (
            f"could not fetch the weights of {name} from the Hugging Face Hub repository '{repo}' "
            f'({type(error).__name__}: {error}; {offline}). Where there is a network: `hf download {repo} '
            f'{HF_WEIGHTS_FILE}` '
            f'fills the cache this machine reads ({constants.HF_HUB_CACHE}; HF_HUB_CACHE moves it). Or download '
            f'https://huggingface.co/{repo}/resolve/main/{HF_WEIGHTS_FILE} yourself and load it with '
            + _own_file_line(name).replace('/path/to/weights.pth', f'/path/to/{HF_WEIGHTS_FILE}') + '.')
    url = loc[0] if isinstance(loc, (list, tuple)) else loc
    return (
        f'could not download the weights of {name} from {url} ({type(error).__name__}: {error}). Download it '
        f"yourself and save it as {_url_cache_file(loc)} (timm's cache; TORCH_HOME moves it), or load it from "
        f'anywhere with {_own_file_line(name)}.')


def build_model(
        model_cls: Type[ModelT],
        variant: str,
        pretrained: bool,
        **kwargs: Any,
) -> ModelT:
    """``timm.models.build_model_with_cfg`` with lsvision's errors for pretrained weights (see the module doc).

    Args:
        model_cls: The model class.
        variant: The registered model name.
        pretrained: Load the weights of the resolved pretrained cfg (tag or overlay).
        **kwargs: ``build_model_with_cfg``'s arguments (``pretrained_filter_fn``, ``feature_cfg``, the model's).

    Raises:
        NoPretrainedWeightsError: ``pretrained`` and no weights source (no released weights, no overlay file).
        FileNotFoundError: The overlay's ``file`` does not exist (the message names it).
        PretrainedDownloadError: The hub or URL could not be reached and nothing is in the cache.
        CheckpointMismatchError: The weights are not of this architecture (the family filter's message).
    """
    if not pretrained:
        return build_model_with_cfg(model_cls, variant, pretrained, **kwargs)
    overlay = kwargs.get('pretrained_cfg_overlay')
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=kwargs.get('pretrained_cfg'), pretrained_cfg_overlay=overlay)
    cfg = cfg.to_dict()
    name = variant + (f".{cfg['tag']}" if cfg.get('tag') else '')
    kind, loc = weights_source(cfg)
    if not kind:
        raise NoPretrainedWeightsError(
            f'{variant} has no released weights (its authors published none; see {model_card(variant)}). Create it '
            f'with pretrained=False and train it, or start from a file of your own: {_own_file_line(variant)} '
            "(lsvision's layout, safetensors or a .pth state dict).")
    if kind == 'file' and not Path(loc).is_file():
        raise FileNotFoundError(f'pretrained_cfg_overlay file {loc!r} for {name} does not exist (working directory '
                                f'{os.getcwd()}); give the path of a checkpoint file.')
    unreachable = _hub_unreachable(loc) if kind == 'hf-hub' else None
    if unreachable is not None:  # what huggingface_hub would end with after its retries, without them
        cached = _cached_hub_weights(loc)
        if cached is None:
            raise PretrainedDownloadError(_download_help(name, kind, loc, unreachable)) from unreachable
        _logger.warning(f'the Hugging Face Hub does not answer ({unreachable}); {name} loads the weights cached at '
                        f'{cached} (HF_HUB_OFFLINE=1 reads only the cache)')
        kwargs['pretrained_cfg_overlay'] = dict(overlay or {}, file=cached)
    try:
        return build_model_with_cfg(model_cls, variant, pretrained, **kwargs)
    except CheckpointMismatchError as e:
        raise CheckpointMismatchError(f'weights of {_describe(kind, loc)} for {name}: {e}') from None
    except OSError as e:
        if kind not in ('hf-hub', 'url') or isinstance(e, PretrainedDownloadError):
            raise
        raise PretrainedDownloadError(_download_help(name, kind, loc, e)) from e


def _numpy_scalar_globals() -> List[Any]:
    """What a pickled numpy scalar needs (an official trainer may store its accuracy as one), and nothing more."""
    import numpy as np
    core = getattr(np, '_core', None) or np.core
    dtypes = [type(np.dtype(t)) for t in ('float64', 'float32', 'float16', 'int64', 'int32', 'bool')]
    return [core.multiarray.scalar, np.dtype, *dtypes]


def load_checkpoint_file(path: str) -> Dict[str, Any]:
    """Read a checkpoint without unpickling code: safetensors, or ``torch.load(weights_only=True)`` with numpy
    scalars allowed (``torch.serialization.safe_globals``)."""
    if str(path).endswith('.safetensors'):
        return load_safetensors(path, device='cpu')
    with torch.serialization.safe_globals(_numpy_scalar_globals()):
        return torch.load(path, map_location='cpu', weights_only=True)


def load_into_model(
        model: nn.Module,
        state_dict: Dict[str, torch.Tensor],
        classifier: str = 'head',
        first_conv: Optional[str] = None,
) -> None:
    """Load an already filtered (lsvision-layout) state dict as timm's ``load_pretrained`` would.

    The classifier is dropped (the model keeps its fresh head; the family filter has warned) when its shape differs
    from the model's, e.g. ``num_classes=10`` or ``0``; the input conv is adapted with timm's ``adapt_input_conv``
    when ``in_chans`` differs. Everything else must load strictly.
    """
    state_dict = dict(state_dict)
    expected = model.state_dict()
    head_keys = [k for k in state_dict if k.startswith(classifier + '.')]
    if any(k not in expected or expected[k].shape != state_dict[k].shape for k in head_keys):
        for k in head_keys:
            del state_dict[k]
    if first_conv and first_conv + '.weight' in state_dict:
        w = state_dict[first_conv + '.weight']
        in_chans = expected[first_conv + '.weight'].shape[1]
        if w.shape[1] != in_chans:
            state_dict[first_conv + '.weight'] = adapt_input_conv(in_chans, w)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.startswith(classifier + '.')]
    if missing or unexpected:
        raise CheckpointMismatchError(f'missing {missing[:8]}, unexpected {unexpected[:8]}')


def load_pretrained_file(
        model: nn.Module,
        checkpoint_path: str,
        filter_fn: Callable[[Dict[str, Any], nn.Module], Dict[str, torch.Tensor]],
) -> None:
    """The body of a family's ``load_pretrained`` (timm's ``custom_load`` hook): read the file
    (:func:`load_checkpoint_file`), convert it with the family's ``filter_fn``, load it (:func:`load_into_model`,
    classifier and first conv from the model's pretrained cfg)."""
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    state_dict = filter_fn(load_checkpoint_file(checkpoint_path), model)
    load_into_model(model, state_dict, classifier=cfg.get('classifier', 'head'), first_conv=cfg.get('first_conv'))
    _logger.info(f'loaded pretrained weights from {checkpoint_path}')


# --------------------------------------------------------------------------------------------------------------------
# The released weights of a model, as its cards list them

_DATASETS = {'in1k': 'ImageNet-1k', 'in12k': 'ImageNet-12k', 'in21k': 'ImageNet-21k', 'in22k': 'ImageNet-22k'}
_TOP1 = re.compile(r'top-1 reported by the authors: (?P<top1>[\d.]+) ?%')


@dataclass(frozen=True)
class ReleasedWeights:
    """One pretrained tag (``'<model>.<tag>'``) with released weights, from its timm pretrained cfg: ``kind``
    ``'hf-hub'`` (``location`` the hub id) or ``'url'`` (the URL without its query; ``cache_file`` the name in timm's
    cache), the cfg's ``license`` and ``origin`` (the authors' repository), the authors' ImageNet-1k ``top1`` (from
    the notes) and what the weights were ``pretrained_on`` (from the tag: ``<source>_<data>[_ft_<data>]``)."""

    tag: str
    kind: str
    location: str
    cache_file: str
    license: str
    origin: str
    top1: float
    pretrained_on: str

    @property
    def host(self) -> str:
        """The host of a URL's weights ('Dropbox')."""
        return _host(self.location)

    @property
    def origin_repo(self) -> str:
        """The authors' repository, owner/name."""
        return _repo_of(self.origin)

    def source_markdown(self) -> str:
        """Where the weights come from, linked."""
        if self.kind == 'hf-hub':
            return f'[{self.location}](https://huggingface.co/{self.location}) (Hugging Face Hub)'
        return f'{self.location} ({_host(self.location)}, linked from the {_repo_of(self.origin)} README)'

    def license_markdown(self) -> str:
        """The weights' license, or where to read it."""
        return self.license or f'that of [{_repo_of(self.origin)}]({self.origin}); read it before use'


def _host(url: str) -> str:
    """'Dropbox' for https://www.dropbox.com/..., the host name otherwise."""
    return url.split('//', 1)[-1].split('/', 1)[0].removeprefix('www.').split('.')[0].capitalize()


def _repo_of(url: str) -> str:
    """'NVIDIA/transformer-ls' for https://github.com/NVIDIA/transformer-ls."""
    return '/'.join(url.rstrip('/').split('/')[-2:])


def _pretrained_on(tag: str) -> str:
    """'ImageNet-22k, fine-tuned on ImageNet-1k' for a tag ``ms_in22k_ft_in1k``."""
    parts = tag.split('_')
    data = [_DATASETS[p] for p in parts if p in _DATASETS]
    if not data:
        raise ValueError(f'pretrained tag {tag!r} names no known dataset ({", ".join(_DATASETS)}); add it to '
                         'lsvision.models._pretrained._DATASETS.')
    return data[0] + ''.join(f', fine-tuned on {d}' for d in data[1:])


def released_weights(name: str) -> List[ReleasedWeights]:
    """The pretrained tags of ``name`` that have weights (hub id or URL), the default tag first; a ValueError if such a
    cfg's notes give no "top-1 reported by the authors: N %", or its tag no dataset."""
    released = []
    for tag, cfg in get_arch_pretrained_cfgs(name).items():
        if cfg.hf_hub_id:
            kind, location, cache_file = 'hf-hub', cfg.hf_hub_id, ''
        elif cfg.url:
            url, cache_file = cfg.url if isinstance(cfg.url, (list, tuple)) else (cfg.url, '')
            kind, location = 'url', url.split('?')[0]
        else:
            continue
        match = next((m for m in (_TOP1.search(note) for note in cfg.notes or ()) if m), None)
        if match is None:
            raise ValueError(f'the pretrained cfg {tag} has weights but no "top-1 reported by the authors: N %" note')
        released.append(ReleasedWeights(
            tag=tag, kind=kind, location=location, cache_file=cache_file, license=cfg.license or '',
            origin=cfg.origin_url or '', top1=float(match.group('top1')),
            pretrained_on=_pretrained_on(tag.split('.', 1)[1])))
    return released
