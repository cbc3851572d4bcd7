"""What `--pretrained-path`, `--pretrained` and `--initial-checkpoint` loaded: one log line naming the file, the
number of tensors loaded, the model's tensors the file did not provide (new) and the file's tensors left out.

The loaders (timm's `load_pretrained` after the family's checkpoint filter and its head drop, a family's own
`custom_load`, or `model.load_state_dict`) all end in `nn.Module.load_state_dict`; `recorded_loads` records what
reached it, so the line reports what was loaded, not what the file holds.
"""
import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from timm.models import clean_state_dict

__all__ = ['LoadRecord', 'describe_load', 'file_num_classes', 'file_tensor_shapes', 'recorded_loads']

Shape = Tuple[int, ...]


class LoadRecord:
    """One `load_state_dict` call: the module, the tensor names given, and the missing / unexpected names."""

    def __init__(self, module: nn.Module, keys: List[str], missing: List[str], unexpected: List[str]):
        self.module, self.keys, self.missing, self.unexpected = module, keys, missing, unexpected


@contextlib.contextmanager
def recorded_loads() -> Iterator[List[LoadRecord]]:
    """Record every `nn.Module.load_state_dict` call made inside (by timm's or a family's loader too).

    The method is wrapped on nn.Module for the duration only: the loaders are called deep inside create_model, where
    no hook can be registered on a model that does not exist yet.
    """
    records: List[LoadRecord] = []
    original = nn.Module.load_state_dict

    def recording(self: nn.Module, state_dict: Dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = original(self, state_dict, *args, **kwargs)
        records.append(LoadRecord(self, list(state_dict), list(result.missing_keys), list(result.unexpected_keys)))
        return result

    nn.Module.load_state_dict = recording
    try:
        yield records
    finally:
        nn.Module.load_state_dict = original


def file_tensor_shapes(path: str) -> Tuple[Dict[str, Shape], str]:
    """Names and shapes of the tensors that timm's `load_state_dict(path)` returns (the EMA weights when the file has
    them, `module.` prefixes dropped), read lazily (mmap); and the entry they come from ('' for a plain state dict).
    ({}, '') for a file that cannot be read that way (the loader reports it)."""
    try:
        if str(path).endswith('.safetensors'):
            from safetensors import safe_open
            with safe_open(path, framework='pt') as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, ''
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
    except Exception:  # not a zip checkpoint (no mmap), or unreadable
        return {}, ''
    entry = ''
    if isinstance(ckpt, dict):  # timm's choice, in its order
        for key, wanted in (('state_dict_ema', True), ('model_ema', True), ('state_dict', False), ('model', False)):
            if ckpt.get(key) is not None if wanted else key in ckpt:
                entry = key
                break
    tensors = ckpt[entry] if entry else ckpt
    if not isinstance(tensors, dict):
        return {}, entry
    return {k: tuple(v.shape) for k, v in clean_state_dict(tensors).items() if hasattr(v, 'shape')}, entry


def file_num_classes(shapes: Dict[str, Shape], classifier: Any) -> Optional[int]:
    """The class count of the file's head (`<classifier>.weight` rows), when the file names it as the model does."""
    if not isinstance(classifier, str):
        return None
    shape = shapes.get(classifier + '.weight')
    return shape[0] if shape else None


def _names(keys: Sequence[str], n: int = 6) -> str:
    return ', '.join(keys[:n]) + (f', ... ({len(keys)} in all)' if len(keys) > n else '')


def describe_load(what: str, path: str, model: nn.Module, records: List[LoadRecord],
                  file_shapes: Optional[Dict[str, Shape]] = None, entry: str = '') -> str:
    """One line: `loaded <what> from <path> (<entry>): N tensors; new (not in the file): ...; left out of the file:
    ...`, or `...; nothing new, nothing left out`.

    Args:
        what: What was loaded ('pretrained weights', 'initial checkpoint').
        path: Where from.
        model: The model loaded into (its own `load_state_dict` calls are the ones reported).
        records: From `recorded_loads`.
        file_shapes: The file's tensors (`file_tensor_shapes`), to name those its loader dropped before loading (a
            head of another class count); the names the model has are compared, so a file in another layout that
            the family's filter converts is not listed name by name.
        entry: The file's entry the weights came from (`state_dict_ema`: the EMA weights).
    """
    mine = [r for r in records if r.module is model]
    source = f'{what} from {path}' + (' (its EMA weights)' if entry in ('state_dict_ema', 'model_ema') else '')
    if not mine:
        return f'loaded {source}'
    given = {k for r in mine for k in r.keys}
    unexpected = {k for r in mine for k in r.unexpected}
    # a name is new only if no call provided it (a family may load in several calls)
    missing = [k for k in mine[-1].missing if k not in given]
    model_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    left_out = []
    for k, shape in (file_shapes or {}).items():
        if k in model_shapes and k not in given:
            left_out.append(k + (f' {list(shape)} (the model: {list(model_shapes[k])})' if shape != model_shapes[k]
                                 else ''))
    left_out += sorted(unexpected)
    line = f'loaded {source}: {len(given - unexpected)} tensors'
    if missing:
        line += f'; new (not in the file): {_names(missing)}'
    if left_out:
        line += f'; left out of the file: {_names(left_out)}'
    if not missing and not left_out:
        line += ", all of the model's; nothing new, nothing left out"
    return line

