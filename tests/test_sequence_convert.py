"""The official-checkpoint converters on state_dicts in the official layouts (the char-LM one read from the key list
the authors' code produced, `golden/char_lm_official/keys.json`), and the documented loading call against the
outputs of the authors' code (`golden/char_lm_official_outputs`, `golden/lra_official`)."""
import json

import pytest
import torch
from _helpers import perturb
from conftest import golden_path
from official_layouts import fairseq, official_char_lm, official_inv_freq
from safetensors.torch import load_file, save_file

import lsvision.sequence as seq
from lsvision.layers import sinusoid_frequencies
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
    src = perturb(seq.create_model(name, max_len=64))
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
    src = perturb(seq.CharLM(**cfg).eval())
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
    assert path.exists(), f'{path} is missing: copy it from ../shared/golden/char_lm_official/ (tests/golden/README.md)'
    return json.loads(path.read_text())


def _random_official(layout: dict) -> dict:
    """Random values with exactly the official keys and shapes; the buffer and the tied output weight as the
    official model saves them."""
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=g) for k, shape in layout['state_dict'].items()}
    sd['out_emb.weight'] = sd['in_emb.weight']
    sd['pos_emb.inv_freq'] = official_inv_freq(sd['in_emb.weight'].shape[1])
    return sd


def model_layers(converted: dict) -> set:
    return {k.split('.')[1] for k in converted if k.startswith('blocks.')}


def assert_offsets_within_rounding(offsets, dim: int, dtype: torch.dtype) -> None:
    """Each layer's `pos_freq_offset` is what the rounding of the file's `dtype` can move a frequency: at most one
    unit (eps relative), so 0 or 1 ulp for an fp32 file, whichever the CPU's float32 `10000 ** x` gave."""
    freq = sinusoid_frequencies(dim)
    for offset in offsets:
        assert offset.shape == freq.shape and (offset.abs() <= torch.finfo(dtype).eps * freq).all(), offset


@pytest.mark.parametrize('preset', sorted(PRESETS))
def test_official_char_lm_layout_loads_strictly(preset, official_char_lm_keys):
    layout = official_char_lm_keys[preset]
    official = _random_official(layout)
    for state in (official, fairseq(official)):
        converted = convert_char_lm_state_dict(state)
        offsets = [k for k in converted if k.endswith('.attn.pos_freq_offset')]  # buffers, ~0 for fp32 files
        assert len(offsets) == len(model_layers(converted))
        assert_offsets_within_rounding([converted[k] for k in offsets], converted['embed.weight'].shape[1],
                                       torch.float32)
        assert sum(v.numel() for k, v in converted.items() if k not in offsets) == layout['params']
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
    with pytest.raises(ValueError, match=r'inv_freq \(torch\.float32\) differs .* by up to 0\.01'):
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


# ---- the authors' outputs (tests/golden/char_lm_official_outputs, tests/golden/lra_official) ----

def _golden_char_lm_kwargs(folder) -> dict:
    """The lsvision arguments of the official constructor in meta.json."""
    ctor = json.loads((folder / 'meta.json').read_text())['ctor']
    assert ctor['pre_ln'] and ctor['use_gelu'] and not ctor['use_bias'] and ctor['clamp_len'] == -1
    return dict(vocab_size=ctor['vocab_size'], dim=ctor['d_model'], depth=ctor['n_layer'], num_heads=ctor['n_head'],
                mlp_hidden=ctor['d_inner'], window_size=ctor['window_len'], segment_size=ctor['chunk_size'],
                dp_rank=ctor['chunk_rank'], mem_len=ctor['mem_len'], drop=ctor['dropout'])


def _run_blocks(model, blocks):
    """Log-probs of the blocks fed in order, each continuing the state of the previous one."""
    outs, state = [], None
    with torch.no_grad():
        for ids in blocks:
            logp, state = model(ids, state)
            outs.append(logp)
    return outs


@pytest.fixture(scope='module')
def char_lm_golden():
    folder = golden_path('char_lm_official_outputs')
    return folder, _golden_char_lm_kwargs(folder), torch.load(folder / 'io.pt', weights_only=True)


def test_documented_call_gives_the_official_char_lm_outputs_from_the_first_block(char_lm_golden):
    """create_model + load_official_checkpoint, as documented (default cache_mode), on fairseq's checkpoint: the
    official log-probs from a zero initial cache, every block (the masked default differed by 0.78 on block 1)."""
    folder, kwargs, io = char_lm_golden
    model = seq.create_model('ls_lm_enwik8_small', **kwargs).eval()
    assert model.cache_mode == 'masked'  # the constructor's default
    load_official_checkpoint(model, str(folder / 'checkpoint_best.pt'))
    for i, (out, ref) in enumerate(zip(_run_blocks(model, io['blocks']), io['logprobs_fp32'])):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=f'block {i}')
    assert model.cache_mode == 'official'
    # fp32 file: lsvision's own frequencies, up to fp32 rounding (on some CPUs float32 `10000 ** x` rounds one of the
    # 24 frequencies 1 ulp away from the file's, and the offset keeps the file's; the outputs above match either way)
    assert_offsets_within_rounding([b.attn.pos_freq_offset for b in model.blocks], kwargs['dim'], torch.float32)


def test_official_settings_false_keeps_the_masked_cache(char_lm_golden):
    """Weights only: the masked cache is kept, and only the first blocks differ from the official model."""
    folder, kwargs, io = char_lm_golden
    model = seq.create_model('ls_lm_enwik8_small', **kwargs).eval()
    load_official_checkpoint(model, str(folder / 'checkpoint_best.pt'), official_settings=False)
    assert model.cache_mode == 'masked'
    diffs = [(out - ref).abs().max().item()
             for out, ref in zip(_run_blocks(model, io['blocks']), io['logprobs_fp32'])]
    assert diffs[0] > 0.1 and diffs[-1] < 1e-5, diffs


def test_fp16_fairseq_checkpoint_gives_the_official_outputs_on_the_same_file(char_lm_golden, tmp_path):
    """fairseq --fp16 saves .half() weights, inv_freq included: they load into the fp32 model, the frequencies as
    rounded (the official fp32 model loading the file runs with those), and an lsvision round trip keeps them."""
    folder, kwargs, io = char_lm_golden
    path = folder / 'checkpoint_best_fp16.pt'
    file_freq = torch.load(path, weights_only=True)['model']['decoder.model.pos_emb.inv_freq']
    assert file_freq.dtype == torch.float16
    model = seq.create_model('ls_lm_enwik8_small', **kwargs).eval()
    load_official_checkpoint(model, str(path))
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    freq = sinusoid_frequencies(kwargs['dim']) + model.blocks[0].attn.pos_freq_offset
    assert torch.equal(freq, file_freq.float())  # the file's frequencies, bit for bit
    outs = _run_blocks(model, io['blocks'])
    for i, (out, ref) in enumerate(zip(outs, io['logprobs_fp16_file'])):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-4, msg=f'block {i}')

    # lsvision's own checkpoint (safetensors) reproduces them; an old one without the offsets still loads
    save_file(model.state_dict(), str(tmp_path / 'lm.safetensors'))
    again = seq.create_model('ls_lm_enwik8_small', cache_mode='official', **kwargs).eval()
    again.load_state_dict(load_file(str(tmp_path / 'lm.safetensors')))
    for out, ref in zip(_run_blocks(again, io['blocks']), outs):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    old = {k: v for k, v in model.state_dict().items() if not k.endswith('pos_freq_offset')}
    again.load_state_dict(old, strict=True)
    assert all(not b.attn.pos_freq_offset.any() for b in again.blocks)


def test_half_state_dicts_load_into_an_fp32_char_lm(char_lm_golden):
    """An lsvision state_dict after .half() loads (cast to fp32); so does the official fp32 file made .half()."""
    folder, kwargs, io = char_lm_golden
    model = seq.create_model('ls_lm_enwik8_small', cache_mode='official', **kwargs).eval()
    model.load_state_dict({k: v.half() for k, v in model.state_dict().items()})
    assert {v.dtype for v in model.state_dict().values()} == {torch.float32}
    official = torch.load(folder / 'checkpoint_best.pt', weights_only=True)
    official['model'] = {k: v.half() for k, v in official['model'].items()}
    load_official_checkpoint(model, official)
    out = _run_blocks(model, io['blocks'][:1])[0]
    torch.testing.assert_close(out, io['logprobs_fp16_file'][0], rtol=0, atol=1e-4)


def test_other_frequencies_in_an_fp16_file_are_refused_with_dtype_and_difference(char_lm_golden):
    folder, _, _ = char_lm_golden
    state = torch.load(folder / 'checkpoint_best_fp16.pt', weights_only=True)
    key = 'decoder.model.pos_emb.inv_freq'
    state['model'][key] = (state['model'][key].float() * 1.01).half()  # 1 %: more than fp16 rounding (0.05 %)
    with pytest.raises(ValueError, match=r'inv_freq \(torch\.float16\) differs .* by up to 0\.01\d* relative'):
        convert_char_lm_state_dict(state)
    bf16 = official_inv_freq(48).to(torch.bfloat16)  # bf16 rounding (up to 0.4 %) passes
    converted = convert_char_lm_state_dict(dict(_small_official_char_lm(), **{'pos_emb.inv_freq': bf16}))
    assert torch.equal(sinusoid_frequencies(48) + converted['blocks.0.attn.pos_freq_offset'], bf16.float())


def _small_official_char_lm() -> dict:
    torch.manual_seed(0)
    model = seq.CharLM(vocab_size=32, dim=48, depth=1, num_heads=4, mlp_hidden=64, window_size=8, segment_size=4,
                       mem_len=8)
    return official_char_lm(model)


@pytest.mark.parametrize('name', ['mean_pool_padded', 'cls_last_layer_padded'])
def test_official_lra_checkpoint_gives_the_official_logits_on_padded_inputs(name):
    """The documented call on the model built with its default pooling: the loader picks the official MEAN pooling
    (sum over real tokens / n) for the file without a cls vector and the cls pooling for the --cls_last_layer one."""
    folder = golden_path('lra_official')
    cfg = json.loads((folder / 'meta.json').read_text())['configs'][name]['config']
    io = torch.load(folder / f'{name}_io.pt', weights_only=True)
    assert not io['mask'].all() and torch.equal(io['mask'], io['input_ids'] != 0)  # padded rows
    model = seq.create_model('ls_lra_listops', num_classes=cfg['num_classes'], vocab_size=cfg['vocab_size'],
                             max_len=cfg['max_seq_len'], dim=cfg['transformer_dim'], depth=cfg['num_layers'],
                             num_heads=cfg['num_head'], mlp_hidden=cfg['transformer_hidden_dim'],
                             window_size=cfg['window_size'], dp_rank=cfg['num_landmarks']).eval()
    load_official_checkpoint(model, str(folder / f'{name}.model'))
    assert model.encoder.pool == ('cls' if cfg['cls_last_layer'] else 'mean_official')
    with torch.no_grad():
        torch.testing.assert_close(model(io['input_ids']), io['logits'], rtol=0, atol=1e-5)


def test_lra_pool_names_say_which_mean():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="ambiguous: 'mean_official' .* 'mean_real'"):
        seq.create_model('ls_lra_listops', max_len=64, pool='mean')
    ids = torch.randint(1, 15, (2, 48))
    ids[1, 30:] = 0
    longer = torch.cat([ids, torch.zeros(2, 16, dtype=torch.long)], 1)  # more padding
    model = seq.create_model('ls_lra_listops', max_len=64, pool='mean_real').eval()
    with torch.no_grad():
        real = model.encoder(ids)
        torch.testing.assert_close(model.encoder(longer), real)  # padding-invariant
        model.encoder.set_pool('mean_official')
        official = model.encoder(ids)
    n_real = (ids != 0).sum(1, keepdim=True)
    torch.testing.assert_close(official, real * n_real / ids.shape[1])  # real tokens summed, divided by n


def test_lra_official_settings_false_keeps_the_models_pooling():
    torch.manual_seed(0)
    src = seq.create_model('ls_lra_listops', max_len=64)
    official = _official_lra(src)
    del official['model_state_dict']['module.model.cls_embed']  # a file trained without --cls_last_layer
    model = seq.create_model('ls_lra_listops', max_len=64)
    with pytest.raises(RuntimeError, match=r'Missing key.*encoder\.cls_token'):
        load_official_checkpoint(model, official, official_settings=False)
    load_official_checkpoint(model, official)
    assert model.encoder.pool == 'mean_official' and model.encoder.cls_token is None
    assert 'encoder.cls_token' not in model.state_dict()
    load_official_checkpoint(model, _official_lra(src))  # and back: a cls vector again
    assert model.encoder.pool == 'cls' and torch.equal(model.encoder.cls_token, src.encoder.cls_token)
