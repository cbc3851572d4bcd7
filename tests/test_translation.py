"""The translation Transformer (pre-norm, plain and GRC), its decoding, BLEU, checkpoint averaging and the demo data.

Generated data only: random token ids and the rule-based demo task of lsvision.data.parallel_text.
"""
import math
import random

import pytest
import torch
import torch.nn.functional as F

import lsvision.sequence as seq
from lsvision.data.parallel_text import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SubwordVocab,
    demo_pair,
    english_number,
    german_number,
    read_parallel,
    write_demo_task,
)
from lsvision.layers import GatedRecurrentCache1d, GrcConfig
from lsvision.sequence.translation import IWSLT14_DE_EN_VOCAB, SentenceGrc
from lsvision.train.checkpoint import save_atomic
from lsvision.train.translation import (
    average_checkpoints,
    beam_search,
    corpus_bleu,
    greedy_decode,
    inverse_sqrt_factor,
    label_smoothed_loss,
    token_batches,
)

V = 23
TINY = dict(src_vocab_size=V, tgt_vocab_size=V, dim=32, encoder_depth=2, decoder_depth=2, num_heads=4, ffn_dim=48,
            drop=0.)


def tiny(grc: bool = True, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    name = 'grc_transformer_iwslt_de_en_prenorm' if grc else 'transformer_iwslt_de_en_prenorm'
    extra = dict(grc_cache_len=8) if grc else {}
    model = seq.create_model(name, **{**TINY, **extra, **kw}).to(dtype)
    if grc:  # a cache that is not zero, as after training
        for m in model.modules():
            if isinstance(m, GatedRecurrentCache1d):
                m.cache.normal_()
    return model.eval()


def sources(batch=3, n=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (batch, n), generator=gen)
    src[:, -1] = EOS_ID
    src[1, 5:] = PAD_ID  # a shorter sentence, right-padded
    src[1, 4] = EOS_ID
    return src


def test_parameter_counts_match_the_iwslt_configuration():
    """6 + 6 layers, D 512, 4 heads, FFN 1024, IWSLT14 De-En's fairseq dictionaries (8848 De / 6632 En), decoder input
    and output embeddings tied: fairseq's transformer_iwslt_de_en has 39,469,056 parameters; normalize-before adds
    the two final LayerNorms (2 x 1024)."""
    D, F_, Vs, Vt = 512, 1024, *IWSLT14_DE_EN_VOCAB
    attn, ffn, ln = 4 * (D * D + D), D * F_ + F_ + F_ * D + D, 2 * D
    encoder = 6 * (attn + ffn + 2 * ln) + ln
    decoder = 6 * (2 * attn + ffn + 3 * ln) + ln
    expected = Vs * D + Vt * D + encoder + decoder
    assert expected == 39_469_056 + 2 * ln
    def count(name: str, **kw) -> int:
        with torch.device('meta'):  # shapes only: no memory, no initialization
            return sum(p.numel() for p in seq.create_model(name, **kw).parameters())

    assert count('transformer_iwslt_de_en_prenorm') == expected
    # GRC in each of the 6 encoder self-attentions, D_m = 256: 3 gate linears (2 D_m -> D_m), candidate LN, memory
    # attention (q D_m->D_m, kv D_m->2 D_m, proj), lam (4 heads), PE Conv1d(D, D, 3, groups D_m)
    dm = D // 2
    grc = 3 * (2 * dm * dm + dm) + 2 * dm + 4 * (dm * dm + dm) + 4 + (D * 2 * 3 + D)
    assert count('grc_transformer_iwslt_de_en_prenorm') == expected + 6 * grc
    with torch.device('meta'):
        model = seq.create_model('grc_transformer_iwslt_de_en_prenorm')
    caches = [m for m in model.modules() if isinstance(m, SentenceGrc)]
    assert len(caches) == 6 and all(m.cache.shape == (1, 64, dm) for m in caches)
    # untied output projection; one joint vocabulary shared by all three
    assert count('transformer_iwslt_de_en_prenorm', share_decoder_input_output_embed=False) == expected + Vt * D
    assert count('transformer_iwslt_de_en_prenorm', src_vocab_size=10000, tgt_vocab_size=10000,
                 share_all_embeddings=True) == expected - (Vs + Vt) * D + 10000 * D


def test_bad_options_are_explained():
    with pytest.raises(ValueError, match='one joint vocabulary'):
        seq.create_model('transformer_iwslt_de_en_prenorm', share_all_embeddings=True)
    with pytest.raises(TypeError, match='grc_transformer_iwslt_de_en_prenorm'):
        seq.create_model('transformer_iwslt_de_en_prenorm', grc_ratio=0.5)
    model = tiny(grc=False)
    with pytest.raises(ValueError, match=r'must be in \[0, 23\): the source embedding has a vocabulary of 23'):
        model(torch.full((1, 3), V), torch.full((1, 2), BOS_ID))


@pytest.mark.parametrize('grc', [False, True])
def test_incremental_decoding_equals_the_full_forward(grc):
    model = tiny(grc)
    src = sources()
    prev = torch.randint(4, V, (3, 7), generator=torch.Generator().manual_seed(1))
    prev[:, 0] = BOS_ID
    full = model(src, prev)
    enc = model.encode(src)
    state = model.start_state(enc)
    steps = []
    for t in range(prev.shape[1]):
        logits, state = model.decode(prev[:, t:t + 1], state=state)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)
    # several tokens at a time after a state
    first, state = model.decode(prev[:, :3], enc)
    rest, state = model.decode(prev[:, 3:], state=state)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=0, atol=1e-10)
    assert state.length == 7


def _log_prob(model, src, hyp):
    """Length-normalized log-probability of `hyp` + eos under the full forward."""
    out = torch.tensor([[BOS_ID] + hyp + [EOS_ID]])
    with torch.no_grad():
        lp = F.log_softmax(model(src[None], out[:, :-1]), -1)[0]
    return float(lp.gather(1, out[0, 1:, None]).sum()) / (len(hyp) + 1)


@pytest.mark.parametrize('grc', [False, True])
def test_greedy_and_beam_search_with_the_state_equal_the_full_forward(grc):
    model = tiny(grc)
    src = sources(4, 6, seed=2)
    kw = dict(max_len_a=1., max_len_b=3)
    greedy = greedy_decode(model, src, **kw)
    assert greedy == greedy_decode(model, src, incremental=False, **kw)
    hyps, scores = beam_search(model, src, beam=3, **kw)
    ref_hyps, ref_scores = beam_search(model, src, beam=3, incremental=False, **kw)
    assert hyps == ref_hyps
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(ref_scores), rtol=0, atol=1e-9)
    # the reported score is the model's own normalized log-probability of the hypothesis; beam 1 is greedy
    for i, (h, s) in enumerate(zip(hyps, scores)):
        assert EOS_ID not in h and PAD_ID not in h and BOS_ID not in h
        assert len(h) + 1 <= int((src[i] != PAD_ID).sum()) + 3
        assert s == pytest.approx(_log_prob(model, src[i], h), abs=1e-9)
    assert beam_search(model, src, beam=1, **kw)[0] == greedy


def test_decoder_is_causal():
    model = tiny(True)
    src = sources()
    prev = torch.randint(4, V, (3, 8), generator=torch.Generator().manual_seed(3))
    out = model(src, prev)
    changed = prev.clone()
    changed[:, 5] = (changed[:, 5] + 1 - 4) % (V - 4) + 4
    out2 = model(src, changed)
    torch.testing.assert_close(out2[:, :5], out[:, :5], rtol=0, atol=1e-12)
    assert (out2[:, 5:] - out[:, 5:]).abs().amax() > 1e-3


def test_sentence_grc_padding_never_enters_the_cache():
    """Garbage at padded positions changes neither the real tokens' outputs nor the stored cache (train mode)."""
    torch.manual_seed(0)
    layer = SentenceGrc(16, 2, 6, config=GrcConfig()).double()
    x, o_self = torch.randn(3, 10, 16, dtype=torch.float64), torch.randn(3, 10, 16, dtype=torch.float64)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 8:] = False
    layer.cache.normal_()
    start = layer.cache.clone()
    out = layer.train()(x, o_self, mask)
    stored = layer.cache.clone()
    x2, o2 = x.clone(), o_self.clone()
    x2[~mask] = 1e3 * torch.randn(int((~mask).sum()), 16, dtype=torch.float64)
    o2[~mask] = -1e3
    layer.cache.copy_(start)
    out2 = layer(x2, o2, mask)
    torch.testing.assert_close(out2[mask], out[mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(layer.cache, stored, rtol=0, atol=1e-12)
    assert not torch.equal(stored, start)


def test_sentence_grc_resizes_any_length():
    """Up to T_m real tokens it is GatedRecurrentCache1d; longer sentences are resized down (nearest: slot i takes
    real token floor(i L / T_m)), where GatedRecurrentCache1d refuses them."""
    torch.manual_seed(0)
    layer = SentenceGrc(16, 2, 6).double().eval()
    plain = GatedRecurrentCache1d(16, 2, 6).double().eval()
    plain.load_state_dict(layer.state_dict())
    layer.cache.normal_()
    plain.cache.copy_(layer.cache)
    x, o_self = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2], dtype=torch.bool)
    torch.testing.assert_close(layer(x, o_self, mask), plain(x, o_self, mask), rtol=0, atol=0)
    long_src = torch.randn(2, 15, 8, dtype=torch.float64)
    long_mask = torch.ones(2, 15, dtype=torch.bool)
    long_mask[1, :2] = False  # padding in front: the real tokens are taken in order
    summary, _ = layer._sequence_summary(long_src, long_mask)
    torch.testing.assert_close(summary[0], long_src[0, [i * 15 // 6 for i in range(6)]], rtol=0, atol=0)
    torch.testing.assert_close(summary[1], long_src[1, [2 + i * 13 // 6 for i in range(6)]], rtol=0, atol=0)
    with pytest.raises(ValueError, match='longer than the GRC cache'):
        plain(torch.randn(1, 9, 16, dtype=torch.float64), torch.randn(1, 9, 16, dtype=torch.float64))
    assert layer(torch.randn(1, 9, 16, dtype=torch.float64), torch.randn(1, 9, 16, dtype=torch.float64)).shape \
        == (1, 9, 16)


def test_padding_changes_no_output_of_real_tokens():
    model = tiny(True)
    src = sources()
    padded = F.pad(src, (0, 5), value=PAD_ID)
    prev = torch.randint(4, V, (3, 5), generator=torch.Generator().manual_seed(4))
    enc, enc_p = model.encode(src), model.encode(padded)
    torch.testing.assert_close(enc_p.out[:, :src.shape[1]][enc.mask], enc.out[enc.mask], rtol=0, atol=1e-10)
    torch.testing.assert_close(model(padded, prev), model(src, prev), rtol=0, atol=1e-10)
    # train mode (no dropout): the stored caches do not see the padding either
    caches = lambda m: [c.cache.clone() for c in m.modules() if isinstance(c, SentenceGrc)]  # noqa: E731
    a, b = tiny(True).train(), tiny(True).train()
    a(src, prev)
    b(padded, prev)
    for ca, cb in zip(caches(a), caches(b)):
        torch.testing.assert_close(cb, ca, rtol=0, atol=1e-12)


def test_outputs_are_a_function_of_parameters_buffers_and_inputs():
    model = tiny(True)
    src = sources()
    prev = torch.randint(4, V, (3, 4), generator=torch.Generator().manual_seed(5))
    out = model(src, prev)
    torch.testing.assert_close(model(src, prev), out, rtol=0, atol=0)  # eval: nothing stored
    twin = tiny(True)
    twin.load_state_dict(model.state_dict())
    twin.train(), model.train()
    torch.testing.assert_close(twin(src, prev), model(src, prev), rtol=0, atol=0)
    for a, b in zip(twin.buffers(), model.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.eval()
    # a decoding state is a value: decoding from it twice gives the same, and leaves it as it was
    state = model.start_state(model.encode(src))
    _, state = model.decode(prev[:, :2], state=state)
    before = [t.clone() for t in state.self_keys]
    first, _ = model.decode(prev[:, 2:3], state=state)
    again, _ = model.decode(prev[:, 2:3], state=state)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(before, state.self_keys))


def test_checkpoint_averaging_is_the_mean(tmp_path):
    states = []
    for i in range(3):
        model = tiny(True, dtype=torch.float32)
        gen = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for t in list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]:
                t.add_(torch.randn(t.shape, generator=gen))
        states.append({k: v.clone() for k, v in model.state_dict().items()})
        save_atomic(dict(model=states[-1]), str(tmp_path / f'c{i}.pt'))
    avg = average_checkpoints([str(tmp_path / f'c{i}.pt') for i in range(3)])
    assert avg.keys() == states[0].keys()
    for k in avg:
        torch.testing.assert_close(avg[k], torch.stack([s[k] for s in states]).mean(0), rtol=1e-6, atol=1e-6)
    assert any('grc.cache' in k for k in avg)
    with pytest.raises(ValueError, match='no checkpoints'):
        average_checkpoints([])


def test_bleu_of_identical_output_is_100(tmp_path):
    rng = random.Random(0)
    pairs = [demo_pair(rng) for _ in range(40)]
    refs = [en for _, en in pairs]
    vocab = SubwordVocab.train([s for p in pairs for s in p], 120)
    decoded = vocab.decode([ids + [EOS_ID, PAD_ID] for ids in vocab.encode(refs)])
    assert decoded == refs
    assert corpus_bleu(decoded, refs)[0] == pytest.approx(100.)
    worse = [r.replace('cats', 'dogs') for r in refs]
    assert corpus_bleu(worse, refs)[0] < 100. and 'tok:13a' in corpus_bleu(worse, refs)[1]
    assert SubwordVocab.from_tensor(vocab.to_tensor()).encode(refs[:2]) == vocab.encode(refs[:2])


def test_loss_schedule_and_batches():
    logits = torch.randn(2, 5, 7)
    target = torch.randint(4, 7, (2, 5))
    target[1, 3:] = PAD_ID
    loss, nll, n = label_smoothed_loss(logits, target, 0.)
    assert n == 8
    real = target != PAD_ID
    ref = -F.log_softmax(logits, -1).gather(2, target[..., None])[..., 0][real].sum()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(nll, ref)
    smoothed, _, _ = label_smoothed_loss(logits, target, 0.1)
    uniform = -F.log_softmax(logits, -1).mean(-1)[real].sum()
    torch.testing.assert_close(smoothed, 0.9 * ref + 0.1 * uniform)
    assert inverse_sqrt_factor(3999, 5e-4, 4000, 1e-7) == pytest.approx(1.)
    assert inverse_sqrt_factor(15999, 5e-4, 4000, 1e-7) == pytest.approx(0.5)
    assert inverse_sqrt_factor(0, 5e-4, 4000, 1e-7) == pytest.approx((1e-7 + (5e-4 - 1e-7) / 4000) / 5e-4)
    lens = [random.Random(i).randint(1, 30) for i in range(200)]
    batches = token_batches(lens, lens[::-1], 64, seed=0)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) * max(max(lens[i], lens[::-1][i]) for i in b) <= 64 for b in batches)
    assert batches == token_batches(lens, lens[::-1], 64, seed=0)


def test_demo_task(tmp_path):
    assert german_number(3457) == 'dreitausendvierhundertsiebenundfünfzig'
    assert german_number(21) == 'einundzwanzig' and german_number(101) == 'einhunderteins'
    assert english_number(3457) == 'three thousand four hundred fifty-seven' and english_number(21) == 'twenty-one'
    sizes = dict(train=50, valid=5, test=5)
    write_demo_task(str(tmp_path / 'a'), sizes, seed=3)
    write_demo_task(str(tmp_path / 'b'), sizes, seed=3)
    src, tgt = read_parallel(str(tmp_path / 'a'), 'train', 'de', 'en')
    assert (src, tgt) == read_parallel(str(tmp_path / 'b'), 'train', 'de', 'en') and len(src) == 50
    test_src, _ = read_parallel(str(tmp_path / 'a'), 'test', 'de', 'en')
    assert not set(test_src) & set(src)
    (tmp_path / 'a' / 'valid.en').write_text('one line\n')
    with pytest.raises(ValueError, match='5 lines.*1'):
        read_parallel(str(tmp_path / 'a'), 'valid', 'de', 'en')
    with pytest.raises(FileNotFoundError, match='train.fr'):
        read_parallel(str(tmp_path / 'a'), 'train', 'de', 'fr')


def test_sinusoids_match_fairseq_formula():
    from lsvision.sequence.translation import sinusoidal_positions
    emb = sinusoidal_positions(5, 8, offset=2)
    w = torch.exp(torch.arange(4) * -(math.log(10000.) / 3))
    p = torch.arange(2, 7)[:, None].float() * w
    torch.testing.assert_close(emb, torch.cat([p.sin(), p.cos()], 1))
