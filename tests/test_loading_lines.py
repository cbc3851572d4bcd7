"""The documented loading lines, run as written on checkpoints in the authors' layouts that the tests write.

* The CvT head: a Microsoft-layout checkpoint (lsvision's cvt_13 through the inverse key map) whose cls-token head
  is trained to disagree with the average-pooled one gives the cls-token logits with the documented call.
* Every `timm.create_model(..., pretrained=True, ...)` line of README.md and model_cards/*.md, and README's char-LM
  block, is parsed from the file and run in a folder that holds the file it names. Lines of one form (same family and
  call, the file named after the model) run once, for the smallest model; every line that names a released file (the
  Microsoft CvT files) runs, since the file, not the model, picks the weights.
* Every line that names no file (`pretrained=True` alone: the authors' released weights) runs against caches filled
  as the download would fill them (tests/released_weights.py): the Hub's transformers-layout file for CvT, the
  official `model_best.pth` under the tag's cache name for ViL-LS, offline.
"""
import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import huggingface_hub.constants as hf_constants
import pytest
import torch
import torch.nn as nn
from _helpers import perturb
from official_layouts import fairseq, microsoft_cvt, official_char_lm, official_pvt, official_vil
from released_weights import (
    assert_loaded_from,
    official_vil_checkpoint,
    official_vil_shapes,
    put_in_hub_cache,
    random_hub_state_dict,
    vil_cache_file,
)
from safetensors.torch import save_file

import timm

import lsvision  # noqa: F401  (registers the models)
import lsvision.sequence as seq
from lsvision.models import list_models
from lsvision.zoo import family_of

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / 'README.md'] + sorted((ROOT / 'model_cards').glob('*.md'))
CREATE = re.compile(r"timm\.create_model\('(?P<name>[\w.]+)'(?:[^()]|\([^()]*\))*\)")
MICROSOFT = re.compile(r'^CvT-(?P<depth>13|21)-(?P<size>224|384)x(?P=size)-IN-1k\.pth$')


def _loading_lines(released: bool = False) -> List[Tuple[str, str, str, str]]:
    """(document, model name, file named, call) of every documented timm loading line that names a file; with
    `released`, of those that name none (the released weights), with '' for the file."""
    lines = []
    for doc in DOCS:
        for m in CREATE.finditer(doc.read_text()):
            call = m.group(0)
            if 'pretrained=True' in call:
                file = re.search(r"file='([^']+)'", call)
                if file and not released:
                    lines.append((doc.name, m.group('name'), file.group(1), call))
                elif not file and released:
                    lines.append((doc.name, m.group('name'), '', call))
    return lines


def _grouped() -> Dict[Tuple[str, ...], List[Tuple[str, str, str, str]]]:
    """Lines by form: family, the call with the model (and a file named after it) abstracted, the file otherwise,
    and the model for a released file."""
    groups: Dict[Tuple[str, ...], List[Tuple[str, str, str, str]]] = {}
    for doc, name, file, call in _loading_lines():
        base = name[:-len('_grc')] if name.endswith('_grc') else name
        named_after_model = Path(file).stem in (name, base)
        form = call.replace(f"'{name}'", "'{name}'").replace(f"file='{file}'", "file='{file}'")
        # a released file of fixed architecture (Microsoft's CvT files) picks the weights: every such line runs
        released = name if MICROSOFT.match(file) else ''
        key = (family_of(name).title, form, '{file}' if named_after_model else file, released)
        groups.setdefault(key, []).append((doc, name, file, call))
    return groups


def _params() -> Dict[str, int]:
    return {n: m['params'] for n, m in json.loads((ROOT / 'model_cards' / 'measurements.json').read_text())[
        'models'].items()}


def _one_per_form() -> List[Tuple[str, str, str, str]]:
    params = _params()
    return [min(lines, key=lambda line: (params.get(line[1], 0), line[1], line[0])) for lines in _grouped().values()]


RUNS = [pytest.param(*line, id=f'{line[1]}:{line[2]}') for line in _one_per_form()]
RELEASED_RUNS = [pytest.param(*line, id=f'{line[0]}:{line[1]}') for line in _loading_lines(released=True)]


def _perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every float parameter moved off its init, so that a key loaded into the wrong place shows."""
    return perturb(model, 0.05, torch.Generator().manual_seed(seed)).eval()


def _writer(name: str, file: str) -> Tuple[Callable[[], nn.Module], Callable[[nn.Module], Dict]]:
    """How the file a line names is made: its source model and the authors' layout it is saved in."""
    m = MICROSOFT.match(file)
    if m:  # a released Microsoft CvT file: its architecture comes from the file name, not from the line
        return (lambda: timm.create_model(f"cvt_{m.group('depth')}")), microsoft_cvt
    if file == 'model_best.pth':
        return (lambda: timm.create_model(name)), official_vil
    stem = Path(file).stem
    if file.endswith('.safetensors'):  # the user's own checkpoint, lsvision layout
        return (lambda: timm.create_model(name)), lambda model: model.state_dict()
    if stem in list_models():  # an official PVT v1 file
        return (lambda: timm.create_model(stem)), official_pvt
    assert stem in timm.list_models(), f'{file}: no writer for this file (line of {name})'
    return (lambda: timm.create_model(stem)), lambda model: model.state_dict()  # a timm base model's checkpoint


def _assert_loaded(model: nn.Module, source: nn.Module) -> None:
    """Every tensor of the loaded model that is not a GRC cache equals the source model's."""
    loaded, expected = model.state_dict(), source.state_dict()
    checked = [k for k in loaded if '.grc.' not in k]
    not_from_source = [k for k in checked if k not in expected]
    assert not not_from_source, f'loaded keys the source model lacks: {not_from_source[:8]}'
    differ = [k for k in checked if not torch.equal(loaded[k], expected[k])]
    assert not differ, f'tensors not loaded from the checkpoint: {differ[:8]}'


def test_every_form_is_run():
    """The parsing finds the lines of every family that documents one, the README ones included."""
    lines = _loading_lines()
    docs = {doc for doc, *_ in lines}
    assert 'README.md' in docs and 'cvt_21.md' in docs and 'vil_ls_medium.md' in docs
    runs = _one_per_form()
    assert {name for _, name, _, _ in runs} >= {
        'cvt_13', 'cvt_21', 'cvt_13_384', 'cvt_21_384', 'vil_ls_medium', 'cvt_ls_13', 'pvt_tiny'}
    assert len(runs) < len(lines) / 2  # one run per form


@pytest.mark.parametrize('doc,name,file,call', RUNS)
def test_documented_loading_line_loads_the_authors_checkpoint(doc, name, file, call, tmp_path, monkeypatch):
    torch.manual_seed(0)
    make_source, layout = _writer(name, file)
    source = _perturbed(make_source())
    if file.endswith('.safetensors'):
        save_file({k: v.contiguous() for k, v in layout(source).items()}, str(tmp_path / file))
    else:
        torch.save(layout(source), tmp_path / file)
    monkeypatch.chdir(tmp_path)  # the lines name their files relative to the working folder
    model = eval(call, {'timm': timm})  # the line as documented
    _assert_loaded(model, source)


def test_every_model_with_released_weights_documents_the_plain_call():
    """The cards of the models with a released tag show `timm.create_model(name, pretrained=True)`, and no line
    without a file is documented for a model that has no released weights."""
    ours = set(list_models())  # once: each call sorts timm's whole registry
    released = {name.split('.')[0] for name in timm.list_pretrained() if name.split('.')[0] in ours}
    assert released >= {'cvt_13', 'cvt_13_384', 'cvt_21', 'cvt_21_384', 'vil_ls_medium', 'vil_ls_base',
                        'vil_ls_medium_384'}
    plain = {(doc, name) for doc, name, _, call in _loading_lines(released=True)
             if call == f"timm.create_model('{name}', pretrained=True)"}
    assert {(f'{name}.md', name) for name in released} <= plain
    assert {name.split('.')[0] for _, name, _, _ in _loading_lines(released=True)} <= released
    assert any(doc == 'README.md' for doc, _ in plain), "README's snippet shows pretrained=True on a released model"


@pytest.fixture(scope='module')
def hub_weights(tmp_path_factory) -> Callable[[str], Path]:
    """``arch`` -> a ``pytorch_model.bin`` of random weights in transformers' CvT layout, written once per arch
    (cvt_13 serves cvt_13 and cvt_13_384, ...; CvT-W24's 277M parameters are 1.1 GB) and hard-linked into each
    test's cache."""
    folder, files = tmp_path_factory.mktemp('hub_weights'), {}

    def weights(arch: str) -> Path:
        if arch not in files:
            files[arch] = folder / f'{arch}.bin'
            torch.save(random_hub_state_dict(arch), files[arch])
        return files[arch]
    return weights


@pytest.mark.parametrize('doc,name,file,call', RELEASED_RUNS)
def test_documented_released_weights_line_loads_them(doc, name, file, call, tmp_path, monkeypatch, hub_weights):
    """The line as documented, offline, from the caches the download fills: every tensor of the file lands."""
    hub, torch_home = tmp_path / 'hf', tmp_path / 'torch'
    monkeypatch.setenv('TORCH_HOME', str(torch_home))
    monkeypatch.setattr(hf_constants, 'HF_HUB_CACHE', str(hub))
    monkeypatch.setattr(hf_constants, 'HF_HUB_OFFLINE', True)
    cfg = timm.models.get_pretrained_cfg(name)
    if cfg.hf_hub_id:
        arch = 'cvt_w24' if name.startswith('cvt_w24') else name.split('.')[0].replace('_384', '')
        put_in_hub_cache(hub, cfg.hf_hub_id, hub_weights(arch))
        tensors = torch.load(hub_weights(arch), weights_only=True, mmap=True)
        head = ('head.', 'classifier.')
    else:
        checkpoint = official_vil_checkpoint(official_vil_shapes(name.split('.')[0]), seed=0)
        torch.save(checkpoint, vil_cache_file(torch_home, name))
        tensors, head = checkpoint['net'], ('head.', 'module.head.')
    model = eval(call, {'timm': timm})  # the line as documented
    assert_loaded_from(model, tensors, head=head if 'num_classes' in call else ())


def test_readme_char_lm_block_loads_a_fairseq_checkpoint(tmp_path, monkeypatch):
    block = re.search(r'```python\n(?P<code>[^`]*load_official_checkpoint\(model[^`]*)```',
                      (ROOT / 'README.md').read_text())
    assert block, 'README.md lost the char-LM loading block'
    code = block.group('code')
    name = re.search(r"create_model\('(\w+)'\)", code).group(1)
    file = re.search(r"load_official_checkpoint\(model, '([^']+)'\)", code).group(1)
    source = _perturbed(seq.create_model(name))
    torch.save(fairseq(official_char_lm(source)), tmp_path / file)
    monkeypatch.chdir(tmp_path)
    namespace: Dict = {}
    exec(code, namespace)  # the block as documented
    _assert_loaded(namespace['model'], source)
    # and it runs the way the authors' model does: from a zero initial cache attended like real tokens
    assert namespace['model'].cache_mode == 'official'


def test_microsoft_checkpoint_gives_the_cls_token_logits(tmp_path, monkeypatch):
    """A cls-token head trained to disagree with the average-pooled one: the documented call gives Microsoft's
    (cls-token) logits; the same file with global_pool='avg' gives the other ones."""
    torch.manual_seed(0)
    source = _perturbed(timm.create_model('cvt_13'))
    x = torch.randn(4, 3, 96, 96)
    with torch.no_grad():
        tokens = source.forward_features(x)
    cls_feats, avg_feats = tokens[:, 0], tokens[:, 1:].mean(1)
    cls_labels = torch.tensor([1, 2, 3, 4])
    avg_labels = torch.tensor([5, 6, 7, 8])
    opt = torch.optim.SGD(source.head.parameters(), lr=1.0)
    for _ in range(100):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(source.head(cls_feats), cls_labels) + \
            nn.functional.cross_entropy(source.head(avg_feats), avg_labels)
        loss.backward()
        opt.step()
    with torch.no_grad():
        cls_logits, avg_logits = source.head(cls_feats), source.head(avg_feats)
    assert torch.equal(cls_logits.argmax(1), cls_labels) and torch.equal(avg_logits.argmax(1), avg_labels)

    file = 'CvT-13-224x224-IN-1k.pth'
    torch.save(microsoft_cvt(source), tmp_path / file)
    assert 'stage2.cls_token' in torch.load(tmp_path / file, weights_only=True)
    monkeypatch.chdir(tmp_path)
    call = next(call for doc, name, f, call in _loading_lines() if doc == 'cvt_13.md' and f == file)
    model = eval(call, {'timm': timm}).eval()
    avg_model = eval(call.replace('pretrained=True', "pretrained=True, global_pool='avg'"), {'timm': timm}).eval()
    with torch.no_grad():
        logits, avg_model_logits = model(x), avg_model(x)
    torch.testing.assert_close(logits, cls_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(avg_model_logits, avg_logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits.argmax(1), avg_model_logits.argmax(1))


def test_microsoft_checkpoint_of_another_size_is_refused_by_key(tmp_path):
    """CvT-13 weights in cvt_21 (the old cvt_21 card): the error names the keys, nothing loads half-way."""
    path = tmp_path / 'CvT-13-224x224-IN-1k.pth'
    torch.save(microsoft_cvt(timm.create_model('cvt_13', depths=(1, 2, 2))), path)
    with pytest.raises(KeyError, match=r'missing.*stages\.2\.blocks\.2\.'):
        timm.create_model('cvt_13', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))


def test_official_pvt_missing_a_key_is_named_in_the_grc_model(tmp_path):
    """pvt_*_grc loads PVT v1 weights non-strictly (fresh caches): any other missing key is an error by name."""
    tiny = dict(embed_dims=(16, 32, 32, 64), num_heads=(1, 1, 2, 2), depths=(1, 1, 1, 1))
    official = official_pvt(timm.create_model('pvt_tiny', **tiny))
    del official['block3.0.attn.proj.weight']
    torch.save(official, tmp_path / 'pvt_tiny.pth')
    with pytest.raises(KeyError, match=r'lacks non-GRC keys.*stages\.2\.blocks\.0\.attn\.proj\.weight'):
        timm.create_model('pvt_tiny_grc', pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(tmp_path / 'pvt_tiny.pth')), **tiny)


def test_head_left_out_for_another_class_count_is_a_warning(tmp_path, caplog):
    """timm drops a checkpoint head of another class count (fine-tuning): said at warning level, rest loaded."""
    tiny = dict(depths=(1, 1, 1))
    source = _perturbed(timm.create_model('cvt_13', **tiny))
    path = tmp_path / 'CvT-13-224x224-IN-1k.pth'
    torch.save(microsoft_cvt(source), path)
    with caplog.at_level('WARNING'):
        model = timm.create_model(
            'cvt_13', pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(file=str(path)), **tiny)
    assert '1000-class head is not loaded into a model of 10 classes' in caplog.text
    assert torch.equal(model.stages[2].cls_token, source.stages[2].cls_token)
