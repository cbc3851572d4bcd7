"""Transformer-XL and its GRC-cached version (lsvision.sequence.transformer_xl): sizes against the paper, causality
with memory and cache, the memory as attention over the stopped-gradient past, the GRC chain over segments against
a restated update, padding kept out of memories and caches, and no state kept in the module."""
import pytest
import torch
import torch.nn.functional as F

import lsvision.sequence as seq
from lsvision.layers import sinusoid_positions
from lsvision.sequence.transformer_xl import AdaptiveLogSoftmax, GrcStreamState, RelPartialLearnableAttention, TxlState

TINY = dict(vocab_size=40, dim=32, depth=2, num_heads=2, head_dim=16, mlp_hidden=48, cutoffs=(8, 20), drop=0.)


def tiny(memory: str = 'xl', **kwargs) -> seq.TransformerXL:
    torch.manual_seed(0)
    model = seq.TransformerXL(memory=memory, **dict(TINY, **kwargs)).double().eval()
    for g in model.grc_layers():  # a start that is not 0.5 everywhere, so that the mix weights are exercised
        g.lam.data.normal_()
    return model


def test_wt103_base_parameter_counts_match_the_paper():
    # Transformer-XL's run_wt103_base.sh: 16 x (qkv 3*410*410, r_net and o_net 410*410, FFN 410-2100-410 with biases,
    # 2 LayerNorms), tied embedding 267735 x 410 with the softmax's own bias and 3 cluster logits, shared u, v
    d, ffn, vocab = 410, 2100, 267735
    layer = 3 * d * d + 2 * d * d + (d * ffn + ffn + ffn * d + d) + 2 * 2 * d
    expected = vocab * d + 16 * layer + 2 * 10 * 41 + vocab + 3 * d + 3
    with torch.device('meta'):
        base = seq.create_model('txl_wt103_base')
        grc = seq.create_model('grc_txl_wt103_base')
    count = sum(p.numel() for p in base.parameters())
    assert count == expected == 151_107_538
    assert round(count / 1e6) == 151  # the paper's Table 1 (WikiText-103, Transformer-XL standard)
    # GRC per layer at D_m = 200 (20 of 41 channels per head): gates 3 x (400 x 200 + 200), candidate LN, memory
    # q / kv / proj, one mixing logit per head
    dm = 200
    grc_layer = 3 * (2 * dm * dm + dm) + 2 * dm + (dm * dm + dm) + (2 * dm * dm + 2 * dm) + (dm * dm + dm) + 10
    assert sum(p.numel() for p in grc.parameters()) == expected + 16 * grc_layer
    assert [g.cache.shape for g in grc.grc_layers()] == [torch.Size([1, 150, dm])] * 16
    assert all(g.pe is None for g in grc.grc_layers())
    # the GRC model keeps Transformer-XL's names and shapes: an uncached checkpoint loads with only `.grc.` missing
    plain, cached = base.state_dict(), grc.state_dict()
    assert all(cached[k].shape == v.shape for k, v in plain.items())
    assert set(cached) - set(plain) and all('.attn.grc.' in k for k in set(cached) - set(plain))


def test_adaptive_softmax_is_a_distribution_and_nll_reads_it():
    torch.manual_seed(0)
    crit = AdaptiveLogSoftmax(16, 40, (8, 20)).double()
    torch.nn.init.normal_(crit.cluster_weight)
    torch.nn.init.normal_(crit.bias)
    weight = torch.randn(40, 16, dtype=torch.float64)
    hidden = torch.randn(30, 16, dtype=torch.float64)
    logp = crit.log_prob(hidden, weight)
    torch.testing.assert_close(logp.exp().sum(1), torch.ones(30, dtype=torch.float64))
    target = torch.arange(30) % 40 + torch.tensor([0, 10] * 15)
    torch.testing.assert_close(crit.nll(hidden, target, weight), -logp.gather(1, target[:, None]).squeeze(1))
    plain = AdaptiveLogSoftmax(16, 40, ()).double()
    torch.testing.assert_close(plain.log_prob(hidden, weight), F.log_softmax(hidden @ weight.t(), -1))
    with pytest.raises(ValueError, match='cutoffs=\\(\\) for a plain softmax'):
        AdaptiveLogSoftmax(16, 40, (20, 8))


def test_adaptive_input_log_probs_are_a_distribution_that_nll_reads():
    # div_val 2: the adaptive input's cluster weights and tail projections in the softmax, the head's own projection
    model = tiny(div_val=2)
    with torch.no_grad():
        model.crit.bias.normal_()
    ids = torch.arange(36).view(2, 18) + torch.tensor([[0], [4]])
    targets = (ids * 7 + 3) % 40
    logp, _ = model(ids)
    nll, _ = model(ids, targets)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 18, dtype=torch.float64))
    torch.testing.assert_close(nll, -logp.gather(-1, targets[..., None]).squeeze(-1))
    assert [tuple(p.shape) for p in model.embed.projs] == [(32, 32), (32, 16), (32, 8)]
    with pytest.raises(ValueError, match='needs cutoffs and div_val >= 2'):
        seq.TransformerXL(**dict(TINY, cutoffs=(), div_val=2))


def _rel_shift(x):
    """The authors' `_rel_shift` (pad a zero column, re-view, drop the first row), restated batch-first."""
    B, H, q, k = x.shape
    padded = torch.cat([x.new_zeros(B, H, q, 1), x], dim=-1).view(B, H, k + 1, q)
    return padded[:, :, 1:].reshape(B, H, q, k)


def test_relative_attention_equals_the_authors_formulation():
    torch.manual_seed(0)
    B, L, M, D, H, dh = 2, 5, 3, 16, 2, 8
    attn = RelPartialLearnableAttention(D, H, dh).double()
    x, mem = torch.randn(B, L, D, dtype=torch.float64), torch.randn(B, M, D, dtype=torch.float64)
    u, v = torch.randn(H, dh, dtype=torch.float64), torch.randn(H, dh, dtype=torch.float64)
    pos_emb = sinusoid_positions(torch.arange(M + L - 1, -1, -1.), D, torch.float64)
    keep = torch.ones(L, M + L, dtype=torch.bool).tril(M)[None]
    out = attn(x, pos_emb, u, v, keep, mem)
    # mem_transformer.py: AC = (q + r_w_bias) k, BD = rel_shift((q + r_r_bias) r_net(pos)), (AC + BD) * scale, the
    # keys past i + M masked, softmax over the keys, then o_net
    heads = lambda t: t.view(B, -1, H, dh).transpose(1, 2)  # noqa: E731
    w = attn.qkv.weight
    q, k, val = heads(x @ w[:D].t()), heads(torch.cat([mem, x], 1) @ w[D:2 * D].t()), heads(
        torch.cat([mem, x], 1) @ w[2 * D:].t())
    r = (pos_emb @ attn.r_net.weight.t()).view(M + L, H, dh).transpose(0, 1)
    ac = (q + u[:, None]) @ k.transpose(-1, -2)
    bd = _rel_shift((q + v[:, None]) @ r.transpose(-1, -2)[None])
    score = ((ac + bd) * dh ** -0.5).masked_fill(~keep[:, None], float('-inf'))
    ref = (score.softmax(-1) @ val).transpose(1, 2).reshape(B, L, H * dh) @ attn.proj.weight.t()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def _segments(n: int, length: int, batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 40, (batch, length), generator=g) for _ in range(n)]


@pytest.mark.parametrize('memory', ['xl', 'grc'])
def test_a_future_token_never_changes_an_earlier_output(memory):
    model = tiny(memory, mem_len=8)
    s1, s2 = _segments(2, 8)
    with torch.no_grad():
        logp1, state = model(s1)
        ref, _ = model(s2, state=state)
        for k in (0, 3, 7):  # change the k-th token of the second segment
            changed = s2.clone()
            changed[:, k] = (changed[:, k] + 1) % 40
            out, _ = model(changed, state=state)
            torch.testing.assert_close(out[:, :k], ref[:, :k], rtol=0, atol=1e-12)
            assert (out[:, k:] - ref[:, k:]).abs().amax() > 1e-6
        # the past reaches the segment through the memory / the cache (so the checks above see the carried state)
        other = s1.clone()
        other[:, 0] = (other[:, 0] + 1) % 40
        _, other_state = model(other)
        out, _ = model(s2, state=other_state)
        assert (out - ref).abs().amax() > 1e-6
        # and within the first segment, no later token of it changes an earlier output
        changed = s1.clone()
        changed[:, 5] = (changed[:, 5] + 1) % 40
        torch.testing.assert_close(model(changed)[0][:, :5], logp1[:, :5], rtol=0, atol=1e-12)


def test_memory_is_attention_over_the_concatenated_past_with_the_gradient_stopped():
    model = tiny('xl', mem_len=6)
    s1, s2 = _segments(2, 6)
    t2 = torch.roll(s2, -1, dims=1)
    nll1, state = model(s1, torch.roll(s1, -1, 1))
    assert all(m.grad_fn is None and not m.requires_grad and m.shape == (2, 6, 32) for m in state.mems)
    nll2, _ = model(s2, t2, state)
    nll2.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # reference: one segment of 12 tokens without memory, whose first 6 positions enter every layer detached
    def detach_past(module, args):
        x = args[0]
        return (torch.cat([x[:, :6].detach(), x[:, 6:]], dim=1),) + args[1:]
    hooks = [b.attn.register_forward_pre_hook(detach_past) for b in model.blocks]
    full, _ = model(torch.cat([s1, s2], 1), torch.cat([torch.roll(s1, -1, 1), t2], 1))
    torch.testing.assert_close(full[:, 6:], nll2, rtol=0, atol=1e-10)
    full[:, 6:].sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=1e-10, msg=n)
    for h in hooks:
        h.remove()
    # without the stop the gradients differ: the check above can tell
    model.zero_grad()
    full, _ = model(torch.cat([s1, s2], 1), torch.cat([torch.roll(s1, -1, 1), t2], 1))
    full[:, 6:].sum().backward()
    assert max((p.grad - grads[n]).abs().max() for n, p in model.named_parameters()) > 1e-6


def _restated_update(grc, cache, summary):
    """GRC's gated update (Cached Transformers Eqs. 4-5 with the authors' GELU + LN candidate), restated."""
    cat = torch.cat([cache, summary], -1)
    g_r = torch.sigmoid(cat @ grc.linear_reset.weight.t() + grc.linear_reset.bias)
    g_u = torch.sigmoid(cat @ grc.linear_update.weight.t() + grc.linear_update.bias)
    cand = torch.cat([g_r * cache, summary], -1) @ grc.linear_candidate.weight.t() + grc.linear_candidate.bias
    cand = F.layer_norm(F.gelu(cand), (cand.shape[-1],), grc.norm_candidate.weight, grc.norm_candidate.bias)
    return g_u * cand + (1 - g_u) * cache


def test_grc_state_over_k_segments_equals_the_unrolled_updates():
    model = tiny('grc', mem_len=5)  # segments of 5 tokens fill the 5 slots one to one
    segs = _segments(4, 5)
    summaries = []  # per segment, per layer: the first D_m channels of the layer's self-attention output
    hooks = [b.attn.register_forward_hook(lambda m, a, out: summaries.append(out[2])) for b in model.blocks]
    state = model.init_state(2)
    assert not state.pending.any()
    with torch.no_grad():
        for s in segs:
            _, state = model(s, state=state)
    for h in hooks:
        h.remove()
    grcs = model.grc_layers()
    for layer, grc in enumerate(grcs):
        cache = grc.cache.expand(2, -1, -1).double()
        for t in range(len(segs) - 1):  # C_{k-1}: the k-1 summaries before the last one written in
            cache = _restated_update(grc, cache, summaries[t * len(grcs) + layer])
        torch.testing.assert_close(state.caches[layer], cache, rtol=0, atol=1e-12)
        torch.testing.assert_close(state.summaries[layer], summaries[-len(grcs) + layer], rtol=0, atol=0)
    assert state.pending.all()
    # the layer's own buffer never moved (the state is carried by the caller)
    assert all(g.cache.abs().max() == 0 for g in grcs)


def test_grc_gates_learn_through_the_segment_that_reads_the_cache():
    model = tiny('grc', mem_len=5).train()
    s1, s2, s3 = _segments(3, 5)
    _, state = model(s1, s1)
    _, state = model(s2, s2, state)  # C_1 = GRC(0, S_1): from here on the reset gate acts on a nonzero cache
    nll, _ = model(s3, s3, state)
    nll.sum().backward()
    for g in model.grc_layers():
        for lin in (g.linear_reset, g.linear_update, g.linear_candidate):
            assert lin.weight.grad.abs().max() > 0
    assert all(c.grad_fn is None for c in state.caches + state.summaries)


@pytest.mark.parametrize('memory', ['xl', 'grc'])
def test_padding_never_enters_a_memory_or_a_cache(memory):
    model = tiny(memory, mem_len=6)
    s1, s2 = _segments(2, 6)
    n_real = 4  # stream 1 ends after 4 tokens of the first segment, padded with arbitrary ids
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, n_real:] = False
    with torch.no_grad():
        outs = []
        for pad in (0, 17):
            padded = s1.clone()
            padded[1, n_real:] = pad
            nll, state = model(padded, torch.roll(padded, -1, 1), mask=mask)
            assert (nll[1, n_real:] == 0).all()
            outs.append(model(s2, state=state)[0])
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        # stream 1 alone, unpadded, gives the same next segment
        _, alone = model(s1[1:, :n_real])
        ref, _ = model(s2[1:], state=alone)
    torch.testing.assert_close(outs[0][1:], ref, rtol=0, atol=1e-12)
    if memory == 'xl':
        assert state.valid[1].sum() == n_real and state.valid[0].all()


@pytest.mark.parametrize('memory', ['xl', 'grc'])
def test_outputs_are_a_function_of_parameters_inputs_and_state(memory):
    model = tiny(memory, mem_len=6).train()  # train mode, dropout 0: nothing may be stored on the way
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s1, s2 = _segments(2, 6)
    _, state = model(s1, s1)
    a, state_a = model(s2, s2, state)
    a.sum().backward()
    _, _ = model(s2, s2, state)  # an unrelated call between the two
    b, state_b = model(s2, s2, state)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for x, y in zip(state_a, state_b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_wrong_state_is_explained_and_the_hint_works():
    xl, grc = tiny('xl'), tiny('grc', mem_len=6)
    s = _segments(1, 6)[0]
    _, xl_state = xl(s)
    with pytest.raises(TypeError, match='start with init_state\\(\\) or None'):
        grc(s, state=xl_state)
    _, grc_state = grc(s, state=None)  # following the hint
    assert isinstance(grc_state, GrcStreamState) and isinstance(xl_state, TxlState)
    with pytest.raises(ValueError, match='longer than the GRC cache'):
        grc(_segments(1, 7)[0], state=grc_state)
    with pytest.raises(ValueError, match='must match the ids'):
        xl(s, mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="memory must be 'xl'"):
        seq.create_model('txl_tiny', vocab_size=10, memory='lstm')


def test_an_id_outside_the_vocabulary_names_its_size():
    model = tiny('xl')
    V = model.embed.num_embeddings
    with pytest.raises(ValueError, match=rf'must be in \[0, {V}\): TransformerXL has a vocabulary of {V} tokens'):
        model(torch.tensor([[1, V]]))
    model(torch.tensor([[1, V - 1]]))  # the largest id the message allows runs
