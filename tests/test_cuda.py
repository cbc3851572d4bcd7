"""Long-short attention on a GPU: gradients against the dense references, kernels batched over the whole batch (no
loop sized by the batch or the map), torch.compile with inductor, bf16 autocast and a full-size training step.

Skipped where there is no CUDA device (CI has none). `LSVISION_TEST_DEVICE=cpu` runs the same checks on the CPU (to
work on them without a GPU).
"""
import os
from typing import Tuple

import pytest
import torch
from _helpers import perturb, tiny_model
from reference_attention import (
    dense_causal_long_short_attention,
    dense_long_short_attention_1d,
    dense_long_short_attention_2d,
)
from test_span_attention import (
    GRAD_CASES,
    LAYERS,
    _assert_grads_equal,
    _grads,
    assert_layer_trains_under_bf16_autocast,
)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import timm

import lsvision  # noqa: F401  (registers the models)
from lsvision.layers import CausalLongShortAttention, LongShortAttention1d, LongShortAttention2d, set_span_kernel

DEVICE = torch.device(os.environ.get('LSVISION_TEST_DEVICE', 'cuda'))
pytestmark = pytest.mark.skipif(DEVICE.type == 'cuda' and not torch.cuda.is_available(), reason='no CUDA device')


def _reference(fn):
    """A dense reference run with its index tensors and masks made on DEVICE."""
    def run(*args):
        with DEVICE:
            return fn(*args)
    return run


@pytest.mark.parametrize('feat_size,w,r,heads,g,layer,rpe', GRAD_CASES)
def test_2d_gradients_match_dense_reference_fp64(feat_size, w, r, heads, g, layer, rpe):
    torch.manual_seed(0)
    C = heads * 8
    attn = LongShortAttention2d(C, heads, w, r, rel_pos_bias=rpe, span_kernel='span', **LAYERS[layer])
    attn = perturb(attn, 0.3).double().to(DEVICE).train()
    x = torch.randn(2, g + feat_size[0] * feat_size[1], C, dtype=torch.float64, device=DEVICE)
    weight = torch.randn_like(x)
    fast = _grads(attn, x, lambda t: attn(t, feat_size), weight)
    dense = _grads(attn, x, lambda t: _reference(dense_long_short_attention_2d)(attn, t, feat_size), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


class _OpNames(TorchDispatchMode):
    """Records the names of the operators dispatched to ATen."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__)
        return func(*args, **(kwargs or {}))


# the fused kernels the float32 training path runs on: forward and backward
FUSED_KERNELS = {
    'cuda': ('_scaled_dot_product_efficient_attention.default',
             '_scaled_dot_product_efficient_attention_backward.default'),
    'cpu': ('_scaled_dot_product_flash_attention_for_cpu.default',
            '_scaled_dot_product_flash_attention_for_cpu_backward.default'),
}


def _assert_float32_grads_match_float64(module, x, run, reference, weight, names):
    """Gradients of the float32 training path, which runs on the fused kernels (checked by their operator names),
    against the float64 dense reference at the same parameters."""
    module = module.float()
    with _OpNames() as ops:
        fast = _grads(module, x.float(), run, weight.float())
    assert set(FUSED_KERNELS[DEVICE.type]) <= ops.names, sorted(n for n in ops.names if 'attention' in n)
    dense = _grads(module.double(), x, reference, weight)
    # each tensor to 2e-4 of its largest value; gradients that cancel to ~0 (a bias before a BatchNorm) to 2e-6 of the
    # largest of all
    floor = 1e-2 * max(float(b.abs().max()) for b in dense)
    scales = [max(float(b.abs().max()), floor) for b in dense]
    worst = max(float((a.double() - b).abs().max()) / scale for a, b, scale in zip(fast, dense, scales))
    print(f"largest gradient error relative to its tensor's largest value: {worst:.2e}")
    for name, a, b, scale in zip(names, fast, dense, scales):
        torch.testing.assert_close(a.double(), b, rtol=2e-4, atol=2e-4 * scale, msg=lambda m, name=name: f'{name}: {m}')


@pytest.mark.parametrize('feat_size,w,r,heads,g,layer', [case[:-1] for case in GRAD_CASES if not case[-1]])
def test_2d_float32_gradients_on_fused_kernels_match_dense_reference(feat_size, w, r, heads, g, layer):
    """In float32 the training path runs on the fused kernels (CUDA: memory-efficient attention, CPU: flash), whose
    log-sum-exp joins the dynamic projection's keys: its gradients match the float64 dense reference's. (A window
    relative-position bias is a mask with a gradient, which the kernels do not give: the batched matmuls run it.)"""
    torch.manual_seed(0)
    C = heads * 8
    attn = LongShortAttention2d(C, heads, w, r, span_kernel='span', **LAYERS[layer])
    attn = perturb(attn, 0.3).double().to(DEVICE).train()
    x = torch.randn(2, g + feat_size[0] * feat_size[1], C, dtype=torch.float64, device=DEVICE)
    weight = torch.randn_like(x)
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the convolutions in float32, as the reference's in float64
    try:
        _assert_float32_grads_match_float64(
            attn, x, lambda t: attn(t, feat_size),
            lambda t: _reference(dense_long_short_attention_2d)(attn, t, feat_size), weight,
            ['x'] + [n for n, _ in attn.named_parameters()])
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32


def test_1d_float32_gradients_on_fused_kernels_match_dense_reference():
    torch.manual_seed(0)
    n, pads = 50, 7
    attn = perturb(LongShortAttention1d(32, 2, 20, 3)).double().to(DEVICE).train()
    x = torch.randn(3, n, 32, dtype=torch.float64, device=DEVICE)
    mask = torch.ones(3, n, dtype=torch.bool, device=DEVICE)
    mask[0, n - pads:] = False
    cls = torch.randn(3, 1, 32, dtype=torch.float64, device=DEVICE)
    weight = torch.randn(3, n + 1, 32, dtype=torch.float64, device=DEVICE)
    _assert_float32_grads_match_float64(
        attn, x, lambda t: attn(t, mask, cls.to(t.dtype)),
        lambda t: _reference(dense_long_short_attention_1d)(attn, t, mask, cls), weight,
        ['x'] + [n for n, _ in attn.named_parameters()])


@pytest.mark.parametrize('n,w,r,pads,with_cls', [(37, 3, 2, 4, True), (50, 20, 3, 7, True)])
def test_1d_bidirectional_gradients_match_dense_reference_fp64(n, w, r, pads, with_cls):
    torch.manual_seed(0)
    attn = perturb(LongShortAttention1d(32, 2, w, r)).double().to(DEVICE).train()
    x = torch.randn(3, n, 32, dtype=torch.float64, device=DEVICE)
    mask = torch.ones(3, n, dtype=torch.bool, device=DEVICE)
    mask[0, n - pads:] = False
    cls = torch.randn(3, 1, 32, dtype=torch.float64, device=DEVICE) if with_cls else None
    weight = torch.randn(3, n + with_cls, 32, dtype=torch.float64, device=DEVICE)
    fast = _grads(attn, x, lambda t: attn(t, mask, cls), weight)
    dense = _grads(attn, x, lambda t: _reference(dense_long_short_attention_1d)(attn, t, mask, cls), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])


@pytest.mark.parametrize('chunk', [None, 16])
def test_causal_gradients_match_dense_reference_fp64(chunk):
    torch.manual_seed(0)
    attn = CausalLongShortAttention(32, 2, 8, 4, 2, query_chunk_size=chunk)
    attn = perturb(attn).double().to(DEVICE).train()
    x = torch.randn(2, 32, 32, dtype=torch.float64, device=DEVICE)
    cache = torch.randn(2, 16, 32, dtype=torch.float64, device=DEVICE)
    weight = torch.randn_like(x)
    fast = _grads(attn, x, lambda t: attn(t, cache), weight)
    dense = _grads(attn, x, lambda t: _reference(dense_causal_long_short_attention)(attn, t, cache), weight)
    _assert_grads_equal(fast, dense, ['x'] + [n for n, _ in attn.named_parameters()])
    # the future stays exactly out of reach: the loss at position 10 has no gradient from later inputs
    xg = x.clone().requires_grad_()
    attn(xg, cache)[:, 10].sum().backward()
    assert (xg.grad[:, 11:] == 0).all()


def test_causal_flex_inference_matches_the_chunk_path():
    """'auto' at inference runs the causal layer as one compiled FlexAttention call (`causal_flex`) on CUDA: the chunk
    path's outputs, with a cache, a padded x and two vectors a segment."""
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(64, 4, 64, 16, 2, query_chunk_size=128)).to(DEVICE).eval()
    x = torch.randn(2, 1000, 64, device=DEVICE)
    cache = torch.randn(2, 256, 64, device=DEVICE)
    with torch.no_grad():
        attn.attn_kernel = 'chunks'
        ref = attn(x, cache)
        attn.attn_kernel = 'auto' if DEVICE.type == 'cuda' else 'flex'
        assert attn._uses_flex(x)
        out = attn(x, cache)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='FlexAttention has no backward on the CPU')
def test_causal_flex_training_matches_the_chunk_path():
    """The causal layer trained through one compiled FlexAttention call: its gradients (the position terms' through
    the score_mod: Inductor's learnable-bias backward) are the chunk path's."""
    torch.manual_seed(0)
    attn = perturb(CausalLongShortAttention(64, 4, 64, 16, 2, query_chunk_size=128)).to(DEVICE).train()
    x = torch.randn(2, 1000, 64, device=DEVICE)
    cache = torch.randn(2, 256, 64, device=DEVICE)
    weight = torch.randn_like(x)
    results = []
    for kernel in ('chunks', 'flex'):
        attn.attn_kernel = kernel
        attn.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_()
        out = attn(xg, cache)
        (out * weight).sum().backward()
        results.append([out, xg.grad] + [p.grad for p in attn.parameters()])
    names = ['output', 'x grad'] + [n for n, _ in attn.named_parameters()]
    for name, flex, chunks in zip(names, results[1], results[0]):
        scale = chunks.abs().max().item()
        torch.testing.assert_close(flex, chunks, rtol=2e-3, atol=2e-3 * scale, msg=name)


class _CountOps(TorchDispatchMode):
    """Counts the operators dispatched to ATen (what Python code calls, below autograd)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _launches(attn: torch.nn.Module, x: torch.Tensor, feat_size) -> Tuple[int, int]:
    """Operators dispatched to ATen and device kernels (CUDA; 0 on CPU) of one training forward and backward."""
    attn(x, feat_size).sum().backward()  # warm: lazy init of cuBLAS and the like stays out of the count
    attn.zero_grad(set_to_none=True)  # the counted pass sets the gradients, as the warm one did
    x.grad = None
    activities = [ProfilerActivity.CUDA] if DEVICE.type == 'cuda' else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof, _CountOps() as ops:
        attn(x, feat_size).sum().backward()
        if DEVICE.type == 'cuda':
            torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return ops.count, kernels


@pytest.mark.parametrize('w,r,heads', [(8, 16, 1), (2, 8, 4)])  # CvT-LS stage 1 and stage 3 windows
def test_window_attention_launches_as_many_kernels_for_any_batch_and_map(w, r, heads):
    """One forward and backward of the 2D layer dispatches the same operators for batch 2 and 8 and for a 24 x 24 and
    a 48 x 40 map: the window attention runs batched over the whole batch, with no loop sized by the batch, the map or
    a cache size. The CUDA kernels they launch vary a little with the sizes (cuBLAS and cuDNN choose their kernels by
    shape), far from the 4x a loop over the batch would make."""
    torch.manual_seed(0)
    C = 16 * heads
    attn = LongShortAttention2d(C, heads, w, r, span_kernel='span', **LAYERS['conv']).to(DEVICE).train()
    ops, kernels = {}, {}
    for B, feat_size in [(2, (24, 24)), (8, (24, 24)), (2, (48, 40))]:
        x = torch.randn(B, 1 + feat_size[0] * feat_size[1], C, device=DEVICE, requires_grad=True)
        ops[(B, feat_size)], kernels[(B, feat_size)] = _launches(attn, x, feat_size)
    print(f'one layer (w={w}) forward + backward: ATen operators {ops}, CUDA kernels {kernels}')
    assert len(set(ops.values())) == 1, ops
    if DEVICE.type == 'cuda':
        assert max(kernels.values()) <= 1.25 * min(kernels.values()), kernels


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='inductor on the CPU needs a C++ compiler; CPU compile is '
                    'tested with aot_eager in test_span_attention')
def test_torch_compile_inductor_fullgraph_forward_and_backward_equal_eager():
    model = tiny_model('cvt_ls_13', img_size=64, num_classes=5, depths=(1, 1, 1)).to(DEVICE).train()
    x = torch.randn(2, 3, 64, 72, device=DEVICE)
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # eager and compiled convs in the same precision
    try:
        eager_out = model(x)
        eager_out.square().sum().backward()
        eager_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        compiled = torch.compile(model, fullgraph=True)
        out = compiled(x)
        out.square().sum().backward()
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    for (name, p), ref in zip(model.named_parameters(), eager_grads):
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f'{name}: {m}')


def test_layer_trains_under_bf16_autocast():
    assert_layer_trains_under_bf16_autocast(DEVICE)


def test_full_size_cvt_ls_13_trains_a_step_under_bf16():
    """cvt_ls_13 at 224 px, batch 4: one SGD step under bf16 autocast gives finite float32 gradients everywhere and
    lowers the loss on the same batch."""
    torch.manual_seed(0)
    model = timm.create_model('cvt_ls_13', num_classes=10).to(DEVICE).train()
    x = torch.randn(4, 3, 224, 224, device=DEVICE)
    y = torch.arange(4, device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(2):
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all(), name
        opt.step()
        losses.append(loss.item())
    assert losses[1] < losses[0], losses


# ---------------------------------------------------------------------------------------------------------------------
# The FlexAttention path (`span_kernel='flex'`, lsvision/layers/span_flex.py): forward and gradients on the GPU

# five of the layer cases (non-divisible maps, w = 2 / 3 / 7 / 8, the cls stage, the window bias), the token orders
# alternating: each compiles its own kernels, forward and backward
FLEX_CASES = [GRAD_CASES[i] + setting for i, setting in zip((1, 2, 3, 5, 6), [('segment', 128), ('raster', 16)] * 3)]


def _flex_layer(feat_size, w, r, heads, g, layer, rpe, order, block):
    """A perturbed layer on DEVICE with the flex kernel, head dim 16 (FlexAttention's smallest), and its input."""
    torch.manual_seed(0)
    C = heads * 16
    attn = LongShortAttention2d(C, heads, w, r, rel_pos_bias=rpe, span_kernel='flex', **LAYERS[layer])
    set_span_kernel(attn, 'flex', order, block)
    attn = perturb(attn, 0.3).to(DEVICE).train()
    x = torch.randn(2, g + feat_size[0] * feat_size[1], C, device=DEVICE)
    return attn, x


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='FlexAttention has no backward on the CPU')
@pytest.mark.parametrize('feat_size,w,r,heads,g,layer,rpe,order,block', FLEX_CASES)
def test_2d_flex_float32_forward_and_gradients_match_dense_reference(feat_size, w, r, heads, g, layer, rpe, order,
                                                                      block):
    """The flex path in float32 (non-divisible maps, the cls stage, ViL-LS's bias through the score_mod and its
    gradient): outputs and every gradient within 1e-4 of their tensor's largest value of the float64 dense reference
    at the same parameters."""
    attn, x = _flex_layer(feat_size, w, r, heads, g, layer, rpe, order, block)
    weight = torch.randn_like(x)
    names = ['x'] + [n for n, _ in attn.named_parameters()]
    allow_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the convolutions in float32, as the reference's in float64
    try:
        out = attn(x, feat_size).detach()  # with gradients: the kernels the backward test compiles anyway
        fast = _grads(attn, x, lambda t: attn(t, feat_size), weight)
        attn.double()
        with torch.no_grad():
            dense_out = _reference(dense_long_short_attention_2d)(attn, x.double(), feat_size)
        dense = _grads(attn, x.double(), lambda t: _reference(dense_long_short_attention_2d)(attn, t, feat_size),
                       weight.double())
    finally:
        torch.backends.cudnn.allow_tf32 = allow_tf32
    torch.testing.assert_close(out.double(), dense_out, rtol=1e-4, atol=1e-4 * float(dense_out.abs().max()))
    floor = 1e-2 * max(float(b.abs().max()) for b in dense)
    for name, a, b in zip(names, fast, dense):
        scale = max(float(b.abs().max()), floor)
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4 * scale, msg=lambda m, name=name: f'{name}: {m}')


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='FlexAttention has no backward on the CPU')
def test_2d_flex_trains_under_bf16_autocast():
    """The project's bf16 bound (`assert_layer_trains_under_bf16_autocast`): the flex path's gradients under bf16
    autocast within 5 % (norm) of its float32 gradients, parameter gradients float32."""
    attn, x = _flex_layer((6, 10), 2, 3, 2, 1, 'conv', False, 'segment', 128)
    weight = torch.randn_like(x)
    ref = _grads(attn, x, lambda t: attn(t, (6, 10)), weight)

    def under_autocast(t):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            return attn(t, (6, 10)).float()

    grads = _grads(attn, x, under_autocast, weight)
    scale = max(g.norm() for g in ref)
    for name, a, b in zip(['x'] + [n for n, _ in attn.named_parameters()], grads, ref):
        assert a.dtype == torch.float32, name
        if b.norm() >= 1e-4 * scale:
            assert (a - b).norm() <= 0.05 * b.norm() + 1e-6, (name, (a - b).norm().item(), b.norm().item())


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='inductor on the CPU needs a C++ compiler')
def test_flex_model_compiles_with_inductor_and_equals_eager():
    """cvt_ls_13 (tiny) with the flex kernel under torch.compile(fullgraph=True), inductor: the flex call inlined in
    the model's graph, forward and backward equal to the eager model's (which runs the separately compiled call)."""
    model = tiny_model('cvt_ls_13', img_size=64, num_classes=5, depths=(1, 1, 1))
    set_span_kernel(model, 'flex')
    model = model.to(DEVICE).train()
    x = torch.randn(2, 3, 64, 72, device=DEVICE)
    model(x).square().mean().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.compile(model, fullgraph=True)(x).square().mean().backward()
    for (name, p), ref in zip(model.named_parameters(), eager):
        torch.testing.assert_close(p.grad, ref, rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f'{name}: {m}')


@pytest.mark.skipif(DEVICE.type != 'cuda', reason='the compiled FlexAttention call runs on CUDA only')
def test_flex_recompile_limit_fails_loudly(monkeypatch):
    """Past `FLEX_RECOMPILE_LIMIT` compiled shapes the flex call raises (naming the knob) instead of dynamo's silent
    fallback to a dense attention."""
    from lsvision.layers import span_flex
    monkeypatch.setattr(span_flex, 'FLEX_RECOMPILE_LIMIT', 2)
    torch._dynamo.reset()
    attn = LongShortAttention2d(32, 2, 2, 2, span_kernel='flex').to(DEVICE).eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match='FLEX_RECOMPILE_LIMIT'):
        for side in range(4, 12):
            attn(torch.randn(1, side * side, 32, device=DEVICE), (side, side))
    torch._dynamo.reset()
