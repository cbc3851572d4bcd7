"""The official-checkpoint converters on state_dicts in the official layouts (the char-LM one read from the key list
the authors' code produced, `golden/char_lm_official/keys.json`)."""
import json

import pytest
import torch
from official_layouts import fairseq, official_char_lm, official_inv_freq

import lsvision.sequence as seq
from lsvision.sequence.convert import convert_char_lm_state_dict, load_official_checkpoint

PRESETS = {'enwik8_small': 'ls_lm_enwik8_small', 'enwik8_large': 'ls_lm_enwik8_large',
           'text8_small': 'ls_lm_text8_small'}


def _official_lra(model, dual=False):
    """A state_dict laid out as the official ModelForSC(Dual), built from an lsvision model's weights."""
    sd = model.state_dict()
    off = {'model.embeddings.word_embeddings.weight': sd['encoder.embed.weight'],
           'model.embeddings.position_embeddings.weight': sd['encoder.pos_embed.weight'],
           'model.norm.weight': sd['encoder.norm.weight'], 'model.norm.bias': sd['encoder.norm.bias'],
           'model.cls_embed': sd['encoder.cls_token'][0]}
    for i in range(len(model.encoder.blocks)):
        p, o = f'encoder.blocks.{i}.', f'model.transformer_{i}.'
        for part in ('weight', 'bias'):
            q, k, v = sd[p + f'attn.qkv.{part}'].chunk(3)
            off.update({o + f'mha.W_q.{part}': q, o + f'mha.W_k.{part}': k, o + f'mha.W_v.{part}': v,
                        o + f'mha.W_o.{part}': sd[p + f'attn.proj.{part}'],
                        # an r = 0 official layer keeps an empty Linear(D, 0)
                        o + f'mha.dconv_fc.{part}': sd.get(p + f'attn.dynamic_proj.{part}',
                                                           q.new_zeros((0,) + tuple(q.shape[1:]))),
                        o + f'mha.dual_ln_l.{part}': sd[p + f'attn.norm_local.{part}'],
                        o + f'mha.dual_ln_s.{part}': sd[p + f'attn.norm_global.{part}'],
                        o + f'norm1.{part}': sd[p + f'norm1.{part}'], o + f'norm2.{part}': sd[p + f'norm2.{part}'],
                        o + f'mlpblock.0.{part}': sd[p + f'mlp.fc1.{part}'],
                        o + f'mlpblock.3.{part}': sd[p + f'mlp.fc2.{part}']})
    for part in ('weight', 'bias'):
        off[f'seq_classifer.mlpblock.0.{part}'] = sd[f'head.0.{part}']
        off[f'seq_classifer.mlpblock.2.{part}'] = sd[f'head.2.{part}']
    return {'model_state_dict': {'module.' + k: v.clone() for k, v in off.items()}}


@pytest.mark.parametrize('name', ['ls_lra_listops', 'ls_lra_retrieval'])
def test_lra_round_trip_through_official_names(name, tmp_path):
    torch.manual_seed(0)
    src = seq.create_model(name, max_len=64)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / 'official.pth'
    torch.save(_official_lra(src), path)
    dst = seq.create_model(name, max_len=64)
    load_official_checkpoint(dst, str(path))
    ids = torch.randint(1, 15, (2, 64))
    with torch.no_grad():
        if name.endswith('retrieval'):
            torch.testing.assert_close(dst.eval()(ids, ids.flip(1)), src.eval()(ids, ids.flip(1)), rtol=0, atol=0)
        else:
            torch.testing.assert_close(dst.eval()(ids), src.eval()(ids), rtol=0, atol=0)


def test_lra_with_rank_0_loads_strictly():
    """The official r = 0 layer keeps an empty `dconv_fc`: it is dropped, not mapped to a projection r = 0 lacks."""
    torch.manual_seed(0)
    src = seq.create_model('ls_lra_listops', max_len=64, dp_rank=0).eval()
    assert src.encoder.blocks[0].attn.dynamic_proj is None
    official = _official_lra(src)
    assert official['model_state_dict']['module.model.transformer_0.mha.dconv_fc.weight'].shape == (0, 64)
    dst = seq.create_model('ls_lra_listops', max_len=64, dp_rank=0).eval()
    load_official_checkpoint(dst, official)
    ids = torch.randint(1, 15, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(dst(ids), src(ids), rtol=0, atol=0)


@pytest.mark.parametrize('wrapped', [False, True])
def test_char_lm_round_trip_through_official_layout(wrapped, tmp_path):
    torch.manual_seed(0)
    cfg = dict(vocab_size=32, dim=32, depth=2, num_heads=2, mlp_hidden=64, window_size=8, segment_size=4,
               mem_len=8, cache_mode='official')
    src = seq.CharLM(**cfg).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    official = official_char_lm(src)
    path = tmp_path / 'checkpoint_best.pt'
    torch.save(fairseq(official) if wrapped else official, path)
    dst = seq.CharLM(**cfg).eval()
    load_official_checkpoint(dst, str(path))
    ids = torch.randint(0, 32, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(dst(ids)[0], src(ids)[0], rtol=0, atol=0)


@pytest.fixture(scope='module')
def official_char_lm_keys(golden_root):
    path = golden_root / 'char_lm_official' / 'keys.json'
    if not path.exists():
        pytest.skip(f'{path} not found')
    return json.loads(path.read_text())


def _random_official(layout: dict) -> dict:
    """Random values with exactly the official keys and shapes; the buffer and the tied output weight as the
    official model saves them."""
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=g) for k, shape in layout['state_dict'].items()}
    sd['out_emb.weight'] = sd['in_emb.weight']
    sd['pos_emb.inv_freq'] = official_inv_freq(sd['in_emb.weight'].shape[1])
    return sd


@pytest.mark.parametrize('preset', sorted(PRESETS))
def test_official_char_lm_layout_loads_strictly(preset, official_char_lm_keys):
    layout = official_char_lm_keys[preset]
    official = _random_official(layout)
    for state in (official, fairseq(official)):
        converted = convert_char_lm_state_dict(state)
        assert sum(v.numel() for v in converted.values()) == layout['params']
        with torch.device('meta'):
            model = seq.create_model(PRESETS[preset])
        model.load_state_dict(converted, strict=True, assign=True)
        assert torch.equal(model.embed.weight, official['in_emb.weight'])
        assert torch.equal(model.blocks[-1].mlp.fc2.bias, official[f'layers.{len(model.blocks) - 1}.ff.fc2.bias'])


def test_official_char_lm_layout_errors_name_the_key(official_char_lm_keys):
    official = _random_official(official_char_lm_keys['text8_small'])
    renamed = dict(official)
    renamed['layers.3.ff.fc_1.weight'] = renamed.pop('layers.3.ff.fc1.weight')
    with pytest.raises(KeyError, match=r"missing: \['layers\.3\.ff\.fc1\.weight'\].*'layers\.3\.ff\.fc_1\.weight'"):
        convert_char_lm_state_dict(renamed)
    for key in ('pos_emb.inv_freq', 'out_emb.bias', 'layers.11.attn.r_r_bias'):
        with pytest.raises(KeyError, match=key.replace('.', r'\.')):
            convert_char_lm_state_dict({k: v for k, v in official.items() if k != key})
    with pytest.raises(KeyError, match=r'lack the prefix .*decoder\.model\..*decoder\.version'):
        convert_char_lm_state_dict({'model': {**fairseq(official)['model'], 'decoder.version': torch.ones(1)}})
    with pytest.raises(ValueError, match='inv_freq differs'):
        convert_char_lm_state_dict(dict(official, **{'pos_emb.inv_freq': official['pos_emb.inv_freq'] * 1.01}))
    with pytest.raises(ValueError, match="'out_emb.weight' differs"):
        convert_char_lm_state_dict(dict(official, **{'out_emb.weight': official['in_emb.weight'] + 1}))
    with torch.device('meta'):
        shallow = seq.create_model('ls_lm_text8_small', depth=11)
    with pytest.raises(RuntimeError, match=r'Unexpected key.*blocks\.11\.'):
        shallow.load_state_dict(convert_char_lm_state_dict(official), strict=True, assign=True)


def test_lra_errors_name_the_key():
    official = _official_lra(seq.create_model('ls_lra_listops', max_len=64))['model_state_dict']
    for key in ('module.model.transformer_1.mha.W_v.bias', 'module.seq_classifer.mlpblock.0.weight'):
        with pytest.raises(KeyError, match=key[len('module.'):].replace('.', r'\.').split('mlpblock')[0]):
            load_official_checkpoint(seq.create_model('ls_lra_listops', max_len=64),
                                     {k: v for k, v in official.items() if k != key})
