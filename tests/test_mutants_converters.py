"""Converters: the cases mutmut found untested (docs/testing.md has the run and the survivors' table)."""
import ast
import re
from typing import Optional

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
    # what is off (dtype, by how much, where), and that it cannot be loaded because of other position encodings
    with pytest.raises(ValueError, match=r'^pos_emb\.inv_freq \(torch\.float32\) differs .* by up to 3(\.\d+)?e-05 '
                                         r'relative \(entry 3: .*trained with other position encodings and cannot '
                                         r'be loaded\.$'):
        _inv_freq_offset(off, 8)
    with pytest.raises(ValueError, match=r'^pos_emb\.inv_freq has shape \(5,\), expected \(4,\) for width 8$'):
        _inv_freq_offset(torch.ones(5), 8)


def _with_stray_keys(state: dict, count: int, prefix: str) -> dict:
    return dict(state, **{f'{prefix}{i}': torch.zeros(1) for i in range(count)})


def _listed_keys(message: str, total: int) -> list:
    """The key list that ends `message`: at most 8 names, then ' ...' exactly when `total` keys were wrong."""
    tail = message.rpartition(': ')[2]
    more = tail.endswith(' ...')
    named = ast.literal_eval(tail[:-len(' ...')] if more else tail)
    assert more == (total > 8) and len(named) == min(total, 8), message
    return named


@pytest.mark.parametrize('count', [8, 9])
def test_lra_converter_names_up_to_8_keys_it_cannot_place(count):
    from lsvision.sequence.convert import convert_lra_state_dict

    state = _with_stray_keys(_official_lra_state(), count, 'model.stray_')
    with pytest.raises(KeyError) as error:
        convert_lra_state_dict(state)
    message = error.value.args[0]
    assert message.startswith(f'LRA conversion: {count} official keys have no lsvision counterpart: ')
    assert _listed_keys(message, count) == sorted(f'model.stray_{i}' for i in range(count))[:8]


def test_lra_converter_drops_only_the_empty_projection_of_an_r0_layer():
    # the authors' r = 0 layer keeps an empty dconv_fc (0 rows): dropped; another empty tensor is still named
    from lsvision.sequence.convert import convert_lra_state_dict

    state = _official_lra_state()
    state['model.transformer_0.mha.dconv_fc.weight'] = torch.zeros(0, 48)
    state['model.transformer_0.mha.dconv_fc.bias'] = torch.zeros(0)
    converted = convert_lra_state_dict(state)
    assert not any('dynamic_proj' in k for k in converted)
    with pytest.raises(KeyError, match=r"1 official keys have no lsvision counterpart: \['model\.empty'\]"):
        convert_lra_state_dict(dict(state, **{'model.empty': torch.zeros(0)}))


def _official_char_lm_file() -> dict:
    """The authors' char-LM as fairseq saved it (`golden/char_lm_official_outputs/checkpoint_best.pt`)."""
    from conftest import golden_path

    return torch.load(golden_path('char_lm_official_outputs') / 'checkpoint_best.pt', weights_only=True)


def _official_char_lm_state() -> dict:
    """The bare `TransformerLSModel` state_dict inside that file (fairseq's 'decoder.model.' prefix removed)."""
    return {k[len('decoder.model.'):]: v for k, v in _official_char_lm_file()['model'].items()}


def test_fairseq_char_lm_list_of_keys_without_the_prefix_ends_the_message():
    from lsvision.sequence.convert import convert_char_lm_state_dict

    for count in (8, 9):
        inner = _with_stray_keys(_official_char_lm_file()['model'], count, 'stray.')
        with pytest.raises(KeyError) as error:
            convert_char_lm_state_dict({'model': inner})
        assert _listed_keys(error.value.args[0], count) == sorted(f'stray.{i}' for i in range(count))[:8]


@pytest.mark.parametrize('count', [8, 9])
def test_char_lm_converter_names_up_to_8_keys_per_problem(count):
    from lsvision.sequence.convert import convert_char_lm_state_dict

    state = _with_stray_keys(_official_char_lm_state(), count, 'stray.')
    with pytest.raises(KeyError) as error:
        convert_char_lm_state_dict(state)
    message = error.value.args[0]
    assert f'{count} keys have no lsvision counterpart: ' in message
    assert _listed_keys(message, count) == sorted(f'stray.{i}' for i in range(count))[:8]
    missing = sorted(k for k in state if k.startswith('layers.1.'))[:count]
    with pytest.raises(KeyError) as error:
        convert_char_lm_state_dict({k: v for k, v in state.items() if k not in missing and not k.startswith('stray')})
    message = error.value.args[0]
    assert f'{count} official keys are missing: ' in message
    assert set(_listed_keys(message, count)) <= set(missing)


def test_char_lm_errors_name_the_kind_of_file():
    # the fairseq checkpoint and the bare state_dict are named as such in both the key and the value errors
    from lsvision.sequence.convert import convert_char_lm_state_dict

    fairseq_file, bare = _official_char_lm_file(), _official_char_lm_state()
    prefix = 'decoder.model.'
    for state, kind in ((fairseq_file, 'fairseq char-LM checkpoint'), (bare, 'char-LM state_dict')):
        inner, key_prefix = (state['model'], prefix) if 'model' in state else (state, '')
        without_bias = {k: v for k, v in inner.items() if k != key_prefix + 'out_emb.bias'}
        with pytest.raises(KeyError, match=rf"^[\'\"]{kind} is not in the official TransformerLSModel layout "
                                           r"\(NVIDIA/transformer-ls autoregressive/\): 1 official keys are missing"):
            convert_char_lm_state_dict(dict(state, model=without_bias) if key_prefix else without_bias)
        untied = dict(inner, **{key_prefix + 'out_emb.weight': inner[key_prefix + 'in_emb.weight'] + 1})
        with pytest.raises(ValueError, match=rf"^{kind}: 'out_emb\.weight' differs from 'in_emb\.weight'.* "
                                             r"CharLM has one tied matrix$"):
            convert_char_lm_state_dict(dict(state, model=untied) if key_prefix else untied)


def test_char_lm_error_lists_both_problems():
    # a renamed key is missing under its official name and has no counterpart under the new one: both lists, '; '
    from lsvision.sequence.convert import convert_char_lm_state_dict

    state = _official_char_lm_state()
    state['layers.1.ff.fc_1.weight'] = state.pop('layers.1.ff.fc1.weight')
    with pytest.raises(KeyError) as error:
        convert_char_lm_state_dict(state)
    assert error.value.args[0].endswith("1 official keys are missing: ['layers.1.ff.fc1.weight']; "
                                        "1 keys have no lsvision counterpart: ['layers.1.ff.fc_1.weight']")


def test_char_lm_without_layers_converts_to_no_blocks():
    """A state_dict with no `layers.{i}` keys (a depth-0 model) gives the embedding and output bias only; a model
    with layers then names each block it lacks in its strict load."""
    import lsvision.sequence as seq
    from lsvision.sequence.convert import convert_char_lm_state_dict, load_official_checkpoint

    state = {k: v for k, v in _official_char_lm_state().items() if not k.startswith('layers.')}
    converted = convert_char_lm_state_dict(state)
    assert converted.keys() == {'embed.weight', 'out_bias'}
    model = seq.CharLM(vocab_size=260, dim=48, depth=2, num_heads=4, mlp_hidden=128, window_size=16,
                       segment_size=16, dp_rank=3, mem_len=32)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*blocks\.0\..*blocks\.1\.'):
        load_official_checkpoint(model, state)


TINY_CVT = dict(embed_dims=(16, 32, 48), num_heads=(1, 2, 3), depths=(1, 1, 2), num_classes=10)  # golden/cvt_official


def test_microsoft_cvt_state_dict_gives_microsofts_logits_bare_or_wrapped():
    """Microsoft's tiny CvT (`golden/cvt_official`, their layout `stage{i}.*`) through the filter: bare, and as a
    DDP training checkpoint (`{'state_dict': {'module.' + key: ...}}`), the same weights and Microsoft's logits."""
    from conftest import golden_path

    from lsvision.models import cvt

    folder = golden_path('cvt_official')
    weights = torch.load(folder / 'tiny_cvt.pth', weights_only=True)
    io = torch.load(folder / 'tiny_cvt_io.pt', weights_only=True)
    assert any(k.startswith('stage2.') for k in weights) and not any(k.startswith('stages.') for k in weights)
    model = timm.create_model('cvt_13', **TINY_CVT).eval()
    bare = cvt.checkpoint_filter_fn(dict(weights), model)
    wrapped = cvt.checkpoint_filter_fn({'state_dict': {'module.' + k: v for k, v in weights.items()}}, model)
    assert wrapped.keys() == bare.keys() == model.state_dict().keys()
    assert all(torch.equal(wrapped[k], bare[k]) for k in bare)
    model.load_state_dict(bare)
    with torch.no_grad():
        torch.testing.assert_close(model(io['x_224']), io['logits_224'], rtol=0, atol=1e-4)


@pytest.mark.parametrize('key,source', [
    ('stage0.bogus', 'the Microsoft CvT checkpoint'),
    ('cvt.encoder.stages.0.bogus', 'the transformers-layout CvT checkpoint (Hugging Face Hub)'),
    ('stages.0.bogus', 'the lsvision CvT checkpoint'),
])
def test_cvt_filter_names_the_kind_of_checkpoint_that_does_not_fit(key, source):
    from lsvision.models import cvt

    model = timm.create_model('cvt_13', device='meta', **TINY_CVT)
    # the message says which layout was read, and the key's lsvision name (each layout renamed to `stages.0.bogus`)
    with pytest.raises(KeyError, match=rf'^{re.escape(source)} does not fit cvt_13: missing .*stages\.0\.'
                                       r'.*unexpected .*: stages\.0\.bogus\.'):
        cvt.checkpoint_filter_fn({key: torch.zeros(1)}, model)


def _golden_char_lm(**kwargs):
    """An lsvision CharLM of the authors' small char-LM's size (`golden/char_lm_official_outputs/meta.json`)."""
    import lsvision.sequence as seq

    return seq.CharLM(vocab_size=260, dim=48, depth=2, num_heads=4, mlp_hidden=128, window_size=16, segment_size=16,
                      dp_rank=3, mem_len=32, **kwargs)


def test_official_char_lm_load_says_when_it_changes_the_cache_mode(caplog):
    from lsvision.sequence.convert import load_official_checkpoint

    masked, official = _golden_char_lm(cache_mode='masked'), _golden_char_lm(cache_mode='official')
    with caplog.at_level('INFO', logger='lsvision.sequence.convert'):
        load_official_checkpoint(official, _official_char_lm_file())
        assert caplog.records == []  # nothing changed, nothing said
        load_official_checkpoint(masked, _official_char_lm_file())
    assert masked.cache_mode == 'official'
    assert [r.getMessage() for r in caplog.records] == [
        "official char-LM checkpoint: cache_mode 'masked' -> 'official'"]


def test_official_char_lm_settings_leave_a_model_without_cache_mode_alone():
    """A model that holds the char-LM's weights but has no `cache_mode` (no initial cache to choose) loads them
    with kind='char_lm' and gets no such attribute."""
    from lsvision.sequence.convert import load_official_checkpoint

    model = _golden_char_lm()
    del model.cache_mode
    load_official_checkpoint(model, _official_char_lm_file(), kind='char_lm')
    assert not hasattr(model, 'cache_mode')
    assert torch.equal(model.embed.weight, _official_char_lm_state()['in_emb.weight'])


def test_vil_ls_filter_names_up_to_5_foreign_keys_and_the_tool_that_lists_all():
    """The authors' tiny ViL-LS file (`golden/vil_ls_official/tiny224.pth`) with 6 keys no ViL-LS has: the error
    counts them, names the first 5 and points at tools/convert_vil_ls.py for every mismatch."""
    from conftest import golden_path

    checkpoint = torch.load(golden_path('vil_ls_official') / 'tiny224.pth', weights_only=True)
    foreign = [f'layer1.0.pos_embed_{i}' for i in range(6)]
    checkpoint['net'].update({'module.' + k: torch.zeros(1) for k in foreign})
    model = timm.create_model('vil_ls_medium', device='meta', **TINY)
    with pytest.raises(ValueError) as error:
        vil_ls.checkpoint_filter_fn(checkpoint, model)
    message = str(error.value)
    assert message.startswith('6 keys of the checkpoint are not ViL-LS')
    assert [k in message for k in foreign] == [True] * 5 + [False]
    assert message.endswith('tools/convert_vil_ls.py lists every mismatch.')


@pytest.mark.parametrize('key', [
    'pos_embed',  # not under a layer
    'layer1.0.pos_embed',  # the patch embedding has no such parameter
    'layer1.1.attn.relative_bias_table',  # an attention parameter of another attention type
    'layer1.1.attn.kv.proj.weight',  # not a parameter of the attention itself
    'layer1.2.mlp.fc3.weight',  # the MLP has fc1 and fc2
])
def test_vil_ls_key_map_raises_keyerror_naming_an_unknown_official_key(key):
    # the documented error of the public key map: KeyError(key), which the filter collects into its message
    with pytest.raises(KeyError) as error:
        vil_ls.official_key_to_lsvision(key)
    assert error.value.args == (key,)


def _golden_lra(name: str, **kwargs):
    """An lsvision LRA classifier of the size of the authors' `golden/lra_official/{name}` (their meta.json)."""
    import json

    from conftest import golden_path

    import lsvision.sequence as seq

    cfg = json.loads((golden_path('lra_official') / 'meta.json').read_text())['configs'][name]['config']
    return seq.create_model('ls_lra_listops', num_classes=cfg['num_classes'], vocab_size=cfg['vocab_size'],
                            max_len=cfg['max_seq_len'], dim=cfg['transformer_dim'], depth=cfg['num_layers'],
                            num_heads=cfg['num_head'], mlp_hidden=cfg['transformer_hidden_dim'],
                            window_size=cfg['window_size'], dp_rank=cfg['num_landmarks'], **kwargs)


@pytest.mark.parametrize('name,pool,expected', [
    ('mean_pool_padded', 'cls', "official LRA checkpoint without a cls vector: pool 'cls' -> 'mean_official'"),
    ('cls_last_layer_padded', 'mean_official',
     "official LRA checkpoint with a cls vector: pool 'mean_official' -> 'cls'"),
])
def test_official_lra_load_says_when_it_changes_the_pooling(name, pool, expected, caplog):
    from conftest import golden_path

    from lsvision.sequence.convert import load_official_checkpoint

    file = str(golden_path('lra_official') / f'{name}.model')
    with caplog.at_level('INFO', logger='lsvision.sequence.convert'):
        load_official_checkpoint(_golden_lra(name, pool=pool), file)
        assert [r.getMessage() for r in caplog.records] == [expected]
        caplog.clear()
        load_official_checkpoint(_golden_lra(name, pool=expected.rpartition(' -> ')[2].strip("'")), file)
        assert caplog.records == []  # the model's pooling already fits: nothing said


def test_load_official_checkpoint_refuses_an_unknown_kind():
    from lsvision.sequence.convert import load_official_checkpoint

    with pytest.raises(ValueError, match=r"kind must be 'lra', 'char_lm' or 'txl', got 'lm'"):
        load_official_checkpoint(_golden_char_lm(), _official_char_lm_file(), kind='lm')


_UNPICKLED = []


def _record_unpickling(text: str) -> str:
    _UNPICKLED.append(text)
    return text


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return _record_unpickling, ('code ran',)


@pytest.mark.parametrize('force_no_weights_only', [False, True])
def test_official_checkpoint_file_is_read_with_weights_only(force_no_weights_only, tmp_path, monkeypatch):
    """A file that would run code when unpickled (an object of any class) is refused before anything runs, also
    where TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set (torch lets it override only calls that leave weights_only
    out)."""
    import pickle

    from lsvision.sequence.convert import load_official_checkpoint

    if force_no_weights_only:
        monkeypatch.setenv('TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD', '1')
    file = tmp_path / 'checkpoint_best.pt'
    torch.save(dict(_official_char_lm_file(), extra=_RunsCodeWhenUnpickled()), file)
    with pytest.raises(pickle.UnpicklingError, match='Weights only load failed'):
        load_official_checkpoint(_golden_char_lm(), str(file))
    assert _UNPICKLED == []


_SAVE_ON_CUDA = []  # while non-empty, torch.save records every storage as saved on 'cuda:0'


def _cuda_location_tag(storage) -> Optional[str]:
    return 'cuda:0' if _SAVE_ON_CUDA else None


torch.serialization.register_package(0, _cuda_location_tag, lambda storage, location: None)


def test_checkpoint_saved_on_a_gpu_loads_into_a_cpu_model(tmp_path):
    """The authors' LRA script saves the state_dict of a model on the GPU (tensors tagged 'cuda:0'); on a machine
    without CUDA such a file loads onto the CPU (map_location='cpu'). The tag is set by a torch.serialization
    location tagger, the public hook torch.save uses for every storage."""
    from conftest import golden_path

    from lsvision.sequence.convert import load_official_checkpoint

    name = 'mean_pool_padded'
    state = torch.load(golden_path('lra_official') / f'{name}.model', weights_only=True)
    file = tmp_path / f'{name}.model'
    _SAVE_ON_CUDA.append(True)
    try:
        torch.save(state, file)
    finally:
        _SAVE_ON_CUDA.clear()
    if not torch.cuda.is_available():  # what a load without map_location does here
        with pytest.raises(RuntimeError, match='CUDA'):
            torch.load(file, weights_only=True)
    model = _golden_lra(name)
    load_official_checkpoint(model, str(file))
    assert torch.equal(model.encoder.embed.weight, state['model_state_dict']['model.embeddings.word_embeddings.weight'])
