"""What long-short attention buys at detection resolution: backbone + FPN (as the detectors run them) forward and
AdamW training step at the inputs torchvision's detector transform makes of 800 x 1333 and 1024 x 1024 images,
cvt_ls_13 against cvt_13 (full attention) and PVT-Small (spatial-reduction attention, plain and GRC).

Measured with `lsvision.bench` (torch.utils.benchmark; peak memory: CPU ru_maxrss, CUDA max_memory_allocated; every
model, size and kind in a fresh process, the models in alternating order over the repeats, paired ratios to the
baseline). `tools/bench_detection.py` is its command line (CPU here; `--device cuda --amp bfloat16` on a GPU).

Written for lsvision, Apache-2.0.
"""
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from lsvision import bench

from .models import backbone_with_fpn

__all__ = ['BASELINE', 'IMAGE_SIZES', 'MODELS', 'detector_input_size', 'report_markdown', 'run_suite']

MODELS = ('cvt_ls_13', 'cvt_13', 'pvt_small', 'pvt_small_grc')
BASELINE = 'cvt_13'
IMAGE_SIZES = ((800, 1333), (1024, 1024))
"""Image sizes (height, width): the detectors' 1x-schedule test size and the square one of large-scale jitter."""


def detector_input_size(height: int, width: int) -> Tuple[int, int]:
    """The batch torchvision's `GeneralizedRCNNTransform` makes of one `height` x `width` image when its sizes are
    the image's (min_size = the shorter side, max_size = the longer): kept, then padded to a multiple of 32."""
    transform = GeneralizedRCNNTransform(min(height, width), max(height, width), [0.] * 3, [1.] * 3)
    images, _ = transform([torch.zeros(3, height, width)])
    return tuple(images.tensors.shape[-2:])


def _jobs(name: str, size: Tuple[int, int], kinds: Sequence[str], device: str, amp: Optional[str], budget_s: float,
          warmup: int, threads: Optional[int]) -> List[bench.Job]:
    h, w = detector_input_size(*size)
    return [bench.Job(
        label=name, build=functools.partial(backbone_with_fpn, name), inputs=[((3, h, w), None)], kind=kind,
        warmup=warmup, budget_s=budget_s, device=device, amp=amp, optimizer='adamw', threads=threads,
        timeout_s=3600., extra=dict(image=f'{size[0]}x{size[1]}')) for kind in kinds]


def run_suite(
        models: Sequence[str] = MODELS,
        sizes: Sequence[Tuple[int, int]] = IMAGE_SIZES,
        baseline: str = BASELINE,
        kinds: Sequence[str] = ('inference', 'train'),
        device: str = 'cpu',
        amp: Optional[str] = None,
        repeats: int = 2,
        budget_s: float = 1.0,
        warmup: int = 1,
        threads: Optional[int] = None,
        log: Optional[Callable[[str], None]] = None,
        on_size: Optional[Callable[[List[Dict[str, Any]]], None]] = None,
) -> List[Dict[str, Any]]:
    """Measures every model at every image size, inference and training; one row per model and size, with its
    ratios to `baseline` (`lsvision.bench.add_ratios`).

    Args:
        models: timm names of backbones with feature maps (the baseline is added when missing).
        sizes: Image sizes (height, width); each is measured at the detector's padded input size.
        baseline: The model the ratios are to.
        kinds: What to measure: 'inference' (forward) and / or 'train' (AdamW step).
        device: 'cpu' or 'cuda'.
        amp: None, 'bfloat16' or 'float16' autocast.
        repeats: Fresh processes per model, size and kind, in alternating model order.
        budget_s: Seconds of timed passes per process (at least one pass).
        warmup: Untimed passes first (the first AdamW step creates its state).
        threads: torch threads per process (None: torch's default).
        log: Progress lines (one per process).
        on_size: Called with the rows so far (ratios added) after each size, e.g. to write a partial report.
    """
    specs = list(dict.fromkeys([*models, baseline]))
    rows: List[Dict[str, Any]] = []
    for size in sizes:
        if log:
            log(f'{size[0]}x{size[1]} images (input {"x".join(map(str, detector_input_size(*size)))}): '
                f'{", ".join(specs)}')
        jobs = {s: _jobs(s, size, kinds, device, amp, budget_s, warmup, threads) for s in specs}
        by_kind = {kind: bench.run_jobs([jobs[s][k] for s in specs], repeats, log=log) for k, kind in enumerate(kinds)}
        rows += [dict(bench.combine({kind: runs[i] for kind, runs in by_kind.items()}), spec=spec,
                      point=list(size), baseline=baseline) for i, spec in enumerate(specs)]
        bench.add_ratios(rows)
        if on_size:
            on_size(rows)
    return rows


def _ratio(row: Dict[str, Any], key: str) -> str:
    paired, pooled = row.get(f'{key}_ratio_paired'), row.get(f'{key}_ratio')
    if paired is not None:
        rounds = row[f'{key}_ratio_rounds']
        return f'{paired:.2f}x ({min(rounds):.2f}-{max(rounds):.2f})'
    return '-' if pooled is None else f'{pooled:.2f}x'


def _kind_table(rows: Sequence[Dict[str, Any]], kind: str, baseline: str) -> str:
    """One kind's table: wall-clock and CPU time and memory, each with its ratio to the baseline at the same size
    (wall-clock: paired where there are rounds; CPU time: this process's, steadier on a shared machine)."""
    prefix, memory = {'inference': ('latency', 'peak_mib'), 'train': ('train_step', 'train_memory_mib')}[kind]
    cpu = f'{kind}_cpu_ms_per_image'

    def cell(value: Optional[float], fmt: str, unit: str = '') -> str:
        return '-' if value is None else format(value, fmt) + unit

    lines = []
    for r in rows:
        if r.get(f'{prefix}_ms') is None:
            continue
        base = next((b for b in rows if b['spec'] == baseline and b['point'] == r['point']), None)
        cpu_ratio = r[cpu] / base[cpu] if base is not None and base.get(cpu) else None
        mem_ratio = r.get(memory.replace('_mib', '_ratio'))
        lines.append([r['label'], r['image'], 'x'.join(map(str, r['input_size'][1:])), cell(r[f'{prefix}_ms'], '.0f'),
                      cell(r.get(cpu), '.0f'), cell(r.get(memory), '.0f'), _ratio(r, prefix),
                      cell(cpu_ratio, '.2f', 'x'), cell(mem_ratio, '.2f', 'x')])
    header = ['backbone + FPN', 'image', 'input', 'wall ms', 'CPU ms', 'MiB', f'wall / {baseline}',
              f'CPU / {baseline}', f'MiB / {baseline}']
    return bench.markdown_table(header, lines, left_columns=3) if lines else 'Not measured.'


def report_markdown(rows: Sequence[Dict[str, Any]], title: str, command: str, commit: str, machine: str,
                    note: str = '') -> str:
    """The report: what was measured, per kind the times and memory with their ratios to the baseline, and every
    measured field."""
    baseline = rows[0]['baseline'] if rows else BASELINE
    return '\n'.join([
        f'## {title}', '', f'Produced by `{command}` at commit `{commit}`.', '', f'Measured on: {machine}.', '',
        'Backbone + FPN (`lsvision.detection.backbone_with_fpn`, 256 channels, five levels) at batch 1, on the input '
        "torchvision's detector transform makes of each image (padded to a multiple of 32). Forward: eval mode, "
        "inference mode; train step: forward, the sum of the levels' means, backward, AdamW (lr 1e-4, weight decay "
        '0.05; its state counts in the train memory). Memory is the peak above the memory in use once model and '
        'input exist (CPU: resident, CUDA: allocated). Each model, size and kind ran in fresh processes, the models '
        f"in alternating order. {bench.RATIOS_EXPLAINED} CPU ms: the measuring process's CPU time per pass."
        + (f'\n\n{note}' if note else ''), '', '### Forward', '', _kind_table(rows, 'inference', baseline), '',
        '### Training step (AdamW)', '', _kind_table(rows, 'train', baseline), '', '### Every measured field', '',
        bench.benchmark_table(rows), ''])
