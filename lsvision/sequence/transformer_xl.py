"""Transformer-XL word-level language models and their GRC-cached version (Cached Transformers, Table 5).

Papers: `Transformer-XL: Attentive Language Models Beyond a Fixed-Length Context` (Dai et al., ACL 2019,
https://arxiv.org/abs/1901.02860), its code kimiyoung/transformer-xl (`pytorch/mem_transformer.py`); `Cached
Transformers: Improving Transformers with Differentiable Memory Cache` (AAAI 2024, https://arxiv.org/abs/2312.12742).

`TransformerXL(memory='xl')` is Transformer-XL: post-norm blocks of relative multi-head attention (Sec. 3.3: scores
(q + u) k^T + (q + v) R^T with the learned biases u = r_w_bias, v = r_r_bias shared by all layers, sinusoid relative
positions projected by each layer's r_net), the segment-level recurrence of Sec. 3.2 (each layer also attends to a
memory of the previous `mem_len` inputs of that layer, with the gradient stopped), a ReLU FFN, embeddings scaled by
sqrt(D), and the tied (adaptive) softmax of the WikiText-103 configuration. The large WikiText-103 model
(`txl_wt103_large`, the authors' released weights) adds the adaptive input (`div_val` 4) and per-layer u, v
(`untie_r`); `lsvision.sequence.convert.load_official_checkpoint` reads the authors' checkpoints.

`TransformerXL(memory='grc')` replaces that memory with a GRC cache carried from segment to segment of each stream
(the Cached Transformers paper: "replacing the caching scheme with the GRC approach while keeping all data
augmentation and hyper-parameters unchanged"). Each layer's self branch is the same relative attention over the
current segment only; its GRC layer (`lsvision.layers.GatedRecurrentCache1d`, no PE) holds a per-stream cache C of
T_m = `mem_len` slots and D_m = 0.5 D channels. For segment t:

    C_{t-1} = GRC(C_{t-2}, S_{t-1})         the gated update (Eqs. 4-5) by the previous segment's summary
    O_t     = mix(o_self_t, MemAttn(X_t, C_{t-1}))   per-head mix with sigmoid(lam) (Eq. 6)
    S_t     = the first D_m channels of o_self_t, resized to T_m slots (carried to segment t + 1)

so a token reads only segments before its own (causal), and the update C_{t-1} is computed in segment t's graph
from its inputs with the gradient stopped (C_{t-2} and S_{t-1} carried detached, as Transformer-XL carries its
memory): the gates learn through the memory branch of the step that reads the cache, the 1-step truncation of the
authors' code. Nothing is kept in the module between calls: the state is an argument and a result.

Written for lsvision, Apache-2.0.
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import Mlp

from lsvision.layers import (
    GatedRecurrentCache1d,
    GrcConfig,
    attach_grc,
    scaled_dot_product_attention,
    self_attention_of,
    sinusoid_positions,
)
from lsvision.layers.softmax import mask_value

from ._init import init_normal_lm_weights
from ._registry import register_model
from ._tokens import check_token_ids

__all__ = ['TransformerXL', 'TxlState', 'GrcStreamState', 'AdaptiveInput', 'AdaptiveLogSoftmax',
           'RelPartialLearnableAttention', 'RelGrcAttention', 'WT103_VOCAB_SIZE', 'WT103_CUTOFFS']

WT103_VOCAB_SIZE = 267735  # words of wiki.train.tokens + <eos> (Transformer-XL's vocabulary)
WT103_CUTOFFS = (20000, 40000, 200000)


class TxlState(NamedTuple):
    """Transformer-XL's memory: per layer the previous inputs of that layer (B, M, D), M <= mem_len (0 at the start
    of a stream), detached; `valid` (B, M) bool marks real slots (None: all real)."""
    mems: Tuple[torch.Tensor, ...]
    valid: Optional[torch.Tensor]


class GrcStreamState(NamedTuple):
    """The GRC cache of each layer for a batch of streams: `caches` C_{t-1} (B, T_m, D_m) and the summaries S_t
    (B, T_m, D_m) of the last segment, not yet written in (both detached); `pending` (B,) bool: which streams'
    summaries hold real tokens (False at the start of a stream)."""
    caches: Tuple[torch.Tensor, ...]
    summaries: Tuple[torch.Tensor, ...]
    pending: torch.Tensor


StreamState = Union[TxlState, GrcStreamState]  # what a TransformerXL carries from segment to segment


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last axis in fp32 (fp64 kept)."""
    return (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(-1)


class AdaptiveInput(nn.Module):
    """Transformer-XL's adaptive input embedding with div_val > 1 (`AdaptiveEmbedding`): the words of cluster i
    (split at `cutoffs`) have embeddings of width dim // div_val**i, each cluster's projected to `dim` by its own
    matrix (`projs[i]`, (dim, dim // div_val**i)). The adaptive softmax reuses both (tied weights and, for the tail
    clusters, tied projections, as the authors' WikiText-103 models)."""

    def __init__(self, vocab_size: int, dim: int, cutoffs: Sequence[int], div_val: int):
        super().__init__()
        if not cutoffs or div_val < 2:
            raise ValueError(f'an adaptive input needs cutoffs and div_val >= 2 (got {list(cutoffs)}, {div_val}); '
                             'div_val=1 is the plain tied embedding')
        widths = [dim // div_val ** i for i in range(len(cutoffs) + 1)]
        if widths[-1] < 1:
            raise ValueError(f'div_val {div_val} leaves the last of {len(widths)} clusters no channels of {dim}')
        self.num_embeddings = vocab_size
        self.dim = dim
        self.bounds = [0] + list(cutoffs) + [vocab_size]
        self.layers = nn.ModuleList([nn.Embedding(hi - lo, w) for lo, hi, w in
                                     zip(self.bounds[:-1], self.bounds[1:], widths)])
        self.projs = nn.ParameterList([nn.Parameter(torch.empty(dim, w)) for w in widths])
        for proj in self.projs:
            nn.init.normal_(proj, std=0.01)  # the authors' proj_init_std

    @property
    def weight(self) -> torch.Tensor:
        """The first cluster's embedding (its device and dtype are the module's)."""
        return self.layers[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = self.weight.new_zeros(flat.shape[0], self.dim)
        for i, (lo, hi) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
            idx = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_copy(0, idx, F.linear(self.layers[i](flat[idx] - lo), self.projs[i]))
        return out.view(*ids.shape, self.dim)


Embedding = Union[nn.Embedding, AdaptiveInput]
ClusterParams = List[Tuple[torch.Tensor, Optional[torch.Tensor]]]  # per cluster: output weight, projection or None


class AdaptiveLogSoftmax(nn.Module):
    """Transformer-XL's adaptive softmax (`ProjectedAdaptiveLogSoftmax`) with the output weights tied to the input
    embedding: a head over the `cutoffs[0]` most frequent words and one logit per tail cluster, each tail a softmax
    over its words. With no cutoffs it is the plain tied softmax.

    The embedding is passed to each call: its weight (div_val 1), or an `AdaptiveInput` (div_val > 1), whose
    cluster weights and tail projections are reused; the module owns the output bias (one per word), the cluster
    logits and, with div_val > 1, the head's own projection `head_proj` (the authors' `tie_projs = [False, True,
    ...]` of WikiText-103). torch's `nn.AdaptiveLogSoftmaxWithLoss` cannot tie its tails to the embedding, which the
    151M of the paper's WikiText-103 base model counts once. Cluster i's logit is the head's i-th column from the end,
    as in the authors' code (their checkpoints read the same way).
    """

    def __init__(self, dim: int, vocab_size: int, cutoffs: Sequence[int] = (), div_val: int = 1):
        super().__init__()
        cutoffs = list(cutoffs)
        if cutoffs and (cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0 or cutoffs[-1] >= vocab_size):
            raise ValueError(f'adaptive softmax cutoffs {cutoffs} must increase strictly within (0, vocab_size='
                             f'{vocab_size}); pass cutoffs=() for a plain softmax over a small vocabulary')
        self.vocab_size = vocab_size
        self.cutoffs = cutoffs
        self.bounds = [0] + cutoffs + [vocab_size]
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        n = len(cutoffs)
        self.cluster_weight = nn.Parameter(torch.zeros(n, dim)) if n else None
        self.cluster_bias = nn.Parameter(torch.zeros(n)) if n else None
        self.head_proj = nn.Parameter(torch.empty(dim, dim).normal_(std=0.01)) if div_val > 1 else None

    def _clusters(self, embed: Union[torch.Tensor, AdaptiveInput]) -> ClusterParams:
        if isinstance(embed, AdaptiveInput):
            return [(layer.weight, self.head_proj if i == 0 else proj)
                    for i, (layer, proj) in enumerate(zip(embed.layers, embed.projs))]
        return [(embed[lo:hi], None) for lo, hi in zip(self.bounds[:-1], self.bounds[1:])]

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                proj: Optional[torch.Tensor]) -> torch.Tensor:
        if proj is not None:  # the authors' order: project the hidden state into the cluster's width first
            hidden = F.linear(hidden, proj.t())
        return F.linear(hidden, weight, bias)

    def _head_logprob(self, hidden: torch.Tensor, clusters: ClusterParams) -> torch.Tensor:
        c0 = self.bounds[1]
        weight, proj = clusters[0]
        if self.cluster_weight is None:
            return _log_softmax(self._logits(hidden, weight, self.bias, proj))
        w = torch.cat([weight, self.cluster_weight.to(weight.dtype)])
        b = torch.cat([self.bias[:c0], self.cluster_bias])
        return _log_softmax(self._logits(hidden, w, b, proj))

    def _tail_logprob(self, hidden: torch.Tensor, clusters: ClusterParams, i: int) -> torch.Tensor:
        weight, proj = clusters[i]
        return _log_softmax(self._logits(hidden, weight, self.bias[self.bounds[i]:self.bounds[i + 1]], proj))

    def nll(self, hidden: torch.Tensor, target: torch.Tensor, embed: Union[torch.Tensor, AdaptiveInput]
            ) -> torch.Tensor:
        """-log p(target) in fp32 (fp64 kept) for hidden (N, D) and target (N,); tail logits only for their targets.
        `embed`: the tied embedding weight, or the `AdaptiveInput`."""
        clusters = self._clusters(embed)
        head = self._head_logprob(hidden, clusters)
        if self.cluster_weight is None:
            return -head.gather(1, target[:, None]).squeeze(1)
        out = head.new_zeros(target.shape)
        c0 = self.bounds[1]
        in_head = target < c0
        out = torch.where(in_head, -head.gather(1, target.clamp(max=c0 - 1)[:, None]).squeeze(1), out)
        for i in range(1, len(self.bounds) - 1):
            lo, hi = self.bounds[i], self.bounds[i + 1]
            idx = ((target >= lo) & (target < hi)).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            tail = self._tail_logprob(hidden[idx], clusters, i)
            lp = head[idx, -i] + tail.gather(1, (target[idx] - lo)[:, None]).squeeze(1)
            out = out.index_put((idx,), -lp)
        return out

    def log_prob(self, hidden: torch.Tensor, embed: Union[torch.Tensor, AdaptiveInput]) -> torch.Tensor:
        """log p(word) for every word, (N, vocab_size) in fp32."""
        clusters = self._clusters(embed)
        head = self._head_logprob(hidden, clusters)
        if self.cluster_weight is None:
            return head
        c0 = self.bounds[1]
        parts = [head[:, :c0]]
        for i in range(1, len(self.bounds) - 1):
            parts.append(head[:, -i, None] + self._tail_logprob(hidden, clusters, i))
        return torch.cat(parts, dim=1)


class RelPartialLearnableAttention(nn.Module):
    """Transformer-XL's relative multi-head attention (`RelPartialLearnableMultiHeadAttn`), without its residual and
    LayerNorm (the block owns those): queries of the segment, keys and values of [memory; segment].

    score(i, j) = ((q_i + u) . k_j + (q_i + v) . R_{i - j}) / sqrt(head_dim), R = r_net(sinusoids of the distance)
    (clamped at `clamp_len`), as one SDPA call with the position term and the mask as its additive bias.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int, attn_drop: float = 0.):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * num_heads * head_dim, bias=False)
        self.r_net = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.proj = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, r_w_bias: torch.Tensor, r_r_bias: torch.Tensor,
                keep: torch.Tensor, mem: Optional[torch.Tensor] = None) -> torch.Tensor:
        """
        Args:
            x: Segment (B, L, D).
            pos_emb: Sinusoids of the distances K - 1 ... 0 (K, D), K = memory + L keys.
            r_w_bias, r_r_bias: u and v (heads, head_dim).
            keep: (B or 1, L, K) bool, True where query i may attend key j.
            mem: Memory (B, M, D) or None.
        """
        B, L, _ = x.shape
        H, dh = self.num_heads, self.head_dim
        cat = x if mem is None or mem.shape[1] == 0 else torch.cat([mem.to(x.dtype), x], dim=1)
        K = cat.shape[1]
        q = F.linear(x, self.qkv.weight[:H * dh]).view(B, L, H, dh).transpose(1, 2)
        k, v = F.linear(cat, self.qkv.weight[H * dh:]).view(B, K, 2, H, dh).permute(2, 0, 3, 1, 4)
        r = self.r_net(pos_emb.to(x.dtype)).view(K, H, dh).transpose(0, 1)  # (H, K, dh): distance K-1-p at p
        pos = (q + r_r_bias.to(q.dtype)[:, None]) @ r.transpose(-2, -1)[None]  # (B, H, L, K) by distance index
        # key j of query i is at distance (K - L + i) - j, i.e. position index j + L - 1 - i (the authors' rel-shift)
        idx = (torch.arange(K, device=x.device)[None] + (L - 1) - torch.arange(L, device=x.device)[:, None])
        pos = pos.gather(-1, idx.clamp(0, K - 1).expand(B, H, L, K))
        scale = dh ** -0.5
        bias = (pos * scale).masked_fill(~keep[:, None], mask_value(pos.dtype))
        out = scaled_dot_product_attention(q + r_w_bias.to(q.dtype)[:, None], k, v, attn_mask=bias,
                                           dropout_p=self.attn_drop if self.training else 0., scale=scale)
        return self.proj(out.transpose(1, 2).reshape(B, L, H * dh))


class RelGrcAttention(RelPartialLearnableAttention):
    """The relative attention (self branch, run as is over the segment) with a GRC cache carried as a stream state
    under `grc` (a `GatedRecurrentCache1d` without PE). Made by `attach_grc` from a built
    `RelPartialLearnableAttention`."""

    grc: GatedRecurrentCache1d
    self_attention = self_attention_of(RelPartialLearnableAttention)

    def forward(self, x: torch.Tensor, pos_emb: torch.Tensor, r_w_bias: torch.Tensor,  # type: ignore[override]
                r_r_bias: torch.Tensor, keep: torch.Tensor, cache: torch.Tensor, summary: torch.Tensor,
                pending: torch.Tensor, valid: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the output (B, L, D), the cache C_{t-1} it read and this segment's summary and real-token flags.

        Args:
            cache, summary, pending: This layer's part of `GrcStreamState` (C_{t-2}, S_{t-1}, flags).
            valid: (B, L) bool, True on real tokens (None: all real); padding never enters the summary.
        """
        o_self = self.self_attention(x, pos_emb, r_w_bias, r_r_bias, keep)
        cache = self.grc.update_state(cache.detach(), summary.detach(), pending)
        out = self.grc.read_state(x, o_self, cache)
        new_summary, has_tokens = self.grc.sequence_summary(x, o_self, valid)
        return out, cache, new_summary, has_tokens


class TxlBlock(nn.Module):
    """Post-norm Transformer-XL layer: x = LN(x + Drop(Attn(x))); x = LN(x + FFN(x)), FFN = Linear-ReLU-Drop-Linear-Drop
    (timm's Mlp)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, mlp_hidden: int, drop: float = 0.1,
                 attn_drop: float = 0.):
        super().__init__()
        self.attn = RelPartialLearnableAttention(dim, num_heads, head_dim, attn_drop)
        self.drop = nn.Dropout(drop)
        self.norm1 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_hidden, act_layer=nn.ReLU, drop=drop)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The residual branches around an attention output the model computed (memory or GRC)."""
        x = self.norm1(x + self.drop(attn_out))
        return self.norm2(x + self.mlp(x))


class TransformerXL(nn.Module):
    """Word ids (B, L) [+ the state of the previous segment] -> per-token NLL (or log-probs) and the next state.

    Streams are batch rows: row b of successive calls continues stream b. `mask` (B, L) marks real tokens; padding
    (only at the end of a row) is never a key of a real token, never enters a memory or a cache, and its NLL is 0.
    """

    def __init__(
            self,
            vocab_size: int = WT103_VOCAB_SIZE,
            dim: int = 410,
            depth: int = 16,
            num_heads: int = 10,
            head_dim: int = 41,
            mlp_hidden: int = 2100,
            mem_len: int = 150,
            cutoffs: Sequence[int] = WT103_CUTOFFS,
            drop: float = 0.1,
            attn_drop: float = 0.,
            memory: str = 'xl',
            clamp_len: Optional[int] = None,
            same_length: bool = False,
            div_val: int = 1,
            untie_r: bool = False,
            grc_config: Optional[GrcConfig] = None,
            **grc_kwargs,
    ):
        """
        Args:
            vocab_size: Words (ids sorted by frequency for the adaptive softmax, as Transformer-XL's vocabulary).
            dim, depth, num_heads, head_dim, mlp_hidden: d_model, n_layer, n_head, d_head, d_inner.
            mem_len: 'xl': memory length M; 'grc': cache slots T_m (the segment's tokens are resized to them).
            cutoffs: Adaptive softmax cutoffs (the WikiText-103 ones by default); () for a plain tied softmax.
            drop: Dropout of embeddings, positions, attention output, FFN and the last hidden state.
            attn_drop: Dropout of the attention probabilities (dropatt).
            memory: 'xl' (Transformer-XL's memory) or 'grc' (the GRC cache instead).
            clamp_len: Relative distances beyond this use its sinusoid (the authors' run_wt103_base.sh evaluates
                with 400, run_wt103_large.sh with 1000); None or <= 0: no clamp (the authors clamp only when
                clamp_len > 0; their default is -1).
            same_length: Every query attends the same number of keys (the authors' evaluation option; 'xl').
            div_val: 1: one tied embedding of width `dim`. > 1: the adaptive input of the authors' large
                WikiText-103 model (`AdaptiveInput`: cluster i embedded in dim // div_val**i channels and projected
                to dim; the softmax ties both the cluster weights and the tail projections).
            untie_r: Each layer has its own u, v (`r_w_bias` (depth, heads, head_dim)), as the released
                WikiText-103 model (trained with the authors' TensorFlow code, `untie_r=True`); False: shared.
            grc_config: GRC options (`GrcConfig`), or the `grc_*` keyword arguments; r = 0.5 by default.
        """
        super().__init__()
        if memory not in ('xl', 'grc'):
            raise ValueError(f"memory must be 'xl' (Transformer-XL) or 'grc' (GRC cache), got {memory!r}")
        config = GrcConfig.from_kwargs(grc_config, grc_kwargs)
        if grc_kwargs:
            raise TypeError(f'unexpected keyword argument(s) {", ".join(sorted(grc_kwargs))}')
        if mem_len < (1 if memory == 'grc' else 0):
            raise ValueError(f'mem_len must be >= {1 if memory == "grc" else 0} for memory={memory!r}, got {mem_len}')
        self.dim = dim
        self.depth = depth
        self.mem_len = mem_len
        self.memory = memory
        self.clamp_len = clamp_len
        self.same_length = same_length
        self.untie_r = untie_r
        self.embed: Embedding = (nn.Embedding(vocab_size, dim) if div_val == 1 else
                                 AdaptiveInput(vocab_size, dim, cutoffs, div_val))
        self.drop = nn.Dropout(drop)
        bias_shape = (depth, num_heads, head_dim) if untie_r else (num_heads, head_dim)
        self.r_w_bias = nn.Parameter(torch.zeros(bias_shape))
        self.r_r_bias = nn.Parameter(torch.zeros(bias_shape))
        self.blocks = nn.ModuleList([TxlBlock(dim, num_heads, head_dim, mlp_hidden, drop, attn_drop)
                                     for _ in range(depth)])
        self.crit = AdaptiveLogSoftmax(dim, vocab_size, cutoffs, div_val)
        if memory == 'grc':
            for block in self.blocks:
                grc = GatedRecurrentCache1d(dim, num_heads, mem_len, config=config, pe=False,
                                            mem_attn_kwargs=dict(attn_drop=attn_drop))
                attach_grc(block.attn, RelGrcAttention, grc)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """The authors' `weights_init` ('normal', std 0.02): weights N(0, 0.02), biases 0, LayerNorm weight N(1, 0.02),
        u, v and the cluster logits N(0, 0.02)."""
        if init_normal_lm_weights(m):
            return
        if isinstance(m, TransformerXL):
            nn.init.normal_(m.r_w_bias, std=0.02)
            nn.init.normal_(m.r_r_bias, std=0.02)
        elif isinstance(m, AdaptiveLogSoftmax) and m.cluster_weight is not None:
            nn.init.normal_(m.cluster_weight, std=0.02)

    def grc_layers(self) -> List[GatedRecurrentCache1d]:
        return [b.attn.grc for b in self.blocks if isinstance(b.attn, RelGrcAttention)]

    def init_state(self, batch_size: int, device=None, dtype: Optional[torch.dtype] = None) -> StreamState:
        """The state at the start of B streams: an empty memory ('xl'), or each layer's `cache` buffer (zeros unless
        loaded otherwise) with no pending summary ('grc')."""
        device = device if device is not None else self.embed.weight.device
        dtype = dtype or self.embed.weight.dtype
        if self.memory == 'xl':
            empty = torch.zeros(batch_size, 0, self.dim, device=device, dtype=dtype)
            return TxlState(tuple(empty for _ in self.blocks), None)
        layers = self.grc_layers()
        caches = tuple(g.cache.to(device, dtype).expand(batch_size, -1, -1) for g in layers)
        return GrcStreamState(caches, tuple(torch.zeros_like(c) for c in caches),
                              torch.zeros(batch_size, dtype=torch.bool, device=device))

    def _keep_mask(self, L: int, M: int, mem_valid: Optional[torch.Tensor], device) -> torch.Tensor:
        """(B or 1, L, M + L) bool: causal over [memory; segment], memory slots that are real, same_length."""
        i = torch.arange(L, device=device)[:, None]
        j = torch.arange(M + L, device=device)[None]
        keep = j <= M + i
        if self.same_length:  # the authors' mask: every query sees the same number of keys (older ones dropped)
            mask_len = M + L - self.mem_len
            shift = L - mask_len if mask_len > 0 else L
            keep = keep & (j > i - shift)
        keep = keep[None]
        if mem_valid is not None and M:
            keep = keep & torch.cat([mem_valid, mem_valid.new_ones(mem_valid.shape[0], L)], dim=1)[:, None]
        return keep

    def _pos_emb(self, K: int, device, dtype) -> torch.Tensor:
        dist = torch.arange(K - 1, -1, -1, device=device, dtype=torch.float32)
        if self.clamp_len is not None and self.clamp_len > 0:  # the authors': -1 (their default) or 0 is no clamp
            dist = dist.clamp(max=self.clamp_len)
        return sinusoid_positions(dist, self.dim, dtype)

    def _next_memory(self, mem: torch.Tensor, h: torch.Tensor, mem_valid: Optional[torch.Tensor],
                     valid: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The last mem_len real entries of [mem; h] per stream (detached), and their validity."""
        cat = torch.cat([mem.to(h.dtype), h], dim=1).detach()
        if mem_valid is None and valid is None:
            return cat[:, max(0, cat.shape[1] - self.mem_len):], None
        B, M, L = h.shape[0], mem.shape[1], h.shape[1]
        ok = torch.cat([mem_valid if mem_valid is not None else h.new_ones(B, M, dtype=torch.bool),
                        valid if valid is not None else h.new_ones(B, L, dtype=torch.bool)], dim=1)
        order = torch.argsort(ok.to(torch.uint8), dim=1, stable=True)  # padding first, real entries in order last
        order = order[:, max(0, order.shape[1] - self.mem_len):]
        return cat.gather(1, order[..., None].expand(-1, -1, cat.shape[2])), ok.gather(1, order)

    def forward_features(self, ids: torch.Tensor, state: Optional[StreamState] = None,
                         mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, StreamState]:
        """Last hidden states (B, L, D) and the next state."""
        check_token_ids(ids, self.embed.num_embeddings, type(self).__name__)
        B, L = ids.shape
        valid = None if mask is None else mask.to(torch.bool)
        if valid is not None and valid.shape != (B, L):
            raise ValueError(f'mask {tuple(valid.shape)} must match the ids {(B, L)}')
        if state is None:
            state = self.init_state(B, ids.device)
        x = self.drop(self.embed(ids) * math.sqrt(self.dim))
        if self.memory == 'xl':
            if not isinstance(state, TxlState):
                raise TypeError(f'a Transformer-XL model carries a TxlState, got {type(state).__name__}: start with '
                                'init_state() or None and pass what forward returned')
            return self._forward_xl(x, state, valid)
        if not isinstance(state, GrcStreamState):
            raise TypeError(f'a GRC-cached model carries a GrcStreamState, got {type(state).__name__}: start with '
                            'init_state() or None and pass what forward returned')
        return self._forward_grc(x, state, valid)

    def _biases(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """u, v of layer i."""
        if self.untie_r:
            return self.r_w_bias[i], self.r_r_bias[i]
        return self.r_w_bias, self.r_r_bias

    def _forward_xl(self, x: torch.Tensor, state: TxlState, valid: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, TxlState]:
        B, L, _ = x.shape
        M = state.mems[0].shape[1]
        if len(state.mems) != self.depth or any(m.shape[0] != B or m.shape[1] != M for m in state.mems):
            raise ValueError(f'state holds {len(state.mems)} memories for {self.depth} layers, or another batch: '
                             'pass the state of the same streams')
        keep = self._keep_mask(L, M, state.valid, x.device)
        pos = self.drop(self._pos_emb(M + L, x.device, x.dtype))
        mems, new_valid = [], None
        for i, (block, mem) in enumerate(zip(self.blocks, state.mems)):
            new_mem, new_valid = self._next_memory(mem, x, state.valid, valid)
            mems.append(new_mem)
            x = block(x, block.attn(x, pos, *self._biases(i), keep, mem))
        return self.drop(x), TxlState(tuple(mems), new_valid)

    def _forward_grc(self, x: torch.Tensor, state: GrcStreamState, valid: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, GrcStreamState]:
        L = x.shape[1]
        keep = self._keep_mask(L, 0, None, x.device)
        pos = self.drop(self._pos_emb(L, x.device, x.dtype))
        caches, summaries, pending = [], [], state.pending
        for i, (block, cache, summary) in enumerate(zip(self.blocks, state.caches, state.summaries)):
            out, cache, summary, pending = block.attn(x, pos, *self._biases(i), keep, cache, summary,
                                                      state.pending, valid)
            caches.append(cache.detach())
            summaries.append(summary.detach())
            x = block(x, out)
        return self.drop(x), GrcStreamState(tuple(caches), tuple(summaries), pending)

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None, state: Optional[StreamState] = None,
                mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, StreamState]:
        """
        Args:
            ids: Word ids (B, L).
            targets: Next words (B, L): returns their NLL (B, L) in fp32 (0 where `mask` is False). None: returns
                log-probs of every word (B, L, vocab) in fp32.
            state: What the previous call returned for these streams (None: `init_state`).
            mask: (B, L) True on real tokens (None: all real).
        """
        h, state = self.forward_features(ids, state, mask)
        B, L, D = h.shape
        weight = self.embed if isinstance(self.embed, AdaptiveInput) else self.embed.weight
        if targets is None:
            return self.crit.log_prob(h.reshape(B * L, D), weight).view(B, L, -1), state
        if targets.shape != ids.shape:
            raise ValueError(f'targets {tuple(targets.shape)} must match the ids {tuple(ids.shape)}')
        nll = self.crit.nll(h.reshape(B * L, D), targets.reshape(-1), weight).view(B, L)
        if mask is not None:
            nll = nll * mask.to(nll.dtype)
        return nll, state


def _txl(memory: str, defaults: dict, /, **kwargs) -> TransformerXL:
    cfg = dict(defaults, memory=memory)
    cfg.update(kwargs)
    return TransformerXL(**cfg)


# Transformer-XL's run_wt103_base.sh: 16 layers, d_model 410, 10 heads of 41, d_inner 2100, dropout 0.1, dropatt 0,
# tgt_len = mem_len = 150, adaptive softmax (cutoffs 20k / 40k / 200k, div_val 1, tied)
_WT103_BASE = dict(vocab_size=WT103_VOCAB_SIZE, dim=410, depth=16, num_heads=10, head_dim=41, mlp_hidden=2100,
                   mem_len=150, cutoffs=WT103_CUTOFFS, drop=0.1, attn_drop=0.)
# Transformer-XL's run_wt103_large.sh and the released WikiText-103 model (the paper's Table 1: test ppl 18.3):
# 18 layers, d_model 1024, 16 heads of 64, d_inner 4096, dropout and dropatt 0.2, adaptive input and softmax
# (div_val 4, cutoffs 20k / 40k / 200k, weights and tail projections tied), per-layer u, v (the released weights were
# trained with the TensorFlow code's untie_r); the memory, clamp and same-length settings of its evaluation
# (run_wt103_large.sh eval: --tgt_len 128 --mem_len 1600 --clamp_len 1000 --same_length)
_WT103_LARGE = dict(vocab_size=WT103_VOCAB_SIZE, dim=1024, depth=18, num_heads=16, head_dim=64, mlp_hidden=4096,
                    mem_len=1600, cutoffs=WT103_CUTOFFS, drop=0.2, attn_drop=0.2, div_val=4, untie_r=True,
                    clamp_len=1000, same_length=True)
WT103_LARGE_EVAL_TGT_LEN = 128  # segment length of the authors' evaluation of the large model
# the released weights on the Hugging Face Hub: transformers' TransfoXLLMHeadModel (`transformer.*`, `crit.*`)
WT103_LARGE_HUB_ID = 'transfo-xl/transfo-xl-wt103'
# a small model for CPU demos and tests: pass vocab_size (plain tied softmax unless cutoffs are given)
_TINY = dict(dim=128, depth=4, num_heads=4, head_dim=32, mlp_hidden=512, mem_len=64, cutoffs=(), drop=0.1)


@register_model
def txl_wt103_base(**kwargs) -> TransformerXL:
    """Transformer-XL base for WikiText-103 (151,107,538 params; the paper's Table 1: 151M, test ppl 24.0)."""
    return _txl('xl', _WT103_BASE, **kwargs)


@register_model
def grc_txl_wt103_base(**kwargs) -> TransformerXL:
    """Transformer-XL base with its memory replaced by a GRC cache (T_m 150, D_m 200; Cached Transformers Table 5:
    test ppl 22.9)."""
    return _txl('grc', _WT103_BASE, **kwargs)


@register_model
def txl_wt103_large(**kwargs) -> TransformerXL:
    """Transformer-XL large for WikiText-103 with its evaluation settings (mem_len 1600, clamp_len 1000,
    same_length; segments of 128): the released model (285,205,322 parameters; the paper's Table 1: test ppl 18.3).
    `pretrained=True` loads its weights from the Hugging Face Hub (`transfo-xl/transfo-xl-wt103`)."""
    return _txl('xl', _WT103_LARGE, **kwargs)


txl_wt103_large.hf_hub_id = WT103_LARGE_HUB_ID  # type: ignore[attr-defined]


@register_model
def txl_tiny(**kwargs) -> TransformerXL:
    """A 4-layer D 128 Transformer-XL (memory 64) for CPU demos and tests; pass vocab_size."""
    return _txl('xl', _TINY, **kwargs)


@register_model
def grc_txl_tiny(**kwargs) -> TransformerXL:
    """`txl_tiny` with a GRC cache of 64 slots instead of the memory."""
    return _txl('grc', _TINY, **kwargs)
