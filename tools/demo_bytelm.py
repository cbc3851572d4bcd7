"""Byte-level language model demo on the Python standard library's own source files (no download): a 2-layer causal
long-short LM and its causal full-attention counterpart, trained for the same wall-clock budget, then evaluated in
bits per byte on the held-out last 10 % of the corpus.

    python tools/demo_bytelm.py                  # 170 s per model, 2 threads (about 6 min in all)
    python tools/demo_bytelm.py --budget 30      # quick look

`--out` writes JSON.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

import lsvision.sequence as seq
from lsvision.data import stdlib_bytes
from lsvision.flops import parameter_count
from lsvision.reports import machine_description
from lsvision.runs import name_choice
from lsvision.runtime import set_threads, threads_help
from lsvision.sequence.budget_train import train_on_lr_factor


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--budget', type=float, default=170., help='training seconds per model (wall clock)')
    parser.add_argument('--threads', type=int, default=0,
                        help=threads_help(max_threads=2))
    parser.add_argument('--models', nargs='+', default=['ls', 'full'], type=name_choice(['ls', 'full']),
                        help='ls (causal long-short), full (causal full attention)')
    parser.add_argument('--block-len', type=int, default=256, help='bytes per training crop / eval window')
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--lr', type=float, default=2e-3)
    parser.add_argument('--eval-windows', type=int, default=200, help='non-overlapping validation windows')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', type=Path, default=None, help='also write the results as JSON here')
    return parser.parse_args(argv)


def build(kind: str, args) -> torch.nn.Module:
    common = dict(vocab_size=256, dim=128, depth=2, num_heads=4, mlp_hidden=512, block='prenorm', drop=0.)
    if kind == 'ls':
        # W 64, l 8, r 1, a masked cache of 64 tokens (empty for independent crops): relative positions only
        return seq.CharLM(window_size=64, segment_size=8, dp_rank=1, mem_len=64, cache_mode='masked', **common)
    return seq.CharLM(attn='full', max_len=args.block_len, **common)


def batch(data: torch.Tensor, starts: torch.Tensor, n: int):
    idx = starts[:, None] + torch.arange(n + 1)[None]
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def bits_per_byte(model, val: torch.Tensor, args) -> float:
    model.eval()
    n = args.block_len
    count = min(args.eval_windows, (len(val) - 1) // n)
    starts = torch.arange(count) * ((len(val) - 1 - n) // max(count - 1, 1))  # spread over the split, no overlap
    nll, total = 0., 0
    for i in range(0, count, 50):
        x, y = batch(val, starts[i:i + 50], n)
        logp, _ = model(x)
        nll -= float(logp.gather(-1, y[..., None]).sum())
        total += y.numel()
    model.train()
    return nll / total / math.log(2)


def train(model, train_data, args) -> dict:
    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, len(train_data) - args.block_len - 1, (args.batch_size,), generator=gen)
        x, y = batch(train_data, starts, args.block_len)
        logp, _ = model(x)
        return -logp.gather(-1, y[..., None]).mean()

    steps, seconds, loss_avg = train_on_lr_factor(
        model, batch_loss, args.budget, args.lr, seed=args.seed, clip_grad=1.0,
        describe_loss=lambda avg: f'loss {avg / math.log(2):.3f} bits')
    return dict(steps=steps, train_s=round(seconds, 1), train_bits=round(loss_avg / math.log(2), 4))


def main(argv=None) -> int:
    args = parse_args(argv)
    args.threads = set_threads(args.threads, max_threads=2)
    train_data, val = stdlib_bytes()
    print(f'stdlib corpus: {len(train_data):,} train / {len(val):,} validation bytes; {machine_description()}',
          file=sys.stderr, flush=True)
    rows = []
    for kind in args.models:
        torch.manual_seed(args.seed)
        model = build(kind, args)
        print(f'training {kind} ({parameter_count(model):,} params) for {args.budget:.0f}s', file=sys.stderr,
              flush=True)
        stats = train(model, train_data, args)
        rows.append(dict(model=kind, params=parameter_count(model), val_bits_per_byte=round(
            bits_per_byte(model, val, args), 4), **stats))
    print(f'\nByte LM on the Python stdlib, {args.budget:.0f} s of training per model ({args.threads} threads):\n')
    print('| attention | params | steps | train bits/byte | val bits/byte |\n|---|---|---|---|---|')
    names = {'ls': 'causal long-short (W 64, l 8, r 1)', 'full': 'causal full (SDPA)'}
    for r in rows:
        print(f"| {names[r['model']]} | {r['params']:,} | {r['steps']} | {r['train_bits']:.3f} | "
              f"{r['val_bits_per_byte']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(task='stdlib-bytelm', budget_s=args.budget, threads=args.threads,
                                            machine=machine_description(), results=rows), indent=2))
    return 0 if all(math.isfinite(r['val_bits_per_byte']) for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
