"""Converters: the cases mutmut found untested (docs/testing.md has the run and the survivors' table)."""
import pytest
import torch

import timm

from lsvision.models import vil_ls

TINY = dict(embed_dims=(8, 16, 32, 64), num_heads=(1, 2, 4, 8), depths=(1, 2, 2, 1), num_classes=10)


def test_vil_ls_filter_names_an_lsvision_checkpoint_in_its_error():
    # an lsvision-layout state dict with a stray key: the KeyError says which kind of checkpoint did not fit
    # (kills the 4 mutants of `source = 'the lsvision ViL-LS checkpoint'` in vil_ls.checkpoint_filter_fn)
    model = timm.create_model('vil_ls_medium', **TINY)
    state = dict(model.state_dict(), **{'stages.0.bogus': torch.zeros(1)})
    with pytest.raises(KeyError, match=r'^the lsvision ViL-LS checkpoint does not fit .*unexpected.*stages\.0\.bogus'):
        vil_ls.checkpoint_filter_fn(state, model)


def test_vil_ls_filter_names_an_official_checkpoint_in_its_error():
    # the authors' layout of a 10-class model loaded into a model one block deeper: the message says "official"
    # (kills the 4 mutants of `source = 'the official ViL-LS checkpoint'`)
    from official_layouts import official_vil

    official = official_vil(timm.create_model('vil_ls_medium', **TINY))
    deeper = timm.create_model('vil_ls_medium', **dict(TINY, depths=(1, 2, 3, 1)))
    with pytest.raises(KeyError, match=r'^the official ViL-LS checkpoint does not fit .*missing.*stages\.2'):
        vil_ls.checkpoint_filter_fn(official, deeper)
