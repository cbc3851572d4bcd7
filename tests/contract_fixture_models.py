"""Two tiny timm models for the contract runner's own test (tests/test_contract_runner.py), imported by the runner
with ``--packages contract_fixture_models``: one keeps timm's model contract, the other ignores ``num_classes``."""
from typing import Any

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.resnet import BasicBlock, ResNet

_TINY_RESNET = dict(block=BasicBlock, layers=(1, 1, 1, 1), channels=(8, 8, 16, 16), stem_width=8)


def _cfg(**kwargs: Any) -> dict:
    return dict(num_classes=1000, input_size=(3, 64, 64), pool_size=(2, 2), crop_pct=0.875, interpolation='bilinear',
                mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, first_conv='conv1', classifier='fc', **kwargs)


default_cfgs = generate_default_cfgs({
    'contract_tiny_resnet.untrained': _cfg(),
    'contract_tiny_resnet_no_num_classes.untrained': _cfg(),
})


@register_model
def contract_tiny_resnet(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """A 4-stage ResNet 8-16 channels wide: passes timm's model tests."""
    return build_model_with_cfg(ResNet, 'contract_tiny_resnet', pretrained, **dict(_TINY_RESNET, **kwargs))


@register_model
def contract_tiny_resnet_no_num_classes(pretrained: bool = False, **kwargs: Any) -> ResNet:
    """The same ResNet with a bug the contract must catch: it drops ``num_classes`` and always has 1000 classes."""
    kwargs.pop('num_classes', None)
    variant = 'contract_tiny_resnet_no_num_classes'
    return build_model_with_cfg(ResNet, variant, pretrained, **dict(_TINY_RESNET, **kwargs))
