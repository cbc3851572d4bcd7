"""Converts an official ViL-LS checkpoint (NVIDIA/transformer-ls `model_best.pth`) into lsvision safetensors.

The checkpoint is read with ``torch.load(weights_only=True)``; its ``net`` entry (a DDP state_dict, ``module.``
prefixed) is renamed to lsvision's layout, the int64 ``relative_position_index`` buffers are dropped (lsvision
computes them), and ``optimizer`` / ``scheduler`` / ``epoch`` / ``best_acc`` are ignored. The model is picked from the
checkpoint's shapes (``vil_ls_medium``, ``vil_ls_base``, ``vil_ls_medium_384``, or the constructor settings of any
other ViL-LS), or named with ``--model``. Every key is checked against that model before anything is written; a
checkpoint that does not fit is reported key by key (missing, unexpected, mis-shaped) with what to do.

Example::

    python tools/convert_vil_ls.py model_best.pth vil_ls_medium.safetensors
    python tools/convert_vil_ls.py model_best.pth vil_ls_medium_at384.safetensors --model vil_ls_medium --img-size 384

and then, in a fresh Python, ``import timm, lsvision`` (lsvision registers its models with timm) and
``model = timm.create_model('vil_ls_medium', pretrained=True, pretrained_cfg_overlay=dict(file=...))``: the tool
prints this snippet, complete, with the exact call. A class count other than 1000 goes both into
``pretrained_cfg_overlay`` and into the model kwargs, so that timm loads the head strictly instead of dropping it.
A head that cannot load strictly, and an official checkpoint whose last stage has a cls token (its official head
classifies that token; lsvision's averages the map), are refused by name.
"""

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from safetensors.torch import save_file

import timm

import lsvision  # noqa: F401  (registers the lsvision models with timm)
from lsvision.models.vil_ls import (
    check_official_head,
    convert_official_state_dict,
    official_config,
    resize_rel_pos_tables,
)
from lsvision.runs import name_choice

VARIANTS = ('vil_ls_medium', 'vil_ls_base', 'vil_ls_medium_384')
ARCH_KEYS = (
    'embed_dims', 'depths', 'num_heads', 'patch_sizes', 'attn_types', 'num_cls_tokens', 'window_sizes', 'dp_ranks',
    'img_size')
SHOW = 8  # keys listed per kind of problem


class ConversionError(Exception):
    """A checkpoint that cannot be converted; the message says why and what to do."""


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('checkpoint', type=Path, help='official checkpoint (model_best.pth) or a bare state_dict')
    parser.add_argument('output', type=Path, help='safetensors file to write')
    parser.add_argument('--model', default=None, type=name_choice(VARIANTS), metavar='{' + ','.join(VARIANTS) + '}',
                        help='lsvision model to convert for (default: the one the checkpoint shapes match)')
    parser.add_argument('--img-size', type=int, default=None,
                        help='native input size of the target model; full-attention tables are interpolated to it')
    return parser.parse_args(argv)


@functools.cache
def _arch_of(name: str) -> Dict[str, Any]:
    """The architecture settings of a registered variant (built on the meta device)."""
    model = timm.create_model(name, device='meta')
    cfg: Dict[str, List[Any]] = {k: [] for k in ARCH_KEYS if k != 'img_size'}
    for stage in model.stages:
        blk = stage.blocks[0]
        ls = hasattr(blk.attn, 'dynamic_proj')
        cfg['embed_dims'].append(stage.patch_embed.proj.out_channels)
        cfg['depths'].append(len(stage.blocks))
        cfg['num_heads'].append(blk.attn.num_heads)
        cfg['patch_sizes'].append(stage.patch_embed.proj.kernel_size[0])
        cfg['attn_types'].append('long_short' if ls else 'full')
        cfg['num_cls_tokens'].append(stage.num_prefix_tokens)
        cfg['window_sizes'].append(blk.attn.window_size if ls else None)
        cfg['dp_ranks'].append(blk.attn.dp_rank if ls else None)
    out: Dict[str, Any] = {k: tuple(v) for k, v in cfg.items()}
    out['img_size'] = model.img_size[0]
    return out


def _same_arch(official: Dict[str, Any], arch: Dict[str, Any]) -> bool:
    for k in ARCH_KEYS:
        a, b = official[k], arch[k]
        if isinstance(b, tuple):  # w and r only matter in long-short stages
            a = tuple(x for x, y in zip(a, b) if y is not None)
            b = tuple(y for y in b if y is not None)
        if a != b:
            return False
    return True


def _describe(cfg: Dict[str, Any]) -> str:
    ls = [i for i, t in enumerate(cfg['attn_types']) if t == 'long_short']
    return (
        f"embed dims {'/'.join(map(str, cfg['embed_dims']))}, depths {'/'.join(map(str, cfg['depths']))}, "
        f"heads {'/'.join(map(str, cfg['num_heads']))}, long-short stages {[i + 1 for i in ls]} with "
        f"w {'/'.join(str(cfg['window_sizes'][i]) for i in ls)}, native size {cfg['img_size']}, "
        f"{cfg['num_classes']} classes")


def _listing(title: str, items: List[str]) -> str:
    more = f'    ... and {len(items) - SHOW} more\n' if len(items) > SHOW else ''
    return f'  {title}: {len(items)} keys\n' + ''.join(f'    {s}\n' for s in items[:SHOW]) + more


def convert(
        checkpoint: Dict[str, Any],
        model_name: Optional[str] = None,
        img_size: Optional[int] = None,
) -> Tuple[Dict[str, torch.Tensor], str, Dict[str, Any], List[str]]:
    """Converts a loaded official checkpoint.

    Returns:
        (lsvision state_dict, model name, the create_model kwargs that rebuild the model, dropped official keys).

    Raises:
        ConversionError: The checkpoint is not an official ViL-LS one, or does not fit the model.
    """
    if not isinstance(checkpoint, dict):
        raise ConversionError(f'expected a dict (model_best.pth or a state_dict), got {type(checkpoint).__name__}')
    try:
        check_official_head(checkpoint)
    except ValueError as e:
        raise ConversionError(str(e)) from e
    try:
        official = official_config(checkpoint)
    except ValueError as e:
        raise ConversionError(
            f'{e}.\nThis tool converts checkpoints of the official ViL-LS (NVIDIA/transformer-ls imagenet/, '
            "MsViT, keys like 'module.layer1.0.proj.weight' under 'net'). lsvision safetensors load as they are."
        ) from e
    auto = model_name is None
    matches = [n for n in VARIANTS if _same_arch(official, _arch_of(n))]
    kwargs: Dict[str, Any] = {'num_classes': official['num_classes']}
    if model_name is None:
        if matches:
            model_name = matches[0]
        else:  # another ViL-LS: the constructor takes every per-stage setting
            model_name = 'vil_ls_medium'
            kwargs.update({k: official[k] for k in ARCH_KEYS})
    if img_size is not None:
        kwargs['img_size'] = img_size
    model = timm.create_model(model_name, device='meta', **kwargs)

    converted, dropped, unknown = convert_official_state_dict(checkpoint)
    converted = resize_rel_pos_tables(converted, model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in expected if k not in converted]
    unexpected = [f'{k} (official key, not a ViL-LS key)' for k in unknown]
    unexpected += [k for k in converted if k not in expected]
    misshaped = [
        f'{k}: checkpoint {tuple(v.shape)}, model {expected[k]}'
        for k, v in converted.items() if k in expected and tuple(v.shape) != expected[k]
    ]
    if missing or unexpected or misshaped:
        msg = f'the checkpoint does not fit {model_name} ({len(expected)} tensors):\n'
        if any(k.startswith('head.') for k in missing + unexpected + misshaped):
            msg += ('  its classifier head cannot be loaded strictly (a head that does not load is never replaced '
                    'by a random one here):\n')
        if missing:
            msg += _listing('missing (the model has them, the checkpoint not)', missing)
        if unexpected:
            msg += _listing('unexpected (the checkpoint has them, the model not)', unexpected)
        if misshaped:
            msg += _listing('mis-shaped', misshaped)
        msg += f'The checkpoint looks like: {_describe(official)}.\n'
        if matches and model_name not in matches:
            msg += f'What to do: pass --model {matches[0]} (or leave --model out to pick it from the checkpoint)'
            msg += '.'
        elif not auto and not unknown:
            msg += "What to do: leave --model out; the model is then built with the checkpoint's own settings."
        else:
            msg += ('What to do: the file is not a complete official ViL-LS (relative position bias, a0) checkpoint; '
                    'check where it came from, or download it again.')
        raise ConversionError(msg)
    return converted, model_name, kwargs, dropped


def load_call(name: str, path: Path, kwargs: Dict[str, Any]) -> str:
    """The `timm.create_model(...)` call that loads the converted file with its head (strictly).

    timm keeps a checkpoint's classifier only when the pretrained config's class count equals the model's, so a
    class count other than 1000 goes both into `pretrained_cfg_overlay` and into the model kwargs.
    """
    overlay = [f'file={str(path)!r}']
    if kwargs['num_classes'] != 1000:
        overlay.append(f"num_classes={kwargs['num_classes']!r}")
    call = ', '.join([repr(name), 'pretrained=True', f'pretrained_cfg_overlay=dict({", ".join(overlay)})']
                     + [f'{k}={v!r}' for k, v in kwargs.items() if not (k == 'num_classes' and v == 1000)])
    return f'timm.create_model({call})'


def load_snippet(name: str, path: Path, kwargs: Dict[str, Any]) -> str:
    """The Python lines that load the converted file in a fresh interpreter: the imports, then `load_call`."""
    return ('import timm, lsvision  # lsvision registers its models with timm\n'
            f'model = {load_call(name, path, kwargs)}')


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the conversion; returns the exit status (0 written, 2 not converted)."""
    args = parse_args(argv)
    try:
        checkpoint = torch.load(args.checkpoint, map_location='cpu', weights_only=True)
    except FileNotFoundError:
        print(f'error: {args.checkpoint} does not exist', file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  (unpickling errors come in many types)
        print(f'error: could not read {args.checkpoint} with torch.load(weights_only=True): {e}\n'
              'The official model_best.pth loads this way; a file that does not is not one.', file=sys.stderr)
        return 2
    try:
        state_dict, name, kwargs, dropped = convert(checkpoint, args.model, args.img_size)
    except ConversionError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    ignored = [k for k in checkpoint if k != 'net'] if 'net' in checkpoint else []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    metadata = {'format': 'pt', 'model': name, 'model_kwargs': json.dumps(kwargs), 'source': args.checkpoint.name}
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(args.output), metadata=metadata)
    params = sum(v.numel() for v in state_dict.values())
    print(f'wrote {args.output}: {len(state_dict)} tensors, {params:,} parameters, for {name}')
    print(f'dropped {len(dropped)} relative_position_index buffers (lsvision computes them)'
          + (f'; ignored checkpoint entries: {", ".join(ignored)}' if ignored else ''))
    print(f'load it with:\n{load_snippet(name, args.output, kwargs)}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
