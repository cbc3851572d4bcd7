"""LRA and char-LM sequence models: parameter counts, shapes, causality through the model (spec sequence.md §6)."""
import pytest
import torch
from _helpers import perturb

import lsvision.sequence as seq
from lsvision.flops import parameter_count


@pytest.mark.parametrize('name,kwargs,params', [
    ('ls_lra_listops', {}, 249_418), ('ls_lra_text', {}, 379_458), ('ls_lra_retrieval', {}, 404_034),
    ('ls_lra_listops', dict(window_size=16, dp_rank=2), 241_618),
    ('ls_lra_text', dict(window_size=1, dp_rank=1), 371_398),
    ('ls_lra_retrieval', dict(window_size=1, dp_rank=254), 461_754),
])
def test_lra_parameter_counts(name, kwargs, params):
    assert parameter_count(seq.create_model(name, **kwargs)) == params


@pytest.mark.parametrize('name,params', [
    ('ls_lm_enwik8_small', 44_294_448), ('ls_lm_enwik8_large', 110_576_064), ('ls_lm_text8_small', 44_204_160)])
def test_char_lm_parameter_counts(name, params):
    with torch.device('meta'):  # full size: count only, no memory or init time
        model = seq.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    assert sum(p.numel() for p in model.blocks[0].parameters()) == 3_682_312
    assert sum(p.numel() for p in model.blocks[0].attn.parameters()) == 1_580_552


def test_registry_lists_every_model_and_counterpart():
    names = seq.list_models()
    for base in ('lra_listops', 'lra_text', 'lra_retrieval', 'lm_enwik8_small', 'lm_enwik8_large', 'lm_text8_small'):
        assert f'ls_{base}' in names and f'full_{base}' in names
    for base in ('lra_listops', 'lra_text', 'lra_retrieval'):  # GRC-Attention (Cached Transformers), both kinds
        assert f'grc_{base}' in names and f'ls_grc_{base}' in names


@pytest.mark.parametrize('name,base', [
    ('grc_lra_listops', 'full_lra_listops'), ('grc_lra_text', 'full_lra_text'),
    ('grc_lra_retrieval', 'full_lra_retrieval'), ('ls_grc_lra_listops', 'ls_lra_listops'),
    ('ls_grc_lra_text', 'ls_lra_text'), ('ls_grc_lra_retrieval', 'ls_lra_retrieval')])
def test_grc_lra_parameter_counts(name, base):
    """The counterpart's parameters plus, per block (2), one GRC layer at D = 64, 2 heads, D_m = 32: the gates
    W_r, W_u, W_c (2 D_m -> D_m) and the candidate LN, the memory attention q, kv, proj at width D_m, lam (one per
    head) and the PE conv (kernel 3, groups D_m); the cache is a buffer (T_m = max_len, + 1 cls slot last)."""
    D, H, dm = 64, 2, 32
    gates = 3 * (2 * dm * dm + dm) + 2 * dm
    memory = (dm * dm + dm) + (dm * 2 * dm + 2 * dm) + (dm * dm + dm)
    pe = D * (D // dm) * 3 + D
    model = seq.create_model(name)
    assert parameter_count(model) == parameter_count(seq.create_model(base)) + 2 * (gates + memory + H + pe)
    max_len = model.encoder.max_len
    assert [b.attn.grc.cache.shape for b in model.encoder.blocks] == [(1, max_len, dm), (1, max_len + 1, dm)]


def test_lra_shapes_and_full_counterparts():
    torch.manual_seed(0)
    ids = torch.randint(1, 15, (2, 2048))
    ids[1, 1500:] = 0
    for name in ('ls_lra_listops', 'full_lra_listops'):
        model = seq.create_model(name).eval()
        with torch.no_grad():
            out = model(ids)
        assert out.shape == (2, 10) and torch.isfinite(out).all()
    docs = torch.randint(1, 200, (2, 4096))
    model = seq.create_model('ls_lra_retrieval').eval()
    with torch.no_grad():
        assert model(docs, docs.flip(0)).shape == (2, 2)
    with pytest.raises(ValueError, match='longer than max_len'):
        seq.create_model('ls_lra_listops')(torch.ones(1, 3000, dtype=torch.long))


def test_lra_cls_only_in_last_layer_and_padding_invariance():
    torch.manual_seed(0)
    model = perturb(seq.create_model('ls_lra_listops', max_len=128), 0.05).eval()
    seen = []
    for blk in model.encoder.blocks:
        blk.attn.register_forward_hook(lambda m, a, o: seen.append(o.shape[1]))
    ids = torch.randint(1, 15, (2, 100))
    ids[:, 90:] = 0
    with torch.no_grad():
        a = model(ids)
        assert seen == [100, 101]  # earlier layers see no cls; the last one returns it first
        ids2 = torch.cat([ids, torch.zeros(2, 20, dtype=torch.long)], 1)  # more padding: same logits
        torch.testing.assert_close(model(ids2), a, rtol=1e-5, atol=1e-6)


def _tiny_lm(**kw):
    cfg = dict(vocab_size=32, dim=64, depth=3, num_heads=4, mlp_hidden=128, window_size=16, segment_size=4,
               dp_rank=1, mem_len=32, drop=0.1, query_chunk_size=16)
    cfg.update(kw)
    return seq.CharLM(**cfg)


@pytest.mark.parametrize('train', [False, True])
@pytest.mark.parametrize('cache_mode', ['official', 'masked'])
def test_char_lm_no_future_leak_with_filled_cache(train, cache_mode):
    """d log p_t / d emb_s == 0 exactly for s > t through 3 layers with a filled cache; train and eval mode."""
    torch.manual_seed(0)
    model = _tiny_lm(cache_mode=cache_mode).train(train)
    L = 32
    with torch.no_grad():
        _, state = model(torch.randint(0, 32, (1, L)))  # fill the caches
    assert all(c.shape == (1, 32, 64) and not c.requires_grad for c in state.caches)
    emb = {}

    def keep(module, args, out):
        emb['out'] = out

    model.embed.register_forward_hook(keep)
    torch.manual_seed(1)
    logp, _ = model(torch.randint(0, 32, (1, L)), state)
    for t in (0, L // 3, L - 2):
        (g,) = torch.autograd.grad(logp[0, t].logsumexp(-1) + logp[0, t, 3], emb['out'], retain_graph=True)
        assert g[0, t + 1:].abs().max() == 0.0, t
        assert g[0, :t + 1].abs().sum() > 0
    # position 0 depends on every cache slot of the first layer
    state_req = type(state)([c.clone().requires_grad_(True) for c in state.caches], state.valid_len)
    logp, _ = model(torch.randint(0, 32, (1, L)), state_req)
    (gc,) = torch.autograd.grad(logp[0, 0, 5], state_req.caches[0])
    assert (gc[0].abs().sum(-1) > 0).all()


def test_char_lm_shapes_state_and_cache_rules():
    torch.manual_seed(0)
    model = _tiny_lm(cache_mode='official').eval()
    ids = torch.randint(0, 32, (2, 48))
    with torch.no_grad():
        logp, state = model(ids)
    assert logp.shape == (2, 48, 32) and state.valid_len is None
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2, 48))
    assert len(state.caches) == 3 and state.caches[0].shape == (2, 32, 64)
    # next cache = last M of [cache; raw layer input] (layer 0: the scaled embeddings)
    torch.testing.assert_close(state.caches[0], model.embed(ids[:, -32:]) * 8.0)
    masked = _tiny_lm(cache_mode='masked').eval()
    with torch.no_grad():
        _, st = masked(ids[:, :20])
        assert st.valid_len == 20
        _, st = masked(ids[:, 20:], st)
        assert st.valid_len == 32
    # official cache layout needs M >= W and M % l == 0
    bad = _tiny_lm(cache_mode='official', mem_len=8)
    with pytest.raises(ValueError, match='masked-cache extension'):
        bad(ids)
    assert _tiny_lm(cache_mode='masked', mem_len=10)(ids)[0].shape == (2, 48, 32)
    # the full-attention counterpart, same interface
    full = seq.create_model('full_lm_text8_small', dim=64, depth=2, num_heads=4, mlp_hidden=128, max_len=64)
    out, st = full(ids)
    assert out.shape == (2, 48, 32) and st is None


def test_char_lm_prenorm_block_and_bf16():
    torch.manual_seed(0)
    model = _tiny_lm(block='prenorm', drop=0.).eval()
    ids = torch.randint(0, 32, (2, 40))
    with torch.no_grad():
        ref, _ = model(ids)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out, _ = model(ids)
    assert torch.isfinite(out).all()
    assert (out.exp() - ref.exp()).abs().max() < 2e-2


def _tiny_hsw(**kw):
    from lsvision.sequence.hsw import HSW
    cfg = dict(vocab_size=40, num_classes=5, embed_dim=16, head_dim=8, window_size=8, drop_path_rate=0.)
    cfg.update(kw)
    return HSW(**cfg)


@pytest.mark.parametrize('build,vocab_size,family', [
    (lambda **kw: seq.create_model('ls_lra_listops', **kw), 512, 'this LRA encoder'),
    (lambda **kw: seq.create_model('ls_grc_lra_listops', **kw), 512, 'this LRA encoder'),
    (lambda **kw: _tiny_lm(**kw), 32, 'this character LM'),
    (lambda **kw: _tiny_hsw(**kw), 40, 'this HSW'),
], ids=['lra', 'grc_lra', 'char_lm', 'hsw'])
def test_token_id_outside_the_vocabulary_is_explained_and_the_hint_works(build, vocab_size, family):
    torch.manual_seed(0)
    ids = torch.randint(1, 10, (2, 16))
    ids[1, 5] = vocab_size + 3
    model = build().eval()
    with pytest.raises(ValueError) as e:
        model(ids)
    assert str(e.value).startswith(f'token ids must be in [0, {vocab_size}): {family} has a vocabulary of '
                                   f'{vocab_size} tokens (vocab_size={vocab_size}), got ids in [1, {vocab_size + 3}]. '
                                   f'Build it with vocab_size={vocab_size + 4} or more')
    with pytest.raises(ValueError, match=r'got ids in \[-1, '):
        model(ids.masked_fill(ids == 2, -1))
    with pytest.raises(ValueError, match=r'integer dtype, got \(2, 16\) torch.float32'):
        model(ids.float())
    with torch.no_grad():  # following the hint
        out = build(vocab_size=vocab_size + 4).eval()(ids)
    assert torch.isfinite(out[0]).all()
