"""Feature extraction on one tiny model per family (spec timm.md §1.3-1.4): ``feature_info``, ``features_only``
(the family's default wrapper and timm's getter), ``forward_intermediates`` (indices, norm, stop_early, output_fmt)
and ``prune_intermediate_layers``.

timm's own tests run the same calls on the full-size default subset (``make contract``); these run every family in
seconds, on a non-square input where the model takes one (a swapped H/W shows).
"""
import copy
from typing import List

import pytest
import torch
from _helpers import TINY_FAMILIES, tiny_model

import timm

FAMILIES = sorted(TINY_FAMILIES)


def _input(name: str) -> torch.Tensor:
    """Batch 2 at 64x96, or 64x64 for the fixed-size families (Swin, ViT: built with img_size=64)."""
    size = (64, 64) if timm.get_pretrained_cfg(name).fixed_input_size else (64, 96)
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))


def _as_map(features: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``forward_features`` output as an NCHW map of ``like``'s shape: tokens lose their prefix (cls) tokens, NHWC
    is permuted."""
    if features.ndim == 3:
        B, C, H, W = like.shape
        return features[:, features.shape[1] - H * W:].transpose(1, 2).reshape(B, C, H, W)
    return features if features.shape[1] == like.shape[1] else features.permute(0, 3, 1, 2)


def _taps(model: torch.nn.Module, x: torch.Tensor, **kwargs) -> List[torch.Tensor]:
    with torch.no_grad():
        return model.forward_intermediates(x, intermediates_only=True, **kwargs)


@pytest.mark.parametrize('name', FAMILIES)
def test_feature_info_matches_the_taps(name):
    model = tiny_model(name).eval()
    x = _input(name)
    info = model.feature_info
    assert len(info) >= 3  # timm's tests need three levels
    reductions = [i['reduction'] for i in info]
    assert reductions == sorted(reductions)
    for i in info:
        model.get_submodule(i['module'])  # names a real module (raises otherwise)
    H, W = x.shape[-2:]
    expected = [(2, i['num_chs'], H // i['reduction'], W // i['reduction']) for i in info]
    assert [tuple(t.shape) for t in _taps(model, x)] == expected


@pytest.mark.parametrize('feature_cls', [None, 'getter'])
@pytest.mark.parametrize('name', FAMILIES)
def test_features_only_gives_the_taps(name, feature_cls):
    """features_only (all levels, then two of them) has the model's channels and reductions and returns exactly
    its forward_intermediates taps (same seed, same weights)."""
    model = tiny_model(name).eval()
    x = _input(name)
    taps = _taps(model, x)
    last = len(taps) - 1
    cls_kwargs = {} if feature_cls is None else dict(feature_cls=feature_cls)
    for out_indices in (tuple(range(last + 1)), (1, last)):
        features = tiny_model(name, features_only=True, out_indices=out_indices, **cls_kwargs).eval()
        assert features.feature_info.channels() == [model.feature_info[i]['num_chs'] for i in out_indices]
        assert features.feature_info.reduction() == [model.feature_info[i]['reduction'] for i in out_indices]
        with torch.no_grad():
            outs = features(x)
        assert len(outs) == len(out_indices)
        nhwc = str(getattr(features, 'output_fmt', 'NCHW')).endswith('NHWC')  # Swin's FeatureListNet
        for i, out in zip(out_indices, outs):
            torch.testing.assert_close(out.permute(0, 3, 1, 2) if nhwc else out, taps[i], rtol=0, atol=0)


@pytest.mark.parametrize('name', FAMILIES)
def test_forward_intermediates_options(name):
    model = tiny_model(name).eval()
    x = _input(name)
    with torch.no_grad():
        features = model.forward_features(x)
        final, taps = model.forward_intermediates(x)
    torch.testing.assert_close(final, features, rtol=0, atol=1e-8)
    n = len(taps)
    for got, want in ((_taps(model, x), taps), (_taps(model, x, indices=2), taps[-2:]),
                      (_taps(model, x, indices=[0, -1]), [taps[0], taps[-1]]),
                      (_taps(model, x, indices=[1], stop_early=True), [taps[1]])):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # norm=True: the last tap is the normed final features (ViT norms every tap)
    torch.testing.assert_close(_taps(model, x, norm=True)[-1], _as_map(features, taps[-1]), rtol=0, atol=1e-6)
    with pytest.raises((IndexError, AssertionError, ValueError)):
        _taps(model, x, indices=[n])
    # other layouts: the same taps permuted, or a clear refusal
    for fmt, to_nchw in (('NHWC', lambda t: t.permute(0, 3, 1, 2)),
                         ('NLC', lambda t: t.transpose(1, 2).reshape(taps[-1].shape))):
        try:
            got = _taps(model, x, output_fmt=fmt)[-1]
        except AssertionError as e:
            assert 'must be' in str(e), e
            continue
        torch.testing.assert_close(to_nchw(got), taps[-1], rtol=0, atol=0)


@pytest.mark.parametrize('name', FAMILIES)
def test_prune_intermediate_layers(name):
    """Pruned to tap i: the tap is unchanged, the model ends there (fewer parameters, num_features = its channels,
    no classifier), and a training backward reaches every remaining parameter."""
    model = tiny_model(name, num_classes=7).eval()
    x = _input(name)
    taps = _taps(model, x)
    last = len(taps) - 1
    with torch.no_grad():
        logits = model(x)
        kept_head = copy.deepcopy(model)
        kept_head.prune_intermediate_layers([last], prune_head=False)
        torch.testing.assert_close(kept_head(x), logits, rtol=0, atol=0)
    params = sum(p.numel() for p in model.parameters())
    for i in range(last + 1):
        pruned = copy.deepcopy(model)
        take = pruned.prune_intermediate_layers([i])
        assert pruned.num_classes == 0 and pruned.num_features == model.feature_info[i]['num_chs']
        assert sum(p.numel() for p in pruned.parameters()) < params
        torch.testing.assert_close(_taps(pruned, x, indices=take)[0], taps[i], rtol=0, atol=0)
        pruned.train()
        tap = pruned.forward_intermediates(x, indices=take, intermediates_only=True)[0]
        (tap.sum() + pruned.forward_features(x).sum()).backward()
        unused = [n for n, p in pruned.named_parameters() if p.grad is None]
        assert not unused, f'pruned to {i}: unused {unused}'
