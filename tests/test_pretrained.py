"""`pretrained=True`: the authors' released weights through timm's own download paths, offline.

The caches are filled the way the downloads would fill them (``tests/released_weights.py``): the Hub's
microsoft/cvt-* repositories hold a transformers ``CvtForImageClassification`` as ``pytorch_model.bin`` only, in a
Hugging Face cache read with ``HF_HUB_OFFLINE=1``; NVIDIA/transformer-ls ``model_best.pth`` files sit in timm's cache
(``$TORCH_HOME/hub/checkpoints``) under each tag's own name. Then the plain ``timm.create_model(name,
pretrained=True)`` runs. References: transformers' CvT with QuickGELU (Microsoft's activation) on the same weights,
and the official ViL-LS outputs (tests/golden) through the same download path. Nothing touches the network.
"""
import logging
import os
import shutil
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
import torch
from released_weights import (
    CVT_ARCHS,
    assert_loaded_from,
    official_vil_checkpoint,
    official_vil_shapes,
    put_in_hub_cache,
    transformers_cvt,
    transformers_logits,
    vil_cache_file,
)

import timm

import lsvision  # noqa: F401  (registers the models)
import lsvision.sequence as seq
from lsvision.models import CheckpointMismatchError
from lsvision.models._pretrained import NoPretrainedWeightsError, PretrainedDownloadError
from lsvision.models.cvt import checkpoint_filter_fn
from lsvision.models.vil_ls import OFFICIAL_CHECKPOINTS, parse_official_arch

ATOL = 1e-4  # the bound on logits against the reference implementation
# tiny widths; depth[i] > i, as transformers' CvtStage indexes its per-stage drop-path rates by the stage
TINY_CVT = ((16, 32, 48), (1, 2, 3), (1, 2, 3))
TINY_CVT_KWARGS = dict(embed_dims=(16, 32, 48), num_heads=(1, 2, 3), depths=(1, 2, 3))


def _hub_id(name: str) -> str:
    return timm.models.get_pretrained_cfg(name).hf_hub_id


def _save_to_hub(hub: Path, name: str, reference: torch.nn.Module, tmp_path: Path) -> Path:
    file = tmp_path / f'{name}.bin'
    torch.save(reference.state_dict(), file)
    return put_in_hub_cache(hub, _hub_id(name), file)


# --- CvT: the Hub's transformers-layout weights ------------------------------------------------------------------

@pytest.mark.parametrize('name,arch', [
    ('cvt_13', 'cvt_13'), ('cvt_13_384', 'cvt_13'), ('cvt_21', 'cvt_21'), ('cvt_21_384', 'cvt_21')])
def test_cvt_pretrained_gives_the_reference_logits(name, arch, caches, tmp_path, caplog):
    hub, _ = caches
    reference = transformers_cvt(arch, seed=len(name))
    file = _save_to_hub(hub, name, reference, tmp_path)
    with caplog.at_level(logging.WARNING):
        model = timm.create_model(name, pretrained=True).eval()  # no other argument
    assert 'head is not loaded' not in caplog.text
    assert model.pretrained_cfg['hf_hub_id'] == f"microsoft/{name.replace('_', '-')}"
    assert_loaded_from(model, torch.load(file, weights_only=True))
    size = model.pretrained_cfg['input_size'][-1]
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)
    expected = transformers_logits(reference, x)
    assert logits.shape == (2, 1000)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    assert expected.std() > 0.1  # the weights move the logits: the comparison can fail


def test_reference_activation_is_the_one_that_matters(caches, tmp_path):
    """transformers' own port (GELU) gives other logits than Microsoft's QuickGELU on the same weights: the reference
    would catch an lsvision CvT that followed transformers instead of Microsoft."""
    hub, _ = caches
    reference = transformers_cvt(TINY_CVT, seed=3, quick_gelu=False)
    _save_to_hub(hub, 'cvt_13', reference, tmp_path)
    model = timm.create_model('cvt_13', pretrained=True, **TINY_CVT_KWARGS).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        gap = (model(x) - transformers_logits(reference, x)).abs().max()
    assert gap > 1e-3


@pytest.mark.parametrize('name,tags', [
    ('cvt_13_384', ('ms_in1k', 'ms_in22k_ft_in1k')), ('cvt_21_384', ('ms_in1k', 'ms_in22k_ft_in1k'))])
def test_each_tag_loads_its_own_repository(name, tags, caches, tmp_path):
    """The 22k -> 1k fine-tunes are tags of the 384 models, each from its own Hub repository; the plain name is the
    ImageNet-1k one."""
    hub, _ = caches
    files = {}
    for seed, tag in enumerate(tags):
        files[tag] = _save_to_hub(hub, f'{name}.{tag}', transformers_cvt(TINY_CVT, seed=seed), tmp_path)
    assert len({_hub_id(f'{name}.{tag}') for tag in tags}) == len(tags)
    for tag in tags:
        model = timm.create_model(f'{name}.{tag}', pretrained=True, **TINY_CVT_KWARGS)
        assert_loaded_from(model, torch.load(files[tag], weights_only=True))
    default = timm.create_model(name, pretrained=True, **TINY_CVT_KWARGS)
    assert default.pretrained_cfg['tag'] == 'ms_in1k'


@pytest.mark.parametrize('name,arch', [('cvt_13', 'cvt_13'), ('cvt_21', 'cvt_21'), ('cvt_w24_384', 'cvt_w24')])
def test_transformers_layout_covers_every_key_at_full_size(name, arch):
    """Every key and shape of transformers' CvT of the released configurations lands on the lsvision model (meta
    tensors: CvT-W24 has 277M parameters)."""
    from transformers import CvtConfig, CvtForImageClassification
    dims, heads, depths = CVT_ARCHS[arch]
    with torch.device('meta'):
        reference = CvtForImageClassification(CvtConfig(
            embed_dim=list(dims), num_heads=list(heads), depth=list(depths), num_labels=1000))
    model = timm.create_model(name, device='meta')
    converted = checkpoint_filter_fn(reference.state_dict(), model)  # raises naming any key it cannot place
    expected = model.state_dict()
    assert set(converted) == set(expected)
    assert all(converted[k].shape == expected[k].shape for k in expected)


def test_another_class_count_drops_the_head_and_says_so(caches, tmp_path, caplog):
    hub, _ = caches
    reference = transformers_cvt(TINY_CVT, seed=5)
    _save_to_hub(hub, 'cvt_13', reference, tmp_path)
    full = timm.create_model('cvt_13', pretrained=True, **TINY_CVT_KWARGS).eval()
    with caplog.at_level(logging.WARNING):
        model = timm.create_model('cvt_13', pretrained=True, num_classes=10, **TINY_CVT_KWARGS).eval()
    assert '1000-class head is not loaded into a model of 10 classes' in caplog.text
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True),
                                   full.forward_head(full.forward_features(x), pre_logits=True))
        assert model(x).shape == (1, 10)


# --- ViL-LS: the official model_best.pth files, each cached under its own name ------------------------------------

def test_three_official_files_have_three_cache_names():
    urls = [timm.models.get_pretrained_cfg(name).url for name in OFFICIAL_CHECKPOINTS]
    assert all(os.path.basename(url.split('?')[0]) == 'model_best.pth' for url, _ in urls)  # why a name is needed
    assert all(url.endswith('?dl=1') for url, _ in urls)  # Dropbox serves the file, not its page
    assert len({file for _, file in urls}) == 3
    assert all(timm.models.get_pretrained_cfg(name).custom_load for name in OFFICIAL_CHECKPOINTS)


@pytest.mark.parametrize('golden,name', [('tiny224', 'vil_ls_medium'), ('tiny384', 'vil_ls_medium_384')])
def test_official_file_through_the_download_path_gives_official_outputs(golden, name, golden_dir, caches):
    """The golden checkpoint (the official model's, model_best.pth layout) in the tag's cache place: the tag's own
    path (timm's download_cached_file, custom_load, load_pretrained) gives the official logits."""
    _, torch_home = caches
    shutil.copy(golden_dir / f'{golden}.pth', vil_cache_file(torch_home, name))
    io = torch.load(golden_dir / f'{golden}_io.pt', weights_only=True)
    kwargs = dict(parse_official_arch(io['arch']), img_size=io['img_size'], num_classes=10)
    model = timm.create_model(name, pretrained=True, **kwargs).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(io['input']), io['logits'], rtol=0, atol=ATOL)


@pytest.mark.parametrize('name', list(OFFICIAL_CHECKPOINTS))
def test_released_vil_ls_file_loads_with_no_argument(name, caches):
    """A full-size file of the official trainer (official keys, `net` of a DDP model, numpy best_acc, optimizer
    state), as downloaded: `timm.create_model(name, pretrained=True)` loads every tensor, head included."""
    _, torch_home = caches
    checkpoint = official_vil_checkpoint(official_vil_shapes(name), seed=len(name))
    path = vil_cache_file(torch_home, name)
    torch.save(checkpoint, path)
    with pytest.raises(Exception, match='numpy'):  # plain weights_only refuses the numpy scalar
        torch.load(path, weights_only=True)
    model = timm.create_model(name, pretrained=True).eval()
    net = {k[len('module.'):]: v for k, v in checkpoint['net'].items()}
    assert torch.equal(model.head.weight, net['head.weight'])
    assert_loaded_from(model, net)
    size = model.pretrained_cfg['input_size'][-1]
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, size, size))).all()


def test_official_file_of_another_class_count(golden_dir, caches, caplog):
    """num_classes other than the file's: the head is dropped with a warning, the rest loads (custom_load path)."""
    _, torch_home = caches
    shutil.copy(golden_dir / 'tiny224.pth', vil_cache_file(torch_home, 'vil_ls_medium'))
    io = torch.load(golden_dir / 'tiny224_io.pt', weights_only=True)
    kwargs = dict(parse_official_arch(io['arch']), img_size=224)
    full = timm.create_model('vil_ls_medium', pretrained=True, num_classes=10, **kwargs).eval()
    with caplog.at_level(logging.WARNING):
        model = timm.create_model('vil_ls_medium', pretrained=True, num_classes=5, **kwargs).eval()
    assert '10-class head is not loaded into a model of 5 classes' in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(model.forward_head(model.forward_features(io['input']), pre_logits=True),
                                   full.forward_head(full.forward_features(io['input']), pre_logits=True))


# --- no released weights, bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize('name', ['cvt_ls_13', 'cvt_ls_21s_384', 'pvt_v2_b0_grc', 'pvt_tiny_grc', 'pvt_tiny',
                                  'swin_tiny_patch4_window7_224_grc', 'deit_small_patch16_224_grc'])
def test_no_released_weights_names_the_card_and_the_overlay_line(name, caches):
    with pytest.raises(NoPretrainedWeightsError) as e:
        timm.create_model(name, pretrained=True)
    assert f'model_cards/{name}.md' in str(e.value)
    assert f"timm.create_model('{name}', pretrained=True, pretrained_cfg_overlay=dict(file=" in str(e.value)
    assert (Path(__file__).resolve().parents[1] / 'model_cards' / f'{name}.md').exists()


@pytest.mark.parametrize('name', ['hsw_tiny', 'ls_lra_listops', 'ls_lm_enwik8_small'])
def test_sequence_models_say_they_have_no_weights(name):
    with pytest.raises(NoPretrainedWeightsError, match='load_official_checkpoint'):
        seq.create_model(name, pretrained=True)


@pytest.mark.parametrize('name', ['cvt_13', 'vil_ls_medium', 'cvt_ls_13'])
def test_missing_overlay_file_is_named(name, tmp_path):
    path = tmp_path / 'no_such_dir' / 'weights.pth'
    with pytest.raises(FileNotFoundError, match=str(path)):
        timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def test_hub_download_failure_names_the_repository_and_the_cache(caches):
    hub, _ = caches
    with pytest.raises(PretrainedDownloadError) as e:
        timm.create_model('cvt_21_384.ms_in22k_ft_in1k', pretrained=True)
    message = str(e.value)
    assert "'microsoft/cvt-21-384-22k'" in message and str(hub) in message
    assert 'https://huggingface.co/microsoft/cvt-21-384-22k/resolve/main/pytorch_model.bin' in message
    assert 'HF_HUB_OFFLINE is set, so only the cache was read' in message


@pytest.fixture
def unreachable_hub(caches, monkeypatch):
    """HF_HUB_OFFLINE unset and a Hub that does not answer: a closed port on this machine (no connection is made)."""
    monkeypatch.delenv('HF_HUB_OFFLINE')
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', False)
    monkeypatch.setattr(hf_constants, 'ENDPOINT', 'http://127.0.0.1:9')
    monkeypatch.setattr(hf_constants, 'HUGGINGFACE_CO_URL_TEMPLATE',
                        'http://127.0.0.1:9/{repo_id}/resolve/{revision}/{filename}')
    return caches


def test_unreachable_hub_fails_without_retries_and_names_hf_hub_offline(unreachable_hub, caplog):
    """Without the check huggingface_hub retries each of timm's two file names five times (about 23 s each)."""
    with caplog.at_level(logging.INFO, logger='huggingface_hub'), pytest.raises(PretrainedDownloadError) as e:
        timm.create_model('cvt_13', pretrained=True)
    assert 'Retrying' not in caplog.text
    message = str(e.value)
    assert "'microsoft/cvt-13'" in message and 'ConnectError' in message
    assert 'on a machine without network, HF_HUB_OFFLINE=1 reads only the cache' in message


def test_cached_weights_load_while_the_hub_is_unreachable(unreachable_hub, tmp_path, caplog):
    """Cached weights load at once: timm asks for model.safetensors first, which the cache does not have, and without
    the check huggingface_hub would retry it for about 23 s before timm falls back to the cached pytorch_model.bin."""
    hub, _ = unreachable_hub
    file = _save_to_hub(hub, 'cvt_13', transformers_cvt(TINY_CVT, seed=5), tmp_path)
    with caplog.at_level(logging.INFO):
        model = timm.create_model('cvt_13', pretrained=True, **TINY_CVT_KWARGS)
    assert 'Retrying' not in caplog.text
    assert 'the Hugging Face Hub does not answer' in caplog.text
    assert 'HF_HUB_OFFLINE=1 reads only the cache' in caplog.text
    assert model.pretrained_cfg['hf_hub_id'] == 'microsoft/cvt-13'
    assert_loaded_from(model, torch.load(file, weights_only=True))


def test_url_download_failure_names_the_url_and_the_cache_file(caches):
    """The tag's own URL is not fetched in a test; a closed port on this machine fails the same way."""
    _, torch_home = caches
    url = ('http://127.0.0.1:9/model_best.pth?dl=1', 'vil_ls_medium.nv_in1k.pth')
    with pytest.raises(PretrainedDownloadError) as e:
        timm.create_model('vil_ls_medium', pretrained=True, pretrained_cfg_overlay=dict(url=url))
    message = str(e.value)
    assert url[0] in message
    assert str(torch_home / 'hub' / 'checkpoints' / 'vil_ls_medium.nv_in1k.pth') in message


def test_file_of_another_architecture_names_both(golden_dir, caches, tmp_path):
    hub, torch_home = caches
    shutil.copy(golden_dir / 'tiny224.pth', vil_cache_file(torch_home, 'vil_ls_base'))
    with pytest.raises(CheckpointMismatchError) as e:
        timm.create_model('vil_ls_base', pretrained=True)
    assert 'vil_ls_base' in str(e.value) and OFFICIAL_CHECKPOINTS['vil_ls_base'][0] in str(e.value)
    _save_to_hub(hub, 'cvt_21', transformers_cvt(TINY_CVT), tmp_path)
    with pytest.raises(CheckpointMismatchError) as e:
        timm.create_model('cvt_21', pretrained=True)
    assert 'cvt_21' in str(e.value) and 'microsoft/cvt-21' in str(e.value) and 'missing' in str(e.value)


# --- CvT against Microsoft's own code (tests/golden/cvt_official) -------------------------------------------------

# Microsoft's CvT names -> transformers' (written here from the two codebases' module trees, not from lsvision's map)
_MS_BLOCK = {
    'norm1': 'layernorm_before', 'norm2': 'layernorm_after', 'attn.proj': 'attention.output.dense',
    'mlp.fc1': 'intermediate.dense', 'mlp.fc2': 'output.dense',
    **{f'attn.proj_{x}': f'attention.attention.projection_{full}' for x, full in (
        ('q', 'query'), ('k', 'key'), ('v', 'value'))},
    **{f'attn.conv_proj_{x}.{part}': f'attention.attention.convolution_projection_{full}.convolution_projection.'
       f'{hf_part}' for x, full in (('q', 'query'), ('k', 'key'), ('v', 'value'))
       for part, hf_part in (('conv', 'convolution'), ('bn', 'normalization'))},
}


def _microsoft_to_transformers(key: str) -> str:
    if key.startswith(('norm.', 'head.')):
        return {'norm': 'layernorm', 'head': 'classifier'}[key.split('.')[0]] + key[key.index('.'):]
    stage, rest = key.split('.', 1)
    prefix = f'cvt.encoder.stages.{int(stage[len("stage"):])}.'
    if rest == 'cls_token':
        return prefix + rest
    if rest.startswith('patch_embed.'):
        module, param = rest[len('patch_embed.'):].split('.', 1)
        return prefix + 'embedding.convolution_embeddings.' + {'proj': 'projection', 'norm': 'normalization'}[
            module] + '.' + param
    _, block, tail = rest.split('.', 2)  # blocks.{j}.<module path>.<param>
    module, param = tail.rsplit('.', 1)
    return f'{prefix}layers.{block}.{_MS_BLOCK[module]}.{param}'


def test_microsoft_names_map_onto_transformers_layout():
    """The test's own Microsoft -> transformers map gives exactly transformers' keys for CvT-13."""
    from official_layouts import microsoft_cvt
    from transformers import CvtConfig, CvtForImageClassification
    with torch.device('meta'):
        expected = set(CvtForImageClassification(CvtConfig(num_labels=1000)).state_dict())
    microsoft = microsoft_cvt(timm.create_model('cvt_13', device='meta'))
    assert {_microsoft_to_transformers(k) for k in microsoft} == expected


@pytest.mark.parametrize('size', ['96x128', '224'])
def test_hub_layout_of_microsofts_weights_gives_microsofts_logits(size, golden_root, caches, tmp_path):
    """Microsoft's tiny CvT (their code's weights and logits), saved in the Hub's transformers layout and fetched by
    `pretrained=True`: the logits of Microsoft's code."""
    hub, _ = caches
    weights = torch.load(golden_root / 'cvt_official' / 'tiny_cvt.pth', weights_only=True)
    io = torch.load(golden_root / 'cvt_official' / 'tiny_cvt_io.pt', weights_only=True)
    file = tmp_path / 'pytorch_model.bin'
    torch.save({_microsoft_to_transformers(k): v for k, v in weights.items()}, file)
    put_in_hub_cache(hub, _hub_id('cvt_13'), file)
    model = timm.create_model(  # a 10-class head: the cfg's class count too, or timm leaves the head out
        'cvt_13', pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(num_classes=10),
        embed_dims=(16, 32, 48), num_heads=(1, 2, 3), depths=(1, 1, 2)).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(io[f'x_{size}']), io[f'logits_{size}'], rtol=0, atol=ATOL)


def test_other_input_channels_adapt_the_first_conv(caches, golden_dir, tmp_path):
    """in_chans=1 with pretrained=True: timm's adapt_input_conv (channel sum) on both paths, the Hub one (timm's
    loader) and ViL-LS's custom_load."""
    hub, torch_home = caches
    reference = transformers_cvt(TINY_CVT, seed=7)
    _save_to_hub(hub, 'cvt_13', reference, tmp_path)
    model = timm.create_model('cvt_13', pretrained=True, in_chans=1, **TINY_CVT_KWARGS)
    rgb = reference.state_dict()['cvt.encoder.stages.0.embedding.convolution_embeddings.projection.weight']
    torch.testing.assert_close(model.stages[0].patch_embed.proj.weight, rgb.sum(1, keepdim=True))
    shutil.copy(golden_dir / 'tiny224.pth', vil_cache_file(torch_home, 'vil_ls_medium'))
    io = torch.load(golden_dir / 'tiny224_io.pt', weights_only=True)
    kwargs = dict(parse_official_arch(io['arch']), img_size=224, num_classes=10)
    model = timm.create_model('vil_ls_medium', pretrained=True, in_chans=1, **kwargs)
    rgb = torch.load(golden_dir / 'tiny224.pth', weights_only=True)['net']['module.layer1.0.proj.weight']
    torch.testing.assert_close(model.stages[0].patch_embed.proj.weight, rgb.sum(1, keepdim=True))
