"""Converters: the cases mutmut found untested (docs/testing.md has the run and the survivors' table)."""
import pytest
import torch

import timm

from lsvision.models import vil_ls

TINY = dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 2, 2, 1), num_classes=10)


def test_vil_ls_filter_names_an_lsvision_checkpoint_in_its_error():
    # an lsvision-layout state dict with a stray key: the KeyError says which kind of checkpoint did not fit
    # (kills the 4 mutants of `source = 'the lsvision ViL-LS checkpoint'` in vil_ls.checkpoint_filter_fn)
    model = timm.create_model('vil_ls_medium', **TINY)
    state = dict(model.state_dict(), **{'stages.0.bogus': torch.zeros(1)})
    with pytest.raises(KeyError, match=r'^the lsvision ViL-LS checkpoint does not fit .*unexpected.*stages\.0\.bogus'):
        vil_ls.checkpoint_filter_fn(state, model)


def test_vil_ls_filter_names_an_official_checkpoint_in_its_error():
    # the authors' layout of a 10-class model loaded into a model one block deeper: the message says "official"
    # (kills the 4 mutants of `source = 'the official ViL-LS checkpoint'`)
    from official_layouts import official_vil

    official = official_vil(timm.create_model('vil_ls_medium', **TINY))
    deeper = timm.create_model('vil_ls_medium', **dict(TINY, depths=(1, 2, 3, 1)))
    with pytest.raises(KeyError, match=r'^the official ViL-LS checkpoint does not fit .*missing.*stages\.2'):
        vil_ls.checkpoint_filter_fn(official, deeper)


def _official_lra_state():
    """The authors' LRA checkpoint (`golden/lra_official`, written by their run_tasks.py) as a bare state_dict."""
    from conftest import golden_path

    file = golden_path('lra_official') / 'mean_pool_padded.model'
    return torch.load(file, weights_only=True)['model_state_dict']


def test_lra_converter_reads_each_documented_wrapper():
    # {'model_state_dict': ...}, {'state_dict': ...}, {'model': ...} and the bare dict give the same weights
    from lsvision.sequence.convert import convert_lra_state_dict

    state = _official_lra_state()
    want = convert_lra_state_dict(state)
    assert 'encoder.blocks.0.attn.qkv.weight' in want and 'head.0.weight' in want
    for wrapper in ('model_state_dict', 'state_dict', 'model'):
        got = convert_lra_state_dict({wrapper: dict(state)})
        assert got.keys() == want.keys(), wrapper
        assert all(torch.equal(got[k], want[k]) for k in want), wrapper


def test_lra_converter_names_a_module_missing_from_the_checkpoint():
    from lsvision.sequence.convert import convert_lra_state_dict

    state = {k: v for k, v in _official_lra_state().items() if not k.startswith('model.transformer_0.norm1.')}
    with pytest.raises(KeyError, match=r"no parameters under 'model\.transformer_0\.norm1' in the official"):
        convert_lra_state_dict(state)


def test_lra_converter_errors_say_what_is_missing():
    from lsvision.sequence.convert import convert_lra_state_dict

    state = _official_lra_state()
    no_embedding = {k: v for k, v in state.items() if not k.endswith('word_embeddings.weight')}
    with pytest.raises(KeyError, match=r'^\'not an official LRA state_dict: no "\.\.\.word_embeddings\.weight" key'):
        convert_lra_state_dict(no_embedding)
    no_query = {k: v for k, v in state.items() if not k.startswith('model.transformer_0.mha.W_q.')}
    with pytest.raises(KeyError, match=r'layer .*model\.transformer_0\..* of the official LRA state_dict has no '
                                       r'attention \("\.\.\.W_q\.weight" key\)'):
        convert_lra_state_dict(no_query)


def test_lra_converter_reads_a_cls_token_key_and_names_what_it_cannot_place():
    from lsvision.sequence.convert import convert_lra_state_dict

    state = _official_lra_state()
    state['model.cls_token'] = torch.randn(state['model.norm.weight'].shape)  # the other name of the cls vector
    assert torch.equal(convert_lra_state_dict(state)['encoder.cls_token'].flatten(), state['model.cls_token'])
    with pytest.raises(KeyError, match=r"^\"LRA conversion: 1 official keys have no lsvision counterpart: "
                                       r"\['model\.bogus'\]"):
        convert_lra_state_dict(dict(state, **{'model.bogus': torch.zeros(1)}))
    no_head = {k: v for k, v in state.items() if not k.startswith('seq_classifer.')}
    with pytest.raises(KeyError, match=r'^\'the official LRA state_dict has no classifier \("seq_classifer\.'):
        convert_lra_state_dict(no_head)


@pytest.mark.parametrize('stray,ellipsis', [(8, False), (9, True)])
def test_fairseq_char_lm_names_up_to_8_keys_without_the_prefix(stray, ellipsis):
    from lsvision.sequence.convert import convert_char_lm_state_dict

    inner = {'decoder.model.in_emb.weight': torch.zeros(2, 2), **{f'bogus.{i}': torch.zeros(1) for i in range(stray)}}
    with pytest.raises(KeyError) as error:
        convert_char_lm_state_dict({'model': inner})
    message = error.value.args[0]
    assert f'{stray} keys under ["model"] lack the prefix \'decoder.model.\'' in message
    assert [f'bogus.{i}' in message for i in range(stray)] == [True] * min(stray, 8) + [False] * (stray - 8)
    assert message.endswith(' ...') == ellipsis


def test_char_lm_frequency_check_is_relative_per_entry():
    """`pos_emb.inv_freq` of width 8 is 10000^(-2k/8) = 1, 0.1, 0.01, 0.001: within fp32's allowance (1e-5 relative)
    it loads as the offset from lsvision's frequencies; 3e-5 relative off on the smallest entry is refused by entry,
    and another shape by shape."""
    from lsvision.sequence.convert import _inv_freq_offset

    exact = torch.tensor([1., 0.1, 0.01, 0.001], dtype=torch.float64)
    near = (exact * torch.tensor([1., 1., 1., 1 + 5e-6], dtype=torch.float64)).float()
    torch.testing.assert_close(_inv_freq_offset(near, 8), near - exact.float(), rtol=0, atol=0)
    off = (exact * torch.tensor([1., 1., 1., 1 + 3e-5], dtype=torch.float64)).float()
    with pytest.raises(ValueError, match=r'by up to 3(\.\d+)?e-05 relative \(entry 3: '):
        _inv_freq_offset(off, 8)
    with pytest.raises(ValueError, match=r'^pos_emb\.inv_freq has shape \(5,\), expected \(4,\) for width 8$'):
        _inv_freq_offset(torch.ones(5), 8)
