"""What the papers report for each registered model, where from, how to cite them, and what each model family's
card says: the data of the model cards (``lsvision.zoo`` renders them). A number the papers do not give is "not
reported". Each source names the paper's section or table, or the authors' public repository, to check it against.
"""
import fnmatch
from dataclasses import dataclass
from typing import Dict, List, Tuple

SOURCES: Dict[str, str] = {
    'ls': 'Transformer-LS paper (arXiv:2107.02192), §4.3, Table 5',
    'ls_official': ('ImageNet-1k top-1 of the official checkpoints as the authors logged it in NVIDIA/transformer-ls, '
                    '`imagenet/launch/eval/eval_{medium_224,base_224,medium_384}.sh` (its README rounds it to 0.1)'),
    'ls_app_e': 'Transformer-LS paper, App. E (the DualLN ablation: 81.9 with DualLN, 81.3 without)',
    'ls_table5_cvt': ('Transformer-LS paper, Table 5, measured there on the rishikksh20/convolution-vision-'
                      "transformers re-implementation of CvT (App. E), not on Microsoft's CvT that this model follows"),
    'ls_table6': 'Transformer-LS paper, Table 6 (ImageNet-C mCE, lower is better), rows "LS-13" / "LS-21"',
    'cvt_table2': 'CvT paper (arXiv:2103.15808), Table 2',
    'grc': 'Cached Transformers (GRC) paper (arXiv:2312.12742), its ImageNet-1k classification results',
    'grc_table9': 'Cached Transformers (GRC) paper, Table 9',
}
"""Where the numbers of :data:`PAPER_RESULTS` come from, by key."""

METRICS: List[Tuple[str, str]] = [
    ('params_m', 'params (M)'),
    ('gflops', 'GFLOPs'),
    ('top1', 'ImageNet-1k top-1 (%)'),
    ('base_top1', 'top-1 of the model without GRC (%)'),
    ('real_top1', 'ImageNet-ReaL top-1 (%)'),
    ('v2_top1', 'ImageNet-V2 top-1 (%)'),
    ('mce', 'ImageNet-C mCE (%)'),
    ('in_a_top1', 'ImageNet-A top-1 (%)'),
    ('in_r_top1', 'ImageNet-R top-1 (%)'),
]
"""The paper metrics a card lists, in order: key and display name."""

Reported = Tuple[float, str]
"""A reported number and its source key in :data:`SOURCES`."""

PAPER_RESULTS: Dict[str, Dict[str, Reported]] = {
    # Transformer-LS: ViL-LS
    'vil_ls_medium': {'params_m': (39.8, 'ls'), 'gflops': (8.7, 'ls'), 'top1': (83.816, 'ls_official')},
    'vil_ls_base': {'params_m': (55.8, 'ls'), 'gflops': (13.4, 'ls'), 'top1': (84.098, 'ls_official')},
    'vil_ls_medium_384': {'params_m': (39.9, 'ls'), 'gflops': (28.7, 'ls'), 'top1': (84.426, 'ls_official')},
    # Transformer-LS: CvT-LS
    'cvt_ls_13': {
        'params_m': (20.3, 'ls'), 'gflops': (4.9, 'ls'), 'top1': (81.9, 'ls_app_e'), 'mce': (58.7, 'ls_table6')},
    'cvt_ls_17': {'params_m': (23.7, 'ls'), 'gflops': (9.8, 'ls')},
    'cvt_ls_21': {'params_m': (32.1, 'ls'), 'gflops': (7.9, 'ls'), 'mce': (55.2, 'ls_table6')},
    'cvt_ls_21s': {'params_m': (30.1, 'ls'), 'gflops': (11.3, 'ls')},
    'cvt_ls_21_384': {'gflops': (23.9, 'ls')},
    'cvt_ls_21_448': {'params_m': (32.1, 'ls'), 'gflops': (34.2, 'ls')},
    # CvT, the full-attention baseline: top-1 from the CvT paper; params and GFLOPs from the Transformer-LS paper,
    # whose CvT numbers are of another implementation
    'cvt_13': {'params_m': (20.0, 'ls_table5_cvt'), 'gflops': (6.7, 'ls_table5_cvt'), 'top1': (81.6, 'cvt_table2')},
    'cvt_21': {'params_m': (32.0, 'ls_table5_cvt'), 'gflops': (10.1, 'ls_table5_cvt'), 'top1': (82.5, 'cvt_table2')},
    'cvt_13_384': {
        'params_m': (20.0, 'ls_table5_cvt'), 'gflops': (31.9, 'ls_table5_cvt'), 'top1': (83.0, 'cvt_table2')},
    'cvt_21_384': {
        'params_m': (32.0, 'ls_table5_cvt'), 'gflops': (45.0, 'ls_table5_cvt'), 'top1': (83.3, 'cvt_table2')},
    'cvt_w24_384': {'top1': (87.7, 'cvt_table2')},  # pre-trained on ImageNet-22k
    # GRC: PVT v1 baselines and cached models
    'pvt_tiny': {'params_m': (13.2, 'grc'), 'gflops': (1.9, 'grc'), 'top1': (75.1, 'grc')},
    'pvt_small': {'params_m': (24.5, 'grc'), 'gflops': (3.8, 'grc'), 'top1': (79.9, 'grc')},
    'pvt_medium': {'params_m': (44.2, 'grc'), 'gflops': (6.7, 'grc'), 'top1': (81.2, 'grc')},
    'pvt_large': {'params_m': (61.4, 'grc'), 'gflops': (9.8, 'grc')},
    'pvt_tiny_grc': {'gflops': (2.15, 'grc_table9'), 'top1': (78.4, 'grc'), 'base_top1': (75.1, 'grc')},
    'pvt_small_grc': {'gflops': (4.29, 'grc_table9'), 'top1': (81.8, 'grc'), 'base_top1': (79.9, 'grc')},
    'pvt_medium_grc': {'gflops': (7.61, 'grc_table9'), 'top1': (83.0, 'grc'), 'base_top1': (81.2, 'grc')},
    # GRC on timm models
    'pvt_v2_b2_grc': {'top1': (82.6, 'grc'), 'base_top1': (82.0, 'grc')},
    'pvt_v2_b3_grc': {'top1': (83.7, 'grc'), 'base_top1': (83.2, 'grc')},
    'pvt_v2_b4_grc': {'top1': (84.1, 'grc'), 'base_top1': (83.6, 'grc')},
    'swin_tiny_patch4_window7_224_grc': {'top1': (82.1, 'grc'), 'base_top1': (81.2, 'grc')},
    'vit_small_patch16_224_grc': {'top1': (81.3, 'grc'), 'base_top1': (79.9, 'grc')},
    'deit_small_patch16_224_grc': {'top1': (81.3, 'grc'), 'base_top1': (79.9, 'grc')},  # the paper's "ViT-S" row
}
"""The papers' numbers per registered model (metric key of :data:`METRICS` -> value and source key)."""

PAPER_NOTES: Dict[str, str] = {
    'cvt_ls_21s': ("The paper's 30.1M is inconsistent with its own Table 12 and with CvT-LS-17's 23.7M; the "
                   'consistent count is about 30.8M: by Table 12, 21S is CvT-LS-17 plus four stage-3 blocks of at '
                   'least 1.77M each, and the FLOPs difference to CvT-LS-17 (1.5G) confirms those four blocks.'),
    'cvt_w24_384': 'The 87.7 is of CvT-W24 pre-trained on ImageNet-22k and fine-tuned on ImageNet-1k at 384.',
    'cvt_ls_21_448': ("lsvision measures 34.83 GFLOPs against the paper's 34.2 (1.8% more). One dynamic-projection "
                      'rank shared by all heads, instead of one per head, would give 34.26 here but misses the '
                      "paper's parameters and FLOPs of CvT-LS-17 and CvT-LS-21."),
    'deit_small_patch16_224_grc': 'DeiT-S and ViT-S are the same architecture; the GRC paper reports it as ViT-S.',
}
"""Remarks on a model's paper numbers, printed under them on its card."""

CITATIONS: Dict[str, str] = {
    'long_short': """@inproceedings{zhu2021longshort,
  title     = {Long-Short Transformer: Efficient Transformers for Language and Vision},
  author    = {Zhu, Chen and Ping, Wei and Xiao, Chaowei and Shoeybi, Mohammad and Goldstein, Tom and
               Anandkumar, Anima and Catanzaro, Bryan},
  booktitle = {Advances in Neural Information Processing Systems (NeurIPS)},
  year      = {2021},
  note      = {arXiv:2107.02192}
}""",
    'cvt': """@inproceedings{wu2021cvt,
  title     = {CvT: Introducing Convolutions to Vision Transformers},
  author    = {Wu, Haiping and Xiao, Bin and Codella, Noel and Liu, Mengchen and Dai, Xiyang and Yuan, Lu and
               Zhang, Lei},
  booktitle = {IEEE/CVF International Conference on Computer Vision (ICCV)},
  year      = {2021},
  note      = {arXiv:2103.15808}
}""",
    'vil': """@inproceedings{zhang2021vil,
  title     = {Multi-Scale Vision Longformer: A New Vision Transformer for High-Resolution Image Encoding},
  author    = {Zhang, Pengchuan and Dai, Xiyang and Yang, Jianwei and Xiao, Bin and Yuan, Lu and Zhang, Lei and
               Gao, Jianfeng},
  booktitle = {IEEE/CVF International Conference on Computer Vision (ICCV)},
  year      = {2021},
  note      = {arXiv:2103.15358}
}""",
    'grc': """@article{zhang2023cached,
  title   = {Cached Transformers: Improving Transformers with Differentiable Memory Cache},
  author  = {Zhang, Zhaoyang and Shao, Wenqi and Ge, Yixiao and Wang, Xiaogang and Gu, Jinwei and Luo, Ping},
  journal = {arXiv preprint arXiv:2312.12742},
  year    = {2023}
}""",
    'pvt': """@inproceedings{wang2021pvt,
  title     = {Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without Convolutions},
  author    = {Wang, Wenhai and Xie, Enze and Li, Xiang and Fan, Deng-Ping and Song, Kaitao and Liang, Ding and
               Lu, Tong and Luo, Ping and Shao, Ling},
  booktitle = {IEEE/CVF International Conference on Computer Vision (ICCV)},
  year      = {2021},
  note      = {arXiv:2102.12122}
}""",
}
"""BibTeX entries by key."""


@dataclass(frozen=True)
class Family:
    """What the cards of one model family share.

    Attributes:
        title: The family's name.
        summary: What the models are.
        intended_use: What they are for (and not for).
        weights: How to load, convert or obtain weights beyond the released ones of the model's pretrained tags
            (markdown, formatted with ``name``, ``base`` and ``microsoft_files``; may come out empty).
        license: The license text of the card (markdown).
        citations: Keys of :data:`CITATIONS`.
    """

    title: str
    summary: str
    intended_use: str
    weights: str
    license: str
    citations: Tuple[str, ...]


_NO_WEIGHTS = ('and lsvision trains none itself, so `pretrained=True` without a file raises '
               '`NoPretrainedWeightsError`, which points to this card. ')
"""The end of the first sentence on a model without released weights (after what its authors released)."""
_LSVISION_LICENSE = 'lsvision code: Apache-2.0 (see setup.cfg). '
_GRC_USE = ('Image classification and research on cross-sample attention memory. The cache is a buffer that training '
            'updates and evaluation reads, so train or fine-tune before use; in eval mode each image uses its own '
            'update and the cache stays fixed.')
_GRC_WEIGHTS = ('No released weights: the GRC authors published none, ' + _NO_WEIGHTS + 'A GRC model loads the '
                'weights of its base model and reports only the `attn.grc.*` tensors as missing, so it fine-tunes '
                "from a base checkpoint:\n\n```python\nmodel = timm.create_model('{name}', pretrained=True, "
                "pretrained_cfg_overlay=dict(file='{base}.pth'))\n```\n\nWith DDP, "
                '`grc_sync_cache=True` all-reduces the cache updates across processes (tools/train.py turns it on '
                'under torchrun).')

FAMILIES: List[Tuple[str, Family]] = [
    ('vil_ls_*', Family(
        title='ViL-LS (Transformer-LS on the multi-scale Vision Longformer)',
        summary=('Four-stage ViL with the long-short attention of Transformer-LS (a sliding window for short range '
                 'plus a dynamic low-rank projection for long range) in stages 1-2 and full attention with a '
                 'relative-position bias in stages 3-4, exactly as the official NVIDIA/transformer-ls code. Any '
                 'input size runs (padding and masking; the bias tables are interpolated).'),
        intended_use=('ImageNet-style classification and a backbone (`features_only`) for dense prediction at high '
                      'resolution, where the linear cost of long-short attention matters. The official checkpoints '
                      'are trained on ImageNet-1k at the native size.'),
        weights=('The same official files, downloaded yourself (`model_best.pth`, as NVIDIA/transformer-ls names '
                 "them), load from disk too, with the outputs of the official code:\n\n```python\nmodel = "
                 "timm.create_model('{name}', pretrained=True, pretrained_cfg_overlay=dict(file='model_best.pth'))"
                 "\n```\n\n`python tools/convert_vil_ls.py model_best.pth {name}.safetensors` writes them once in "
                 "lsvision's layout (safetensors, read with `weights_only=True`). 224 weights also load into "
                 '`vil_ls_medium_384` as a starting point for fine-tuning at 384.'),
        license=(_LSVISION_LICENSE + 'The official checkpoints are distributed by NVIDIA/transformer-ls under that '
                 "repository's license; read it before use."),
        citations=('long_short', 'vil'),
    )),
    ('cvt_ls_*', Family(
        title='CvT-LS (Transformer-LS on CvT)',
        summary=('Three-stage CvT with the long-short attention of Transformer-LS (depthwise-separable conv '
                 'projections, a sliding window plus a dynamic low-rank projection), as specified from the paper '
                 "(there is no official code). `_384` and `_448` variants use the paper's windows and ranks for "
                 "those sizes. The head is the paper's, the normed stage-3 cls token (`global_pool='token'`); "
                 "`global_pool='avg'` averages the stage-3 map instead."),
        intended_use=('Classification and a backbone (`features_only`, strides 4/8/16) for high-resolution inputs, '
                      'and research on efficient attention: time and memory grow about linearly with the pixel count '
                      '(see docs/benchmarks/).'),
        weights=('No released weights: the authors published none for CvT-LS, ' + _NO_WEIGHTS + 'Create the model '
                 "and train it, then load your checkpoint (lsvision's layout):\n\n```python\nmodel = "
                 "timm.create_model('{name}', pretrained=True, "
                 "pretrained_cfg_overlay=dict(file='my_checkpoint.safetensors'))\n```"),
        license=_LSVISION_LICENSE + 'No third-party weights are involved.',
        citations=('long_short', 'cvt'),
    )),
    ('cvt_*', Family(
        title="CvT (Microsoft's official design, full attention)",
        summary=('Convolutional vision Transformer: conv token embeddings, q/k/v from depthwise convs with keys and '
                 "values at stride 2, full attention, and Microsoft's head, the normed stage-3 cls token "
                 "(`global_pool='token'`; `'avg'` averages the stage-3 map instead). The quadratic baseline beside "
                 "CvT-LS. `_384` variants take Microsoft's 384 evaluation settings (crop_pct 1.0)."),
        intended_use=('Classification, and the full-attention counterpart in benchmarks of long-short attention '
                      '(its cost grows quadratically with the pixel count at large inputs).'),
        weights='{microsoft_files}',
        license=(_LSVISION_LICENSE + 'Adapted from microsoft/CvT (MIT). The Hub weights come under the license of '
                 "their Hub repository (the weights table above), Microsoft's own checkpoint files under that of "
                 'microsoft/CvT.'),
        citations=('cvt',),
    )),
    ('pvt_v2_*_grc', Family(
        title='PVT v2 with GRC-Attention (Cached Transformers)',
        summary="timm's PVT v2 with a Gated Recurrent Cache in every attention block.",
        intended_use=_GRC_USE,
        weights=_GRC_WEIGHTS,
        license=_LSVISION_LICENSE + "The base model is timm's PVT v2 (Apache-2.0).",
        citations=('grc',),
    )),
    ('pvt_*_grc', Family(
        title='PVT v1 with GRC-Attention (Cached Transformers)',
        summary='Pyramid Vision Transformer v1 (timm has none) with a Gated Recurrent Cache in every attention block.',
        intended_use=_GRC_USE,
        weights=_GRC_WEIGHTS + ' Official PVT v1 checkpoints (`block1.0.*` keys) are renamed on load.',
        license=_LSVISION_LICENSE + 'The PVT v1 configurations follow whai362/PVT (Apache-2.0).',
        citations=('grc', 'pvt'),
    )),
    ('pvt_*', Family(
        title='PVT v1 (Pyramid Vision Transformer)',
        summary=('Four-stage PVT v1 with spatial-reduction attention and learned position embeddings (resized for '
                 'other sizes); the base of the PVT GRC models (timm has no PVT v1).'),
        intended_use='Classification and dense-prediction backbone; the baseline of the PVT v1 GRC models.',
        weights=('No weights to download: lsvision registers none for PVT v1, ' + _NO_WEIGHTS + 'Official '
                 'whai362/PVT checkpoints, downloaded yourself (`patch_embed1`, `block1.0`, '
                 "... keys), are renamed on load: `timm.create_model('{name}', pretrained=True, "
                 "pretrained_cfg_overlay=dict(file='{name}.pth'))`."),
        license=_LSVISION_LICENSE + 'The configurations follow whai362/PVT (Apache-2.0).',
        citations=('pvt',),
    )),
    ('swin_*_grc', Family(
        title='Swin Transformer with GRC-Attention (Cached Transformers)',
        summary=("timm's Swin Transformer with a Gated Recurrent Cache per window-attention block (one cache slot per "
                 'window position, shared by all windows).'),
        intended_use=_GRC_USE + ' The input size is fixed (the window and cache follow it).',
        weights=_GRC_WEIGHTS,
        license=_LSVISION_LICENSE + "The base model is timm's Swin Transformer (MIT).",
        citations=('grc',),
    )),
    ('*_grc', Family(
        title='ViT / DeiT with GRC-Attention (Cached Transformers)',
        summary="timm's ViT-S / DeiT-S with a Gated Recurrent Cache in every attention block.",
        intended_use=_GRC_USE + ' The input size is fixed (the cache length follows the token count).',
        weights=_GRC_WEIGHTS,
        license=_LSVISION_LICENSE + "The base model is timm's Vision Transformer (Apache-2.0).",
        citations=('grc',),
    )),
]
"""Model families, matched in order by fnmatch pattern (the first match wins)."""


def family_of(name: str) -> Family:
    """The :class:`Family` of a registered model.

    Raises:
        KeyError: If no family pattern matches (add one to :data:`FAMILIES`).
    """
    for pattern, family in FAMILIES:
        if fnmatch.fnmatchcase(name, pattern):
            return family
    raise KeyError(f'no model family in lsvision.models.papers.FAMILIES matches {name!r}; add one.')


# code snippets of the cards (formatted with the model's name, its default tag, a file)
CREATE_SNIPPET = """```python
import timm
import lsvision  # registers the lsvision models with timm

model = timm.create_model('{name}', num_classes=1000)
features = timm.create_model('{name}', features_only=True)  # multi-scale feature maps
```"""
CREATE_PRETRAINED_SNIPPET = """```python
import timm
import lsvision  # registers the lsvision models with timm

model = timm.create_model('{name}', pretrained=True)  # {tag}, the default tag (see the table below)
features = timm.create_model('{name}', features_only=True)  # multi-scale feature maps
```"""
MICROSOFT_FILE_SNIPPET = (
    "Microsoft's own released file of this model (microsoft/CvT's model zoo, `stage{{i}}.*` keys) "
    "loads from disk as well, maps to lsvision's names and gives Microsoft's logits:\n\n```python\n"
    "model = timm.create_model('{name}', pretrained=True, pretrained_cfg_overlay=dict(file='{file}'))"
    "\n```")
