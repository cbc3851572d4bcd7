"""Small pieces shared by the lsvision model families."""
import contextlib
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from timm.layers import _assert, register_notrace_function, trunc_normal_
from timm.models import load_state_dict as timm_load_state_dict

from lsvision.layers import GatedRecurrentCache

__all__ = [
    'check_image_input', 'init_linear_trunc_normal', 'require_non_grc_keys', 'GrcModelMixin',
    'GRC_CHECKPOINT_ERROR', 'CheckpointMismatchError', 'state_dict_mismatch', 'check_state_dict_fits',
    'read_checked_state_dict', 'checkpoint_arch', 'checkpoint_record', 'explain_checkpoint_errors',
]

GRC_CHECKPOINT_ERROR = (
    'gradient checkpointing is not supported with GRC: the recompute in backward would update the cache a second '
    'time and use the new cache (wrong gradients)')


class CheckpointMismatchError(ValueError, KeyError):
    """A checkpoint whose tensors do not fit the model: another architecture, or the same one built differently.

    Also a KeyError: the checkpoint filters raise it for keys they cannot place.
    """

    __str__ = Exception.__str__  # the message as written (KeyError would quote it)


def _sample(keys: Sequence[str], n: int = 4) -> str:
    return ', '.join(keys[:n]) + (f', ... ({len(keys)} in all)' if len(keys) > n else '')


def state_dict_mismatch(
        model_state: Mapping[str, torch.Tensor],
        state_dict: Mapping[str, torch.Tensor],
        ignore: Optional[Callable[[str], bool]] = None,
) -> Optional[str]:
    """A one-line summary of how `state_dict` differs from `model_state` (missing, unexpected, other shapes), with a
    few key names of each kind; None when every key and shape matches.

    Args:
        model_state: The model's `state_dict()` (or any mapping of its tensors).
        state_dict: The checkpoint's tensors.
        ignore: A predicate on a model key: True for keys the checkpoint need not carry.
    """
    missing = [k for k in model_state if k not in state_dict and not (ignore and ignore(k))]
    unexpected = [k for k in state_dict if k not in model_state]
    shapes = [f'{k} {tuple(state_dict[k].shape)} vs {tuple(model_state[k].shape)}' for k in model_state
              if k in state_dict and hasattr(state_dict[k], 'shape') and state_dict[k].shape != model_state[k].shape]
    if not (missing or unexpected or shapes):
        return None
    parts = [f"{len(model_state) - len(missing)} of the model's {len(model_state)} tensor names found"]
    if missing:
        parts.append(f'missing: {_sample(missing)}')
    if unexpected:
        parts.append(f'not in the model: {_sample(unexpected)}')
    if shapes:
        parts.append(f'other shape (checkpoint vs model): {_sample(shapes, 2)}')
    return '; '.join(parts)


def check_state_dict_fits(
        model: nn.Module,
        state_dict: Mapping[str, torch.Tensor],
        model_name: str,
        recorded_arch: Optional[str] = None,
        source: str = 'checkpoint',
        ignore: Optional[Callable[[str], bool]] = None,
) -> None:
    """Raise a short `CheckpointMismatchError` naming both architectures and a sample of keys when `state_dict` does
    not load strictly into `model` (instead of `load_state_dict`'s full listing of every key).

    Args:
        model: The model the weights are for.
        state_dict: The checkpoint's tensors (already converted by the model's filter, if any).
        model_name: The model's timm name, for the message.
        recorded_arch: The architecture the checkpoint records (a tools/train.py checkpoint's `arch`), if any.
        source: What the checkpoint is, for the message (e.g. its path).
        ignore: A predicate on a model key: True for keys the checkpoint need not carry.
    """
    detail = state_dict_mismatch(model.state_dict(), state_dict, ignore)
    if detail is None:
        return
    if recorded_arch and recorded_arch != model_name:
        what = f'it holds {recorded_arch} weights'
        fix = f'load it into {recorded_arch}, or use a checkpoint of {model_name}'
    elif recorded_arch:
        what = f'it holds {recorded_arch} weights of another configuration (model kwargs, num_classes, img_size)'
        fix = 'build the model with the arguments it was trained with'
    else:
        what = 'the checkpoint does not record its architecture'
        fix = f'check that it is a checkpoint of {model_name} built with the same arguments'
    raise CheckpointMismatchError(f'{source} does not fit {model_name} ({what}): {detail}. Fix: {fix}.')


def checkpoint_record(path: str) -> Dict[str, Any]:
    """A checkpoint's top-level entries, read lazily (mmap: the tensors stay on disk until used), for its small
    records (`arch`, tools/train.py's `args` and `class_names`); {} for a safetensors file, a bare tensor file or an
    unreadable one (the state dict read reports the latter)."""
    if str(path).endswith('.safetensors'):
        return {}
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except Exception:  # not a zip checkpoint (no mmap) or unreadable
        return {}
    return ckpt if isinstance(ckpt, dict) else {}


def checkpoint_arch(path: str) -> Optional[str]:
    """The `arch` a training checkpoint records (timm's and tools/train.py's), read lazily (mmap); None if absent."""
    arch = checkpoint_record(path).get('arch')
    return arch if isinstance(arch, str) else None


def read_checked_state_dict(
        model: nn.Module,
        path: str,
        model_name: str,
        use_ema: bool = True,
) -> Dict[str, torch.Tensor]:
    """Read a checkpoint file's state dict (timm's `load_state_dict`, weights_only; the EMA weights when present and
    `use_ema`) and check that it fits `model` (`check_state_dict_fits`, with the architecture the file records).

    Raises:
        CheckpointMismatchError: the file holds another architecture's or configuration's weights.
    """
    state_dict = timm_load_state_dict(path, use_ema=use_ema, weights_only=True)
    check_state_dict_fits(model, state_dict, model_name, checkpoint_arch(path), source=str(path))
    return state_dict


@contextlib.contextmanager
def explain_checkpoint_errors(model_name: str, path: str, model_kwargs: Optional[Dict[str, Any]] = None) -> Iterator:
    """Around `timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=dict(file=path), ...)`: turn
    torch's listing of every mismatched key (and a checkpoint filter's error about a file that records its
    architecture) into the short `CheckpointMismatchError` of `read_checked_state_dict`, with both architectures.

    Args:
        model_name: The model being created.
        path: The checkpoint file it loads.
        model_kwargs: The other create_model arguments (the comparison builds the model on the meta device).
    """
    try:
        yield
    except (RuntimeError, CheckpointMismatchError) as e:
        # a filter's own error stays where the file records no architecture (official checkpoints)
        if not ('loading state_dict' in str(e) or isinstance(e, CheckpointMismatchError)
                and checkpoint_arch(path) is not None):
            raise
        from timm import create_model  # at call time: timm.models imports nothing of lsvision
        read_checked_state_dict(create_model(model_name, device='meta', **(model_kwargs or {})), path, model_name)
        raise


def require_non_grc_keys(
        state_dict: Dict[str, torch.Tensor],
        model: nn.Module,
        ignore_suffixes: Sequence[str] = (),
) -> Dict[str, torch.Tensor]:
    """Return `state_dict` if it holds every key of `model` except the GRC ones (`.grc.`), else raise a
    `CheckpointMismatchError`: a baseline checkpoint loaded with `strict=False` may leave only GRC layers fresh.

    The message tells a base checkpoint that lacks a few keys from another architecture's checkpoint (which holds
    fewer than half of the model's non-GRC tensors), so a wrong checkpoint is not blamed on GRC.

    Args:
        state_dict: The filtered checkpoint.
        model: The GRC model it is for.
        ignore_suffixes: Endings of non-persistent keys a checkpoint need not carry (e.g. Swin's index buffers).
    """
    def ignore(k: str) -> bool:
        return k.endswith(tuple(ignore_suffixes))

    wanted = [k for k in model.state_dict() if '.grc.' not in k and not ignore(k)]
    missing = [k for k in wanted if k not in state_dict]
    if not missing:
        return state_dict
    name = (getattr(model, 'pretrained_cfg', None) or {}).get('architecture') or type(model).__name__
    if len(missing) * 2 > len(wanted):  # most of the model is absent: not its base model's checkpoint
        check_state_dict_fits(model, state_dict, name, source='checkpoint',
                              ignore=lambda k: '.grc.' in k or ignore(k))
    raise CheckpointMismatchError(
        f'checkpoint lacks non-GRC keys of {name} (a base-model checkpoint may lack only `.grc.` keys): '
        f'{_sample(missing, 8)}')


def init_linear_trunc_normal(m: nn.Module) -> None:
    """timm's Linear init (weights trunc normal std .02, biases 0), for `module.apply` on new GRC attention."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class GrcModelMixin:
    """`reset_cache` and a guarded `set_grad_checkpointing` for timm models whose attention carries GRC caches.

    Put it before the timm model class in the bases, so its methods come first.
    """

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            raise RuntimeError(GRC_CHECKPOINT_ERROR)
        super().set_grad_checkpointing(False)

    @torch.jit.ignore
    def reset_cache(self) -> None:
        """Zero every GRC cache."""
        for m in self.modules():
            if isinstance(m, GatedRecurrentCache):
                m.reset_cache()


@register_notrace_function  # asserts on the input shape: a leaf for torch.fx
def check_image_input(x: torch.Tensor, in_chans: int, min_size: int) -> None:
    """Raise an error that says what was expected when `x` is not an image batch the model can take."""
    _assert(x.ndim == 4, f'expected an image batch (B, {in_chans}, H, W), got a tensor of {x.ndim} dims')
    _assert(
        x.shape[1] == in_chans,
        f'expected {in_chans} input channels, got {x.shape[1]}; create the model with in_chans={x.shape[1]} '
        'to change it',
    )
    _assert(
        x.shape[2] >= min_size and x.shape[3] >= min_size,
        f'input {x.shape[2]}x{x.shape[3]} is smaller than the smallest this model takes ({min_size}x{min_size})',
    )
