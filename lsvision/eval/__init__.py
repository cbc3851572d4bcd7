"""Evaluation suites (any image folder, ImageNet-1K, ReaL, V2, ImageNet-C, -A, -R, -9): layouts, checks, metrics,
loop, reports.

Knows no model: every runner takes an ``nn.Module`` with an ImageNet-1K head (the folder suite: a head of the
folder's classes). ``tools/validate.py`` and
``tools/robustness.py`` are the command lines.
"""
from .dataset import EvalImageDataset, ImageChecks
from .metrics import In9Accuracy, TopKAccuracy, add_real_results, corruption_summary, real_labels, real_result
from .report import markdown_report, plot_corruptions
from .runner import (
    EvalSettings,
    default_workers,
    evaluate_corrupt_on_the_fly,
    evaluate_folder,
    evaluate_imagenet,
    evaluate_imagenet_9,
    evaluate_imagenet_ar,
    evaluate_imagenet_c,
    evaluate_v2,
    file_sha256,
    model_eval_protocol,
    no_resize_protocol,
    predict,
    usable_cores,
)
from .suites import *
