"""The 2D long-short attention fast path against its dense reference, and its edge cases."""
import pytest
import torch
from reference_attention import dense_long_short_attention_2d

from lsvision.layers import (
    LinearDynamicProjection,
    LongShortAttention2d,
    window_rel_pos_index,
    window_rel_pos_table_size,
    window_span,
)
from lsvision.models.cvt import ConvDynamicProjection, SepConvQkv

# the q, k, v and projection-logit modules of ViL-LS ('linear', the layer's defaults) and CvT-LS ('conv')
QKV_LAYERS = {'linear': None, 'conv': SepConvQkv}
DP_LAYERS = {'linear': LinearDynamicProjection, 'conv': ConvDynamicProjection}
CVT_LS = dict(qkv_layer=SepConvQkv, dp_layer=ConvDynamicProjection)

# (H, W), w, r, heads, prefix tokens, batch, qkv layer, dp layer, window RPE
SWEEP = [
    ((8, 8), 4, 3, 2, 1, 1, 'linear', 'linear', True),  # square, divisible
    ((14, 14), 7, 8, 3, 1, 3, 'linear', 'linear', True),  # the ViL-LS setting
    ((9, 13), 4, 2, 2, 0, 3, 'conv', 'conv', False),  # non-square, not divisible, no prefix
    ((3, 3), 8, 4, 1, 2, 1, 'conv', 'conv', False),  # map smaller than one window, two prefix tokens
    ((5, 11), 3, 5, 4, 2, 3, 'linear', 'conv', True),  # odd window
    ((16, 12), 8, 4, 2, 0, 1, 'linear', 'linear', True),
    ((6, 10), 2, 2, 2, 1, 3, 'conv', 'linear', False),  # the CvT-LS stage-3 window
    ((7, 5), 1, 1, 1, 1, 1, 'linear', 'linear', False),  # w = 1: span 3 (pad max(w // 2, 1))
    ((12, 12), 6, 16, 2, 1, 3, 'conv', 'conv', False),
]


def _randomize_batchnorm(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.)
            m.weight.data.normal_()
            m.bias.data.normal_()


@pytest.mark.parametrize('feat_size,w,r,heads,g,batch,qkv,dp,rpe', SWEEP)
def test_fast_path_matches_dense_reference(feat_size, w, r, heads, g, batch, qkv, dp, rpe):
    torch.manual_seed(0)
    C = heads * 8
    attn = LongShortAttention2d(
        C, heads, w, r, qkv_layer=QKV_LAYERS[qkv], dp_layer=DP_LAYERS[dp], rel_pos_bias=rpe).eval()
    _randomize_batchnorm(attn)
    with torch.no_grad():
        for p in attn.parameters():  # move off the init so that every branch matters
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(batch, g + feat_size[0] * feat_size[1], C)
    with torch.no_grad():
        fast = attn(x, feat_size)
        dense = dense_long_short_attention_2d(attn, x, feat_size)
    assert fast.shape == x.shape
    torch.testing.assert_close(fast, dense, rtol=0, atol=1e-5)


def test_window_is_local_and_projection_is_global():
    """A change in one corner reaches the far corner only through the global (projected) keys: with learned and with
    uniform projection weights; without them (window alone) nothing outside the corner's key span moves."""
    torch.manual_seed(0)
    attn = LongShortAttention2d(16, 2, window_size=2, dp_rank=2).eval()
    H = W = 8
    x = torch.randn(1, H * W, 16)
    x2 = x.clone()
    x2[0, 0] += 1.

    def far_corner_change():
        return float((attn(x2, (H, W)) - attn(x, (H, W)))[0, -1].abs().sum())

    with torch.no_grad():
        learned = far_corner_change()
        attn.dynamic_proj.weight.zero_()
        attn.dynamic_proj.bias.zero_()  # uniform P: the projected keys are the mean, still global
        uniform = far_corner_change()
    assert learned > 1e-4 and uniform > 1e-4, (learned, uniform)
    # with the window alone (no global keys), a token far outside the window span is untouched
    attn_local = LongShortAttention2d(16, 2, window_size=2, dp_rank=1).eval()
    with torch.no_grad():
        attn_local.norm_global.weight.zero_()
        attn_local.norm_global.bias.zero_()  # projected keys and values become 0: constant score, zero value
        ref = attn_local(x, (H, W))
        moved = attn_local(x2, (H, W))
    diff = (moved - ref).abs().sum(-1)[0].reshape(H, W)
    # w = 2, span 4: only segment (0, 0) (rows and cols 0-1) has key (0, 0) in its span [-1, 3)
    assert diff[:2, :2].min() > 0
    assert diff[:, 2:].max() == 0 and diff[2:, :].max() == 0


def test_rel_pos_index_shape_and_collision():
    for w, rows in ((7, 253), (8, 375), (4, 91)):
        assert window_rel_pos_table_size(w) == rows
        idx = window_rel_pos_index(w, torch.device('cpu'))
        _, span = window_span(w)
        assert idx.shape == (w * w, span * span)
        assert idx.min() == 0 and idx.max() == rows - 1
    # bug B1 of the official code: distinct offsets share a row (361 offsets on 253 rows for w = 7)
    assert window_rel_pos_index(7, torch.device('cpu')).unique().numel() < 361


def test_rel_pos_index_matches_official_buffer(golden_dir):
    for name, w in (('tiny224', 7), ('tiny384', 8)):
        net = torch.load(golden_dir / f'{name}.pth', map_location='cpu', weights_only=True)['net']
        official = net['module.layer1.1.attn.relative_position_index']
        assert torch.equal(window_rel_pos_index(w, torch.device('cpu')), official)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_pure_half_precision(dtype):
    """A pure half-precision copy runs and stays within 2e-2 of the fp32 output's largest value (measured: bf16 4e-3,
    fp16 7e-4)."""
    torch.manual_seed(0)
    attn = LongShortAttention2d(32, 2, 4, 4, **CVT_LS, rel_pos_bias=True).eval()
    x = torch.randn(2, 1 + 10 * 7, 32)
    with torch.no_grad():
        ref = attn(x, (10, 7))
        out = attn.to(dtype)(x.to(dtype), (10, 7))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2 * float(ref.abs().max()))


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    attn = LongShortAttention2d(16, 2, 3, 2, **CVT_LS, rel_pos_bias=True)
    x = torch.randn(2, 1 + 5 * 4, 16, requires_grad=True)
    attn(x, (5, 4)).square().mean().backward()
    for name, p in attn.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_bad_arguments_are_explained():
    with pytest.raises(TypeError, match="qkv_layer must be a module class or callable.*got 'conv'"):
        LongShortAttention2d(16, 2, qkv_layer='conv')
    with pytest.raises(ValueError, match='qkv_bias=False applies to the default LinearQkv only'):
        LongShortAttention2d(16, 2, qkv_bias=False, **CVT_LS)
    attn = LongShortAttention2d(16, 2, 4, 2)
    with pytest.raises(AssertionError, match='fewer tokens than H'):
        attn(torch.randn(1, 10, 16), (4, 4))


def test_scriptable():
    attn = LongShortAttention2d(16, 2, 3, 2, **CVT_LS, rel_pos_bias=True).eval()
    scripted = torch.jit.script(attn)
    x = torch.randn(1, 1 + 5 * 7, 16)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x, (5, 7)), attn(x, (5, 7)))


@pytest.mark.parametrize('src,dst', [(7, 8), (8, 7), (4, 6), (7, 7)])
def test_window_table_carried_over_offset_by_offset(src, dst):
    from lsvision.layers import resize_window_rel_pos_table
    torch.manual_seed(0)
    table = torch.randn(window_rel_pos_table_size(src), 3)
    out = resize_window_rel_pos_table(table, dst)
    assert out.shape == (window_rel_pos_table_size(dst), 3)
    # the offsets of every (query, key) pair of the new window, and which row each reads
    pad, span = window_span(dst)
    delta = torch.arange(dst)[:, None] - (torch.arange(span) - pad)[None, :]
    drow = delta[:, None, :, None].expand(dst, dst, span, span).reshape(-1)
    dcol = delta[None, :, None, :].expand(dst, dst, span, span).reshape(-1)
    dst_rows = window_rel_pos_index(dst, torch.device('cpu')).reshape(-1)
    reach = src + src // 2 - 1
    src_rows = ((drow.clamp(-reach, reach) + src // 2 + src - 1) * (src + 2 * (src // 2))
                + dcol.clamp(-reach, reach) + src // 2 + src - 1)
    checked = 0
    for row in dst_rows.unique():
        sources = src_rows[dst_rows == row].unique()
        if sources.numel() == 1:  # a row with one meaning: its bias is exactly the old one of that offset
            torch.testing.assert_close(out[row], table[sources[0]], rtol=0, atol=0)
            checked += 1
    assert checked > 0.5 * dst_rows.unique().numel()
    if src == dst:
        assert out is table


def test_traced_layer_equals_eager():
    """The padding mask is built on every call (no module-level cache): a trace at one map size reproduces eager."""

    class OnMap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = LongShortAttention2d(16, 2, window_size=2, dp_rank=2)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.attn(t, (6, 4))

    model = OnMap().eval()
    x = torch.randn(1, 1 + 6 * 4, 16)
    with torch.no_grad():
        ref = model(x)
        traced = torch.jit.trace(model, x, check_trace=False)
        torch.testing.assert_close(traced(x), ref)


def test_cast_stacked_casts_every_group_in_one_buffer_and_returns_gradients_in_their_dtypes():
    from lsvision.layers.autocast import cast_stacked
    torch.manual_seed(0)
    a, b, c = (torch.randn(3, 5, requires_grad=True) for _ in range(3))
    w = torch.randn(7, requires_grad=True)
    stacked, single = cast_stacked([[a, b, c], [w]], torch.bfloat16)
    assert stacked.shape == (3, 3, 5) and single.shape == (1, 7) and stacked.dtype == torch.bfloat16
    assert stacked.untyped_storage().data_ptr() == single.untyped_storage().data_ptr()  # one buffer
    torch.testing.assert_close(stacked, torch.stack([a, b, c]).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(single[0], w.bfloat16(), rtol=0, atol=0)
    (stacked.float().pow(2).sum() + (single.float() * 3).sum()).backward()
    assert a.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(a.grad, 2 * a.bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, torch.full_like(w, 3.), rtol=0, atol=0)
    # nothing to cast: stacked as they are (no copy for a group of one)
    same, one = cast_stacked([[a, b], [w]], torch.float32)
    torch.testing.assert_close(same, torch.stack([a, b]), rtol=0, atol=0)
    assert one.data_ptr() == w.data_ptr()
    with pytest.raises(ValueError, match='one shape'):
        cast_stacked([[a, w]], torch.bfloat16)
