"""Write configs/<model>.yaml (the paper training recipe of every registered lsvision model) from the tables below.

    python tools/make_configs.py            # rewrites configs/<model>.yaml (not digits_demo.yaml, finetune.yaml)

Recipes are per-process batch sizes with lr_base given at the papers' reference batch (lr_base_size), so
`lr = lr_base * global_batch / lr_base_size` reproduces the paper's lr at the paper's global batch on any number
of GPUs. Sources: NVIDIA/transformer-ls `imagenet/launch/*` (ViL-LS), the Transformer-LS paper's App. E (CvT-LS),
microsoft/CvT `experiments/imagenet/cvt/*.yaml` (CvT), and the base models' papers for the GRC models (a GRC model
trains with its base model's recipe). configs/digits_demo.yaml (the demo) and configs/finetune.yaml (a pretrained
model on a small folder) are written by hand.
"""
import argparse
import os
import sys
import textwrap
from typing import Any, Dict, Tuple

import yaml

import timm

import lsvision
from lsvision.train import validate_config
from lsvision.train.args import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ImageNet recipe pieces shared by the DeiT-derived recipes (PVT, CvT-LS, ViL-LS, Swin)
_AUG = dict(aa='rand-m9-mstd0.5-inc1', reprob=0.25, remode='pixel', mixup=0.8, cutmix=1.0, smoothing=0.1,
            color_jitter=0.4, interpolation='bicubic', train_interpolation='bicubic')
_ADAMW = dict(opt='adamw', opt_eps=1.0e-8, weight_decay=0.05, sched='cosine', epochs=300, warmup_epochs=5,
              warmup_lr=1.0e-6, min_lr=1.0e-5, lr_base_scale='linear', amp=True)

RECIPES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    'cvt_ls': ('CvT-LS (arXiv:2107.02192 App. E): AdamW, 300 epochs, lr 5e-4 (at batch 512, the PVT/DeiT '
               'convention it follows), cosine, 5 warmup epochs, PVT/ViL-style augmentation; drop path is not '
               'given in the paper (0.1 in the last stage, as the CvT recipe)',
               dict(_ADAMW, **_AUG, batch_size=128, lr_base=5.0e-4, lr_base_size=512, drop_path=0.1)),
    'cvt': ('Microsoft CvT (experiments/imagenet/cvt/cvt-*-224x224.yaml): AdamW lr 2.5e-4 per 256 images, wd 0.05, '
            'cosine 300 epochs, 5 warmup (warmup_lr 1e-6, min_lr 1e-5, cooldown 10), RandAugment, mixup 0.8 / '
            'cutmix 1.0, random erasing 0.25, label smoothing 0.1, AMP',
            dict(_ADAMW, **_AUG, batch_size=256, lr_base=2.5e-4, lr_base_size=256, cooldown_epochs=10,
                 drop_path=0.1)),
    'vil_ls': ('ViL-LS (NVIDIA/transformer-ls imagenet/launch/*): AdamW lr 8e-4 at batch 1024, '
               'wd 0.1, cosine 300 epochs, 5 warmup, label smoothing 0.1, mixup 0.8 / cutmix 1.0, '
               'RandAugment m9-mstd0.5-inc1, random erasing 0.25, AMP',
               dict(_ADAMW, **_AUG, batch_size=128, lr_base=8.0e-4, lr_base_size=1024, weight_decay=0.1)),
    'pvt': ('PVT v1 / v2 (their DeiT-based code): AdamW lr 5e-4 x batch / 512 (1e-3 at 8 x 128), wd 0.05, '
            'cosine 300 epochs, 5 warmup, RandAugment, mixup 0.8 / cutmix 1.0, random erasing 0.25, label '
            'smoothing 0.1; the GRC variant uses its base recipe (arXiv:2312.12742)',
            dict(_ADAMW, **_AUG, batch_size=128, lr_base=5.0e-4, lr_base_size=512)),
    'swin': ('Swin (arXiv:2103.14030): AdamW lr 1e-3 at batch 1024, wd 0.05, cosine 300 epochs, 20 warmup '
             '(warmup_lr 5e-7, min_lr 5e-6), grad clip 5, RandAugment, mixup 0.8 / cutmix 1.0, '
             'random erasing 0.25, label smoothing 0.1; the GRC variant uses its base recipe',
             dict(_ADAMW, **_AUG, batch_size=128, lr_base=1.0e-3, lr_base_size=1024, warmup_epochs=20,
                  warmup_lr=5.0e-7, min_lr=5.0e-6, clip_grad=5.0)),
    'deit': ('DeiT-S (arXiv:2012.12877), the ViT-S recipe the GRC paper compares with: AdamW lr 5e-4 x batch / '
             '512, wd 0.05, cosine 300 epochs, 5 warmup, drop path 0.1, repeated augmentation 3, RandAugment, '
             'mixup 0.8 / cutmix 1.0, random erasing 0.25, label smoothing 0.1',
             dict(_ADAMW, **_AUG, batch_size=128, lr_base=5.0e-4, lr_base_size=512, drop_path=0.1, aug_repeats=3)),
}

# per-model drop path where the recipe differs by size
DROP_PATH = {
    'vil_ls_medium': 0.3, 'vil_ls_base': 0.5, 'vil_ls_medium_384': 0.2,  # official launch scripts
    'swin_tiny': 0.2, 'swin_small': 0.3, 'swin_base': 0.5,  # Swin's configs
    'pvt_tiny': 0.1, 'pvt_small': 0.1, 'pvt_medium': 0.3, 'pvt_large': 0.3,  # PVT v1 repo configs
    'pvt_v2_b0': 0.1, 'pvt_v2_b1': 0.1, 'pvt_v2_b2': 0.1, 'pvt_v2_b2_li': 0.1, 'pvt_v2_b3': 0.3,
    'pvt_v2_b4': 0.3, 'pvt_v2_b5': 0.3,  # PVT v2 repo configs
}


def recipe_for(name: str) -> Tuple[str, Dict[str, Any]]:
    """(source note, recipe) of a registered model."""
    for prefix, family in (('cvt_ls_', 'cvt_ls'), ('cvt_', 'cvt'), ('vil_ls_', 'vil_ls'), ('pvt', 'pvt'),
                           ('swin_', 'swin'), ('vit_', 'deit'), ('deit_', 'deit')):
        if name.startswith(prefix):
            note, recipe = RECIPES[family]
            recipe = dict(recipe)
            base = name[:-len('_grc')] if name.endswith('_grc') else name
            for key, rate in DROP_PATH.items():
                if base == key or base.startswith(key + '_patch'):
                    recipe['drop_path'] = rate
            return note, recipe
    raise KeyError(f'no recipe family for {name}; add one to tools/make_configs.py')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', default=os.path.join(ROOT, 'configs'))
    args = parser.parse_args()
    train_parser = build_parser()
    for name in lsvision.models.list_models():
        note, recipe = recipe_for(name)
        size = timm.models.get_pretrained_cfg(name).input_size
        cfg = dict(model=name, input_size=list(size), **recipe)
        validate_config(cfg, train_parser, name)
        header = textwrap.fill(f'{name}: {note}.', 116, initial_indent='# ', subsequent_indent='# ')
        header += '\n# Generated by tools/make_configs.py; data: --data-dir /path/to/imagenet\n'
        with open(os.path.join(args.out, f'{name}.yaml'), 'w') as f:
            f.write(header + yaml.safe_dump(cfg, sort_keys=False, default_flow_style=None))
    print(f'wrote {len(lsvision.models.list_models())} configs to {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
