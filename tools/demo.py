"""Build every lsvision model, run one forward at its default size, and print params, GFLOPs and output shape.

    python tools/demo.py                  # all models
    python tools/demo.py --models 'cvt_ls_*' --out output/demo.json
"""
import argparse
import json
import os
import sys
import time
from typing import List, Optional

import torch

import timm

import lsvision
from lsvision.flops import count_flops, parameter_count
from lsvision.runs import close_names


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='*', default=['*'], help='model names or wildcards (default: all)')
    parser.add_argument('--out', default='output/demo/models.json', help='JSON report path')
    args = parser.parse_args(argv)

    known = lsvision.models.list_models()
    unmatched = [p for p in args.models if not lsvision.models.list_models(p)]
    if unmatched:  # a mistyped name is an error, even beside names that match
        hints = ' '.join(f'Did you mean {", ".join(close)} for {p!r}?' for p in unmatched
                         for close in [close_names(p, known)] if close)
        print(f'no lsvision model matches {unmatched}; ' + (f'{hints} ' if hints else '')
              + f'known: {", ".join(known)}', file=sys.stderr)
        return 2
    names = lsvision.models.list_models(args.models)
    torch.manual_seed(0)
    rows = []
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        model = timm.create_model(name).eval()
        input_size = model.pretrained_cfg['input_size']
        with torch.inference_mode():
            out = model(torch.randn(1, *input_size))
        flops = count_flops(model, input_size)
        rows.append(dict(
            model=name,
            input_size=list(input_size),
            params=parameter_count(model),
            gflops=round(flops.gflops, 3),
            output_shape=list(out.shape),
            finite=bool(torch.isfinite(out).all()),
        ))
        print(f'[{i}/{len(names)}] {name}: {time.perf_counter() - t0:.1f}s', file=sys.stderr, flush=True)

    print('\n| model | input | params | GFLOPs | output shape |\n|---|---|---|---|---|')
    for r in rows:
        print(f"| {r['model']} | {r['input_size'][1]}x{r['input_size'][2]} | {r['params']:,} | {r['gflops']:.3f} "
              f"| {tuple(r['output_shape'])} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
        json.dump(dict(torch=torch.__version__, timm=timm.__version__, lsvision=lsvision.__version__, models=rows),
                  f, indent=2)
    print(f'\nJSON report: {args.out}')
    return 0 if all(r['finite'] for r in rows) else 1


if __name__ == '__main__':
    sys.exit(main())
