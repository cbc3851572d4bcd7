"""Character-level language models of Transformer-LS (enwik8, text8) and their full-attention counterparts.

Paper: `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

The official fairseq plugin (`autoregressive/model_lib/{layer,model}.py`): embeddings scaled by sqrt(D), blocks of
causal long-short attention with a per-layer cache of the previous M raw layer inputs, output weights tied to the
input embedding (own bias), log-softmax. `block='official'` is the official normalized-residual block
(y = LN1 x; z = y + Attn(y, LN1 cache); z' = LN2 z; out = z' + FF(z'), no final LayerNorm); `block='prenorm'` is a
standard pre-LN block with a final LayerNorm. `cache_mode='official'` starts from a zero cache that is attended like
real tokens, as fairseq runs the official model; `'masked'` (default) masks cache slots until real tokens fill them
(see `CharLM`). `lsvision.sequence.convert.load_official_checkpoint` sets `'official'` for the authors' checkpoints.

Written for lsvision, Apache-2.0.
"""
import math
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import Mlp

from lsvision.layers import CausalLongShortAttention, scaled_dot_product_attention

from ._init import init_normal_lm_weights
from ._registry import register_model
from ._tokens import check_token_ids

__all__ = ['CharLM', 'LMState', 'CausalFullAttention']


class LMState(NamedTuple):
    """Per-layer caches of the previous M raw layer inputs (B, M, D) and how many of their last slots are real.

    `valid_len` None means every slot counts as real (official zero cache).
    """
    caches: List[torch.Tensor]
    valid_len: Optional[int]


class CausalFullAttention(nn.Module):
    """Causal full attention (SDPA) over the current block, the counterpart of `CausalLongShortAttention`.

    The cache is accepted for interface compatibility and ignored: positions are absolute within the block.
    """

    def __init__(self, dim: int, num_heads: int = 8, attn_drop: float = 0., proj_drop: float = 0.):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, cache: Optional[torch.Tensor] = None,
                cache_valid_len: Optional[int] = None) -> torch.Tensor:
        B, L, C = x.shape
        h = self.num_heads

        def heads(t):
            return t.reshape(B, L, h, C // h).transpose(1, 2)

        out = scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True,
                                             dropout_p=self.attn_drop if self.training else 0.)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, L, C)))


class CausalLSBlock(nn.Module):
    """Causal long-short (or full) attention + GELU FFN, official normalized-residual or pre-LN."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, attn: str = 'ls', block: str = 'official',
                 drop: float = 0., **attn_kwargs):
        super().__init__()
        if block not in ('official', 'prenorm'):
            raise ValueError(f"block must be 'official' or 'prenorm', got {block!r}")
        self.block = block
        self.norm1 = nn.LayerNorm(dim)
        if attn == 'ls':
            self.attn = CausalLongShortAttention(dim, num_heads, proj_drop=drop, pos_drop=drop, **attn_kwargs)
        elif attn == 'full':
            self.attn = CausalFullAttention(dim, num_heads, proj_drop=drop)
        else:
            raise ValueError(f"attn must be 'ls' or 'full', got {attn!r}")
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_hidden, act_layer=nn.GELU, drop=drop)

    def forward(self, x: torch.Tensor, cache: Optional[torch.Tensor], valid_len: Optional[int]) -> torch.Tensor:
        c = None if cache is None else self.norm1(cache)
        if self.block == 'official':
            y = self.norm1(x)
            z = self.norm2(y + self.attn(y, c, valid_len))
            return z + self.mlp(z)
        x = x + self.attn(self.norm1(x), c, valid_len)
        return x + self.mlp(self.norm2(x))


class CharLM(nn.Module):
    """Token ids (B, L) [+ state] -> next-token log-probs (B, L, V) and the next state (per-layer caches)."""

    def __init__(
            self,
            vocab_size: int = 208,
            dim: int = 512,
            depth: int = 12,
            num_heads: int = 8,
            mlp_hidden: int = 2048,
            window_size: int = 512,
            segment_size: int = 16,
            dp_rank: int = 1,
            mem_len: int = 2048,
            attn: str = 'ls',
            block: str = 'official',
            cache_mode: str = 'masked',
            drop: float = 0.2,
            max_len: int = 2048,
            compress_hidden_cache: bool = True,
            query_chunk_size: Optional[int] = 128,
    ):
        """
        Args:
            vocab_size: Output classes and embedding rows (fairseq dictionary size).
            dim, depth, num_heads, mlp_hidden: Width, blocks, heads, FFN width.
            window_size, segment_size, dp_rank: W, l and r of the causal long-short attention.
            mem_len: M, cached tokens per layer (0: no cache).
            attn: 'ls', or 'full' (causal SDPA within the block, learned absolute positions, no cache).
            block: 'official' (normalized residual, no final LN) or 'prenorm' (pre-LN + final LN).
            cache_mode: How the state before the first block (`init_state`) is read. 'official': M zero vectors
                per layer that are attended like real tokens (fairseq's zero initial cache; LN1 turns each into
                LN1's bias, so they take attention weight). 'masked': the slots no real token has filled yet are
                masked (window keys and cache segments), so the first tokens of a stream attend only real tokens;
                it also allows M < W and M % l != 0. The two differ only on the first blocks of a stream, until
                every layer's cache holds states computed from filled caches. Use 'official' for the authors'
                checkpoints (trained and evaluated that way; `load_official_checkpoint` sets it) and to compare
                with their numbers; 'masked' for models trained in lsvision with it, for short streams or
                documents that each start afresh (where fake zero tokens would weigh most), and for M < W.
            drop: Dropout (embeddings, window sinusoids, residual branches, FFN, last hidden state).
            max_len: Longest block for the learned positions of `attn='full'`.
            compress_hidden_cache: See `CausalLongShortAttention`.
            query_chunk_size: See `CausalLongShortAttention`.
        """
        super().__init__()
        if cache_mode not in ('masked', 'official'):
            raise ValueError(f"cache_mode must be 'masked' or 'official', got {cache_mode!r}")
        self.dim = dim
        self.mem_len = mem_len if attn == 'ls' else 0
        self.cache_mode = cache_mode
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_len, dim) if attn == 'full' else None
        self.drop = nn.Dropout(drop)
        attn_kwargs = dict(window_size=window_size, segment_size=segment_size, dp_rank=dp_rank,
                           compress_hidden_cache=compress_hidden_cache, query_chunk_size=query_chunk_size)
        self.blocks = nn.ModuleList([
            CausalLSBlock(dim, num_heads, mlp_hidden, attn, block, drop, **(attn_kwargs if attn == 'ls' else {}))
            for _ in range(depth)])
        self.norm = nn.LayerNorm(dim) if block == 'prenorm' else nn.Identity()
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        """Official `_init_weights`: Linear/Embedding N(0, 0.02), biases 0, LayerNorm weight N(1, 0.02)."""
        if init_normal_lm_weights(m):
            return
        if isinstance(m, CausalLongShortAttention):
            nn.init.normal_(m.content_bias, std=0.02)
            nn.init.normal_(m.pos_bias, std=0.02)

    def init_state(self, batch_size: int, device=None, dtype=None) -> Optional[LMState]:
        """The state before the first block: zero caches, masked or (official) attended."""
        if self.mem_len == 0:
            return None
        dtype = dtype or self.embed.weight.dtype
        caches = [torch.zeros(batch_size, self.mem_len, self.dim, device=device, dtype=dtype) for _ in self.blocks]
        return LMState(caches, 0 if self.cache_mode == 'masked' else None)

    def forward(self, ids: torch.Tensor, state: Optional[LMState] = None) -> Tuple[torch.Tensor, Optional[LMState]]:
        """
        Args:
            ids: Token ids (B, L).
            state: The state returned by the previous call (None: `init_state`).

        Returns:
            Log-probs (B, L, V) in fp32 and the next state (caches detached).
        """
        check_token_ids(ids, self.embed.num_embeddings, 'this character LM')
        B, L = ids.shape
        x = self.embed(ids) * math.sqrt(self.dim)
        if self.pos_embed is not None:
            if L > self.pos_embed.num_embeddings:
                raise ValueError(f'block of {L} tokens is longer than max_len={self.pos_embed.num_embeddings}')
            x = x + self.pos_embed(torch.arange(L, device=ids.device))[None]
        x = self.drop(x)
        if state is None:
            state = self.init_state(B, ids.device, x.dtype)
        next_caches = []
        for i, block in enumerate(self.blocks):
            cache = None if state is None else state.caches[i]
            if cache is not None:
                next_caches.append(torch.cat([cache, x], dim=1)[:, -self.mem_len:].detach())
            x = block(x, cache, None if state is None else state.valid_len)
        x = self.drop(self.norm(x))
        logits = F.linear(x, self.embed.weight, self.out_bias)
        next_state = None
        if state is not None:
            valid = None if state.valid_len is None else min(self.mem_len, state.valid_len + L)
            next_state = LMState(next_caches, valid)
        return logits.float().log_softmax(dim=-1), next_state


_ENWIK8_SMALL = dict(vocab_size=208, depth=12, drop=0.2)
_ENWIK8_LARGE = dict(vocab_size=208, depth=30, drop=0.4)
_TEXT8_SMALL = dict(vocab_size=32, depth=12, drop=0.2)


def _lm(defaults, attn, **kwargs) -> CharLM:
    cfg = dict(defaults, attn=attn)
    cfg.update(kwargs)
    return CharLM(**cfg)


@register_model
def ls_lm_enwik8_small(**kwargs) -> CharLM:
    """Transformer-LS 12L D512 char-LM for enwik8 (44,294,448 params with vocab 208): W 512, l 16, r 1, M = L."""
    return _lm(_ENWIK8_SMALL, 'ls', **kwargs)


@register_model
def ls_lm_enwik8_large(**kwargs) -> CharLM:
    """Transformer-LS 30L D512 char-LM for enwik8 (110,576,064 params)."""
    return _lm(_ENWIK8_LARGE, 'ls', **kwargs)


@register_model
def ls_lm_text8_small(**kwargs) -> CharLM:
    """Transformer-LS 12L D512 char-LM for text8 (44,204,160 params with vocab 32)."""
    return _lm(_TEXT8_SMALL, 'ls', **kwargs)


@register_model
def full_lm_enwik8_small(**kwargs) -> CharLM:
    """Causal full-attention counterpart of `ls_lm_enwik8_small` (learned positions, no cache)."""
    return _lm(_ENWIK8_SMALL, 'full', **kwargs)


@register_model
def full_lm_enwik8_large(**kwargs) -> CharLM:
    """Causal full-attention counterpart of `ls_lm_enwik8_large`."""
    return _lm(_ENWIK8_LARGE, 'full', **kwargs)


@register_model
def full_lm_text8_small(**kwargs) -> CharLM:
    """Causal full-attention counterpart of `ls_lm_text8_small`."""
    return _lm(_TEXT8_SMALL, 'full', **kwargs)
