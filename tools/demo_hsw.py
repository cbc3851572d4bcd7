"""HSW long-document demo: which stdlib package does a 4096-byte window of Python source come from?

No download: documents are 4096-byte windows of the `.py` files of the running Python's standard library, labelled
by their top-level package (lsvision.data.stdlib_docs; split by file). Four models train under the same wall-clock
budget each and are evaluated on the same test documents:

  * HSW      hierarchical shifted windows: 4-byte patches (byte embedding 16, merged like the stages merge),
             widths 16-128, depths 2,2,2,2, window 64, heads C/8; merges start as token sums (merge_init='mean'),
             mean+max pool with a LayerNorm after it (fc_norm): what a ~1-minute run from scratch needs
  * HSW-LS   the same with long-short attention (dynamic-projection keys r = 16, 8, 4, 0 per stage)
  * flat     flat full-attention encoder over bytes: width 96, 3 heads, 8 blocks (as many as hsw_tiny), learned
             positions
  * bag      bag of bytes: a linear classifier on byte log-frequencies

All train with AdamW, class-balanced batches of 64, the transformers on random 128-byte crops (evaluation reads
whole documents), the bag on whole documents. It prints the split, the class counts, and per model the parameters,
training steps, training and inference throughput (documents/s), test accuracy and macro-F1. Evaluation is
time-budgeted too, in a class-balanced order: a model that is too slow to finish (the flat encoder) is scored on the
documents it reached, and every model is also scored on the documents all of them reached (the "common" columns).

    python tools/demo_hsw.py                        # ~4.5 min on 2 cores (60 s training + <= 10 s evaluation per model)
    python tools/demo_hsw.py --train-seconds 10 --eval-seconds 5 --models hsw bag   # quick look
"""
import argparse
import json
import os
import sys
import time
from typing import Dict, Optional

import torch
import torch.nn as nn

from lsvision.data.stdlib_docs import PAD_ID, VOCAB_SIZE, build_stdlib_docs
from lsvision.runs import name_choice
from lsvision.runtime import set_threads, threads_help
from lsvision.sequence.budget_train import (
    accuracy,
    evaluate_for_seconds,
    macro_f1,
    stratified_order,
    train_for_seconds,
)
from lsvision.sequence.hsw import HSW, BagOfTokens, FlatEncoder

MODELS = ('hsw', 'hsw_ls', 'flat', 'bag')
LABELS = {'hsw': 'HSW', 'hsw_ls': 'HSW-LS', 'flat': 'flat full attention', 'bag': 'bag of bytes'}


def build(name: str, num_classes: int, doc_len: int, args: argparse.Namespace) -> nn.Module:
    """The demo's models (see the module docstring for their sizes)."""
    common = dict(vocab_size=VOCAB_SIZE, num_classes=num_classes, pad_token_id=PAD_ID)
    if name in ('hsw', 'hsw_ls'):
        return HSW(**common, embed_dim=args.hsw_dim, depths=(2, 2, 2, 2), head_dim=8, window_size=64,
                   attn='ls' if name == 'hsw_ls' else 'window', dp_ranks=(16, 8, 4, 0), patch_size=args.patch_size,
                   patch_embed_dim=16, merge_init='mean', fc_norm=True, global_pool='catavgmax', drop_path_rate=0.)
    if name == 'flat':
        return FlatEncoder(**common, embed_dim=96, depth=8, num_heads=3, max_len=doc_len, drop_path_rate=0.)
    return BagOfTokens(VOCAB_SIZE, num_classes, pad_token_id=PAD_ID)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', default=list(MODELS), type=name_choice(MODELS),
                        help=f'of {", ".join(MODELS)}')
    parser.add_argument('--train-seconds', type=float, default=60., help='training budget per model')
    parser.add_argument('--eval-seconds', type=float, default=10., help='evaluation budget per model')
    parser.add_argument('--threads', type=int, default=0, help=threads_help())
    parser.add_argument('--batch-size', type=int, default=64, help='training batch (of crops)')
    parser.add_argument('--eval-batch-size', type=int, default=8, help='evaluation batch (of whole documents)')
    parser.add_argument('--lr', type=float, default=1e-3, help='AdamW learning rate of the transformers')
    parser.add_argument('--weight-decay', type=float, default=0.01, help='AdamW weight decay of the transformers')
    parser.add_argument('--crop', type=int, default=128,
                        help='the transformers train on random crops of this many bytes of each document (0: whole '
                             'documents); evaluation always reads whole documents')
    parser.add_argument('--bag-lr', type=float, default=3e-2, help='AdamW learning rate of the bag of bytes')
    parser.add_argument('--hsw-dim', type=int, default=16, help='stage-1 width of the demo HSW models')
    parser.add_argument('--patch-size', type=int, default=4, help='bytes per stage-1 token of the demo HSW models')
    parser.add_argument('--doc-len', type=int, default=4096, help='bytes per document')
    parser.add_argument('--max-train-per-class', type=int, default=0,
                        help='cap on the train documents per class (0: all; batches are class-balanced anyway)')
    parser.add_argument('--max-test-per-class', type=int, default=30)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', default='output/demo_hsw/results.json', help='JSON report path')
    args = parser.parse_args(argv)
    start = time.perf_counter()
    args.threads = set_threads(args.threads)

    train, test = build_stdlib_docs(doc_len=args.doc_len, max_train_per_class=args.max_train_per_class or None,
                                    max_test_per_class=args.max_test_per_class, seed=args.seed)
    classes = train.classes
    print(f'Python {sys.version.split()[0]} standard library: {len(classes)} packages, {args.doc_len}-byte '
          f'documents, split by file ({len(set(train.files))} train files, {len(set(test.files))} test files, '
          f'none shared)')
    print('\n| class | train docs | test docs |\n|---|---|---|')
    for name, n_train, n_test in zip(classes, train.class_counts(), test.class_counts()):
        print(f'| {name} | {n_train} | {n_test} |')
    print(f'| **total** | {len(train)} | {len(test)} |')

    order = stratified_order(test.labels, seed=args.seed)
    train_mask, test_mask = train.mask, test.mask
    rows: Dict[str, dict] = {}
    for name in args.models:
        torch.manual_seed(args.seed)
        model = build(name, len(classes), args.doc_len, args)
        params = sum(p.numel() for p in model.parameters())
        log(f'{LABELS[name]}: {params:,} params, training for {args.train_seconds:.0f} s')
        fit = train_for_seconds(
            model, train.tokens, train.labels, args.train_seconds, mask=train_mask, batch_size=args.batch_size,
            lr=args.bag_lr if name == 'bag' else args.lr, weight_decay=0. if name == 'bag' else args.weight_decay,
            crop=None if name == 'bag' or args.crop <= 0 else args.crop, class_balanced=True, seed=args.seed, log=log)
        ev = evaluate_for_seconds(model, test.tokens, order, args.eval_seconds, mask=test_mask,
                                  batch_size=args.eval_batch_size)
        labels = test.labels[ev.index]
        rows[name] = dict(
            model=LABELS[name], params=params, train_steps=fit.steps, train_docs=fit.samples,
            train_seconds=fit.seconds, train_docs_per_s=fit.samples_per_s, eval_docs=len(ev.index),
            eval_seconds=ev.seconds, infer_docs_per_s=ev.samples_per_s, final_loss=fit.final_loss,
            accuracy=accuracy(ev.predictions, labels), macro_f1=macro_f1(ev.predictions, labels, len(classes)),
            predictions=ev.predictions.tolist(), index=ev.index.tolist())
        log(f'  {fit.steps} steps, test accuracy {rows[name]["accuracy"]:.3f} on {len(ev.index)} docs')

    common = min(r['eval_docs'] for r in rows.values())
    common_labels = test.labels[order[:common]]
    for r in rows.values():
        preds = torch.tensor(r['predictions'][:common])
        r['common_accuracy'] = accuracy(preds, common_labels)
        r['common_macro_f1'] = macro_f1(preds, common_labels, len(classes))
    load = os.getloadavg() if hasattr(os, 'getloadavg') else (float('nan'),) * 3
    print(f'\nSame budget per model: {args.train_seconds:.0f} s training, {args.eval_seconds:.0f} s evaluation, '
          f'{args.threads} threads, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. '
          f'Chance: {1 / len(classes):.3f}; majority class of the test set: '
          f'{test.class_counts()[int(torch.tensor(test.class_counts()).argmax())] / len(test):.3f}.')
    print(f'\n| model | params | train steps (docs) | train docs/s | infer docs/s | test docs | accuracy | macro-F1 '
          f'| accuracy, common {common} | macro-F1, common {common} |\n|---|---|---|---|---|---|---|---|---|---|')
    for r in rows.values():
        print(f"| {r['model']} | {r['params']:,} | {r['train_steps']} ({r['train_docs']}) | "
              f"{r['train_docs_per_s']:.1f} | {r['infer_docs_per_s']:.1f} | {r['eval_docs']} | {r['accuracy']:.3f} | "
              f"{r['macro_f1']:.3f} | {r['common_accuracy']:.3f} | {r['common_macro_f1']:.3f} |")
    total = time.perf_counter() - start
    print(f'\nTotal {total:.0f} s.')
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    report = dict(args=vars(args), python=sys.version, torch=torch.__version__, classes=classes,
                  train_counts=train.class_counts(), test_counts=test.class_counts(), load_average=list(load),
                  total_seconds=total, common_docs=common, models=rows)
    tmp = args.out + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.out)
    print(f'JSON report: {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
