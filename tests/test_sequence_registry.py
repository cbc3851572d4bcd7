import pytest
import torch.nn as nn

import lsvision.sequence as seq
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
