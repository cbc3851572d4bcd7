"""Every size threshold that picks a kernel or a layout in lsvision's layers and models, with what chose it.

Each switches between paths that compute the same values (the tests compare every path with a dense reference): only
speed or memory changes. The timings were taken on a 2-core AMD EPYC CPU shared with other work (lsvision's development
machine); none was tuned on a GPU, where the layers take the fused or block-diagonal path (one launch instead of many)
whatever the size. The measurement that chose each value is the comment above it.

| constant | value | where it switches | below or at it | above it |
|---|---|---|---|---|
| `SPAN_BLOCK_COST_PAIRS` | 720 | `span_blocks.block_segments` (2D, fused) | a block's cost in the width estimate | |
| `SPAN_MATMUL_MAX_QUERIES` | 16 | `span_attention._span_forward` (CPU) | batched matmuls | SDPA |
| `SPAN_1D_MATMUL_MAX_WINDOW` | 16 | `span_fused._use_flash` (1D training) | batched-matmul backward | fused kernels |
| `BLOCK_DIAGONAL_MAX_MACS` | 2 ** 21 | `long_short._block_diagonal_heads` (CPU) | all heads at once | a matmul a head |
| `GRC_MATMUL_MAX_SCORES` | 64 * 64 | `grc.GrcMemoryAttention.attend` (CPU) | batched matmuls | SDPA |
| `FUSE_CONVS_MAX_POSITIONS` | 1024 | `models.cvt.FusedConvProjections` | one conv of 4 filter sets | a conv per set |
| `CAUSAL_CHECKPOINT_MIN_SCORES` | 2 ** 24 | `CausalLongShortAttention` chunks (default) | scores kept | recomputed |

Written for lsvision, Apache-2.0.
"""

__all__ = ['SPAN_BLOCK_COST_PAIRS', 'SPAN_MATMUL_MAX_QUERIES', 'SPAN_1D_MATMUL_MAX_WINDOW', 'BLOCK_DIAGONAL_MAX_MACS',
           'GRC_MATMUL_MAX_SCORES', 'FUSE_CONVS_MAX_POSITIONS', 'CAUSAL_CHECKPOINT_MIN_SCORES']

# The fixed cost of one kernel block of 2D span attention on the fused kernels, in query-key pairs of work (head dim
# 64): the CPU flash kernels' forward + backward spend ~20 us a block on 2 cores, the time of ~720 pairs. Fit to
# CvT-LS's stage-3 window attention forward + backward over block widths c = 1..gx: 224 px batch 8 (w = 2, gx = 7)
# c = 7 21 ms, c = 4 28 ms, c = 1 44 ms; 384 px batch 2 (w = 3, gx = 8) c = 2 15 ms, c = 4 17 ms, c = 8 19 ms,
# c = 1 21 ms (the estimate picks c = 7 and c = 2).
SPAN_BLOCK_COST_PAIRS = 720

# Span attention's forward on CPU runs segments of at most this many queries (w^ndim) as batched matmuls: SDPA's flash
# kernel costs a few microseconds per (batch x head x segment) block, which dominates when a block is 4 queries
# against ~20 keys (w = 2: 2.4 ms through SDPA against 0.6 ms as matmuls, CvT-LS stage 3 at 384 px on 2 cores).
SPAN_MATMUL_MAX_QUERIES = 16

# 1D span attention trains on the batched-matmul backward for segments of at most this many queries, on the fused
# kernels above: on CPU, segments of 16 and 4 queries took 1.25-1.9x the time of the batched-matmul backward on the
# fused kernels (2 cores). Not measured on CUDA: the same rule there.
SPAN_1D_MATMUL_MAX_WINDOW = 16

# The long-short dynamic projection's products run for all heads at once, block-diagonal (h times the multiply-adds
# of the per-head products, in one matmul each), where a sample's r x N x C multiply-adds are at most this many; above
# it, one matmul per head. On 2 CPU cores, the products' forward + backward in one layer: CvT-LS stage 3 at 224 px
# batch 8 (r N C = 0.3M) 3.2 ms against 6.5 ms per head, at 384 px batch 2 (0.9M) 2.0 against 3.3 ms; at 768 px
# (3.5M) 6.0 against 5.3 ms, stage 2 at 384 px (7.1M) 7.6 against 6.9 ms. CUDA always runs them block-diagonal.
BLOCK_DIAGONAL_MAX_MACS = 2 ** 21

# GRC window memory attention with at most this many scores per (window, head) runs as batched matmuls + softmax on
# CPU (Swin's 7 x 7 windows: 49 x 49): SDPA's flash kernel costs a few microseconds per (window x head) block and does
# not speed up with a second thread; the matmuls were 1.4-1.6x faster than SDPA on 2 cores at Swin-T's shapes (head
# dim 16), 0.8-0.9x on one thread.
GRC_MATMUL_MAX_SCORES = 64 * 64

# A reparameterized CvT-LS layer runs its four depthwise convs as one conv up to this many map positions (batch x H x
# W): in cvt_ls_13 on 2 CPU cores, 2.5-3.3 % faster at batch 1 (stages 2 and 3); fused at batch 8 as well, stage 3
# (1568 positions) was no faster and stage 1 slower.
FUSE_CONVS_MAX_POSITIONS = 1024

# The causal long-short layer recomputes each query chunk in the backward pass (`checkpoint_chunks=None`) where the
# scores of all chunks together would exceed this many elements (64 MB in fp32): a memory bound, not a timing. Chosen
# with the 128-query chunks of `80d3817` (16k tokens forward + backward ~0.34x the time of causal SDPA on 2 cores);
# below it, keeping the scores saves the chunk's second forward.
CAUSAL_CHECKPOINT_MIN_SCORES = 2 ** 24
