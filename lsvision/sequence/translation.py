"""Pre-norm encoder-decoder Transformer for translation, and its GRC version (Cached Transformers, Table 4).

The plain model is fairseq's `transformer_iwslt_de_en` run with `--encoder-normalize-before
--decoder-normalize-before` (the pre-norm setting of Wang et al. 2019, `Learning Deep Transformer Models for Machine
Translation`): 6 encoder and 6 decoder layers, width 512, 4 heads, FFN 1024 (ReLU), dropout 0.3, sinusoidal
positions, token embeddings scaled by sqrt(512), a final LayerNorm after each stack (fairseq adds one when the layers
normalize before), the decoder's output projection tied to its input embedding (`--share-decoder-input-output-embed`,
the IWSLT recipe) or all three embeddings shared (`--share-all-embeddings`, one joint vocabulary). Built on torch.nn
and SDPA; the names follow fairseq's (`q_proj`, `k_proj`, `v_proj`, `out_proj`, `fc1`, `fc2`), the code does not.

The GRC model (`Cached Transformers: Improving Transformers with Differentiable Memory Cache`, AAAI 2024,
https://arxiv.org/abs/2312.12742, Table 4) has GRC-Attention in every encoder self-attention with a cache of T_m = 64
slots of width D / 2 (r = 0.5); the decoder is unchanged. Each encoder self-attention is built as usual and turned
into its GRC subclass in place (`lsvision.layers.attach_grc`, as the LRA encoders do): its forward is the unchanged
self-attention followed by lsvision's sequence GRC layer. Only the real tokens of a sentence enter the cache (resized
to the 64 slots, nearest); a sentence longer than 64 tokens is resized down the same way, as the image models' GRC
resizes any token count to its cache (`SentenceGrc`). The paper trains it with the learning rate doubled and
averages the last 10 checkpoints (`lsvision.train.translation`).

Decoding: `encode` runs the encoder once; `start_state` projects the encoder output to each layer's cross-attention
keys and values once; `decode` takes the previous tokens and a `DecoderState` (the self-attention keys and values of
the tokens so far) and returns the logits and a new state. The state is an explicit value, never module state: the
outputs are a function of parameters, buffers and inputs only.

Written for lsvision, Apache-2.0.
"""
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from lsvision.layers import GatedRecurrentCache1d, GrcConfig, attach_grc, self_attention_of
from lsvision.layers.matmul_attention import scaled_dot_product_attention

from ._registry import register_model
from ._tokens import check_token_ids

__all__ = [
    'DecoderState', 'EncoderOut', 'GrcEncoderSelfAttention', 'SentenceGrc', 'TranslationTransformer',
    'IWSLT14_DE_EN_VOCAB', 'sinusoidal_positions',
]

# fairseq's dictionaries of IWSLT14 De-En (examples/translation/prepare-iwslt14.sh, joint BPE 10k, each side's
# dictionary padded to a multiple of 8): the vocabulary sizes the registered models default to
IWSLT14_DE_EN_VOCAB = (8848, 6632)


def sinusoidal_positions(length: int, dim: int, offset: int = 0, device=None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(length, dim) sinusoids of positions offset..offset+length-1 as fairseq's: [sin(p w) | cos(p w)],
    w_k = 10000^(-k / (dim / 2 - 1))."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -(math.log(10000.) / (half - 1)))
    pos = torch.arange(offset, offset + length, device=device, dtype=torch.float32)[:, None] * freq[None]
    emb = torch.cat([torch.sin(pos), torch.cos(pos)], dim=1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb.to(dtype)


class EncoderOut(NamedTuple):
    """The encoder's output (B, S, D) and the source's real tokens (B, S) bool."""
    out: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class DecoderState:
    """The incremental decoding state: per decoder layer, the self-attention keys and values of the tokens decoded so
    far (B, H, t, D/H) and the cross-attention keys and values of the encoder output (B, H, S, D/H), and the source
    mask (B, S). A value: `decode` returns a new one, `reorder` (beam search) too."""
    self_keys: Tuple[torch.Tensor, ...]
    self_values: Tuple[torch.Tensor, ...]
    cross_keys: Tuple[torch.Tensor, ...]
    cross_values: Tuple[torch.Tensor, ...]
    source_mask: torch.Tensor

    @property
    def length(self) -> int:
        """Tokens decoded so far."""
        return self.self_keys[0].shape[2]

    def reorder(self, index: torch.Tensor) -> 'DecoderState':
        """The state of the rows `index` (beam search: the hypotheses that continue)."""
        def pick(ts: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
            return tuple(t.index_select(0, index) for t in ts)
        return DecoderState(pick(self.self_keys), pick(self.self_values), pick(self.cross_keys),
                            pick(self.cross_values), self.source_mask.index_select(0, index))


class MultiheadAttention(nn.Module):
    """Multi-head attention with separate q/k/v projections (fairseq's layout), through SDPA."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float = 0.):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} must be divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_drop = attn_drop
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """fairseq's MultiheadAttention init: q/k/v weights xavier-uniform with gain 1/sqrt(2) (their biases as
        nn.Linear's), the output projection xavier-uniform with a zero bias."""
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.reset_parameters()
            nn.init.xavier_uniform_(proj.weight, gain=2 ** -0.5)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, S, D/H) of `x` (B, S, D)."""
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
               is_causal: bool = False) -> torch.Tensor:
        """Queries from `x` (B, T, D) against `k`, `v` (B, H, S, D/H); `mask` bool, True where a key is seen."""
        B, T, D = x.shape
        out = scaled_dot_product_attention(self._heads(self.q_proj(x)), k, v, attn_mask=mask, is_causal=is_causal,
                                           dropout_p=self.attn_drop if self.training else 0.)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, D))


class EncoderSelfAttention(MultiheadAttention):
    """Encoder self-attention over the real tokens (`mask` (B, S), True on real tokens)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        k, v = self.keys_values(x)
        return self.attend(x, k, v, mask[:, None, None, :])


class SentenceGrc(GatedRecurrentCache1d):
    """The sequence GRC layer with a fixed cache length T_m for sentences of any length.

    `GatedRecurrentCache1d` refuses a sample with more real tokens than cache slots (its LRA encoders cache max_len
    slots); a translation model caches T_m = 64 slots (the paper's Table 4) for sentences of any length, so here the
    real tokens are resized to the T_m slots in both directions, nearest (slot i takes real token floor(i L / T_m) of
    the L real tokens), as the image models' GRC resizes any token count to its cache. Padding never enters it.
    """

    def _sequence_summary(
            self, src: torch.Tensor, valid: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.num_prefix_tokens:
            raise ValueError('SentenceGrc has no prefix (cls) slots')
        B, n, dm = src.shape
        T_m = self.seq_len
        if valid is None:
            counts = torch.full((B,), n, dtype=torch.long, device=src.device)
        else:
            counts = valid.sum(1)
        src_index = torch.arange(T_m, device=src.device)[None] * counts[:, None] // T_m  # (B, T_m)
        if valid is not None:  # the real tokens first, in order (stable)
            src_index = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True).gather(1, src_index)
        summary = src.gather(1, src_index[..., None].expand(-1, -1, dm))
        return summary, (None if valid is None else counts > 0)


class GrcEncoderSelfAttention(EncoderSelfAttention):
    """Encoder self-attention (the self branch, run as is) followed by a `SentenceGrc` under `grc`.

    Made from a built `EncoderSelfAttention` by `attach_grc` (its keys stay; GRC's are under `grc.`)."""

    grc: SentenceGrc
    self_attention = self_attention_of(EncoderSelfAttention)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.grc(x, self.self_attention(x, mask), mask)


class FeedForward(nn.Module):
    """fc1 -> ReLU -> dropout (fairseq's activation dropout) -> fc2."""

    def __init__(self, dim: int, hidden: int, act_drop: float = 0.):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act_drop = nn.Dropout(act_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_drop(F.relu(self.fc1(x))))


class EncoderLayer(nn.Module):
    """Pre-norm: x + Drop(SelfAttn(LN x)); x + Drop(FFN(LN x))."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, drop: float, attn_drop: float, act_drop: float):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = EncoderSelfAttention(dim, num_heads, attn_drop)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim, act_drop)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.self_attn(self.self_attn_layer_norm(x), mask))
        return x + self.drop(self.ffn(self.final_layer_norm(x)))


class DecoderLayer(nn.Module):
    """Pre-norm: causal self-attention, cross-attention over the encoder output, FFN; each residual."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, drop: float, attn_drop: float, act_drop: float):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.self_attn = MultiheadAttention(dim, num_heads, attn_drop)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = MultiheadAttention(dim, num_heads, attn_drop)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, ffn_dim, act_drop)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, past_k: Optional[torch.Tensor], past_v: Optional[torch.Tensor],
                cross_k: torch.Tensor, cross_v: torch.Tensor, source_mask: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, D) are the tokens after the `past_k`/`past_v` ones (None: the first); returns x and the
        self-attention keys and values of all tokens so far."""
        h = self.self_attn_layer_norm(x)
        k, v = self.self_attn.keys_values(h)
        T = x.shape[1]
        if past_k is None or past_v is None:
            h = self.self_attn.attend(h, k, v, is_causal=T > 1)
        else:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
            past = past_k.shape[2]
            causal = None
            if T > 1:  # query i (position past + i) sees keys 0..past + i
                pos = torch.arange(past + T, device=x.device)
                causal = pos[None] <= pos[past:, None]
            h = self.self_attn.attend(h, k, v, causal)
        x = x + self.drop(h)
        h = self.encoder_attn.attend(self.encoder_attn_layer_norm(x), cross_k, cross_v, source_mask[:, None, None, :])
        x = x + self.drop(h)
        return x + self.drop(self.ffn(self.final_layer_norm(x))), k, v


class TranslationTransformer(nn.Module):
    """Pre-norm encoder-decoder Transformer (fairseq's transformer_iwslt_de_en, normalize-before), optionally with
    GRC-Attention in every encoder self-attention.

    Token ids: `pad_id` pads (right padding); the decoder's inputs are the target shifted right behind a start token
    (the training loop's choice). `forward(src, prev)` returns the logits (B, T, tgt_vocab_size).
    """

    def __init__(
            self,
            src_vocab_size: int = IWSLT14_DE_EN_VOCAB[0],
            tgt_vocab_size: int = IWSLT14_DE_EN_VOCAB[1],
            dim: int = 512,
            encoder_depth: int = 6,
            decoder_depth: int = 6,
            num_heads: int = 4,
            ffn_dim: int = 1024,
            drop: float = 0.3,
            attn_drop: float = 0.,
            act_drop: float = 0.,
            pad_id: int = 0,
            share_decoder_input_output_embed: bool = True,
            share_all_embeddings: bool = False,
            grc_config: Optional[GrcConfig] = None,
            grc_cache_len: int = 64,
    ):
        """
        Args:
            src_vocab_size: Source vocabulary (IWSLT14 De-En: fairseq's 8848).
            tgt_vocab_size: Target vocabulary (IWSLT14 De-En: fairseq's 6632).
            dim: Width D (embeddings and layers).
            encoder_depth: Encoder layers.
            decoder_depth: Decoder layers.
            num_heads: Attention heads.
            ffn_dim: FFN hidden width.
            drop: Dropout on embeddings and residual branches (IWSLT: 0.3).
            attn_drop: Attention-weight dropout.
            act_drop: Dropout after the FFN's ReLU.
            pad_id: Padding token id of both vocabularies.
            share_decoder_input_output_embed: The output projection is the decoder's embedding (no bias).
            share_all_embeddings: One embedding for encoder, decoder and output (needs one joint vocabulary).
            grc_config: GRC-Attention in every encoder self-attention (`lsvision.layers.GrcConfig`); None: none.
            grc_cache_len: T_m, the cache slots of each GRC layer (paper: 64).
        """
        super().__init__()
        if share_all_embeddings and src_vocab_size != tgt_vocab_size:
            raise ValueError(f'share_all_embeddings needs one joint vocabulary, got source {src_vocab_size} and '
                             f'target {tgt_vocab_size} entries: build both sides with one vocabulary, or pass '
                             'share_all_embeddings=False')
        self.dim = dim
        self.pad_id = pad_id
        self.src_vocab_size = src_vocab_size
        self.tgt_vocab_size = tgt_vocab_size
        self.embed_scale = math.sqrt(dim)
        self.encoder_embed_tokens = nn.Embedding(src_vocab_size, dim, padding_idx=pad_id)
        self.decoder_embed_tokens = (self.encoder_embed_tokens if share_all_embeddings
                                     else nn.Embedding(tgt_vocab_size, dim, padding_idx=pad_id))
        self.drop = nn.Dropout(drop)
        args = (dim, num_heads, ffn_dim, drop, attn_drop, act_drop)
        self.encoder_layers = nn.ModuleList([EncoderLayer(*args) for _ in range(encoder_depth)])
        self.encoder_layer_norm = nn.LayerNorm(dim)
        self.decoder_layers = nn.ModuleList([DecoderLayer(*args) for _ in range(decoder_depth)])
        self.decoder_layer_norm = nn.LayerNorm(dim)
        self.output_projection = None
        if not (share_decoder_input_output_embed or share_all_embeddings):
            self.output_projection = nn.Linear(dim, tgt_vocab_size, bias=False)
        self.apply(self._init_weights)
        for m in self.modules():
            if isinstance(m, MultiheadAttention):
                m.reset_parameters()
        self.grc_cache_len = grc_cache_len if grc_config is not None else 0
        if grc_config is not None:
            for layer in self.encoder_layers:
                attn = layer.self_attn
                grc = SentenceGrc(dim, num_heads, grc_cache_len, config=grc_config,
                                  mem_attn_kwargs=dict(attn_drop=attn_drop))
                attach_grc(attn, GrcEncoderSelfAttention, grc)

    def _init_weights(self, m: nn.Module) -> None:
        """fairseq's: the FFN's Linear xavier-uniform with zero bias, Embedding N(0, D^-1/2) with a zero padding row,
        an untied output projection N(0, D^-1/2) (the attentions: `MultiheadAttention.reset_parameters`)."""
        if m is self.output_projection:
            nn.init.normal_(m.weight, mean=0., std=self.dim ** -0.5)
        elif isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0., std=self.dim ** -0.5)
            nn.init.zeros_(m.weight[self.pad_id])

    def _embed(self, embedding: nn.Embedding, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        x = embedding(tokens) * self.embed_scale
        x = x + sinusoidal_positions(tokens.shape[1], self.dim, offset, tokens.device, x.dtype)
        return self.drop(x)

    def encode(self, src_tokens: torch.Tensor) -> EncoderOut:
        """The encoder on source ids (B, S) (right-padded with `pad_id`)."""
        check_token_ids(src_tokens, self.src_vocab_size, 'the source embedding')
        mask = src_tokens != self.pad_id
        x = self._embed(self.encoder_embed_tokens, src_tokens)
        for layer in self.encoder_layers:
            x = layer(x, mask)
        return EncoderOut(self.encoder_layer_norm(x), mask)

    def start_state(self, encoder_out: EncoderOut) -> DecoderState:
        """The decoding state before the first token: each layer's cross-attention keys and values, computed once."""
        cross = [layer.encoder_attn.keys_values(encoder_out.out) for layer in self.decoder_layers]
        B = encoder_out.out.shape[0]
        empty = [encoder_out.out.new_zeros(B, layer.self_attn.num_heads, 0, layer.self_attn.head_dim)
                 for layer in self.decoder_layers]
        return DecoderState(tuple(empty), tuple(empty), tuple(k for k, _ in cross), tuple(v for _, v in cross),
                            encoder_out.mask)

    def decode(self, prev_tokens: torch.Tensor, encoder_out: Optional[EncoderOut] = None,
               state: Optional[DecoderState] = None) -> Tuple[torch.Tensor, DecoderState]:
        """The decoder on `prev_tokens` (B, T): the tokens after those in `state` (None: from the start, with
        `encoder_out`). Returns the logits (B, T, V) and the state after these tokens."""
        if state is None:
            if encoder_out is None:
                raise ValueError('decode needs encoder_out (or a state from start_state)')
            state = self.start_state(encoder_out)
        check_token_ids(prev_tokens, self.tgt_vocab_size, 'the decoder embedding')
        past = state.length
        x = self._embed(self.decoder_embed_tokens, prev_tokens, offset=past)
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        for i, layer in enumerate(self.decoder_layers):
            pk, pv = (state.self_keys[i], state.self_values[i]) if past else (None, None)
            x, k, v = layer(x, pk, pv, state.cross_keys[i], state.cross_values[i], state.source_mask)
            keys.append(k)
            values.append(v)
        x = self.decoder_layer_norm(x)
        weight = self.decoder_embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        logits = F.linear(x, weight)
        return logits, DecoderState(tuple(keys), tuple(values), state.cross_keys, state.cross_values,
                                    state.source_mask)

    def forward(self, src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: logits (B, T, V) for the decoder inputs `prev_output_tokens` (B, T)."""
        return self.decode(prev_output_tokens, self.encode(src_tokens))[0]


def _create_grc(kwargs: dict) -> TranslationTransformer:
    cache_len = kwargs.pop('grc_cache_len', 64)
    config = GrcConfig.from_kwargs(kwargs.pop('grc_config', None), kwargs)
    return TranslationTransformer(grc_config=config, grc_cache_len=cache_len, **kwargs)


@register_model
def transformer_iwslt_de_en_prenorm(**kwargs) -> TranslationTransformer:
    """fairseq's transformer_iwslt_de_en with encoder and decoder normalize-before (6 + 6 layers, 512 wide, 4 heads,
    FFN 1024; 39,471,104 parameters with IWSLT14 De-En's 8848 / 6632 vocabularies, decoder embeddings tied)."""
    if any(k.startswith('grc_') for k in kwargs):
        raise TypeError(f'{", ".join(k for k in kwargs if k.startswith("grc_"))}: transformer_iwslt_de_en_prenorm '
                        'has no GRC layers; use grc_transformer_iwslt_de_en_prenorm')
    return TranslationTransformer(**kwargs)


@register_model
def grc_transformer_iwslt_de_en_prenorm(**kwargs) -> TranslationTransformer:
    """transformer_iwslt_de_en_prenorm with GRC-Attention in every encoder self-attention (Cached Transformers,
    Table 4): T_m = 64 (`grc_cache_len`), r = 0.5 (`grc_ratio`) and the other `grc_*` options of GrcConfig."""
    return _create_grc(kwargs)
