"""The timm model API shared by lsvision's hierarchical transformers (CvT, CvT-LS, PVT, ViL-LS), and the pre-norm
block and stage CvT, CvT-LS and ViL-LS share.

A model builds its stages (NCHW in, NCHW out, each with `forward_with_prefix` returning the map and its prefix
tokens, and a `grad_checkpointing` flag) and their `feature_info`, and passes them with the rest of its contract
(`in_chans`, `num_classes`, `global_pool`, `img_size`, `min_input_size`, ...) to `HierarchicalTransformer.__init__`,
which adds the final `norm` over channels, `head_drop` and `head` and initializes the weights.

Two output layouts, chosen by the class attribute `token_features`:
    * False: `forward_features` returns the normed last-stage map (timm's standard NCHW contract); the head averages
      it ('avg'), or classifies the normed cls token of the last stage ('token', reached through `forward` only).
    * True (CvT, CvT-LS): `forward_features` returns the normed last-stage tokens (B, g + H*W, C), cls token(s)
      first, as timm's ViT does; the head takes the cls token ('token') or averages the patch tokens ('avg'), and
      `forward == forward_head(forward_features)` for every pooling. '' returns the tokens.
"""
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from timm.layers import DropPath, Mlp, _assert, get_device_dtype, to_2tuple, trunc_normal_
from timm.models import checkpoint
from timm.models._features import feature_take_indices

from ._helpers import check_image_input

__all__ = ['ConvEmbed', 'PreNormBlock', 'HierarchicalStage', 'TransformerStage', 'HierarchicalTransformer']


class ConvEmbed(nn.Module):
    """Conv token embedding: Conv2d (bias) then LayerNorm over channels. NCHW in and out.

    Overlapping as in CvT (kernel > stride, padded) or non-overlapping as in ViL-LS (the defaults: stride = kernel,
    no padding).
    """

    def __init__(
            self,
            in_chs: int,
            dim: int,
            patch_size: int,
            stride: Optional[int] = None,
            padding: int = 0,
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        stride = patch_size if stride is None else stride
        self.proj = nn.Conv2d(in_chs, dim, patch_size, stride=stride, padding=padding, **dd)
        self.norm = nn.LayerNorm(dim, eps=norm_eps, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class PreNormBlock(nn.Module):
    """Pre-norm transformer block on (B, g + H*W, C) tokens: x + DropPath(attn(LN(x), feat_size)), then
    x + DropPath(MLP(LN(x))), both with the same drop-path rate.

    The attention is an argument: `attn_layer(dim, device=, dtype=)` builds a module called as
    `attn(x, feat_size)` (a class, or a `functools.partial` holding its other settings).
    """

    def __init__(
            self,
            dim: int,
            attn_layer: Callable[..., nn.Module],
            mlp_ratio: float = 4.,
            act_layer: Callable[..., nn.Module] = nn.GELU,
            proj_drop: float = 0.,
            drop_path: float = 0.,
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """
        Args:
            dim: Channels C.
            attn_layer: Builds the attention (see the class docstring).
            mlp_ratio: MLP hidden width over C.
            act_layer: MLP activation.
            proj_drop: Dropout in the MLP.
            drop_path: Stochastic depth rate of both residual branches.
            norm_eps: Epsilon of the two LayerNorms (CvT 1e-5, ViL-LS 1e-6).
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        self.attn = attn_layer(dim, **dd)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0. else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **dd)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=proj_drop, **dd)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0. else nn.Identity()

    def forward(self, x: torch.Tensor, feat_size: Tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path1(self.attn(self.norm1(x), feat_size))
        x = x + self.drop_path2(self.mlp(self.norm2(x)))
        return x


class HierarchicalStage(nn.Module):
    """A stage: `patch_embed` (NCHW map out), an optional `cls_token`, then `blocks` on tokens with the map size.

    Subclasses build `patch_embed`, `cls_token` (or None), `num_prefix_tokens`, `blocks` (called as
    `blk(x, feat_size)`) and `grad_checkpointing`.
    """

    def forward_with_prefix(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Returns the output map (B, C, H, W) and the prefix tokens (B, g, C), g = 0 without a cls token."""
        x = self.patch_embed(x)
        B, C, H, W = x.shape
        feat_size = (H, W)
        x = x.flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(B, -1, -1), x], dim=1)
        for blk in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, feat_size)
            else:
                x = blk(x, feat_size)
        prefix = x[:, :self.num_prefix_tokens]
        x = x[:, self.num_prefix_tokens:].reshape(B, H, W, C).permute(0, 3, 1, 2)  # NCHW, channels-last memory
        return x, prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_prefix(x)[0]


class TransformerStage(HierarchicalStage):
    """A patch embedding, optional cls tokens of the stage's own, then `PreNormBlock`s. NCHW in, NCHW out.

    The stage of CvT, CvT-LS and ViL-LS; the attention of its blocks is the `attn_layer` argument.
    """

    def __init__(
            self,
            patch_embed: nn.Module,
            dim: int,
            depth: int,
            attn_layer: Callable[..., nn.Module],
            num_prefix_tokens: int = 0,
            drop_path: Sequence[float] = (),
            device=None,
            dtype=None,
            **block_kwargs: Any,
    ):
        """
        Args:
            patch_embed: NCHW map in, (B, dim, H, W) map out (e.g. `ConvEmbed`).
            dim: Channels of the stage.
            depth: Blocks.
            attn_layer: Builds each block's attention (`PreNormBlock`).
            num_prefix_tokens: cls tokens g prepended to the patch tokens (learned, (1, g, dim)); 0 for none.
            drop_path: Drop-path rate of each block; empty for none.
            **block_kwargs: The other `PreNormBlock` arguments (mlp_ratio, act_layer, proj_drop, norm_eps).
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.grad_checkpointing = False
        self.patch_embed = patch_embed
        self.num_prefix_tokens = num_prefix_tokens
        if num_prefix_tokens > 0:
            self.cls_token = nn.Parameter(torch.zeros(1, num_prefix_tokens, dim, **dd))
        else:
            self.cls_token = None
        drop_path = list(drop_path) or [0.] * depth
        self.blocks = nn.ModuleList([
            PreNormBlock(dim, attn_layer, drop_path=drop_path[i], **block_kwargs, **dd)
            for i in range(depth)
        ])


class HierarchicalTransformer(nn.Module):
    """Base of the stage-wise lsvision models: everything of the timm API that does not depend on the family.

    A subclass builds its stages and passes them, with its whole contract, to `__init__` (call it once the stages
    are built, before setting any attribute of its own).
    """

    global_pools: Tuple[str, ...] = ('avg', 'token', '')
    token_features: bool = False  # forward_features returns tokens (with the cls token) instead of the NCHW map

    def __init__(
            self,
            stages: Sequence[nn.Module],
            feature_info: Sequence[Dict[str, Any]],
            in_chans: int,
            num_classes: int,
            global_pool: str,
            img_size: Union[int, Tuple[int, int]],
            min_input_size: int,
            drop_rate: float = 0.,
            norm_eps: float = 1e-5,
            device=None,
            dtype=None,
    ):
        """Takes the stages; adds the final norm, head dropout and classifier; then the weight init of every family.

        Linear weights trunc_normal(.02) with zero bias, per-stage `pos_embed` and `cls_token` trunc_normal(.02);
        the rest keeps PyTorch's defaults.

        Args:
            stages: The stages, in order (stored as the nn.Sequential `stages`).
            feature_info: timm's feature info, one dict per stage (`num_chs`, `reduction`, `module`); the last
                stage's `num_chs` is `num_features`, the width of the norm and classifier.
            in_chans: Input image channels (checked by forward).
            num_classes: Classifier outputs (0 for no classifier).
            global_pool: One of the class's `global_pools`; 'token' needs a cls token in the last stage.
            img_size: Native input size, as (H, W) in `img_size`.
            min_input_size: The smallest input side the model takes (checked by forward and `set_input_size`).
            drop_rate: Dropout before the classifier.
            norm_eps: Epsilon of the final LayerNorm.
        """
        dd = {'device': device, 'dtype': dtype}
        super().__init__()
        self.stages = nn.Sequential(*stages)
        self.feature_info = [dict(f) for f in feature_info]
        self._check_global_pool(global_pool)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.img_size = to_2tuple(img_size)
        self.min_input_size = min_input_size
        self.num_features = self.head_hidden_size = self.feature_info[-1]['num_chs']
        self.drop_rate = drop_rate
        self.num_prefix_tokens = self.stages[-1].num_prefix_tokens  # of the last stage, in the token features
        self.token_features = type(self).token_features  # an instance attribute: TorchScript sees only those
        self.norm = nn.LayerNorm(self.num_features, eps=norm_eps, **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)
        for stage in self.stages:
            for name in ('pos_embed', 'cls_token'):
                param = getattr(stage, name, None)
                if param is not None:
                    trunc_normal_(param, std=.02)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def _checked_input_size(self, img_size: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
        """`img_size` as (H, W); a ValueError when it is below `min_input_size` (for `set_input_size`)."""
        img_size = to_2tuple(img_size)
        if min(img_size) < self.min_input_size:
            raise ValueError(f'img_size {img_size} is smaller than the smallest this model takes '
                             f'({self.min_input_size}x{self.min_input_size})')
        return img_size

    def _check_global_pool(self, global_pool: str) -> None:
        assert global_pool in self.global_pools, f'global_pool must be one of {self.global_pools}, got {global_pool!r}'
        if global_pool == 'token':
            assert self.stages[-1].cls_token is not None, (
                "global_pool='token' needs a cls token in the last stage; pass global_pool='avg' to average the map")

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters() if n.endswith('cls_token')}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^stages\.0\.(?:patch_embed|pos_embed)',
            blocks=r'^stages\.(\d+)' if coarse else [
                (r'^stages\.(\d+)\.(?:patch_embed|pos_embed|cls_token)', (0,)),
                (r'^stages\.(\d+)\.blocks\.(\d+)', None),
                (r'^norm', (99999,)),
            ]
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for s in self.stages:
            s.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self._check_global_pool(global_pool)
            self.global_pool = global_pool
        dd = get_device_dtype(self)
        self.head = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def _norm_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def _final_features(self, x: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """What forward_features returns from the last stage's map and prefix tokens: the normed map, or the normed
        tokens [prefix | row-major patches] when `token_features`."""
        if self.token_features:
            return self.norm(torch.cat([prefix, x.flatten(2).transpose(1, 2)], dim=1))
        return self._norm_map(x)

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Forward that also returns the stage outputs.

        Args:
            x: Input images.
            indices: Take the last n stages if an int, all if None, the listed stages if a sequence.
            norm: Apply the final norm to the last stage's tap.
            stop_early: Stop after the last stage needed.
            output_fmt: Only 'NCHW'.
            intermediates_only: Return only the taps.

        Returns:
            The taps (NCHW, prefix tokens dropped), or (final features as forward_features returns them, taps).
        """
        assert output_fmt == 'NCHW', 'Output format must be NCHW.'
        check_image_input(x, self.in_chans, self.min_input_size)
        intermediates = []
        num_stages = len(self.stages)
        take_indices, max_index = feature_take_indices(num_stages, indices)
        if torch.jit.is_scripting() or not stop_early:  # can't slice stages in torchscript
            stages = self.stages
        else:
            stages = self.stages[:max_index + 1]
        last_idx = 0
        prefix = x
        for i, stage in enumerate(stages):
            x, prefix = stage.forward_with_prefix(x)
            last_idx = i
            if i in take_indices:
                intermediates.append(self._norm_map(x) if norm and i == num_stages - 1 else x)
        if intermediates_only:
            return intermediates
        if last_idx == num_stages - 1:
            x = self._final_features(x, prefix)
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drop the stages after the last needed tap (and the final norm and head as asked)."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[:max_index + 1]
        self.num_prefix_tokens = self.stages[-1].num_prefix_tokens
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Normed last-stage map (B, C, H/r, W/r) at the last reduction r, prefix tokens dropped; with
        `token_features` the normed last-stage tokens (B, g + H/r * W/r, C), prefix tokens first."""
        check_image_input(x, self.in_chans, self.min_input_size)
        prefix = x
        for stage in self.stages:
            x, prefix = stage.forward_with_prefix(x)
        return self._final_features(x, prefix)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool and classify what forward_features returns ('avg', 'token' or '' pooling).

        Without `token_features`, 'token' takes a normed cls token (B, C), which only `forward` passes in.
        """
        if self.token_features:
            if self.global_pool == 'token':
                x = x[:, 0]
            elif self.global_pool == 'avg':
                x = x[:, self.num_prefix_tokens:].mean(dim=1)
        elif self.global_pool == 'avg':
            x = x.mean(dim=(2, 3))
        elif self.global_pool == 'token':
            _assert(x.ndim == 2, "global_pool='token' classifies the cls token: call forward(), not "
                    'forward_head(forward_features(x)), which returns the map without it')
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_pool == 'token' and not self.token_features:
            check_image_input(x, self.in_chans, self.min_input_size)
            prefix = x
            for stage in self.stages:
                x, prefix = stage.forward_with_prefix(x)
            return self.forward_head(self.norm(prefix[:, 0]))
        return self.forward_head(self.forward_features(x))
