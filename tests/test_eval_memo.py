"""EvalMemo: the get-or-compute memo of input-independent terms, and the layers that keep theirs in it."""
import copy

import pytest
import torch

from lsvision.layers import long_short
from lsvision.layers.eval_memo import EvalMemo
from lsvision.layers.grc import GatedRecurrentCache


class Source(torch.nn.Module):
    """A parameter and a term computed from it, counting how often the term is computed."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(3, 4))
        self.calls = 0
        self.memos = EvalMemo()

    def doubled(self, scale: float = 2.) -> torch.Tensor:
        self.calls += 1
        return self.weight * scale

    def get(self, scale: float = 2.) -> torch.Tensor:
        return self.memos.get('doubled', (self.weight,), self.doubled, scale, extra=(scale,))


def test_second_call_returns_kept_value():
    src = Source()
    first = src.get()
    again = src.get()
    assert src.calls == 1
    assert again is first
    torch.testing.assert_close(first, src.weight.detach() * 2)
    assert 'doubled' in src.memos and len(src.memos) == 1


def test_value_is_a_plain_tensor_without_autograd_even_under_inference_mode():
    src = Source()
    with torch.inference_mode():
        value = src.get()
    assert not value.is_inference() and not value.requires_grad
    with torch.enable_grad():  # usable in autograd code later
        (value * src.weight).sum().backward()
    torch.testing.assert_close(src.weight.grad, value)


def test_in_place_write_to_a_source_recomputes():
    src = Source()
    first = src.get().clone()
    with torch.no_grad():
        src.weight.add_(1.)
    second = src.get()
    assert src.calls == 2
    torch.testing.assert_close(second, first + 2.)
    src.get()
    assert src.calls == 2


def test_replaced_source_recomputes():
    src = Source()
    src.get()
    src.weight = torch.nn.Parameter(torch.zeros(3, 4))
    assert torch.equal(src.get(), torch.zeros(3, 4))
    assert src.calls == 2


def test_load_state_dict_recomputes():
    src = Source()
    src.get()
    other = Source()
    src.load_state_dict(other.state_dict())
    torch.testing.assert_close(src.get(), other.weight.detach() * 2)
    assert src.calls == 2


def test_extra_is_part_of_the_key():
    src = Source()
    src.get(2.)
    assert torch.equal(src.get(3.), src.weight.detach() * 3)
    assert src.calls == 2
    src.get(3.)
    assert src.calls == 2


def test_inference_tensor_sources_are_never_kept():
    with torch.inference_mode():
        src = Source()  # its parameter is an inference tensor: no version counter
    for _ in range(2):
        torch.testing.assert_close(src.get(), src.weight * 2)
    assert src.calls == 2 and len(src.memos) == 0
    assert src.memos.get('doubled', (src.weight,), src.doubled, compute_unkept=False) is None
    assert src.calls == 2


def test_clear_drops_entries():
    src = Source()
    src.get()
    src.memos.clear()
    assert len(src.memos) == 0 and 'doubled' not in src.memos
    src.get()
    assert src.calls == 2


def test_deepcopy_recomputes_for_the_copy():
    src = Source()
    src.get()
    dup = copy.deepcopy(src)
    with torch.no_grad():
        dup.weight.mul_(-1.)
    torch.testing.assert_close(dup.get(), dup.weight.detach() * 2)
    assert dup.calls == 2 and src.calls == 1


def _check_memo_follows_changes(module, args, change):
    """Eval outputs without autograd (memos) equal the memo-free path (autograd on) before and after `change`."""
    module.eval()

    def full():
        with torch.enable_grad():
            return module(*args).detach()

    with torch.no_grad():
        memo = module(*args)
    kept = sum(len(m._memos) for m in module.modules() if isinstance(getattr(m, '_memos', None), EvalMemo))
    assert kept > 0, 'no memo was kept'
    torch.testing.assert_close(memo, full(), atol=1e-6, rtol=0)
    with torch.no_grad():
        change()
        changed = module(*args)
    torch.testing.assert_close(changed, full(), atol=1e-6, rtol=0)
    assert (changed - memo).abs().max() > 1e-3


@pytest.mark.parametrize('fuse_convs', [True, False])
def test_long_short_conv_layers_follow_parameter_changes(fuse_convs, monkeypatch):
    # cvt_ls_13-like: BatchNorm folded into the q, k, v depthwise convs, standardized projection conv, and (fused)
    # the four depthwise convs as one
    if not fuse_convs:
        monkeypatch.setattr(long_short, '_FUSE_CONVS_MAX_POSITIONS', 0)
    torch.manual_seed(0)
    attn = long_short.LongShortAttention2d(16, num_heads=2, window_size=2, dp_rank=2, qkv_layer='conv',
                                           dp_layer='conv')
    with torch.no_grad():
        for m in attn.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.)
                m.weight.normal_()
                m.bias.normal_()
    x = torch.randn(2, 1 + 4 * 4, 16)

    def change():
        attn.qkv.k.bn.running_var.mul_(3.)
        attn.qkv.q.dw.weight.normal_()
        attn.dynamic_proj.dw.weight.normal_()

    _check_memo_follows_changes(attn, (x, (4, 4)), change)
    assert ('fused_dw' in attn._memos) == fuse_convs


@pytest.mark.parametrize('mem_attn_kwargs', [{'sr_ratio': 2}, {'window_size': (4, 4)}])
def test_gated_recurrent_cache_follows_parameter_changes(mem_attn_kwargs):
    torch.manual_seed(0)
    grc = GatedRecurrentCache(32, 2, cache_len=16, cache_hw=(4, 4), lam_init=2., mem_attn_kwargs=mem_attn_kwargs)
    with torch.no_grad():
        grc.cache.normal_()
        if grc.mem_attn.relative_position_bias_table is not None:
            grc.mem_attn.relative_position_bias_table.normal_()
    x, o = torch.randn(2, 16, 32), torch.randn(2, 16, 32)

    def change():
        grc.linear_reset.weight.mul_(3.)
        grc.cache.mul_(-2.)
        mem = grc.mem_attn
        if mem.sr is not None:
            mem.sr.weight.normal_()
        if mem.relative_position_bias_table is not None:
            mem.relative_position_bias_table.normal_()

    _check_memo_follows_changes(grc, (x, o, [4, 4]), change)
    assert 'frozen' in grc._memos
    assert ('sr_weight' if 'sr_ratio' in mem_attn_kwargs else 'rel_pos_bias') in grc.mem_attn._memos
    grc.train()  # a mode switch drops the memos
    assert len(grc._memos) == 0 and len(grc.mem_attn._memos) == 0
