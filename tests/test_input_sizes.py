"""Input sizes as timm users set them: `img_size=` at creation and `set_input_size` afterwards, for every family;
inputs a model cannot take are explained."""
import pytest
import torch
from _helpers import TINY_CONFIGS, TINY_FAMILIES, tiny_model

import timm

import lsvision  # noqa: F401  (registers the models)

# the smallest input of each family built on lsvision's own stem and input check, in its tiny config (Swin- and
# ViT-GRC take timm's, which check the size only against img_size)
SMALLEST_INPUT = {'cvt_13': 16, 'cvt_ls_13': 16, 'vil_ls_medium': 32, 'pvt_tiny_grc': 32, 'pvt_v2_b0_grc': 32}


@pytest.mark.parametrize('name', list(SMALLEST_INPUT))
def test_wrong_input_is_explained(name):
    model = tiny_model(name).eval()
    with pytest.raises(AssertionError, match='expected 3 input channels, got 1; create the model with in_chans=1'):
        model(torch.randn(1, 1, 64, 64))
    smallest = SMALLEST_INPUT[name]
    with pytest.raises(AssertionError, match=f'input {smallest - 1}x64 is smaller than the smallest this model '
                                             f'takes \\({smallest}x{smallest}\\)'):
        model(torch.randn(1, 3, smallest - 1, 64))
    with pytest.raises(AssertionError, match=r'expected an image batch \(B, 3, H, W\), got a tensor of 3 dims'):
        model(torch.randn(3, 64, 64))
    with torch.no_grad():
        assert model(torch.randn(1, 3, smallest, smallest)).isfinite().all()  # the smallest itself runs


@pytest.mark.parametrize('name', ['swin_tiny_patch4_window7_224_grc', 'vit_small_patch16_224_grc'])
def test_wrong_input_is_explained_on_timm_stems(name):
    """Swin- and ViT-GRC run timm's stems: lsvision's check explains channels and dims, timm's a wrong size."""
    model = tiny_model(name).eval()
    with pytest.raises(AssertionError, match='expected 3 input channels, got 1; create the model with in_chans=1'):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(AssertionError, match=r'expected an image batch \(B, 3, H, W\), got a tensor of 3 dims'):
        model(torch.randn(3, 64, 64))
    with pytest.raises(AssertionError, match=r"Input height \(32\) doesn't match model \(64\)"):
        model(torch.randn(1, 3, 32, 64))


@pytest.mark.parametrize('name,native', [('cvt_13', 224), ('cvt_ls_13', 224), ('cvt_13_384', 384),
                                         ('cvt_ls_13_384', 384)])
def test_cvt_takes_img_size_and_set_input_size(name, native):
    kwargs = TINY_FAMILIES['cvt_ls_13' if name.startswith('cvt_ls') else 'cvt_13']
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
    name = 'pvt_tiny_grc' if grc else 'pvt_tiny'
    model = timm.create_model(name, **{**TINY_CONFIGS[name], 'num_classes': 10}).eval()
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
    model = timm.create_model('pvt_v2_b0_grc', **{**TINY_FAMILIES['pvt_v2_b0_grc'], 'num_classes': 10}).eval()
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
    kwargs = {**TINY_FAMILIES['vit_small_patch16_224_grc'], 'num_classes': 10}
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
