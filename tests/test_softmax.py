"""The layers' one softmax precision rule and one masked-key score (`lsvision.layers.softmax`)."""
import pytest
import torch

from lsvision.layers.softmax import mask_value, softmax_dtype, softmax_fp32
from lsvision.layers.span_attention import span_attention, span_window_key_mask

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize('dtype', DTYPES)
def test_mask_value_is_half_the_lowest_finite_value(dtype):
    assert mask_value(dtype) == torch.finfo(dtype).min / 2
    assert torch.jit.script(mask_value)(dtype) == mask_value(dtype)


def test_mask_value_refuses_integer_scores():
    with pytest.raises(ValueError, match='floating point.*torch.int64'):
        mask_value(torch.int64)


@pytest.mark.parametrize('dtype', DTYPES)
def test_masked_keys_weigh_zero_and_a_fully_masked_row_is_uniform(dtype):
    """Beside a real key a masked one gets exactly 0 (as -inf would); a row of masked keys gets uniform weights, not
    NaN; a bias of -100 added to the mask value stays finite (the lowest value itself would be -inf in fp16)."""
    scores = torch.tensor([[1.5, -2., 0.5, 3.], [0.5, -1., 2., 0.]], dtype=dtype)
    masked = torch.tensor([[False, True, False, True], [True, True, True, True]])
    weights = softmax_fp32(scores.masked_fill(masked, mask_value(dtype)))
    with_inf = softmax_fp32(scores[:1].masked_fill(masked[:1], float('-inf')))
    assert torch.equal(weights[0], with_inf[0])
    assert torch.equal(weights[1], torch.full((4,), 0.25, dtype=dtype))
    assert torch.isfinite(torch.tensor(mask_value(dtype), dtype=dtype) - 100).all()


@pytest.mark.parametrize('dtype', DTYPES)
def test_softmax_fp32_upcasts_half_precision_only(dtype):
    scores = torch.randn(3, 7, dtype=torch.float64).to(dtype) * 4
    assert softmax_dtype(dtype) == (torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype)
    want = scores.to(softmax_dtype(dtype)).softmax(-1)
    assert torch.equal(softmax_fp32(scores), want.to(dtype))
    assert torch.equal(softmax_fp32(scores, out_dtype=torch.float32), want.float())
    assert torch.equal(torch.jit.script(softmax_fp32)(scores, -1, None), want.to(dtype))


@pytest.mark.parametrize('spatial,w', [((9, 10), 4), ((5, 11), 2), ((40,), 20), ((9,), 2)])
def test_span_mask_value_gives_the_outputs_of_minus_infinity(spatial, w):
    """The span key mask with `mask_value` on the padded keys, and the same mask with -inf: bitwise the same outputs
    and gradients, through SDPA or the batched matmuls (forward) and the fused or batched-matmul backward (fp32)."""
    torch.manual_seed(0)
    B, h, d = 2, 2, 8
    q = torch.randn(B, h, *spatial, d)
    kv = torch.randn(2, B, h, *spatial, d)
    shared = torch.randn(2, B, h, 3, d)
    mask = span_window_key_mask(list(spatial), w, torch.float32, q.device)[None, None, :, None]
    assert (mask == mask_value(torch.float32)).any()
    results = []
    for m in (mask, mask.masked_fill(mask < 0, float('-inf'))):
        inputs = [t.clone().requires_grad_() for t in (q, kv, shared)]
        out = span_attention(*inputs, m, w, 0.3)
        results.append([out] + list(torch.autograd.grad(out.square().sum(), inputs)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
