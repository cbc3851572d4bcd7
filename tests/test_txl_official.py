"""lsvision's Transformer-XL against the authors' own code (kimiyoung/transformer-xl `pytorch/`, kept under
tests/official/transformer_xl): their checkpoints converted (`load_official_checkpoint`, the module's state_dict and
the Hub's transfo-xl-wt103 layout), per-token losses of their `MemTransformerLM` over carried segments, clamp_len
(<= 0 is no clamp), their eval.py protocol and the every-token one, and `txl_wt103_large` with `pretrained=True`
through an offline Hugging Face cache.

The authors' attention casts its scores to float32 before masking (`attn_score.float().masked_fill(...)`), so in
float64 the two agree to float32 rounding of the scores, not to float64's: losses (nats, up to about 10 here) are
compared within 1e-6 relative (8 float32 ulps) plus 2e-6.
"""
import math

import huggingface_hub.constants as hf_constants
import pytest
import torch
from official_txl import hub_layout, official, official_model, their_environment
from released_weights import put_in_hub_cache

import lsvision.sequence as seq
from lsvision.sequence.convert import convert_txl_state_dict, load_official_checkpoint
from lsvision.sequence.transformer_xl import WT103_LARGE_HUB_ID, AdaptiveInput
from lsvision.train.lm import evaluate_perplexity

ATOL, RTOL = 2e-6, 1e-6  # the authors' float32 cast of the attention scores (see the module doc)
V = 60
SMALL = dict(depth=2, heads=2, head_dim=8, dim=16, inner=24)


def _lsvision(official_kwargs: dict, **kwargs) -> seq.TransformerXL:
    """The lsvision model of the same configuration (docs/sequence.md's `create_model('txl_wt103_base', ...)`, at
    small widths)."""
    o = dict(SMALL, **official_kwargs)
    model = seq.create_model('txl_wt103_base', vocab_size=o['vocab'], dim=o['dim'], depth=o['depth'],
                             num_heads=o['heads'], head_dim=o['head_dim'], mlp_hidden=o['inner'], mem_len=o['mem_len'],
                             cutoffs=o.get('cutoffs', ()), div_val=o.get('div_val', 1), drop=0.,
                             clamp_len=o.get('clamp_len', -1), same_length=o.get('same_length', False), **kwargs)
    return model.double().eval()


def _official_losses(model, ids: torch.Tensor, tgt_len: int) -> torch.Tensor:
    """Per-token losses (B, N - 1) of the authors' model over ids (B, N), segments of tgt_len, memory carried."""
    mems, out = [], []
    with torch.no_grad():
        for i in range(0, ids.shape[1] - 1, tgt_len):
            x, y = ids[:, i:i + tgt_len], ids[:, i + 1:i + 1 + tgt_len]
            x = x[:, :y.shape[1]]
            ret = model(x.t().contiguous(), y.t().contiguous(), *mems)
            out.append(ret[0].t())
            mems = ret[1:]
    return torch.cat(out, dim=1)


def _lsvision_losses(model: seq.TransformerXL, ids: torch.Tensor, tgt_len: int) -> torch.Tensor:
    state, out = None, []
    with torch.no_grad():
        for i in range(0, ids.shape[1] - 1, tgt_len):
            x, y = ids[:, i:i + tgt_len], ids[:, i + 1:i + 1 + tgt_len]
            nll, state = model(x[:, :y.shape[1]], y, state)
            out.append(nll)
    return torch.cat(out, dim=1)


CONFIGS = {
    'plain softmax, mem_len = tgt_len': dict(vocab=V, tgt_len=5, mem_len=5),
    'adaptive, clamp 3, same_length, mem_len 12': dict(vocab=V, cutoffs=(10, 30), tgt_len=5, mem_len=12,
                                                      clamp_len=3, same_length=True),
    'adaptive input div_val 2, clamp 0, mem_len 7': dict(vocab=V, cutoffs=(10, 30), div_val=2, tgt_len=6,
                                                         mem_len=7, clamp_len=0, same_length=True),
}


@pytest.mark.parametrize('config', list(CONFIGS.values()), ids=list(CONFIGS))
def test_per_token_losses_equal_the_authors_over_carried_segments(config, tmp_path):
    o = dict(SMALL, **config)
    ref = official_model(o['vocab'], o['depth'], o['heads'], o['head_dim'], o['dim'], o['inner'],
                         cutoffs=o.get('cutoffs', ()), div_val=o.get('div_val', 1), tgt_len=o['tgt_len'],
                         mem_len=o['mem_len'], clamp_len=o.get('clamp_len', -1),
                         same_length=o.get('same_length', False))
    # the documented route from their train.py's model.pt (the whole module pickled) to a state_dict file
    with their_environment():
        torch.save(ref, tmp_path / 'model.pt')
        torch.save(torch.load(tmp_path / 'model.pt', weights_only=False).state_dict(), tmp_path / 'state_dict.pt')
    ours = _lsvision(config)
    load_official_checkpoint(ours, str(tmp_path / 'state_dict.pt'))
    ids = torch.randint(0, o['vocab'], (3, 4 * o['tgt_len'] + 2), generator=torch.Generator().manual_seed(1))
    expected = _official_losses(ref, ids, o['tgt_len'])
    got = _lsvision_losses(ours, ids, o['tgt_len'])
    assert got.shape == expected.shape == (3, ids.shape[1] - 1)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert (ids[:, 1:] >= 10).any() and (ids[:, 1:] < 10).any()  # head and tail clusters both scored


def test_clamp_len_minus_one_and_zero_are_no_clamp_as_the_authors():
    config = dict(vocab=V, tgt_len=5, mem_len=10)
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(2))
    ref = official_model(V, SMALL['depth'], SMALL['heads'], SMALL['head_dim'], SMALL['dim'], SMALL['inner'],
                         tgt_len=5, mem_len=10, clamp_len=-1)
    unclamped = _official_losses(ref, ids, 5)
    ref.clamp_len = 2
    clamped = _official_losses(ref, ids, 5)
    assert (clamped - unclamped).abs().max() > 100 * ATOL  # the clamp matters on this data
    ours = _lsvision(config)
    load_official_checkpoint(ours, ref.state_dict())
    for clamp in (-1, 0, None):
        ours.clamp_len = clamp
        torch.testing.assert_close(_lsvision_losses(ours, ids, 5), unclamped, rtol=RTOL, atol=ATOL)
    ours.clamp_len = 2
    torch.testing.assert_close(_lsvision_losses(ours, ids, 5), clamped, rtol=RTOL, atol=ATOL)
    # the evaluation option: -1 is the unclamped result, whatever the model was built with
    data = ids.reshape(-1)
    ours.clamp_len = None
    free = evaluate_perplexity(ours, data, 5, batch_size=2)
    ours.clamp_len = 2
    assert evaluate_perplexity(ours, data, 5, batch_size=2, clamp_len=-1)['nll'] == pytest.approx(free['nll'],
                                                                                                 abs=1e-12)
    assert abs(evaluate_perplexity(ours, data, 5, batch_size=2)['nll'] - free['nll']) > 1e-4


def _authors_eval(model, data: torch.Tensor, batch_size: int, tgt_len: int) -> float:
    """The loop of the authors' eval.py `evaluate` over their LMOrderedIterator (ext_len 0)."""
    it = official().LMOrderedIterator(data, batch_size, tgt_len, ext_len=0)
    total_len, total_loss, mems = 0, 0., tuple()
    with torch.no_grad():
        for data_, target, seq_len in it:
            ret = model(data_, target, *mems)
            loss, mems = ret[0], ret[1:]
            total_loss += seq_len * loss.mean().item()
            total_len += seq_len
    return total_loss / total_len


def _every_token_reference(model, data: torch.Tensor, rows: int, tgt_len: int) -> float:
    """The every-token protocol run on the authors' model: (N - 1) / rows targets per row, rows starting at b * S."""
    S = (len(data) - 1) // rows
    streams = torch.stack([data[b * S:(b + 1) * S + 1] for b in range(rows)])
    return float(_official_losses(model, streams, tgt_len).mean())


def test_both_eval_protocols_give_the_authors_numbers():
    # a carried memory longer than the segment, clamp and same_length: the authors' evaluation settings, small
    ref = official_model(V, SMALL['depth'], SMALL['heads'], SMALL['head_dim'], SMALL['dim'], SMALL['inner'],
                         cutoffs=(10, 30), tgt_len=4, mem_len=9, clamp_len=6, same_length=True)
    ours = _lsvision(dict(vocab=V, cutoffs=(10, 30), mem_len=9, clamp_len=6, same_length=True))
    load_official_checkpoint(ours, ref.state_dict())
    data = torch.randint(0, V, (4 * 17 + 3,), generator=torch.Generator().manual_seed(3))  # N mod B = 3 left out
    authors = _authors_eval(ref, data, 4, 4)
    got = evaluate_perplexity(ours, data, 4, batch_size=4, protocol='authors')
    assert got['tokens'] == 4 * (len(data) // 4 - 1)
    assert got['nll'] == pytest.approx(authors, abs=ATOL)
    assert got['ppl'] == pytest.approx(math.exp(authors), rel=10 * ATOL)
    every = evaluate_perplexity(ours, data[:4 * 17 + 1], 4, batch_size=4)  # (N - 1) / 4 = 17 tokens a row
    assert every['tokens'] == 4 * 17
    assert every['nll'] == pytest.approx(_every_token_reference(ref, data[:4 * 17 + 1], 4, 4), abs=ATOL)
    assert abs(every['nll'] - got['nll']) > 100 * ATOL  # the two protocols score different tokens


def test_documented_reproduction_lines_give_the_authors_number(tmp_path):
    """docs/sequence.md's lines for their WikiText-103 number, on a small model and a text in WikiText's format."""
    symbols = ['<eos>'] + [f'w{i}' for i in range(V - 2)] + ['<unk>']
    g = torch.Generator().manual_seed(5)
    lines = [' '.join(symbols[int(i)] for i in torch.randint(1, V - 1, (int(n),), generator=g)) + ' oov \n'
             for n in torch.randint(3, 15, (12,), generator=g)]
    (tmp_path / 'wiki.test.tokens').write_text(''.join(lines), encoding='utf-8')
    ref = official_model(V, SMALL['depth'], SMALL['heads'], SMALL['head_dim'], SMALL['dim'], SMALL['inner'],
                         cutoffs=(10, 30), tgt_len=5, mem_len=8, clamp_len=4, same_length=True)
    model = _lsvision(dict(vocab=V, cutoffs=(10, 30), mem_len=8, clamp_len=4, same_length=True))
    load_official_checkpoint(model, ref.state_dict())

    from lsvision.data.text_corpus import Vocab, encode_lines
    vocab = Vocab(symbols, symbols.index('<unk>'))  # symbols: the released words, by id
    ids, _ = encode_lines(open(tmp_path / 'wiki.test.tokens', encoding='utf-8'), vocab)
    result = evaluate_perplexity(model, ids, tgt_len=5, batch_size=3, protocol='authors')

    assert result['nll'] == pytest.approx(_authors_eval(ref, ids.long(), 3, 5), abs=ATOL)
    assert (ids == V - 1).sum() == 12  # 'oov' became <unk> once a line


# ---- the large configuration's shape at small widths, the Hub layout, pretrained=True offline -------------------

LARGE_SMALL = dict(vocab_size=300, cutoffs=(20, 40, 200), dim=64, depth=3, num_heads=4, head_dim=16, mlp_hidden=96,
                   mem_len=11, clamp_len=7)  # div_val 4: cluster widths 64, 16, 4, 1


def _untied_official(seed: int = 0):
    """The authors' model in the large configuration's shape (small widths), with each layer using its own u, v
    (the Hub weights' untie_r, as transformers' port runs them); returns the model and its Hub-layout weights."""
    c = LARGE_SMALL
    ref = official_model(c['vocab_size'], c['depth'], c['num_heads'], c['head_dim'], c['dim'], c['mlp_hidden'],
                         cutoffs=c['cutoffs'], div_val=4, tgt_len=6, mem_len=c['mem_len'], clamp_len=c['clamp_len'],
                         same_length=True, seed=seed)
    hub = hub_layout(ref.state_dict(), c['depth'])
    g = torch.Generator().manual_seed(seed + 5)
    for i in range(c['depth']):
        u, v = (hub[f'transformer.layers.{i}.dec_attn.{n}'] for n in ('r_w_bias', 'r_r_bias'))
        u.add_(0.2 * torch.randn(u.shape, generator=g, dtype=u.dtype))
        v.add_(0.2 * torch.randn(v.shape, generator=g, dtype=v.dtype))
    with torch.no_grad():  # float32 values (the Hub's file), kept in the reference's float64 (shared storage)
        for t in hub.values():
            t.copy_(t.float())
    for i, layer in enumerate(ref.layers):
        u, v = (hub[f'transformer.layers.{i}.dec_attn.{n}'] for n in ('r_w_bias', 'r_r_bias'))

        def forward(dec_inp, r, r_w_bias, r_r_bias, _f=layer.forward, _u=u, _v=v, **kw):
            return _f(dec_inp, r, _u, _v, **kw)
        layer.forward = forward
    return ref, hub


def _check_against(ref, model: seq.TransformerXL) -> None:
    ids = torch.randint(0, LARGE_SMALL['vocab_size'], (2, 20), generator=torch.Generator().manual_seed(4))
    assert (ids[:, 1:] < 20).any() and (ids[:, 1:] >= 200).any()  # the head and the narrowest cluster scored
    torch.testing.assert_close(_lsvision_losses(model.double().eval(), ids, 6), _official_losses(ref, ids, 6),
                               rtol=RTOL, atol=ATOL)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache read offline (huggingface_hub read its settings at import: its constants too)."""
    hub = tmp_path / 'hf'
    hub.mkdir()
    monkeypatch.setenv('HF_HUB_CACHE', str(hub))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setattr(hf_constants, 'HF_HUB_CACHE', str(hub))
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', True)
    return hub


def test_large_configuration_loads_the_hub_layout_and_pretrained_true_reads_the_cache(hub_cache, tmp_path):
    ref, hub = _untied_official()
    # the file as the Hub holds it: fp32, in transformers' TransfoXLLMHeadModel names, tied copies included
    file = tmp_path / 'pytorch_model.bin'
    torch.save({k: v.float() for k, v in hub.items()}, file)
    put_in_hub_cache(hub_cache, WT103_LARGE_HUB_ID, file)
    model = seq.create_model('txl_wt103_large', pretrained=True, **LARGE_SMALL)
    assert model.untie_r and model.same_length and isinstance(model.embed, AdaptiveInput)
    _check_against(ref, model)
    # the authors' own state_dict (shared u, v) loads into the same configuration, each layer given the shared ones
    plain = official_model(300, 3, 4, 16, 64, 96, cutoffs=(20, 40, 200), div_val=4, tgt_len=6, mem_len=11,
                           clamp_len=7, same_length=True, seed=1)
    shared = seq.create_model('txl_wt103_large', **LARGE_SMALL)
    load_official_checkpoint(shared, plain.state_dict())
    _check_against(plain, shared)


def test_pretrained_without_the_file_names_the_repository_and_how_to_fill_the_cache(hub_cache):
    from lsvision.models._pretrained import PretrainedDownloadError
    with pytest.raises(PretrainedDownloadError) as e:
        seq.create_model('txl_wt103_large', pretrained=True, **LARGE_SMALL)
    message = str(e.value)
    assert "'transfo-xl/transfo-xl-wt103'" in message and 'HF_HUB_OFFLINE is set' in message
    assert 'hf download transfo-xl/transfo-xl-wt103 pytorch_model.bin' in message


def test_registered_large_model_has_the_hub_layouts_names_and_shapes():
    """transformers' TransfoXLLMHeadModel for transfo-xl-wt103 (its config: the authors' large model with
    untie_r) against txl_wt103_large, both on the meta device; the tied copies in the Hub's file are the same
    tensors as the embedding's."""
    with torch.device('meta'):
        ref = official().MemTransformerLM(
            267735, 18, 16, 1024, 64, 4096, 0., 0., tie_weight=True, d_embed=1024, div_val=4,
            tie_projs=[False, True, True, True], tgt_len=128, ext_len=0, mem_len=1600,
            cutoffs=[20000, 40000, 200000], same_length=True, clamp_len=1000)
        ours = seq.create_model('txl_wt103_large')
    state = hub_layout(ref.state_dict(), 18)
    # the frequencies are checked by value: the real ones (the authors' formula, 1 / 10000^(2k/D))
    state['transformer.pos_emb.inv_freq'] = 1 / (10000 ** (torch.arange(0., 1024, 2.) / 1024))
    converted = convert_txl_state_dict(state)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in
                                                                 ours.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == 285_205_322
    assert (ours.mem_len, ours.clamp_len, ours.same_length) == (1600, 1000, True)


def test_wrong_checkpoints_are_named_and_the_hint_works():
    ref, hub = _untied_official()
    shared_model = seq.TransformerXL(**dict(LARGE_SMALL, div_val=4, drop=0.))
    with pytest.raises(ValueError, match='build the model with untie_r=True'):
        load_official_checkpoint(shared_model, hub)
    load_official_checkpoint(seq.TransformerXL(**dict(LARGE_SMALL, div_val=4, untie_r=True)), hub)
    untied = dict(hub)
    untied['crit.out_projs.2'] = untied['crit.out_projs.2'] + 1
    with pytest.raises(ValueError, match="'crit.out_projs.2' differs from 'word_emb.emb_projs.2'"):
        convert_txl_state_dict(untied)
    stray = dict(ref.state_dict(), extra=torch.zeros(1))
    missing = {k: v for k, v in ref.state_dict().items() if k != 'layers.1.pos_ff.CoreNet.0.bias'}
    with pytest.raises(KeyError, match=r"1 official keys are missing: \['layers.1.pos_ff.CoreNet.0.bias'\]"):
        convert_txl_state_dict(missing)
    with pytest.raises(KeyError, match=r"1 keys have no lsvision counterpart: \['extra'\]"):
        convert_txl_state_dict(stray)
