"""Train a translation Transformer (pre-norm, plain or GRC) on parallel text files; fairseq's IWSLT recipe.

    python tools/train_mt.py --time-budget 120 --model-kwargs dim=128 encoder_depth=2 decoder_depth=2 ffn_dim=256
                                                  # the local demo task (German -> English by rules), no download
    python tools/train_mt.py --data-dir iwslt14.de-en --epochs 50 --amp     # train.de / train.en, valid.*, test.*
    python tools/train_mt.py --data-dir iwslt14.de-en --epochs 50 --model grc_transformer_iwslt_de_en_prenorm
    torchrun --nproc_per_node=4 tools/train_mt.py --data-dir iwslt14.de-en --epochs 50 --device cuda --amp
    python tools/train_mt.py --output output/train_mt/run --resume auto --epochs 60    # continue exactly
    python tools/train_mt.py --data-dir my-corpus --time-budget 600 --model-kwargs dim=128 encoder_depth=2 \
        decoder_depth=2 num_heads=4 ffn_dim=256 drop=0.1 --vocab-size 1000 --max-tokens 1024 --lr 2e-3 \
        --warmup-updates 100 --save-interval-updates 25 --average-last 5    # a corpus of thousands of pairs

Data: `<data-dir>/{train,valid,test}.{src,tgt}`, one sentence per line (raw text: the SentencePiece vocabulary is
trained here on both sides of train). Without --data-dir the demo task is written to <output>/data. Stops at the first
of --epochs, --max-updates, --time-budget. Writes <output>/last.pt (resume), checkpoint_<update>.pt (the last
--average-last), averaged.pt, result.json and result.md (valid perplexity and beam-search BLEU, sacrebleu, of the
last weights and of the checkpoint average). A resumed run takes its settings from the checkpoint; flags given on the
resume win (the limits --epochs, --max-updates, --time-budget count the whole run; those given replace all of the
checkpoint's), except the model, data and optimization, which stay the checkpoint's (the run says which it kept).
"""
import argparse
import logging
import os
import sys

import yaml

from lsvision.runtime import set_threads, threads_help
from lsvision.train.args import given_flags
from lsvision.train.checkpoint import CheckpointWriteError
from lsvision.train.translation import MTConfig, run


def _kwargs(items) -> dict:
    out = {}
    for item in items or []:
        key, sep, value = item.partition('=')
        if not sep:
            raise argparse.ArgumentTypeError(f'--model-kwargs takes key=value pairs, got {item!r}')
        out[key] = yaml.safe_load(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    d = MTConfig()
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--data-dir', default=None, help='folder of train/valid/test.<lang> files (default: the demo task)')
    p.add_argument('--source-lang', default=d.source_lang)
    p.add_argument('--target-lang', default=d.target_lang)
    p.add_argument('--output', default=d.output, help='run folder')
    p.add_argument('--model', default=d.model, help='transformer_iwslt_de_en_prenorm or its grc_ version')
    p.add_argument('--model-kwargs', nargs='*', default=[], metavar='KEY=VALUE',
                   help='model options, e.g. dim=256 share_all_embeddings=true grc_cache_len=64')
    p.add_argument('--vocab-size', type=int, default=d.vocab_size, help='joint SentencePiece vocabulary (at most)')
    p.add_argument('--spm-model-type', default=d.spm_model_type, choices=['unigram', 'bpe'])
    p.add_argument('--max-tokens', type=int, default=d.max_tokens, help='tokens per batch (and process)')
    p.add_argument('--max-positions', type=int, default=d.max_positions, help='longer training pairs are dropped')
    p.add_argument('--lr', type=float, default=None, help='peak learning rate (default 5e-4; 1e-3 for GRC models)')
    p.add_argument('--warmup-updates', type=int, default=d.warmup_updates)
    p.add_argument('--warmup-init-lr', type=float, default=d.warmup_init_lr)
    p.add_argument('--weight-decay', type=float, default=d.weight_decay)
    p.add_argument('--label-smoothing', type=float, default=d.label_smoothing)
    p.add_argument('--clip-norm', type=float, default=d.clip_norm, help='0: no clipping')
    p.add_argument('--epochs', dest='max_epochs', type=int, default=None)
    p.add_argument('--max-updates', type=int, default=None)
    p.add_argument('--time-budget', dest='time_budget_s', type=float, default=None,
                   help="seconds of training, the run's total over its resumes (a resumed run gets what is left of "
                        'it: give the new total)')
    p.add_argument('--save-interval-updates', type=int, default=d.save_interval_updates,
                   help='an averaging checkpoint every N updates (0: at the end of each epoch)')
    p.add_argument('--average-last', type=int, default=d.average_last, help='checkpoints averaged at the end')
    p.add_argument('--beam', type=int, default=d.beam)
    p.add_argument('--len-penalty', type=float, default=d.len_penalty)
    p.add_argument('--max-len-a', type=float, default=d.max_len_a, help='output length limit: a * source + b')
    p.add_argument('--max-len-b', type=int, default=d.max_len_b)
    p.add_argument('--eval-split', default=d.eval_split, help='split scored with BLEU')
    p.add_argument('--eval-max-sentences', type=int, default=None, help='score only the first N sentences')
    p.add_argument('--bleu-bootstrap', type=int, default=d.bleu_bootstrap,
                   help="resamples of sacrebleu's bootstrap 95%% interval of BLEU (0: none)")
    p.add_argument('--device', default=d.device, help='cpu or cuda (under torchrun: one device per process)')
    p.add_argument('--amp', action='store_true', help='autocast (--amp-dtype)')
    p.add_argument('--amp-dtype', default=d.amp_dtype, choices=['bfloat16', 'float16'])
    p.add_argument('--grc-sync-cache', action='store_true',
                   help='under torchrun: average the GRC caches over the processes after every update')
    p.add_argument('--seed', type=int, default=d.seed)
    p.add_argument('--log-interval-s', '--log-interval', dest='log_interval_s', type=float, default=d.log_interval_s,
                   help='seconds between progress lines (a line at the first update after them; 0: every update)')
    p.add_argument('--threads', type=int, default=0, help=threads_help())
    p.add_argument('--resume', default=None, help="last.pt of a run, or 'auto' (<output>/last.pt)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def config_from_args(args: argparse.Namespace) -> MTConfig:
    fields = {k: v for k, v in vars(args).items() if k not in ('threads', 'model_kwargs')}
    return MTConfig(model_kwargs=_kwargs(args.model_kwargs), **fields)


def main(argv=None) -> int:
    # progress from the first process only (under torchrun every process runs this)
    logging.basicConfig(level=logging.INFO if os.environ.get('RANK', '0') == '0' else logging.WARNING,
                        format='%(message)s')
    parser = build_parser()
    args = parser.parse_args(argv)
    set_threads(args.threads, log=os.environ.get('RANK', '0') == '0')
    try:
        cfg = config_from_args(args)
        result = run(cfg, given=given_flags(parser, argv) - {'threads'})
    except (ValueError, FileNotFoundError, argparse.ArgumentTypeError, CheckpointWriteError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if result is not None and 'output' in result:
        print(f"\n{result['model']}: {result['eval_split']} BLEU {result['last']['bleu']:.2f} (last weights), "
              f"{result['averaged']['bleu']:.2f} (average of the last {result['averaged_checkpoints']} checkpoints) "
              f"after {result['updates']} updates, {result['train_seconds']:.0f}s")
        print(f"run folder: {result['output']} (result.json, result.md, averaged.pt, last.pt)")
    return 0


if __name__ == '__main__':
    sys.exit(main())
