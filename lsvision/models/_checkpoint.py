"""Key checks shared by the checkpoint filters of the lsvision models."""
import logging
from typing import Dict, List, Sequence

import torch
import torch.nn as nn

from ._helpers import CheckpointMismatchError

__all__ = ['check_filtered_keys']

_logger = logging.getLogger(__name__)

SHOW = 8  # keys named per kind of problem


def _names(keys: List[str]) -> str:
    more = f' ... and {len(keys) - SHOW} more' if len(keys) > SHOW else ''
    return ', '.join(keys[:SHOW]) + more


def _other_in_chans(shape: torch.Size, model_shape: torch.Size) -> bool:
    """Conv weights that differ only in input channels: timm adapts the first conv to `in_chans` after the filter."""
    return len(shape) == len(model_shape) == 4 and shape[0] == model_shape[0] and shape[2:] == model_shape[2:]


def check_filtered_keys(
        state_dict: Dict[str, torch.Tensor],
        model: nn.Module,
        source: str,
        classifier: str = 'head',
        optional: Sequence[str] = (),
) -> Dict[str, torch.Tensor]:
    """Return `state_dict` (already in lsvision names) if it loads into `model` strictly but for the classifier.

    timm drops the classifier and loads with `strict=False` when the model's class count differs from the pretrained
    config's; this check makes that safe (nothing else may be missing) and says so (a warning) instead of an
    info-level log line.

    Args:
        state_dict: The filtered checkpoint.
        model: The model it is for.
        source: What the checkpoint is, for the messages (e.g. "Microsoft CvT checkpoint").
        classifier: Prefix of the classifier's keys.
        optional: Parts of model keys the checkpoint may lack (e.g. '.grc.': a GRC model loads its base's weights).

    Raises:
        CheckpointMismatchError: (a KeyError) Naming every key that could not be placed (missing, unexpected or
            mis-shaped), classifier aside.
    """
    expected = model.state_dict()
    head = classifier + '.'
    missing = [k for k in expected
               if k not in state_dict and not k.startswith(head) and not any(part in k for part in optional)]
    unexpected = [k for k in state_dict if k not in expected and not k.startswith(head)]
    first_conv = ((getattr(model, 'pretrained_cfg', None) or {}).get('first_conv') or '') + '.weight'
    misshaped = [f'{k} {tuple(v.shape)} (model {tuple(expected[k].shape)})' for k, v in state_dict.items()
                 if k in expected and not k.startswith(head) and v.shape != expected[k].shape
                 and not (k == first_conv and _other_in_chans(v.shape, expected[k].shape))]
    if missing or unexpected or misshaped:
        problems = [f'{what}: {_names(keys)}' for what, keys in (
            ('missing (the model has them, the checkpoint not)', missing),
            ('unexpected (the checkpoint has them, the model not)', unexpected),
            ('mis-shaped', misshaped)) if keys]
        arch = (getattr(model, 'pretrained_cfg', None) or {}).get('architecture') or type(model).__name__
        raise CheckpointMismatchError(f'{source} does not fit {arch}: ' + '; '.join(problems)
                       + '. Create the model with the settings the checkpoint was trained with.')
    ckpt_head = state_dict.get(head + 'weight')
    model_head = expected.get(head + 'weight')
    if ckpt_head is not None and (model_head is None or model_head.shape != ckpt_head.shape):
        model_classes = 0 if model_head is None else model_head.shape[0]
        _logger.warning(
            f'{source}: its {ckpt_head.shape[0]}-class head is not loaded into a model of {model_classes} classes '
            f'(a new head starts from scratch). To keep it, pass num_classes={ckpt_head.shape[0]} both to '
            f'create_model and in pretrained_cfg_overlay.')
    return state_dict
