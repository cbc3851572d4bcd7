"""GRC-Attention on token sequences (`GatedRecurrentCache1d`, the `grc_lra_*` / `ls_grc_lra_*` encoders).

Against the spec restated in tests/grc_reference.py (fp64): the layer's output and cache update, the whole LS + GRC
encoder's logits, stored caches and gradients. Behaviour: padding never reaches the cache or the real tokens,
eval is per sample and leaves the cache frozen, the cache agrees across 2 gloo processes.
"""
import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from _helpers import forkserver, free_port, grc_caches, grc_modules, perturb
from grc_reference import full_attention_1d, grc_sequence_reference
from reference_attention import dense_long_short_attention_1d, layer_norm

import lsvision.sequence as seq
from lsvision.layers import GatedRecurrentCache1d, GrcConfig, LongShortAttention1d
from lsvision.sequence.grc_lra import FullGrcAttention1d, LongShortGrcAttention1d
from lsvision.train.engine import all_reduce_grc_caches

TINY = dict(max_len=24, dim=32, num_heads=2, mlp_hidden=48, vocab_size=16)


def _tiny(name: str, **kw) -> nn.Module:
    cfg = dict(TINY, window_size=4, dp_rank=3) if name.startswith('ls_') else dict(TINY)
    cfg.update(kw)
    return seq.create_model(name, **cfg)


def _ids(lengths, n, vocab=16, seed=0):
    """Token ids (len(lengths), n): sample b has lengths[b] real tokens (ids 1..vocab-1), then padding (0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), n), generator=g)
    for b, length in enumerate(lengths):
        ids[b, length:] = 0
    return ids


@pytest.mark.parametrize('prefix,seq_len,n,lengths', [
    (0, 12, 12, None),             # no padding, n = T_m: the summary is the tokens themselves
    (0, 20, 16, [14, 16, 3]),      # up-sampling; 14 -> 20 is where F.interpolate's float32 scale is off by one
    (1, 10, 16, [10, 7, 0]),       # padding beyond T_m (real tokens fit), cls slot, a sample without tokens
])
@pytest.mark.parametrize('summary_src,eval_update', [('self', True), ('input', False)])
@pytest.mark.parametrize('training', [True, False])
def test_layer_matches_reference_fp64(prefix, seq_len, n, lengths, summary_src, eval_update, training):
    torch.manual_seed(0)
    B, D = 3, 32
    grc = GatedRecurrentCache1d(D, 2, seq_len, num_prefix_tokens=prefix,
                                config=GrcConfig(summary_src=summary_src, eval_update=eval_update)).double()
    perturb(grc).train(training)
    with torch.no_grad():
        grc.cache.copy_(torch.randn_like(grc.cache))  # a filled cache
    start = grc.cache.clone()
    x = torch.randn(B, prefix + n, D, dtype=torch.float64)
    o_self = torch.randn(B, prefix + n, D, dtype=torch.float64)
    mask = None if lengths is None else torch.arange(n)[None] < torch.tensor(lengths)[:, None]
    out = grc(x, o_self, mask)
    ref, ref_cache = grc_sequence_reference(grc, x, o_self, mask, start.double(), training)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(grc.cache, ref_cache, rtol=0, atol=1e-6)  # the store rounds to fp32
    if not training:
        assert torch.equal(grc.cache, start)
    assert grc.cache.shape == (1, prefix + seq_len, D // 2)


def test_layer_defaults_and_pad_values_never_matter():
    """r = 0.5 (first half of the channels), lam init 0, zero cache; the values at pad positions change neither the
    stored cache nor any real token's output (bit for bit)."""
    torch.manual_seed(0)
    grc = GatedRecurrentCache1d(32, 2, 16)
    assert grc.cache_dim == 16 and torch.equal(grc.lam, torch.zeros(2)) and not grc.cache.any()
    perturb(grc).train()
    x, o_self = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    mask = torch.arange(16)[None] < torch.tensor([[11], [16]])
    out = grc(x, o_self, mask)
    cache = grc.cache.clone()
    grc.reset_cache()
    x2, o2 = x.clone(), o_self.clone()
    x2[~mask] = 100 * torch.randn_like(x2[~mask])
    o2[~mask] = -50.
    out2 = grc(x2, o2, mask)
    assert torch.equal(grc.cache, cache) and cache.any()
    assert torch.equal(out2[mask], out[mask])


def _encoder_reference(encoder, ids, caches, training):
    """The LRA encoder (drop 0) restated with the dense attention references and the GRC reference: pooled features
    and the caches after the call."""
    B, n = ids.shape
    mask = ids != encoder.pad_id
    x = F.embedding(ids, encoder.embed.weight) + encoder.pos_embed.weight[:n][None]
    new_caches = []
    for i, blk in enumerate(encoder.blocks):
        last = i == len(encoder.blocks) - 1
        cls = encoder.cls_token.expand(B, -1, -1) if (last and encoder.cls_token is not None) else None
        h = layer_norm(x, blk.norm1)
        if isinstance(blk.attn, LongShortAttention1d):
            o_self = dense_long_short_attention_1d(blk.attn, h, mask, cls)
        else:
            o_self = full_attention_1d(blk.attn, h, mask, cls)
        grc_in = h if cls is None else torch.cat([cls, h], dim=1)
        out, cache = grc_sequence_reference(blk.attn.grc, grc_in, o_self, mask, caches[i], training)
        new_caches.append(cache)
        if cls is not None:
            x = torch.cat([cls, x], dim=1)
        x = x + out
        mlp = blk.mlp
        x = x + F.linear(F.gelu(F.linear(layer_norm(x, blk.norm2), mlp.fc1.weight, mlp.fc1.bias)),
                         mlp.fc2.weight, mlp.fc2.bias)
    x = layer_norm(x, encoder.norm)
    if encoder.cls_token is not None:
        return x[:, 0], new_caches
    m = mask[..., None].to(x.dtype)
    return (x * m).sum(1) / m.sum(1), new_caches


@pytest.mark.parametrize('name,pool', [('ls_grc_lra_listops', 'cls'), ('ls_grc_lra_listops', 'mean_real'),
                                       ('grc_lra_listops', 'cls')])
def test_encoder_logits_caches_and_gradients_match_dense_reference(name, pool):
    """Train mode from filled caches: logits, the stored caches and every parameter's gradient of the model (its fast
    long-short attention, with the recomputing LN backward) against the dense masked references, fp64."""
    torch.manual_seed(0)
    model = perturb(_tiny(name, pool=pool).double()).train()
    with torch.no_grad():
        model(_ids([20, 13, 24], 24, seed=1))  # fill the caches
    start = [c.double() for c in grc_caches(model)]
    ids = _ids([17, 24, 5], 24, seed=2)
    weight = torch.randn(3, 10, dtype=torch.float64)
    params = [p for p in model.parameters()]
    logits = model(ids)
    grads = torch.autograd.grad((logits * weight).sum(), params)
    stored = grc_caches(model)

    feats, ref_caches = _encoder_reference(model.encoder, ids, start, training=True)
    ref_logits = model.head(feats)
    ref_grads = torch.autograd.grad((ref_logits * weight).sum(), params)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-10)
    for a, b in zip(stored, ref_caches):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-6)
    names = [n for n, _ in model.named_parameters()]
    for name_, g, r in zip(names, grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-10, msg=name_)
    # every GRC parameter learns, except (cls pooling) the last block's PE: only the cls output is pooled, and the
    # prefix token gets no PE (as in ViT-GRC's last block)
    unused = {'encoder.blocks.1.attn.grc.pe.weight', 'encoder.blocks.1.attn.grc.pe.bias'} if pool == 'cls' else set()
    assert {n_ for n_, g in zip(names, grads) if '.grc.' in n_ and not g.abs().sum() > 0} == unused


@pytest.mark.parametrize('name', ['grc_lra_listops', 'ls_grc_lra_listops'])
@pytest.mark.parametrize('pool', ['cls', 'mean_real'])
def test_padding_never_reaches_cache_or_outputs(name, pool):
    """The same real tokens with 0, 3 or 11 pads after them: the same stored caches (train) and logits (train and
    eval), and the eval caches stay as they were."""
    torch.manual_seed(0)
    model = perturb(_tiny(name, pool=pool, max_len=32).double())
    real = _ids([9, 13, 5], 13, seed=3)
    results = []
    for extra in (0, 3, 11):
        model.reset_cache()
        ids = torch.cat([real, torch.zeros(3, extra, dtype=torch.long)], dim=1)
        model.train()
        train_logits = model(ids)
        caches = grc_caches(model)
        model.eval()
        with torch.no_grad():
            eval_logits = model(ids)
        assert all(torch.equal(a, b) for a, b in zip(caches, grc_caches(model)))  # frozen in eval
        results.append((train_logits.detach(), caches, eval_logits))
    for logits, caches, eval_logits in results[1:]:
        torch.testing.assert_close(logits, results[0][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(eval_logits, results[0][2], rtol=0, atol=1e-12)
        for a, b in zip(caches, results[0][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize('name', ['grc_lra_listops', 'ls_grc_lra_listops'])
def test_eval_is_per_sample_and_cache_frozen_updated_in_train(name):
    torch.manual_seed(0)
    model = perturb(_tiny(name)).train()
    assert all(not c.any() for c in grc_caches(model))  # zero initial cache
    ids = _ids([20, 7, 24, 12], 24, seed=4)
    with torch.no_grad():  # the update is stored in train mode also without a graph (as in vision)
        model(ids)
    trained = grc_caches(model)
    assert all(c.any() for c in trained)
    model(ids[:2]).sum().backward()
    assert all(not torch.equal(a, b) for a, b in zip(trained, grc_caches(model)))  # every train forward updates
    model.eval()
    frozen = grc_caches(model)
    with torch.no_grad():
        batch = model(ids)
        alone = torch.cat([model(ids[b:b + 1, :int((ids[b] != 0).sum())]) for b in range(4)])
        permuted = model(ids.flip(0)).flip(0)
    torch.testing.assert_close(alone, batch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(permuted, batch, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(frozen, grc_caches(model)))


def test_bad_input_names_both_lengths():
    grc = GatedRecurrentCache1d(32, 2, 8)
    x = torch.randn(2, 12, 32)
    with pytest.raises(ValueError, match='10 real tokens is longer than the GRC cache \\(T_m = 8'):
        grc(x, x, torch.arange(12)[None] < torch.tensor([[10], [6]]))
    assert grc(x, x, torch.arange(12)[None] < torch.tensor([[8], [6]])).shape == (2, 12, 32)  # pads beyond T_m: fine
    with pytest.raises(ValueError, match='12 real tokens is longer than the GRC cache \\(T_m = 8'):
        grc(x, x)
    with pytest.raises(ValueError, match='interp_mode'):
        GatedRecurrentCache1d(32, 2, 8, config=GrcConfig(interp_mode='2d'))
    model = _tiny('ls_grc_lra_listops')
    with pytest.raises(ValueError, match='longer than max_len=24'):
        model(torch.ones(1, 30, dtype=torch.long))
    other = _tiny('ls_grc_lra_listops', max_len=40)
    with pytest.raises(ValueError, match='cache in the checkpoint has T_m = 40 .*this model has T_m = 24'):
        model.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match='cls slot'):
        model.encoder.set_pool('mean_real')


def test_grc_options_reach_every_layer():
    model = _tiny('grc_lra_listops', grc_ratio=0.25, grc_lam_init=-1.0, grc_sync_cache=True)
    grcs = grc_modules(model)
    assert len(grcs) == 2 and all(g.cache_dim == 8 and g.sync_cache and torch.equal(g.lam, -torch.ones(2))
                                  for g in grcs)
    assert [g.cache.shape for g in grcs] == [(1, 24, 8), (1, 25, 8)]  # the last layer has the cls slot
    assert [type(b.attn) for b in model.encoder.blocks] == [FullGrcAttention1d] * 2
    assert type(_tiny('ls_grc_lra_listops').encoder.blocks[0].attn) is LongShortGrcAttention1d
    with pytest.raises(TypeError, match='grc_nope'):
        _tiny('grc_lra_listops', grc_nope=1)


def _ddp_worker(rank, world, port, path, batches):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank, world_size=world)
    try:
        for mode in ('layer_sync', 'engine_sync'):
            torch.manual_seed(0)
            # mean pooling: with cls pooling the last block's PE is unused, which DDP refuses by default
            model = _tiny('ls_grc_lra_listops', pool='mean_real', grc_sync_cache=mode == 'layer_sync').train()
            ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.)
            for ids in batches:
                ddp(ids.chunk(world)[rank]).sum().backward()
                opt.step()
                opt.zero_grad()
                if mode == 'engine_sync':
                    all_reduce_grc_caches(grc_modules(model))  # what the training loop does once per optimizer step
            torch.save(grc_caches(model), os.path.join(path, f'{mode}{rank}.pth'))
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_caches_agree_and_equal_the_global_batch(tmp_path):
    """2 gloo processes with different samples (and padding): the per-forward sync (grc_sync_cache) and the training
    loop's all-reduce after each step both leave identical caches on both ranks, equal to one process on the
    global batch (the ranks hold the same number of samples)."""
    batches = [_ids([24, 10, 17, 3], 24, seed=5), _ids([8, 24, 21, 15], 24, seed=6)]
    mp.start_processes(_ddp_worker, args=(2, free_port(), str(tmp_path), batches), nprocs=2, join=True,
                       start_method=forkserver())
    torch.manual_seed(0)
    model = _tiny('ls_grc_lra_listops', pool='mean_real').train()
    with torch.no_grad():
        for ids in batches:
            model(ids)
    single = grc_caches(model)
    for mode in ('layer_sync', 'engine_sync'):
        r0 = torch.load(tmp_path / f'{mode}0.pth', weights_only=True)
        r1 = torch.load(tmp_path / f'{mode}1.pth', weights_only=True)
        for a, b, c in zip(r0, r1, single):
            assert torch.equal(a, b), mode
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_reparameterized_model_gives_the_same_eval_outputs():
    """timm's reparameterize_model folds the frozen-cache gate terms of the sequence GRC layers too (the 1D PE conv
    stays as it is)."""
    from timm.models import reparameterize_model
    torch.manual_seed(0)
    model = perturb(_tiny('ls_grc_lra_listops')).train()
    with torch.no_grad():
        model(_ids([20, 11], 24, seed=7))
    model.eval()
    folded = reparameterize_model(model)
    assert all(g.reparameterized and g.linear_reset is None and isinstance(g.pe, nn.Conv1d)
               for g in grc_modules(folded))
    ids = _ids([24, 9, 15], 24, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(folded(ids), model(ids), rtol=1e-5, atol=1e-6)
