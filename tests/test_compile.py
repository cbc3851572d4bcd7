"""torch.compile of every long-short model: each traces as one graph (fullgraph=True: a graph break in lsvision's code
fails), forward and backward, and gives eager's outputs and gradients.

Dynamo only (backend 'eager': the captured graph runs as is), on tiny configs: what breaks a graph is lsvision's Python,
not the backend. cvt_ls_13 is compiled with AOTAutograd as well, in tests/test_span_attention.py; inductor runs on a
GPU (tests/test_cuda.py). What compiling costs and gains: docs/training_notes.md.
"""
from typing import Callable, Tuple

import pytest
import torch
import torch.nn as nn
from _helpers import TINY_VIL_LS_TWO_STAGES, perturb

import timm

import lsvision  # noqa: F401  (registers the models)
import lsvision.sequence as seq


def _vil_ls() -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    return timm.create_model('vil_ls_medium', num_classes=5, **TINY_VIL_LS_TWO_STAGES), (torch.randn(2, 3, 32, 32),)


def _lra() -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """The bidirectional 1D layer (LRA encoder, w = 8, r = 32 as the official ListOps config), 100 tokens."""
    return seq.create_model('ls_lra_listops', max_len=128, depth=1), (torch.randint(0, 10, (2, 100)),)


def _char_lm() -> Tuple[nn.Module, Tuple[torch.Tensor, ...]]:
    """The causal layer (character LM, segments of 4, a 16-token window)."""
    model = seq.create_model('ls_lm_enwik8_small', dim=32, depth=1, num_heads=2, mlp_hidden=64, window_size=16,
                             segment_size=4, mem_len=16, max_len=64, drop=0.)
    return model, (torch.randint(0, 200, (2, 40)),)


@pytest.mark.parametrize('make', [_vil_ls, _lra, _char_lm], ids=['vil_ls_medium', 'ls_lra_listops', 'ls_lm'])
def test_long_short_model_compiles_as_one_graph_and_matches_eager(make: Callable):
    torch.manual_seed(0)
    model, inputs = make()
    model = perturb(model).train()

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager_out, eager_grads = run(model)
    torch._dynamo.reset()
    out, grads = run(torch.compile(model, fullgraph=True, backend='eager'))
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(eager_grads)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
