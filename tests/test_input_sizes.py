"""Input sizes as timm users set them: `img_size=` at creation and `set_input_size` afterwards, for every family."""
import pytest
import torch

import timm

import lsvision  # noqa: F401  (registers the models)

TINY_CVT_LS = dict(
    embed_dims=(16, 32, 64), num_heads=(1, 2, 4), depths=(1, 1, 2), window_sizes=(4, 2, 2), dp_ranks=(4, 2, 2))
TINY_PVT = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 40, 64))


@pytest.mark.parametrize('name,native', [('cvt_13', 224), ('cvt_ls_13', 224), ('cvt_13_384', 384),
                                         ('cvt_ls_13_384', 384)])
def test_cvt_takes_img_size_and_set_input_size(name, native):
    kwargs = dict(TINY_CVT_LS) if name.startswith('cvt_ls') else dict(embed_dims=(16, 32, 64), num_heads=(1, 2, 4),
                                                                       depths=(1, 1, 2))
    assert timm.create_model(name, **kwargs).img_size == (native, native)
    model = timm.create_model(name, img_size=96, **kwargs).eval()
    assert model.img_size == (96, 96)
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        before = model(x)
        model.set_input_size((128, 96))
        assert model.img_size == (128, 96)
        assert torch.equal(model(x), before)  # nothing in CvT is sized by the input
    with pytest.raises(ValueError, match='smaller than the smallest'):
        model.set_input_size(8)


@pytest.mark.parametrize('grc', [False, True])
def test_pvt_set_input_size_resamples_pos_embed_and_caches(grc):
    torch.manual_seed(0)
    model = timm.create_model('pvt_tiny_grc' if grc else 'pvt_tiny', img_size=64, num_classes=10, **TINY_PVT).eval()
    for stage in model.stages:
        torch.nn.init.normal_(stage.pos_embed)
    x = torch.randn(2, 3, 96, 64)
    with torch.no_grad():
        before = model(x)
        model.set_input_size((96, 64))
    assert model.img_size == (96, 64)
    grids = [(24, 16), (12, 8), (6, 4), (3, 2)]
    for stage, grid in zip(model.stages, grids):
        assert stage.grid_size == grid
        assert stage.pos_embed.shape[1] == stage.num_prefix_tokens + grid[0] * grid[1]
        assert stage.pos_embed.requires_grad
        for blk in stage.blocks:
            if grc:
                assert blk.attn.grc.cache_hw == grid
                assert blk.attn.grc.cache.shape[1] == stage.num_prefix_tokens + grid[0] * grid[1]
            else:
                assert not hasattr(blk.attn, 'grc')
    if not grc:  # the stored embeddings are the ones forward resampled on the fly
        with torch.no_grad():
            torch.testing.assert_close(model(x), before)
    with torch.no_grad():
        assert model(x).isfinite().all()


def test_pvt_v2_grc_set_input_size_resizes_caches():
    model = timm.create_model('pvt_v2_b0_grc', img_size=64, depths=(1, 1, 1, 1), num_classes=10).eval()
    model.set_input_size(96)
    grids = [(24, 24), (12, 12), (6, 6), (3, 3)]
    for stage, grid in zip(model.stages, grids):
        for blk in stage.blocks:
            assert blk.attn.grc.cache_hw == grid
    with torch.no_grad():
        assert model(torch.randn(1, 3, 96, 96)).shape == (1, 10)


@pytest.mark.parametrize('name', ['vit_small_patch16_224_grc', 'deit_small_patch16_224_grc'])
def test_vit_grc_takes_non_square_grids_with_dynamic_img_size(name):
    torch.manual_seed(0)
    kwargs = dict(img_size=64, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    dynamic = timm.create_model(name, dynamic_img_size=True, **kwargs).eval()
    fixed = timm.create_model(name, **kwargs).eval()
    fixed.load_state_dict(dynamic.state_dict())
    square = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(square), fixed(square), rtol=0, atol=0)
        out = dynamic(torch.randn(2, 3, 64, 48))  # a 4 x 3 patch grid
    assert out.shape == (2, 10) and out.isfinite().all()
    with pytest.raises(ValueError, match='not a square grid'):  # timm's fixed-size path cannot know the grid
        fixed.blocks[0].attn(torch.randn(1, 13, 64))
