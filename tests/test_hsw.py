"""HSW (hierarchical shifted-window encoder): sizes, shapes, the shift's receptive field, padding, training, bf16,
and the window attention (with and without the long-short keys) against a dense masked reference."""
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from _helpers import perturb

from lsvision.sequence import create_model
from lsvision.sequence.hsw import HSW, WindowAttention1d, shift_window_ids


def _small(attn: str = 'window', **kwargs) -> HSW:
    """A tiny HSW: widths 16-128, window 8, heads C / 8, any vocabulary."""
    cfg = dict(vocab_size=40, num_classes=5, embed_dim=16, head_dim=8, window_size=8, attn=attn,
               dp_ranks=(3, 2, 1, 0), drop_path_rate=0.)
    cfg.update(kwargs)
    return HSW(**cfg)


@pytest.fixture(scope='module')
def hsw_tiny() -> HSW:
    """The full-size hsw_tiny (25M parameters), built once: the tests below use it without changing its weights."""
    torch.manual_seed(0)
    return create_model('hsw_tiny').eval()


def _dense_window_reference(
        attn: WindowAttention1d,
        x: torch.Tensor,
        valid: Optional[torch.Tensor],
        window: int,
        shift: int,
) -> torch.Tensor:
    """Full N x (r + N) attention with an explicit boolean mask, written from the spec (§4, §1 steps 2-6).

    Query i and key j share a window iff their rolled positions (p - shift) mod N_pad fall in the same window and,
    in a shifted block, in the same region (0: p < N_pad - w, 1: p < N_pad - s, 2: else); padded keys are out.
    The bias of a pair is table[pos_in_window(i) - pos_in_window(j) + w_max - 1]. LS: r projected keys per head.
    """
    B, N, C = x.shape
    h, d, r = attn.num_heads, attn.head_dim, attn.dp_rank
    if valid is None:
        valid = torch.ones(B, N, dtype=torch.bool)
    padded = -(-N // window) * window
    q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).split(C, dim=-1)
    if r > 0:
        ln_l = attn.norm_local
        k = F.layer_norm(k, (C,), ln_l.weight, ln_l.bias, ln_l.eps)
        v = F.layer_norm(v, (C,), ln_l.weight, ln_l.bias, ln_l.eps)
    heads = lambda t: t.reshape(B, -1, h, d).transpose(1, 2)  # noqa: E731
    q, k, v = heads(q), heads(k), heads(v)
    pos = (torch.arange(N) - shift) % padded
    win, in_win = pos // window, pos % window
    region = torch.zeros(N, dtype=torch.long)
    if shift:
        region[pos >= padded - window] = 1
        region[pos >= padded - shift] = 2
    allowed = (win[:, None] == win[None, :]) & (region[:, None] == region[None, :])
    allowed = allowed[None, None] & valid[:, None, None, :]  # (B, 1, N, N)
    rel = in_win[:, None] - in_win[None, :] + attn.window_size - 1
    bias = attn.relative_position_bias_table[rel].permute(2, 0, 1)[None]  # (1, h, N, N)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5 + bias
    scores = scores.masked_fill(~allowed, float('-inf'))
    values = v
    if r > 0:
        logits = F.linear(x, attn.dynamic_proj.weight, attn.dynamic_proj.bias)  # (B, N, h * r)
        logits = logits.masked_fill(~valid[:, :, None], float('-inf'))
        p = logits.softmax(dim=1).reshape(B, N, h, r).permute(0, 2, 3, 1)  # (B, h, r, N)
        ln_g = attn.norm_global
        merge = lambda t: t.transpose(1, 2).reshape(B, r, C)  # noqa: E731
        k_bar = heads(F.layer_norm(merge(p @ k), (C,), ln_g.weight, ln_g.bias, ln_g.eps))
        v_bar = heads(F.layer_norm(merge(p @ v), (C,), ln_g.weight, ln_g.bias, ln_g.eps))
        scores = torch.cat([(q @ k_bar.transpose(-1, -2)) * d ** -0.5, scores], dim=-1)
        values = torch.cat([v_bar, v], dim=2)
    out = scores.softmax(dim=-1) @ values
    return attn.proj(out.transpose(1, 2).reshape(B, N, C))


def test_parameter_counts():
    # the spec's counts (sequence.md §4, §6 assertion 11); built on the meta device, no memory, no init cost
    assert sum(p.numel() for p in create_model('hsw_tiny', device='meta').parameters()) == 25_238_801
    assert sum(p.numel() for p in create_model('hsw_small', device='meta').parameters()) == 32_342_753
    small = create_model('hsw_small', device='meta')
    assert [len(s.blocks) for s in small.stages] == [2, 2, 6, 2]
    assert [s.blocks[0].attn.num_heads for s in small.stages] == [3, 6, 12, 24]


def test_stage_shapes_at_4096(hsw_tiny):
    model = hsw_tiny
    torch.manual_seed(0)
    x = torch.randint(0, 50265, (1, 4096))
    with torch.no_grad():
        final, valid, feats = model.forward_intermediates(x)
        logits = model.forward_head(final, valid)
    assert [tuple(f.shape) for f in feats] == [(1, 4096, 96), (1, 1024, 192), (1, 256, 384), (1, 64, 768)]
    assert tuple(logits.shape) == (1, 11) and valid is None
    assert torch.isfinite(logits).all()
    assert len(model.forward_intermediates(x[:, :300], indices=2, intermediates_only=True)) == 2


@pytest.mark.parametrize('seq_len', [4096, 4000])
def test_shifted_stage1_receptive_field(hsw_tiny, seq_len):
    """Spec §6 assertion 13: output 4095 of the shifted stage-1 block sees 4064..4095 and not 0..31 (the
    wrap-around window is masked); output 100 sees exactly 96..159. At 4000 tokens the sequence is padded to 4032
    inside, and the wrap-around window holds 3968..3999 (real), 4000..4031 (padding) and 0..31."""
    torch.manual_seed(0)
    block = hsw_tiny.stages[0].blocks[1]
    assert block.window_and_shift(seq_len) == (64, 32)
    x = torch.randn(1, seq_len, 96, requires_grad=True)
    out = block(x)
    last = seq_len - 1
    (grad_last,) = torch.autograd.grad(out[0, last].sum(), x, retain_graph=True)
    (grad_100,) = torch.autograd.grad(out[0, 100].sum(), x)
    seen_last = grad_last[0].abs().sum(-1) != 0
    seen_100 = grad_100[0].abs().sum(-1) != 0
    assert not seen_last[:32].any()
    window_start = 4064 if seq_len == 4096 else 3936
    assert seen_last[window_start:].all() and not seen_last[:window_start].any()
    assert seen_100.nonzero().flatten().tolist() == list(range(96, 160))


def test_unshifted_block_and_stage4_is_one_global_window(hsw_tiny):
    model = hsw_tiny
    torch.manual_seed(0)
    # stage 1, unshifted block: windows 0..63, 64..127
    x = torch.randn(1, 4096, 96, requires_grad=True)
    (grad,) = torch.autograd.grad(model.stages[0].blocks[0](x)[0, 100].sum(), x)
    assert (grad[0].abs().sum(-1) != 0).nonzero().flatten().tolist() == list(range(64, 128))
    # stage 4 (64 tokens at 4096) never shifts: both blocks see the whole sequence
    for block in model.stages[3].blocks:
        assert block.window_and_shift(64) == (64, 0)
        x = torch.randn(1, 64, 768, requires_grad=True)
        (grad,) = torch.autograd.grad(block(x)[0, 0].sum(), x)
        assert (grad[0].abs().sum(-1) != 0).all()
    # stages 1-3 at 4096 shift their second block
    for stage, n in zip(model.stages[:3], (4096, 1024, 256)):
        assert [b.window_and_shift(n)[1] for b in stage.blocks] == [0, 32]


def test_wrap_around_region_ids():
    ids = shift_window_ids(256, 64, 32)
    assert (ids[:192] == 0).all() and (ids[192:224] == 1).all() and (ids[224:] == 2).all()


@pytest.mark.parametrize('dp_rank', [0, 3])
@pytest.mark.parametrize('seq_len,window,shift,padded', [
    (32, 8, 0, False), (32, 8, 4, False), (30, 8, 4, True), (29, 8, 3, True), (6, 8, 0, True), (40, 5, 2, False),
])
def test_window_attention_matches_dense_reference(dp_rank, seq_len, window, shift, padded):
    torch.manual_seed(0)
    attn = WindowAttention1d(16, 2, window_size=8, dp_rank=dp_rank).double().eval()
    perturb(attn, 0.3)  # off the init, so every part (LN affine, biases, rel table) matters
    x = torch.randn(3, seq_len, 16, dtype=torch.float64)
    valid = None
    if padded:
        valid = torch.ones(3, seq_len, dtype=torch.bool)
        valid[1, seq_len // 2:] = False
        valid[2, 1:4] = False  # holes, not only a padded tail
    window = min(window, seq_len)
    with torch.no_grad():
        fast = attn(x, valid, window, shift)
        dense = _dense_window_reference(attn, x, valid, window, shift)
    real = valid if valid is not None else torch.ones(3, seq_len, dtype=torch.bool)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast[real], dense[real], rtol=0, atol=1e-10)



@pytest.mark.parametrize('dp_rank', [0, 3])
@pytest.mark.parametrize('seq_len,window,shift,batch', [(24, 8, 0, 1), (29, 8, 3, 3), (6, 6, 0, 2), (20, 5, 2, 3)])
def test_window_attention_gradients_match_dense_reference_fp64(dp_rank, seq_len, window, shift, batch):
    """Input and parameter gradients (the relative position table among them) in training mode against the dense
    masked reference; padded keys in holes (no window or region is all padding, where the reference has no
    softmax), and padded query rows carry no loss."""
    torch.manual_seed(0)
    attn = WindowAttention1d(16, 2, window_size=8, dp_rank=dp_rank).double().train()
    perturb(attn, 0.3)
    x = torch.randn(batch, seq_len, 16, dtype=torch.float64)
    valid = None
    if batch > 1:
        valid = torch.ones(batch, seq_len, dtype=torch.bool)
        valid[1, 2:4] = False
        valid[-1, seq_len - 1] = False
    weight = torch.randn(batch, seq_len, 16, dtype=torch.float64)
    if valid is not None:
        weight = weight * valid[:, :, None]

    def grads(fn):
        attn.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        (fn(xg) * weight).sum().backward()
        return {'x': xg.grad, **{n: p.grad for n, p in attn.named_parameters()}}

    fast = grads(lambda t: attn(t, valid, window, shift))
    dense = grads(lambda t: _dense_window_reference(attn, t, valid, window, shift))
    assert fast.keys() == dense.keys()
    for name in fast:
        torch.testing.assert_close(fast[name], dense[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f'{n}: {m}')

@pytest.mark.parametrize('attn', ['window', 'ls'])
def test_padding_invariance(attn):
    torch.manual_seed(0)
    model = _small(attn).eval()
    lengths = [300, 217, 41]
    x = torch.randint(1, 40, (3, 300))
    mask = torch.arange(300)[None] < torch.tensor(lengths)[:, None]
    x2 = torch.where(mask, x, torch.randint(1, 40, x.shape))  # other content in the padding
    with torch.no_grad():
        out = model(x, mask)
        out2 = model(x2, mask)
        alone = model(x[1:2], mask[1:2])
        # a length that is not a multiple of the window, padded further to one that is: same logits
        short = model(x[1:2, :217])
        longer = model(torch.cat([x[1:2, :217], torch.zeros(1, 23, dtype=torch.long)], 1), mask[1:2, :240])
        # pad_token_id instead of a mask
        pad_model = _small(attn, pad_token_id=0).eval()
        pad_model.load_state_dict(model.state_dict())
        via_id = pad_model(torch.where(mask, x, 0))
        all_pad = model(x[:1], torch.zeros(1, 300, dtype=torch.bool))
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(out[1:2], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(short, longer, rtol=0, atol=1e-6)
    torch.testing.assert_close(via_id, out, rtol=0, atol=1e-6)
    assert torch.isfinite(all_pad).all()


@pytest.mark.parametrize('attn', ['window', 'ls'])
def test_train_step_finite_gradients(attn):
    torch.manual_seed(0)
    model = _small(attn, drop_path_rate=0.1).train()
    x = torch.randint(0, 40, (2, 200))
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    y = torch.tensor([1, 3])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = F.cross_entropy(model(x, mask), y)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # every weight takes part (the unused padding embeddings aside)
    zero = [n for n, g in grads.items() if g.abs().sum() == 0 and n != 'embed.weight']
    assert not zero, zero
    opt.step()
    model.eval()
    with torch.no_grad():
        assert F.cross_entropy(model(x, mask), y) < loss


@pytest.mark.parametrize('attn', ['window', 'ls'])
def test_bf16_autocast_forward(attn):
    """bf16 autocast and a pure bf16 copy stay within 2e-2 of the fp32 features' largest value (measured 0.9-1.2e-2),
    the pure copy's logits within 3e-2 of the largest fp32 logit (measured 2.1e-2 and 0.9e-2: a random head's small
    logits are differences of larger features)."""
    torch.manual_seed(0)
    model = _small(attn).eval()
    x = torch.randint(0, 40, (2, 257))
    mask = torch.ones(2, 257, dtype=torch.bool)
    mask[0, 100:] = False
    with torch.no_grad():
        ref, _, feats = model.forward_intermediates(x, mask)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            low, _, feats_low = model.forward_intermediates(x, mask)
        pure = _small(attn).eval()
        pure.load_state_dict(model.state_dict())
        pure = pure.to(torch.bfloat16)
        pure_feats, _, _ = pure.forward_intermediates(x, mask)
        logits_pure = pure(x, mask)
        logits = model(x, mask)
    assert low.dtype == pure_feats.dtype == logits_pure.dtype == torch.bfloat16
    scale = float(ref.abs().max())
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=2e-2 * scale)
    torch.testing.assert_close(pure_feats.float(), ref, rtol=0, atol=2e-2 * scale)
    torch.testing.assert_close(logits_pure.float(), logits, rtol=0, atol=3e-2 * float(logits.abs().max()))


def test_flat_encoder_and_errors():
    torch.manual_seed(0)
    flat = create_model('hsw_flat_tiny', vocab_size=40, num_classes=5, max_len=128).eval()
    assert len(flat.blocks) == len(create_model('hsw_tiny', device='meta').stages) * 2
    x = torch.randint(0, 40, (2, 100))
    mask = torch.ones(2, 100, dtype=torch.bool)
    mask[1, 60:] = False
    with torch.no_grad():
        out = flat(x, mask)
        out2 = flat(torch.where(mask, x, 7), mask)
    torch.testing.assert_close(out, out2, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match='max_len'):
        flat(torch.randint(0, 40, (1, 129)))
    model = _small()
    with pytest.raises(ValueError, match='vocab_size'):
        model(torch.tensor([[1, 2, 40]]))
    with pytest.raises(ValueError, match='integer'):
        model(torch.randn(1, 10))
    with pytest.raises(ValueError, match="'window' or 'ls'"):
        _small('full')


def test_window_arguments_are_checked():
    attn = WindowAttention1d(16, 2, window_size=8)
    with pytest.raises(ValueError, match='window_size'):
        attn(torch.randn(1, 32, 16), window=16)
    with pytest.raises(ValueError, match='shift'):
        attn(torch.randn(1, 32, 16), window=8, shift=8)


def _demo_options(**kwargs) -> dict:
    """The options the long-document demo adds to the paper's HSW (byte patches, mean-path merges, fc_norm, avg+max
    pool)."""
    return dict(dict(patch_size=4, patch_embed_dim=8, merge_init='mean', fc_norm=True, global_pool='catavgmax'),
                **kwargs)


def test_patch_embedding_stage_shapes_and_feature_info():
    model = _small(**_demo_options()).eval()
    assert [f['reduction'] for f in model.feature_info] == [4, 16, 64, 256]
    with torch.no_grad():
        feats = model.forward_intermediates(torch.randint(0, 40, (2, 1000)), intermediates_only=True)
        pooled = model.forward_head(*model.forward_features(torch.randint(0, 40, (2, 1000))), pre_logits=True)
    assert [tuple(f.shape) for f in feats] == [(2, 250, 16), (2, 63, 32), (2, 16, 64), (2, 4, 128)]
    assert model.head_hidden_size == 256 and pooled.shape == (2, 256)
    model.reset_classifier(7)
    assert model(torch.randint(0, 40, (1, 64))).shape == (1, 7)
    # the paper's configuration keeps its names (no patch merge before stage 1, no fc_norm parameters)
    assert not any(n.startswith(('patch_embed.', 'fc_norm.')) for n, _ in _small().named_parameters())


@pytest.mark.parametrize('attn', ['window', 'ls'])
def test_demo_options_padding_invariance(attn):
    """Byte patches that straddle the end of a document, and the max pool, ignore padding."""
    torch.manual_seed(0)
    model = _small(attn, **_demo_options()).eval()
    x = torch.randint(1, 40, (2, 300))
    mask = torch.arange(300)[None] < torch.tensor([300, 197])[:, None]
    x2 = torch.where(mask, x, torch.randint(1, 40, x.shape))
    with torch.no_grad():
        out, out2 = model(x, mask), model(x2, mask)
        short = model(x[1:2, :197])
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(out[1:2], short, rtol=0, atol=1e-6)


def test_mean_merge_init_passes_the_token_sum():
    from lsvision.sequence.hsw import PatchMerging1d
    torch.manual_seed(0)
    merge = PatchMerging1d(6, 12)
    merge.init_mean_path()
    x = torch.randn(2, 8, 6)
    out, _ = merge(x)
    normed = merge.norm(x.reshape(2, 2, 24))
    torch.testing.assert_close(out[..., :6], normed.reshape(2, 2, 4, 6).sum(2) / 2)
    assert out[..., 6:].abs().max() > 0  # the other channels stay random
    with pytest.raises(ValueError, match='merge_init'):
        _small(merge_init='zeros')
    with pytest.raises(ValueError, match='global_pool'):
        _small(global_pool='max')


def test_demo_options_train_step_finite_gradients():
    torch.manual_seed(0)
    model = _small(**_demo_options()).train()
    x = torch.randint(0, 40, (2, 200))
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, 150:] = False
    loss = F.cross_entropy(model(x, mask), torch.tensor([1, 3]))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
