#!/usr/bin/env python3
"""The GPU check for the day a CUDA device is lent (`make gpu-check`, under 8 minutes on one GPU).

1. tests/test_cuda.py: the real kernels against the dense references (fp32 / bf16 / fp16, forward and backward).
2. A training-step benchmark (torch.utils.benchmark, `torch.cuda.max_memory_allocated`): cvt_ls_13 against cvt_13 and
   Swin-T at 224 / 384 / 768 px, vil_ls_medium_384 against its full-attention counterpart.
3. The results in docs/benchmarks/gpu.md (device name, commit) and docs/benchmarks/gpu.json.

`--dry-run` lists what it would run. Self-contained on torch.utils.benchmark (no lsvision benchmark module).
"""
import argparse
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from lsvision.bench import write_atomic, write_json

ROOT = Path(__file__).resolve().parents[1]
# (label, model name, model kwargs, image size, batch)
CASES: List[Tuple[str, str, Dict, int, int]] = [
    (f'{name} @ {size}', name, {'img_size': size} if name.startswith('swin') else {}, size, batch)
    for size, batch in ((224, 32), (384, 8), (768, 2))
    for name in ('cvt_ls_13', 'cvt_13', 'swin_tiny_patch4_window7_224')
] + [
    ('vil_ls_medium_384', 'vil_ls_medium_384', {}, 384, 4),
    ('vil_ls_medium_384, full attention', 'vil_ls_medium_384', {'attn_types': ('full',) * 4}, 384, 4),
]


def plan() -> List[str]:
    steps = [f'{sys.executable} -m pytest -q tests/test_cuda.py']
    steps += [f'train step (SGD, bf16 autocast) {label}: batch {batch}' for label, _, _, _, batch in CASES]
    steps.append('write docs/benchmarks/gpu.md and docs/benchmarks/gpu.json')
    return steps


def train_step_stats(name: str, kwargs: Dict, size: int, batch: int) -> Dict:
    """Median time of one training step and its peak CUDA memory."""
    import torch
    import torch.utils.benchmark as benchmark

    import timm

    import lsvision  # noqa: F401  (registers the models)
    model = timm.create_model(name, num_classes=1000, **kwargs).cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, size, size, device='cuda')
    y = torch.randint(0, 1000, (batch,), device='cuda')

    def step():
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    measured = benchmark.Timer('step()', globals={'step': step}).blocked_autorange(min_run_time=3)
    return {'median_ms': measured.median * 1e3, 'iqr_ms': measured.iqr * 1e3,
            'peak_mem_mib': torch.cuda.max_memory_allocated() / 2 ** 20}


def write_report(results: Dict[str, Dict], device: str, commit: str, out_dir: Path) -> None:
    write_json(out_dir / 'gpu.json', {'device': device, 'commit': commit, 'results': results})
    lines = ['# GPU training-step benchmark', '', f'`make gpu-check` on {device}, commit {commit}: one SGD step '
             'under bf16 autocast, median of torch.utils.benchmark blocked_autorange.', '',
             '| model | median ms | IQR ms | peak MiB |', '|---|---|---|---|']
    lines += [f"| {label} | {r['median_ms']:.1f} | {r['iqr_ms']:.1f} | {r['peak_mem_mib']:.0f} |"
              for label, r in results.items()]
    write_atomic(out_dir / 'gpu.md', lambda tmp: tmp.write_text('\n'.join(lines) + '\n'))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--dry-run', action='store_true', help='list what would run, run nothing')
    parser.add_argument('--out-dir', default=str(ROOT / 'docs' / 'benchmarks'))
    args = parser.parse_args(argv)
    if args.dry_run:
        print('\n'.join(plan()))
        return 0
    import torch
    if not torch.cuda.is_available():
        print('gpu-check needs a CUDA device (use --dry-run to list the steps)', file=sys.stderr)
        return 2
    rc = subprocess.call([sys.executable, '-m', 'pytest', '-q', 'tests/test_cuda.py'], cwd=ROOT)
    results = {}
    for label, name, kwargs, size, batch in CASES:
        results[label] = train_step_stats(name, kwargs, size, batch)
        print(f'{label}: {results[label]}', flush=True)
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    write_report(results, torch.cuda.get_device_name(), commit, Path(args.out_dir))
    return rc


if __name__ == '__main__':
    sys.exit(main())
