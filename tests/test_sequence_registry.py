import pytest
import torch
import torch.nn as nn

import lsvision.sequence as seq
from lsvision.models._pretrained import NoPretrainedWeightsError
from lsvision.sequence import _registry


def test_register_create_list(monkeypatch):
    monkeypatch.setattr(_registry, '_model_entrypoints', {})

    @seq.register_model
    def tiny_seq_model(width: int = 4) -> nn.Module:
        return nn.Linear(width, width)

    assert seq.list_models() == ['tiny_seq_model']
    assert seq.list_models('tiny_*') == ['tiny_seq_model'] and seq.list_models('x*') == []
    assert seq.create_model('tiny_seq_model', width=3).in_features == 3
    with pytest.raises(ValueError, match='Unknown sequence model'):
        seq.create_model('nope')
    with pytest.raises(ValueError, match='registered twice'):
        seq.register_model(tiny_seq_model)


LRA_MODELS = seq.list_models('*lra*')


def _uncached_counterpart(name: str):
    """grc_lra_x -> full_lra_x, ls_grc_lra_x -> ls_lra_x; None for the uncached models."""
    if name.startswith('grc_'):
        return 'full_' + name[len('grc_'):]
    if name.startswith('ls_grc_'):
        return 'ls_' + name[len('ls_grc_'):]
    return None


def _inputs(name: str, batch: int = 2, n: int = 24):
    torch.manual_seed(0)
    ids = torch.randint(1, 15, (batch, n))
    ids[1, n // 2:] = 0
    return (ids, ids.flip(0)) if 'retrieval' in name else (ids,)


def test_lra_models_are_all_covered():
    assert {'grc_lra_listops', 'grc_lra_text', 'grc_lra_retrieval', 'ls_grc_lra_listops', 'ls_grc_lra_text',
            'ls_grc_lra_retrieval', 'ls_lra_listops', 'full_lra_listops'} <= set(LRA_MODELS)


@pytest.mark.parametrize('name', LRA_MODELS)
def test_lra_model_contract(name):
    """Every registered LRA model: documented, builds, trains (finite logits and gradients), evaluates, round-trips
    its state dict (GRC caches included), refuses pretrained=True; a GRC model has its counterpart's parameters
    (same names and shapes: an uncached checkpoint loads with only `.grc.` keys missing) and names the paper."""
    doc = _registry._model_entrypoints[name].__doc__
    assert doc and doc.strip()
    kw = dict(max_len=32)
    model = seq.create_model(name, **kw).train()
    inputs = _inputs(name)
    classes = 2 if ('text' in name or 'retrieval' in name) else 10
    for _ in range(2):  # the second step starts from the cache the first one stored
        logits = model(*inputs)
        assert logits.shape == (2, classes) and torch.isfinite(logits).all()
        logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        out = model(*inputs)
        fresh = seq.create_model(name, **kw).eval()
        fresh.load_state_dict(model.state_dict())
        assert torch.equal(fresh(*inputs), out)
    with pytest.raises(NoPretrainedWeightsError):
        seq.create_model(name, pretrained=True)
    base = _uncached_counterpart(name)
    if base is None:
        return
    assert 'Cached Transformers' in doc and 'Table 6' in doc
    cached = {k: v.shape for k, v in model.state_dict().items()}
    plain = seq.create_model(base, **kw).state_dict()
    assert all(cached.get(k) == v.shape for k, v in plain.items())
    missing, unexpected = model.load_state_dict(plain, strict=False)
    assert not unexpected and missing and all('.grc.' in k for k in missing)
    assert set(missing) == set(cached) - set(plain)
