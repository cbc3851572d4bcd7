"""Train and evaluate a word-level language model: Transformer-XL or its GRC-cached version (lsvision.train.lm).

    python tools/train_lm.py --data-dir data/wikitext-103                  # the WikiText-103 base recipe
    torchrun --nproc_per_node=4 tools/train_lm.py --data-dir data/wikitext-103 --device cuda --amp
    python tools/train_lm.py --model grc_txl_wt103_base --data-dir data/wikitext-103 --device cuda --amp
    python tools/train_lm.py --train-file my.txt --model txl_tiny --min-freq 2 --batch-size 16 --tgt-len 64
    python tools/train_lm.py --resume auto --output output/train_lm        # continue a stopped run exactly
    python tools/train_lm.py --resume auto --output output/train_lm --time-budget-s 600   # a 300 s run: 300 s more

Data: WikiText's word-level release (`wiki.train.tokens`, `wiki.valid.tokens`, `wiki.test.tokens`), any text file
(--train-file, with --valid-file / --test-file or held-out lines of it), or --corpus stdlib (the standard library's
docstrings, no download). Perplexity is evaluated with the memory carried over each split: --eval-protocol
every-token (default) scores every token but the first once; --eval-protocol authors is Transformer-XL's eval.py
(the authors' code, whose numbers the paper reports), --eval-batch-size rows of N // B tokens each predicting its own
tokens but the first.
The run directory gets last.pth.tar (resume), model_best.pth.tar, result.json and result.md. A resumed run takes its
settings from the checkpoint; flags given on the resume win for where it stops (--max-steps, --time-budget-s: the
run's totals; one given replaces both of the checkpoint's), where it runs, its logging and evaluation, while its model,
data, batches and optimization stay the checkpoint's (the run says which it kept).
"""
import argparse
import dataclasses
import logging
import os
import sys
from typing import Set, Tuple

import yaml

from lsvision.runtime import PROGRESS_HELP, set_threads, threads_help
from lsvision.train.args import given_flags
from lsvision.train.lm import LMConfig, LMSetupError, run


def _kv(text: str):
    if '=' not in text:
        raise argparse.ArgumentTypeError(f'--model-kwargs takes key=value pairs (e.g. cutoffs=[]), got {text!r}')
    key, value = text.split('=', 1)
    return key, yaml.safe_load(value)


def build_parser() -> argparse.ArgumentParser:
    d = LMConfig()
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--model', default=d.model, help='a registered sequence model (txl_*, grc_txl_*)')
    p.add_argument('--model-kwargs', nargs='*', type=_kv, default=[], metavar='KEY=VALUE',
                   help='model options, values in YAML (e.g. cutoffs=[] mem_len=64 drop=0.2)')
    data = p.add_argument_group('data')
    data.add_argument('--data-dir', help='folder with wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens')
    data.add_argument('--train-file', help='any UTF-8 text file to train on')
    data.add_argument('--valid-file')
    data.add_argument('--test-file')
    data.add_argument('--corpus', choices=['stdlib'], help="'stdlib': the Python standard library's docstrings")
    data.add_argument('--min-freq', type=int, default=d.min_freq, help='rarer training words become <unk>')
    data.add_argument('--max-vocab', type=int, default=d.max_vocab, help='keep the most frequent words only')
    train = p.add_argument_group('training')
    for name, kind, help_ in (
            ('tgt_len', int, 'tokens per segment'), ('batch_size', int, 'streams (all processes together)'),
            ('lr', float, 'Adam learning rate'), ('min_lr', float, 'end of the cosine'),
            ('warmup_steps', int, 'linear warm-up steps'), ('clip_grad', float, 'gradient norm clip (0: none)'),
            ('max_steps', int, "updates, the run's total (a resumed run counts the checkpoint's)"),
            ('time_budget_s', float, "stop after this many seconds of training, the run's total over its resumes (a "
                                     'resumed run gets what is left of it: give the new total); the learning rate '
                                     'follows the time; on a resume with a larger budget it never rises back'),
            ('seed', int, 'seed'), ('log_interval', int, 'steps between progress lines'),
            ('log_interval_s', float, PROGRESS_HELP),
            ('save_interval', int, 'steps between checkpoints'), ('eval_interval', int, 'steps between validations')):
        train.add_argument('--' + name.replace('_', '-'), type=kind, default=getattr(d, name), help=help_)
    train.add_argument('--amp', action='store_true', help='autocast (see --amp-dtype)')
    train.add_argument('--amp-dtype', default=d.amp_dtype, choices=['bfloat16', 'float16'])
    train.add_argument('--device', default=d.device, help="'cpu' or 'cuda' (torchrun: one process per GPU)")
    train.add_argument('--threads', type=int, default=0, help=threads_help())
    train.add_argument('--output', default=d.output, help='run directory')
    train.add_argument('--resume', help="a last.pth.tar, or 'auto' (the one in --output)")
    ev = p.add_argument_group(
        "evaluation (the authors' eval.py as their run_wt103_base.sh runs it: --eval-protocol "
        'authors --eval-batch-size 10 --eval-tgt-len 64 --eval-mem-len 640 --eval-clamp-len 400 --eval-same-length)')
    ev.add_argument('--eval-protocol', default=d.eval_protocol, choices=['every-token', 'authors'],
                    help="'every-token': every token of the split but the first scored once; 'authors': "
                         "Transformer-XL eval.py's batches, as the authors' code that gave the paper's numbers "
                         'evaluates (--eval-batch-size rows of N // B tokens, each predicting its own tokens but '
                         'the first)')
    ev.add_argument('--eval-tgt-len', type=int, help='segment length (default: --tgt-len)')
    ev.add_argument('--eval-batch-size', type=int, default=d.eval_batch_size,
                    help="streams the split is cut into (the authors' eval.py: 10)")
    ev.add_argument('--eval-mem-len', type=int, help='memory length for evaluation (Transformer-XL only)')
    ev.add_argument('--eval-clamp-len', type=int,
                    help="clamp relative distances at this value; <= 0: no clamp (the authors' -1)")
    ev.add_argument('--eval-same-length', action='store_true', help='every query attends as many keys')
    ev.add_argument('--eval-max-tokens', type=int, help='validate on the first this many tokens during training')
    return p


def parse_config(argv=None) -> Tuple[LMConfig, Set[str]]:
    """The run's config and the fields the command line set (a resumed run takes the others from its checkpoint);
    sets torch's threads."""
    parser = build_parser()
    args = parser.parse_args(argv)
    set_threads(args.threads, log=os.environ.get('RANK', '0') == '0')
    fields = {f.name for f in dataclasses.fields(LMConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values['model_kwargs'] = dict(args.model_kwargs)
    return LMConfig(**values), given_flags(parser, argv) & fields


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s', datefmt='%H:%M:%S')
    try:
        cfg, given = parse_config(argv)
        result = run(cfg, given=given)
    except (LMSetupError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    if result['world_size'] == 1 or os.environ.get('RANK', '0') == '0':
        print(f"\n{result['model']}: valid ppl {result['valid']['ppl']:.2f}, test ppl {result['test']['ppl']:.2f} "
              f"after {result['steps']} steps ({result['train_seconds']:.0f} s); {result['checkpoint']}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
