"""HSW: a hierarchical shifted-window encoder for long documents, with an optional long-short attention.

Paper: `Hierarchical Shifted Window transformer for long documents` (HSW), which brings Swin's windows, shifted
windows and patch merging to 4096-token text. The paper gives no code; this is the architecture its text fixes
(embedding width 96, windows of 64, three 4x merges to 64 x 768, window / shifted-window pairs), Swin in 1D:

  * token embedding -> LayerNorm,
  * 4 stages of (window attention, shifted-window attention) block pairs with a relative position bias per block,
    windows of 64 tokens, shift by half a window with Swin's mask against wrap-around pairs,
  * 4-token patch merging (concat -> LayerNorm -> Linear(4C, 2C)) before stages 2-4: 4096 x 96 -> 64 x 768,
  * LayerNorm -> mean over the real tokens -> Linear classifier.

`attn='ls'` (HSW-LS, not in the paper) adds r dynamic-projection keys per head to every window (Transformer-LS, with
its DualLN), computed over the whole stage sequence, in the same softmax as the window keys.

Any vocabulary and any length: documents are padded (mask or `pad_token_id`), stage lengths need not be a multiple
of the window (padded and masked inside), padded tokens never change the outputs of real ones.

Written for lsvision, Apache-2.0.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import DropPath, Mlp, trunc_normal_
from timm.models.vision_transformer import Block

from lsvision.layers import LinearDynamicProjection, dynamic_projection, span_attention
from lsvision.layers.softmax import mask_value

from ._registry import register_model
from ._tokens import check_token_ids

__all__ = ['HSW', 'FlatEncoder', 'BagOfTokens', 'WindowAttention1d', 'HSWBlock', 'PatchMerging1d', 'HSWStage']

# Pairs across the wrap-around. Swin uses -100 (exp(-100) is ~4e-44, not 0); -inf makes the receptive field exact,
# and keeps it so in a padded query's row, whose keys are all padded (`mask_value`, finite): the one mask of the layers
# that is not `mask_value` (lsvision.layers.softmax). No row is all -inf: a query always sees itself.
_SHIFT_MASK_VALUE = float('-inf')


def shift_window_ids(seq_len: int, window_size: int, shift_size: int, device=None) -> torch.Tensor:
    """Region ids of the rolled positions of a shifted block: 0 for p < N - w, 1 for N - w <= p < N - s,
    2 for p >= N - s. Only the last window holds two regions: the last s tokens and the first s (wrapped around)."""
    ids = torch.zeros(seq_len, dtype=torch.long, device=device)
    ids[seq_len - window_size:] = 1
    ids[seq_len - shift_size:] = 2
    return ids


def shift_window_mask(seq_len: int, window_size: int, shift_size: int, device=None) -> torch.Tensor:
    """Swin's additive wrap-around mask of a shifted block: (num_windows, w, w), -inf between different regions."""
    ids = shift_window_ids(seq_len, window_size, shift_size, device).reshape(-1, window_size)
    mask = torch.zeros(ids.shape[0], window_size, window_size, device=device)
    return mask.masked_fill(ids[:, :, None] != ids[:, None, :], _SHIFT_MASK_VALUE)


class WindowAttention1d(nn.Module):
    """Multi-head attention within windows of a token sequence, relative position bias, optional shift.

    With `dp_rank` r > 0 every window also sees r dynamic-projection keys per head (long-short attention): k and v
    go through LN_L, the projected k_bar, v_bar = LN_G(P k), LN_G(P v) are computed over the whole (un-rolled)
    sequence, and the queries of a window take one softmax over [r projected keys | w window keys]. The relative
    position bias and the shift mask act on the window keys only. The attention itself is the long-short core,
    `span_attention`, with non-overlapping spans (`span_pad=0`) and a recomputing backward.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int,
            window_size: int = 64,
            qkv_bias: bool = True,
            dp_rank: int = 0,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            dual_ln_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels C.
            num_heads: Heads h; head dim C / h.
            window_size: Window w (the largest; a shorter sequence is one window of its own length).
            qkv_bias: Bias in the qkv Linear.
            dp_rank: Dynamic projections r per head (0: plain window attention).
            attn_drop: Dropout on the attention weights.
            proj_drop: Dropout after the output projection.
            dual_ln_eps: Epsilon of the LN_L / LN_G pair (LS only).
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} must be divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.dp_rank = dp_rank
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias, **dd)
        # bias of offset i - j (window-local positions) at row i - j + w - 1
        self.relative_position_bias_table = nn.Parameter(torch.zeros(2 * window_size - 1, num_heads, **dd))
        if dp_rank > 0:
            self.dynamic_proj = LinearDynamicProjection(dim, num_heads * dp_rank, **dd)
            self.norm_local = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)  # LN_L on k and v
            self.norm_global = nn.LayerNorm(dim, eps=dual_ln_eps, **dd)  # LN_G on the projected k and v
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        trunc_normal_(self.relative_position_bias_table, std=.02)

    def _rel_pos_bias(self, window: int) -> torch.Tensor:
        """(h, window, window) bias; a window shorter than the table's uses the central offsets."""
        pos = torch.arange(window, device=self.relative_position_bias_table.device)
        idx = pos[:, None] - pos[None, :] + self.window_size - 1
        return self.relative_position_bias_table[idx.reshape(-1)].reshape(window, window, -1).permute(2, 0, 1)

    def attn_mask(
            self,
            valid: Optional[torch.Tensor],
            seq_len: int,
            window: int,
            shift: int,
            dtype: torch.dtype,
    ) -> torch.Tensor:
        """Additive mask of the window keys, in rolled (shifted) order: (B or 1, h, num_windows, w, w).

        Relative position bias + wrap-around mask (shifted blocks) + padded keys (`valid` False, and the positions
        that complete the last window).
        """
        num_windows = -(-seq_len // window)
        padded_len = num_windows * window
        mask = self._rel_pos_bias(window).to(dtype)[None, :, None]  # (1, h, 1, w, w)
        device = mask.device
        if shift:
            mask = mask + shift_window_mask(padded_len, window, shift, device).to(dtype)[None, None]
        if valid is not None or padded_len != seq_len:
            if valid is None:
                valid = torch.ones(1, seq_len, dtype=torch.bool, device=device)
            valid = F.pad(valid, (0, padded_len - seq_len), value=False)
            if shift:
                valid = valid.roll(-shift, dims=1)
            key_mask = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill(~valid, mask_value(dtype))
            mask = mask + key_mask.reshape(-1, 1, num_windows, 1, window)
        return mask

    def forward(
            self,
            x: torch.Tensor,
            valid: Optional[torch.Tensor] = None,
            window: Optional[int] = None,
            shift: int = 0,
    ) -> torch.Tensor:
        """
        Args:
            x: Tokens (B, N, C).
            valid: (B, N) bool, True on real tokens; None if there is no padding.
            window: Window size (default: min(w, N)); at most `window_size`.
            shift: Roll the sequence by -shift before the windows and back after (shifted windows), 0 <= shift < w.

        Returns:
            Tokens (B, N, C).
        """
        B, N, C = x.shape
        h, d, r = self.num_heads, self.head_dim, self.dp_rank
        window = min(self.window_size, N) if window is None else window
        if not 0 < window <= self.window_size or not 0 <= shift < window:
            raise ValueError(
                f'need 0 < window <= window_size ({self.window_size}) and 0 <= shift < window, got window {window}, '
                f'shift {shift}')
        num_windows = -(-N // window)
        padded_len = num_windows * window

        qkv = self.qkv(x).reshape(B, N, 3, h, d)
        q, kv = qkv[:, :, 0], qkv[:, :, 1:]
        if r > 0:
            # LS: LN_L on k, v (window and projection alike); k_bar, v_bar from the un-rolled sequence (roll-invariant)
            kv = self.norm_local(kv.reshape(B, N, 2, C)).to(qkv.dtype).reshape(B, N, 2, h, d)
            logits = self.dynamic_proj(x, (1, N))
            kv_bar = dynamic_projection(kv.permute(2, 0, 3, 1, 4), logits, self.norm_global, valid).to(qkv.dtype)
        else:
            kv_bar = q.new_zeros(2, B, h, 0, d)  # plain window attention: no shared keys
        if padded_len != N:
            q = F.pad(q, (0, 0, 0, 0, 0, padded_len - N))
            kv = F.pad(kv, (0, 0, 0, 0, 0, 0, 0, padded_len - N))
        if shift:
            q, kv = q.roll(-shift, dims=1), kv.roll(-shift, dims=1)
        # one softmax over [r projected | w window] keys per window: the long-short core with non-overlapping spans
        out = span_attention(
            q.transpose(1, 2), kv.permute(2, 0, 3, 1, 4), kv_bar,
            self.attn_mask(valid, N, window, shift, q.dtype), window, d ** -0.5,
            self.attn_drop if self.training else 0., span_pad=0)  # (B, padded_len, h, d)
        out = out.reshape(B, padded_len, C)
        if shift:
            out = out.roll(shift, dims=1)
        x = self.proj(out[:, :N])
        return self.proj_drop(x)


class HSWBlock(nn.Module):
    """Swin block in 1D: x + WMSA(LN x); x + MLP(LN x). Shifted blocks shift only when the sequence is longer than
    one window (a sequence of at most w tokens is one global window, as stage 4 at 4096 tokens)."""

    def __init__(
            self,
            dim: int,
            num_heads: int,
            window_size: int = 64,
            shift_size: int = 0,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            dp_rank: int = 0,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: float = 0.,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if not 0 <= shift_size < window_size:
            raise ValueError(f'shift_size must be in [0, window_size={window_size}), got {shift_size}')
        self.window_size = window_size
        self.shift_size = shift_size
        self.norm1 = nn.LayerNorm(dim, **dd)
        self.attn = WindowAttention1d(
            dim, num_heads, window_size, qkv_bias=qkv_bias, dp_rank=dp_rank, attn_drop=attn_drop,
            proj_drop=proj_drop, **dd)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def window_and_shift(self, seq_len: int) -> Tuple[int, int]:
        """(window, shift) used at this length: min(w, N), and no shift when N <= w."""
        if seq_len <= self.window_size:
            return seq_len, 0
        return self.window_size, self.shift_size

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        window, shift = self.window_and_shift(x.shape[1])
        x = x + self.drop_path1(self.attn(self.norm1(x), valid, window, shift))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class PatchMerging1d(nn.Module):
    """Merges 4 consecutive tokens: (B, N, C) -> (B, ceil(N / 4), 4C) -> LayerNorm -> Linear(4C, 2C, no bias).

    Padded tokens are zeroed first (so their content never reaches a real token), the sequence is zero-padded to a
    multiple of 4, and a merged token is real if any of its 4 is.
    """

    def __init__(self, dim: int, out_dim: Optional[int] = None, merge: int = 4, device=None, dtype=None):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.merge = merge
        self.out_dim = out_dim or 2 * dim
        self.norm = nn.LayerNorm(merge * dim, **dd)
        self.reduction = nn.Linear(merge * dim, self.out_dim, bias=False, **dd)

    def forward(
            self,
            x: torch.Tensor,
            valid: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        B, N, C = x.shape
        m = self.merge
        pad = -N % m
        if pad and valid is None:
            valid = torch.ones(B, N, dtype=torch.bool, device=x.device)
        if valid is not None:
            x = x.masked_fill(~valid[:, :, None], 0.)
            valid = F.pad(valid, (0, pad), value=False).reshape(B, -1, m).any(dim=-1)
        x = F.pad(x, (0, 0, 0, pad)).reshape(B, (N + pad) // m, m * C)
        return self.reduction(self.norm(x)), valid

    @torch.no_grad()
    def init_mean_path(self, std: float = .02) -> None:
        """Starts the first `dim` outputs as the sum / 2 of the merged tokens (the rest random, std `std`): the token
        statistics then reach the pooled features unscrambled from the first step (a random 4C -> 2C projection after
        LayerNorm loses most of them, and every merge compounds the loss)."""
        in_dim = self.reduction.in_features
        dim = in_dim // self.merge
        weight = torch.empty_like(self.reduction.weight)
        trunc_normal_(weight, std=std)
        keep = min(dim, self.out_dim)
        for k in range(self.merge):
            weight[:keep, k * dim:(k + 1) * dim] = torch.eye(keep, dim, dtype=weight.dtype, device=weight.device) / 2
        self.reduction.weight.copy_(weight)


class HSWStage(nn.Module):
    """Optional 4-token merge, then `depth` blocks alternating window (even) and shifted-window (odd) attention."""

    def __init__(
            self,
            dim: int,
            out_dim: int,
            depth: int,
            num_heads: int,
            downsample: bool = True,
            window_size: int = 64,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            dp_rank: int = 0,
            proj_drop: float = 0.,
            attn_drop: float = 0.,
            drop_path: Union[float, Sequence[float]] = 0.,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.downsample = PatchMerging1d(dim, out_dim, **dd) if downsample else None
        dpr = drop_path if isinstance(drop_path, (list, tuple)) else [drop_path] * depth
        self.blocks = nn.ModuleList([
            HSWBlock(
                out_dim, num_heads, window_size, shift_size=0 if i % 2 == 0 else window_size // 2,
                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, dp_rank=dp_rank, proj_drop=proj_drop, attn_drop=attn_drop,
                drop_path=dpr[i], **dd)
            for i in range(depth)])

    def forward(
            self,
            x: torch.Tensor,
            valid: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.downsample is not None:
            x, valid = self.downsample(x, valid)
        for blk in self.blocks:
            x = blk(x, valid)
        return x, valid


def _masked_mean(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean over the real tokens (B, N, C) -> (B, C); an all-padded sample gives 0."""
    if valid is None:
        return x.mean(dim=1)
    w = valid.to(x.dtype)[:, :, None]
    return (x * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.)


def _masked_max(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """Max over the real tokens (B, N, C) -> (B, C); an all-padded sample gives 0."""
    if valid is None:
        return x.amax(dim=1)
    out = x.masked_fill(~valid[:, :, None], float('-inf')).amax(dim=1)
    return out.masked_fill(~valid.any(dim=1, keepdim=True), 0.)


def _validate_tokens(x: torch.Tensor, vocab_size: int, mask: Optional[torch.Tensor]) -> None:
    check_token_ids(x, vocab_size, 'this HSW')
    if mask is not None and mask.shape != x.shape:
        raise ValueError(f'mask must have the shape of the tokens {tuple(x.shape)}, got {tuple(mask.shape)}')


def _resolve_mask(x: torch.Tensor, mask: Optional[torch.Tensor], pad_token_id: Optional[int]) -> Optional[torch.Tensor]:
    """(B, N) bool of real tokens from `mask` (1 = real) or from `pad_token_id`; None when nothing is padded."""
    if mask is None and pad_token_id is not None:
        mask = x != pad_token_id
    if mask is None:
        return None
    mask = mask.bool()
    return None if bool(mask.all()) else mask


class HSW(nn.Module):
    """Hierarchical shifted-window encoder for long token sequences (document classification).

    forward(x, mask) takes token ids (B, N), any N, and an optional (B, N) mask (1 = real token; or set
    `pad_token_id`), and returns logits (B, num_classes). `forward_intermediates` gives every stage's tokens.
    """

    def __init__(
            self,
            vocab_size: int = 50265,
            num_classes: int = 11,
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 2, 2),
            num_heads: Optional[Sequence[int]] = None,
            head_dim: int = 32,
            window_size: int = 64,
            mlp_ratio: float = 4.,
            qkv_bias: bool = True,
            attn: str = 'window',
            dp_ranks: Sequence[int] = (16, 8, 4, 0),
            pad_token_id: Optional[int] = None,
            patch_size: int = 1,
            patch_embed_dim: Optional[int] = None,
            merge_init: str = 'random',
            fc_norm: bool = False,
            global_pool: str = 'avg',
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            attn_drop_rate: float = 0.,
            drop_path_rate: float = 0.1,
            device=None,
            dtype=None,
    ):
        """
        Args:
            vocab_size: Token ids are in [0, vocab_size).
            num_classes: Classifier outputs (0: no classifier, forward returns the pooled features).
            embed_dim: Width of stage 1; each merge doubles it.
            depths: Blocks per stage (window, shifted window, window, ...).
            num_heads: Heads per stage (default: width / head_dim).
            head_dim: Channels per head when `num_heads` is not given.
            window_size: Window w; shifted blocks shift by w // 2.
            mlp_ratio: MLP hidden width / width.
            qkv_bias: Bias in the qkv Linears.
            attn: 'window' (HSW) or 'ls' (HSW-LS: window + dynamic-projection keys).
            dp_ranks: Dynamic projections r per head and stage (`attn='ls'`; 0 = plain window attention there).
            pad_token_id: Tokens with this id are padding when no mask is given.
            patch_size: Tokens per stage-1 token. 1 (the paper): Embedding -> LayerNorm. p > 1 (for byte input, like
                Swin's 4x4 pixel patches): Embedding(vocab, patch_embed_dim), p consecutive tokens merged as the
                stage merges do (concat -> LayerNorm -> Linear to embed_dim), then LayerNorm; stage i then holds
                N / (p 4^i) tokens.
            patch_embed_dim: Embedding width when patch_size > 1 (default embed_dim // 2).
            merge_init: 'random' (the paper) or 'mean': every merge (and the patch embedding) starts by passing the
                sum / 2 of its tokens in its first channels (`PatchMerging1d.init_mean_path`), so a short training
                run starts from the token statistics instead of a random projection of them.
            fc_norm: LayerNorm after the mean pool too (timm ViT's fc_norm): documents differ little in their mean
                token, so normalizing the pooled vector speeds up training from scratch.
            global_pool: 'avg' (the paper: masked mean over tokens) or 'catavgmax' (timm's name: masked mean and max
                concatenated, 2C features; the max tells whether a pattern occurs at all, which a mean over
                thousands of tokens dilutes).
            drop_rate: Dropout before the classifier.
            proj_drop_rate: Dropout after attention and MLP projections.
            attn_drop_rate: Dropout on attention weights.
            drop_path_rate: Stochastic depth, rising linearly over the blocks to this value.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        if attn not in ('window', 'ls'):
            raise ValueError(f"attn must be 'window' or 'ls', got {attn!r}")
        if merge_init not in ('random', 'mean'):
            raise ValueError(f"merge_init must be 'random' or 'mean', got {merge_init!r}")
        if global_pool not in ('avg', 'catavgmax'):
            raise ValueError(f"global_pool must be 'avg' or 'catavgmax', got {global_pool!r}")
        if patch_size < 1:
            raise ValueError(f'patch_size must be >= 1, got {patch_size}')
        num_stages = len(depths)
        dims = [embed_dim * 2 ** i for i in range(num_stages)]
        num_heads = list(num_heads) if num_heads is not None else [d // head_dim for d in dims]
        dp_ranks = list(dp_ranks) if attn == 'ls' else [0] * num_stages
        if len(num_heads) != num_stages or len(dp_ranks) != num_stages:
            raise ValueError(f'num_heads {num_heads} and dp_ranks {dp_ranks} need one entry per stage ({num_stages})')
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.pad_token_id = pad_token_id
        self.attn_type = attn
        self.global_pool = global_pool
        self.num_features = dims[-1]
        self.head_hidden_size = dims[-1] * (2 if global_pool == 'catavgmax' else 1)
        self.patch_size = patch_size
        self.feature_info = [
            dict(num_chs=d, reduction=patch_size * 4 ** i, module=f'stages.{i}') for i, d in enumerate(dims)]

        if patch_size == 1:
            self.embed = nn.Embedding(vocab_size, embed_dim, **dd)
            self.patch_embed = None
        else:
            patch_embed_dim = patch_embed_dim or embed_dim // 2
            self.embed = nn.Embedding(vocab_size, patch_embed_dim, **dd)
            self.patch_embed = PatchMerging1d(patch_embed_dim, embed_dim, merge=patch_size, **dd)
        self.embed_norm = nn.LayerNorm(embed_dim, **dd)
        dpr = [x.tolist() for x in torch.linspace(0, drop_path_rate, sum(depths)).split(list(depths))]
        self.stages = nn.ModuleList([
            HSWStage(
                dims[max(i - 1, 0)], dims[i], depths[i], num_heads[i], downsample=i > 0, window_size=window_size,
                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, dp_rank=dp_ranks[i], proj_drop=proj_drop_rate,
                attn_drop=attn_drop_rate, drop_path=dpr[i], **dd)
            for i in range(num_stages)])
        self.norm = nn.LayerNorm(self.num_features, **dd)
        self.fc_norm = nn.LayerNorm(self.head_hidden_size, **dd) if fc_norm else nn.Identity()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.head_hidden_size, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        if merge_init == 'mean':
            for m in self.modules():
                if isinstance(m, PatchMerging1d):
                    m.init_mean_path()

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            trunc_normal_(m.weight, std=.02)

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters() if 'relative_position_bias_table' in n}

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.head_hidden_size, num_classes) if num_classes > 0 else nn.Identity()

    def _embed(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        _validate_tokens(x, self.vocab_size, mask)
        valid = _resolve_mask(x, mask, self.pad_token_id)
        x = self.embed(x.long())
        if self.patch_embed is not None:
            x, valid = self.patch_embed(x, valid)
        return self.embed_norm(x), valid

    def forward_intermediates(
            self,
            x: torch.Tensor,
            mask: Optional[torch.Tensor] = None,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, Optional[torch.Tensor], List[torch.Tensor]]]:
        """Every stage's tokens, like timm's forward_intermediates.

        Args:
            x: Token ids (B, N).
            mask: (B, N), 1 on real tokens (optional).
            indices: Stages to return: the last n if int, all if None, else these indices.
            norm: Apply the final norm to the last stage's output.
            intermediates_only: Return only the list.

        Returns:
            [(B, ceil(N / (patch_size 4^i)), C_i) for the chosen stages i], or (final tokens, their (B, N') bool mask
            or None, that list).
        """
        num_stages = len(self.stages)
        if indices is None:
            take = list(range(num_stages))
        elif isinstance(indices, int):
            take = list(range(num_stages - indices, num_stages))
        else:
            take = [i % num_stages for i in indices]
        x, valid = self._embed(x, mask)
        intermediates = []
        for i, stage in enumerate(self.stages):
            x, valid = stage(x, valid)
            if i in take:
                intermediates.append(self.norm(x) if norm and i == num_stages - 1 else x)
        if intermediates_only:
            return intermediates
        return self.norm(x), valid, intermediates

    def forward_features(
            self,
            x: torch.Tensor,
            mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Normed last-stage tokens (B, N', C) and their (B, N') bool mask of real tokens (None: all real)."""
        x, valid = self._embed(x, mask)
        for stage in self.stages:
            x, valid = stage(x, valid)
        return self.norm(x), valid

    def forward_head(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None, pre_logits: bool = False):
        pooled = _masked_mean(x, valid)
        if self.global_pool == 'catavgmax':
            pooled = torch.cat([pooled, _masked_max(x, valid)], dim=-1)
        x = self.head_drop(self.fc_norm(pooled))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids (B, N) [+ mask (B, N), 1 = real] -> logits (B, num_classes)."""
        x, valid = self.forward_features(x, mask)
        return self.forward_head(x, valid)


class FlatEncoder(nn.Module):
    """Flat (non-hierarchical) full-attention encoder, the quadratic counterpart of HSW: token embedding + learned
    absolute positions, timm ViT blocks (SDPA, key-padding mask), LayerNorm, masked mean pool, classifier."""

    def __init__(
            self,
            vocab_size: int = 50265,
            num_classes: int = 11,
            embed_dim: int = 96,
            depth: int = 8,
            num_heads: int = 3,
            mlp_ratio: float = 4.,
            max_len: int = 4096,
            pad_token_id: Optional[int] = None,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.1,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.pad_token_id = pad_token_id
        self.num_classes = num_classes
        self.num_features = embed_dim
        self.embed = nn.Embedding(vocab_size, embed_dim, **dd)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, embed_dim, **dd))
        self.embed_norm = nn.LayerNorm(embed_dim, **dd)
        dpr = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, qkv_bias=True, drop_path=dpr[i], **dd) for i in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.apply(HSW._init_weights)
        trunc_normal_(self.pos_embed, std=.02)

    def forward_features(
            self,
            x: torch.Tensor,
            mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        _validate_tokens(x, self.vocab_size, mask)
        N = x.shape[1]
        if N > self.max_len:
            raise ValueError(f'sequence of {N} tokens is longer than max_len={self.max_len}; build with a larger one')
        valid = _resolve_mask(x, mask, self.pad_token_id)
        x = self.embed_norm(self.embed(x.long()) + self.pos_embed[:, :N])
        attn_mask = None
        if valid is not None:
            attn_mask = torch.zeros(valid.shape, dtype=x.dtype, device=x.device)
            attn_mask = attn_mask.masked_fill(~valid, mask_value(x.dtype))[:, None, None]
        for blk in self.blocks:
            x = blk(x, attn_mask=attn_mask)
        return self.norm(x), valid

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x, valid = self.forward_features(x, mask)
        return self.head(self.head_drop(_masked_mean(x, valid)))


class BagOfTokens(nn.Module):
    """Linear classifier on the log-frequencies of the token ids of a document (bag of bytes for byte tokens): the
    order-free baseline of the HSW demo."""

    def __init__(self, vocab_size: int, num_classes: int, pad_token_id: Optional[int] = None, eps: float = 1e-4):
        super().__init__()
        self.vocab_size = vocab_size
        self.pad_token_id = pad_token_id
        self.eps = eps
        self.head = nn.Linear(vocab_size, num_classes)

    def features(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, vocab_size) log(frequency + eps) of the real tokens."""
        _validate_tokens(x, self.vocab_size, mask)
        valid = _resolve_mask(x, mask, self.pad_token_id)
        weight = torch.ones(x.shape, device=x.device) if valid is None else valid.float()
        counts = torch.zeros(x.shape[0], self.vocab_size, device=x.device).scatter_add_(1, x.long(), weight)
        return torch.log(counts / weight.sum(1, keepdim=True).clamp(min=1.) + self.eps)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.features(x, mask))


@register_model
def hsw_tiny(**kwargs) -> HSW:
    """HSW, depths (2, 2, 2, 2), widths 96-768, heads 3-24, window 64 (25.2M params with the RoBERTa vocabulary).
    `attn='ls'` gives HSW-LS."""
    return HSW(**dict(dict(embed_dim=96, depths=(2, 2, 2, 2)), **kwargs))


@register_model
def hsw_small(**kwargs) -> HSW:
    """HSW with Swin-T depths (2, 2, 6, 2) (32.3M params with the RoBERTa vocabulary)."""
    return HSW(**dict(dict(embed_dim=96, depths=(2, 2, 6, 2)), **kwargs))


@register_model
def hsw_flat_tiny(**kwargs) -> FlatEncoder:
    """Flat full-attention counterpart of hsw_tiny: width 96, 3 heads, 8 blocks (as many as hsw_tiny)."""
    return FlatEncoder(**dict(dict(embed_dim=96, depth=8, num_heads=3), **kwargs))

