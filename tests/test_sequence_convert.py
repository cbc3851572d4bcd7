"""The official-checkpoint converter on synthetic state_dicts that use the official parameter names."""
import pytest
import torch

import lsvision.sequence as seq
from lsvision.sequence.convert import convert_char_lm_state_dict, load_official_checkpoint


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
                        o + f'mha.dconv_fc.{part}': sd[p + f'attn.dynamic_proj.{part}'],
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


def test_char_lm_round_trip_through_official_names():
    torch.manual_seed(0)
    cfg = dict(vocab_size=32, dim=32, depth=2, num_heads=2, mlp_hidden=64, window_size=8, segment_size=4,
               mem_len=8, cache_mode='official')
    src = seq.CharLM(**cfg).eval()
    sd = src.state_dict()
    names = {'q': 'proj_query', 'k': 'proj_key', 'v': 'proj_val', 'proj': 'proj_out', 'dynamic_proj': 'dconv_1',
             'r_net': 'r_net', 'r_net_chunk': 'r_net_chunk', 'norm_local': 'dual_ln_win',
             'norm_global': 'dual_ln_dproj'}
    off = {'decoder.embed_tokens.weight': sd['embed.weight'], 'decoder.out_bias': sd['out_bias']}
    for i in range(2):
        p, o = f'blocks.{i}.', f'decoder.layers.{i}.'
        for k, v in sd.items():
            if not k.startswith(p):
                continue
            rest = k[len(p):]
            if rest.startswith('attn.'):
                mod, _, part = rest[5:].partition('.')
                if mod == 'content_bias':
                    off[o + 'self_attn.r_w_bias'] = v.reshape(1, 2, 1, 1, 16)
                elif mod == 'pos_bias':
                    off[o + 'self_attn.r_r_bias'] = v.reshape(1, 2, 1, 16)
                else:
                    off[o + f'self_attn.{names[mod]}.{part}'] = v
            else:
                rest = rest.replace('norm1', 'self_attn_layer_norm').replace('norm2', 'final_layer_norm')
                off[o + rest.replace('mlp.', '')] = v
    dst = seq.CharLM(**cfg).eval()
    load_official_checkpoint(dst, {'model': off})
    ids = torch.randint(0, 32, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(dst(ids)[0], src(ids)[0], rtol=0, atol=0)
    off['decoder.layers.0.extra.weight'] = torch.zeros(3)
    with pytest.raises(KeyError, match='no lsvision counterpart'):
        convert_char_lm_state_dict(off)
