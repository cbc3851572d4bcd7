"""Long Range Arena encoders and heads of Transformer-LS (ListOps, Text, Retrieval), and full-attention counterparts.

Paper: `Long-Short Transformer: Efficient Transformers for Language and Vision` - https://arxiv.org/abs/2107.02192

The structure is the official `lra/model.py` + `lra/model_wrapper.py`: token + learned absolute position embeddings
(N(0, 0.02)), pre-LN blocks (attention, GELU MLP), a final LayerNorm. With `pool='cls'` (official `--cls_last_layer`)
a zero-initialised cls vector is passed as the global token to the last layer's attention only (un-normalized), and
the normalized cls output is pooled. Without cls: `pool='mean_official'` is the official MEAN pooling (the normed
tokens times the padding mask, averaged over all n positions: it depends on how much padding there is), and
`pool='mean_real'` averages the real tokens only (padding-invariant). Heads: Linear -> ReLU -> Linear on the pooled
vector (ListOps, Text), or on [u, v, u * v, u - v] of the two documents (Retrieval).

`grc_lra_*` and `ls_grc_lra_*` are the same encoders with GRC-Attention (Cached Transformers, Table 6: Long ListOps)
in every block (`grc_config`, or the `grc_*` keyword arguments; see `lsvision/sequence/grc_lra.py`): a cache of
T_m = max_len slots (+ 1 for the cls token in the last layer) of width D / 2.

Written for lsvision, Apache-2.0.
"""
from typing import Optional

import torch
import torch.nn as nn

from timm.layers import Mlp

from lsvision.layers import FullAttention1d, GatedRecurrentCache, GrcConfig, LongShortAttention1d

from ._registry import register_model
from ._tokens import check_token_ids
from .grc_lra import add_grc_1d

__all__ = ['LraEncoder', 'LraClassifier', 'LraDualClassifier', 'POOLS']

POOLS = ('cls', 'mean_official', 'mean_real')


def _check_pool(pool: str) -> None:
    if pool == 'mean':
        raise ValueError("pool='mean' is ambiguous: 'mean_official' is the official MEAN pooling (real tokens summed, "
                         "divided by the padded length n), 'mean_real' lsvision's former 'mean' (divided by the "
                         'number of real tokens)')
    if pool not in POOLS:
        raise ValueError(f'pool must be one of {POOLS}, got {pool!r}')


class LraBlock(nn.Module):
    """Pre-LN block: x + Attn(LN1 x [, cls]); x + MLP(LN2 x)."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, attn: str = 'ls', window_size: int = 8,
                 dp_rank: int = 32, drop: float = 0., attn_drop: float = 0., grc_config: Optional[GrcConfig] = None,
                 grc_len: int = 0, grc_prefix_tokens: int = 0):
        """`grc_config`: GRC-Attention with a cache of `grc_len` sequence slots (+ `grc_prefix_tokens` for a cls
        token); None: the attention alone."""
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        if attn == 'ls':
            self.attn = LongShortAttention1d(dim, num_heads, window_size, dp_rank, attn_drop=attn_drop)
        elif attn == 'full':
            self.attn = FullAttention1d(dim, num_heads, attn_drop=attn_drop)
        else:
            raise ValueError(f"attn must be 'ls' or 'full', got {attn!r}")
        if grc_config is not None:
            add_grc_1d(self.attn, grc_len, grc_prefix_tokens, grc_config)
        self.drop = nn.Dropout(drop)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp_hidden, act_layer=nn.GELU, drop=drop)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                cls_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.attn(self.norm1(x), mask, cls_token)
        if cls_token is not None:
            x = torch.cat([cls_token, x], dim=1)  # the un-normalized cls joins the residual stream
        x = x + self.drop(out)
        return x + self.mlp(self.norm2(x))


class LraEncoder(nn.Module):
    """Token ids (B, n), 0 = padding -> pooled features (B, D)."""

    def __init__(
            self,
            vocab_size: int = 512,
            max_len: int = 2048,
            dim: int = 64,
            depth: int = 2,
            num_heads: int = 2,
            mlp_hidden: int = 128,
            attn: str = 'ls',
            window_size: int = 8,
            dp_rank: int = 32,
            drop: float = 0.,
            attn_drop: float = 0.,
            pool: str = 'cls',
            pad_id: int = 0,
            grc_config: Optional[GrcConfig] = None,
    ):
        """
        Args:
            vocab_size: Rows of the token embedding (official table: 512).
            max_len: Rows of the learned position embedding (longest input).
            dim: Width D.
            depth: Blocks.
            num_heads: Heads.
            mlp_hidden: MLP hidden width.
            attn: 'ls' (long-short) or 'full' (quadratic counterpart).
            window_size: w of the long-short attention.
            dp_rank: r of the long-short attention.
            drop: Dropout (embeddings, residual branches, MLP).
            attn_drop: Attention-weight dropout.
            pool: 'cls' (official `--cls_last_layer`: a cls vector joins the last layer, its output is pooled),
                'mean_official' (official MEAN pooling without cls: sum of the real tokens divided by n, the padded
                length) or 'mean_real' (sum of the real tokens divided by their number).
            pad_id: Token id of padding (official: 0); the key-padding mask is `ids != pad_id`.
            grc_config: GRC-Attention in every block (`lsvision.layers.GrcConfig`): a cache of max_len slots, plus
                one for the cls token in the last block with `pool='cls'`. None: no cache.
        """
        super().__init__()
        _check_pool(pool)
        self.max_len = max_len
        self.pool = pool
        self.pad_id = pad_id
        self.num_features = dim
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList([
            LraBlock(dim, num_heads, mlp_hidden, attn, window_size, dp_rank, drop, attn_drop, grc_config, max_len,
                     int(pool == 'cls' and i == depth - 1)) for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == 'cls' else None
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.02)

    def set_pool(self, pool: str) -> None:
        """Switches the pooling; to 'cls' adds a zero cls vector, away from it removes the cls parameter.

        Meant before loading weights (`load_official_checkpoint` calls it), not during training: it changes the
        parameters.
        """
        _check_pool(pool)
        if (pool == 'cls') != (self.pool == 'cls') and self.grc_layers():
            raise ValueError(f"the GRC cache of the last block was built {'with' if self.pool == 'cls' else 'without'}"
                             f" a cls slot: build the model with pool={pool!r} instead of switching from "
                             f'{self.pool!r}')
        if pool == 'cls' and self.cls_token is None:
            w = self.embed.weight
            self.cls_token = nn.Parameter(torch.zeros(1, 1, w.shape[1], device=w.device, dtype=w.dtype))
        elif pool != 'cls':
            self.cls_token = None
        self.pool = pool

    def grc_layers(self) -> list:
        """The GRC layers of the blocks (`lsvision.layers.GatedRecurrentCache`), first block first; [] without."""
        return [m for m in self.modules() if isinstance(m, GatedRecurrentCache)]

    def reset_cache(self) -> None:
        """Zero every GRC cache."""
        for m in self.grc_layers():
            m.reset_cache()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.embed.num_embeddings, 'this LRA encoder')
        B, n = ids.shape
        if n > self.max_len:
            raise ValueError(f'input of {n} tokens is longer than max_len={self.max_len}; build the model with a '
                             f'larger max_len or truncate the input')
        mask = ids != self.pad_id
        x = self.embed(ids) + self.pos_embed(torch.arange(n, device=ids.device))[None]
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            last = i == len(self.blocks) - 1
            cls = self.cls_token.expand(B, -1, -1) if (last and self.cls_token is not None) else None
            x = block(x, mask, cls)
        x = self.norm(x)
        if self.cls_token is not None:
            return x[:, 0]
        m = mask.to(x.dtype)[:, :, None]
        if self.pool == 'mean_official':
            return (x * m).mean(1)  # official: norm(X) * mask, then mean over all n positions
        return (x * m).sum(1) / m.sum(1).clamp(min=1.)


class LraClassifier(nn.Module):
    """Encoder + SCHead (Linear -> ReLU -> Linear): ids (B, n) -> logits (B, classes)."""

    def __init__(self, num_classes: int, mlp_hidden: int = 128, **encoder_kwargs):
        super().__init__()
        self.encoder = LraEncoder(mlp_hidden=mlp_hidden, **encoder_kwargs)
        dim = self.encoder.num_features
        self.head = nn.Sequential(nn.Linear(dim, mlp_hidden), nn.ReLU(), nn.Linear(mlp_hidden, num_classes))

    def reset_cache(self) -> None:
        """Zero every GRC cache (models with GRC-Attention)."""
        self.encoder.reset_cache()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids))


class LraDualClassifier(nn.Module):
    """Shared encoder on two documents + SCHeadDual on [u, v, u * v, u - v]: (ids1, ids2) -> logits (B, classes)."""

    def __init__(self, num_classes: int = 2, mlp_hidden: int = 128, **encoder_kwargs):
        super().__init__()
        self.encoder = LraEncoder(mlp_hidden=mlp_hidden, **encoder_kwargs)
        dim = self.encoder.num_features
        self.head = nn.Sequential(nn.Linear(4 * dim, mlp_hidden), nn.ReLU(), nn.Linear(mlp_hidden, num_classes))

    def reset_cache(self) -> None:
        """Zero every GRC cache (models with GRC-Attention)."""
        self.encoder.reset_cache()

    def forward(self, ids1: torch.Tensor, ids2: torch.Tensor) -> torch.Tensor:
        u, v = self.encoder(ids1), self.encoder(ids2)
        return self.head(torch.cat([u, v, u * v, u - v], dim=-1))


# official scripts: 2 layers, D 64, 2 heads, FFN 128, vocab table 512; (w, r) = (8, 32)
_LISTOPS = dict(num_classes=10, max_len=2048, drop=0., attn_drop=0.)
_TEXT = dict(num_classes=2, max_len=4096, drop=0., attn_drop=0.)
_RETRIEVAL = dict(num_classes=2, max_len=4096, drop=0.1, attn_drop=0.1)


def _lra(cls, defaults, attn, **kwargs):
    cfg = dict(defaults, attn=attn)
    cfg.update(kwargs)
    return cls(**cfg)


def _lra_grc(cls, defaults, attn, **kwargs):
    """`_lra` with GRC-Attention: `grc_config`, or `grc_*` keyword arguments (`grc_ratio`, `grc_sync_cache`, ...)."""
    grc_config = GrcConfig.from_kwargs(kwargs.pop('grc_config', None), kwargs)
    return _lra(cls, defaults, attn, grc_config=grc_config, **kwargs)


@register_model
def ls_lra_listops(**kwargs) -> LraClassifier:
    """Transformer-LS (w, r = 8, 32) on LRA ListOps: ids (B, 2048) -> (B, 10). Best of Table 7: w=16, r=2."""
    return _lra(LraClassifier, _LISTOPS, 'ls', **kwargs)


@register_model
def ls_lra_text(**kwargs) -> LraClassifier:
    """Transformer-LS (w, r = 8, 32) on LRA Text (IMDb bytes): ids (B, 4096) -> (B, 2). Best: w=1, r=1."""
    return _lra(LraClassifier, _TEXT, 'ls', **kwargs)


@register_model
def ls_lra_retrieval(**kwargs) -> LraDualClassifier:
    """Transformer-LS (w, r = 8, 32) on LRA Retrieval (AAN): 2 x (B, 4096) -> (B, 2). Best: w=1, r=254."""
    return _lra(LraDualClassifier, _RETRIEVAL, 'ls', **kwargs)


@register_model
def full_lra_listops(**kwargs) -> LraClassifier:
    """Full-attention counterpart of `ls_lra_listops` (same shapes)."""
    return _lra(LraClassifier, _LISTOPS, 'full', **kwargs)


@register_model
def full_lra_text(**kwargs) -> LraClassifier:
    """Full-attention counterpart of `ls_lra_text`."""
    return _lra(LraClassifier, _TEXT, 'full', **kwargs)


@register_model
def full_lra_retrieval(**kwargs) -> LraDualClassifier:
    """Full-attention counterpart of `ls_lra_retrieval`."""
    return _lra(LraDualClassifier, _RETRIEVAL, 'full', **kwargs)


# GRC-Attention (Cached Transformers, Table 6: Long ListOps; Transformer 36.23 -> 37.40 with the cache): r = 0.5
# (D_m = 32 of D = 64), lam init 0, a cache of T_m = max_len slots, updated in training and frozen in eval


@register_model
def grc_lra_listops(**kwargs) -> LraClassifier:
    """`full_lra_listops` with GRC-Attention in both blocks: the paper's Long ListOps setting (Cached Transformers,
    Table 6: Transformer 36.23 -> 37.40), r = 0.5, cache T_m = max_len = 2048."""
    return _lra_grc(LraClassifier, _LISTOPS, 'full', **kwargs)


@register_model
def grc_lra_text(**kwargs) -> LraClassifier:
    """`full_lra_text` with GRC-Attention (the Table 6 ListOps setting of Cached Transformers on LRA Text), r = 0.5,
    cache T_m = max_len = 4096."""
    return _lra_grc(LraClassifier, _TEXT, 'full', **kwargs)


@register_model
def grc_lra_retrieval(**kwargs) -> LraDualClassifier:
    """`full_lra_retrieval` with GRC-Attention (the Table 6 ListOps setting of Cached Transformers on LRA Retrieval),
    r = 0.5, cache T_m = max_len = 4096; both documents go through the same encoder and update its cache."""
    return _lra_grc(LraDualClassifier, _RETRIEVAL, 'full', **kwargs)


@register_model
def ls_grc_lra_listops(**kwargs) -> LraClassifier:
    """`ls_lra_listops` (w, r = 8, 32) with GRC-Attention: long-short self branch, full attention over the cache
    (Cached Transformers, Table 6 Long ListOps setting: r = 0.5, T_m = max_len = 2048)."""
    return _lra_grc(LraClassifier, _LISTOPS, 'ls', **kwargs)


@register_model
def ls_grc_lra_text(**kwargs) -> LraClassifier:
    """`ls_lra_text` with GRC-Attention (the Table 6 ListOps setting of Cached Transformers), T_m = 4096."""
    return _lra_grc(LraClassifier, _TEXT, 'ls', **kwargs)


@register_model
def ls_grc_lra_retrieval(**kwargs) -> LraDualClassifier:
    """`ls_lra_retrieval` with GRC-Attention (the Table 6 ListOps setting of Cached Transformers), T_m = 4096."""
    return _lra_grc(LraDualClassifier, _RETRIEVAL, 'ls', **kwargs)
