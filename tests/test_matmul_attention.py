"""lsvision.layers.matmul_attention: the batched-matmul attention equals F.scaled_dot_product_attention."""
import pytest
import torch
import torch.nn.functional as F
from _helpers import tiny_model

import lsvision  # noqa: F401  (registers the models)
from lsvision.flops import count_flops
from lsvision.layers import matmul_attention


@pytest.mark.parametrize('mask_shape', [(1, 3, 1, 7), (2, 3, 5, 7), (1, 3, 5, 7)])
@pytest.mark.parametrize('scale', [None, 0.3])
def test_matmul_attention_equals_sdpa(mask_shape, scale):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 6)
    mask = torch.randn(mask_shape)
    mask[..., 2] = float('-inf')  # a masked key, as the padding masks have
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    torch.testing.assert_close(matmul_attention(q, k, v, mask, scale=scale), expected, atol=1e-6, rtol=1e-5)


def test_matmul_attention_bf16_softmax_in_fp32():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 16) for _ in range(3))
    mask = torch.zeros(1, 2, 1, 4)
    out = matmul_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), matmul_attention(q, k, v, mask), atol=3e-2, rtol=3e-2)


def test_swin_window_memory_attention_is_independent_of_threads():
    # Swin's window memory attention runs as batched matmuls on CPU whatever the thread count (one kernel per device:
    # the rounding must not change with the threads); outputs and FLOP counts agree on 1 and 2 threads
    model = tiny_model('swin_tiny_patch4_window7_224_grc', depths=(1, 1, 1, 1), num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    torch.set_num_threads(1)  # conftest gives the next test its thread count back
    with torch.no_grad():
        one = model(x)
    flops_one = count_flops(model, (3, 64, 64)).total
    torch.set_num_threads(2)
    with torch.no_grad():
        two = model(x)
    flops_two = count_flops(model, (3, 64, 64)).total
    torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-5)
    assert flops_one == flops_two > 0
