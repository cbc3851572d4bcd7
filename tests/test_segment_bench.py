"""tools/benchmark.py dense (backbone + detection FPN or segmentation head at dense-prediction resolution) at tiny
sizes, and cuda-count's validation of every model spec before it counts anything."""
import json

import pytest
import torch
from _helpers import ROOT, load_tool

from lsvision import bench
from lsvision.sequence import list_models as sequence_models

QUICK = ('--repeats', '1', '--warmup', '0', '--budget-s', '0')


@pytest.fixture(scope='module')
def tool():
    return load_tool('benchmark')


def test_dense_segmentation_against_a_baseline(tool, tmp_path, capsys, monkeypatch):
    """Semantic FPN on two backbones, forward and AdamW step, ratios to the baseline. The measurements run in this
    process (the fresh processes are tested in test_bench_tools.py), so the test takes seconds."""
    monkeypatch.setattr(bench, 'run_fresh', lambda job, fn=bench.measure: fn(job))
    threads = torch.get_num_threads()
    assert tool.main(['dense', '--head', 'semantic_fpn', '--models', 'test_convnext', '--baseline', 'test_convnext2',
                      '--sizes', '64x96', '--out', str(tmp_path), *QUICK]) == 0
    torch.set_num_threads(threads)
    report = json.loads((tmp_path / 'segmentation.json').read_text())
    rows = report['rows']
    assert [(r['spec'], r['image'], r['input_size']) for r in rows] == [
        ('test_convnext', '64x96', [3, 64, 96]), ('test_convnext2', '64x96', [3, 64, 96])]
    assert report['settings']['head'] == 'semantic_fpn' and 'exceeded' not in rows[0]
    convnext, convnext2 = rows
    assert convnext['train_step_ratio'] == pytest.approx(convnext['train_step_ms'] / convnext2['train_step_ms'])
    text = (tmp_path / 'segmentation.md').read_text()
    assert text.startswith('## Backbone + Semantic FPN at segmentation resolution')
    assert '`lsvision.segmentation.semantic_fpn`, 150 classes' in text and 'CUDA: the kernels' not in text
    cpu = convnext['train_cpu_ms_per_image'] / convnext2['train_cpu_ms_per_image']
    train = text.split('### Training step (AdamW)')[1].split('###')[0]
    assert '| test_convnext | 64x96 | 64x96 |' in train and f'| {cpu:.2f}x |' in train
    assert capsys.readouterr().out.strip() == text.strip()


def test_dense_run_over_its_time_out_is_noted_and_counted(tool, tmp_path, capsys):
    """A measurement (in a fresh process) stopped by --timeout is a row that says so, in the table of its kind, with
    the CUDA counts of that point (the columns of times left out: no row has them); the run goes on."""
    assert tool.main(['dense', '--head', 'upernet', '--models', 'test_convnext', '--baseline', 'test_convnext',
                      '--sizes', '64x64', '--bench', 'train', '--timeout', '1', '--cuda-count', '--out', str(tmp_path),
                      '--repeats', '1', '--warmup', '0', '--budget-s', '30']) == 0
    [row] = json.loads((tmp_path / 'segmentation_upernet.json').read_text())['rows']
    assert row['exceeded'] == ['train: test_convnext: the measuring process died (killed for memory, or over the '
                               'time-out of 1 s)'] and 'train_step_ms' not in row
    counts = row['train_cuda']
    assert counts['kernels'] > 100 and counts['bytes'] > 0 and counts['flops'] > 0
    train = (tmp_path / 'segmentation_upernet.md').read_text().split('### Training step (AdamW)')[1].split('###')[0]
    assert (f"| test_convnext | 64x64 | 64x64 | {counts['kernels']}, "
            f"{counts['bytes'] / 1e9:.1f}, {counts['flops'] / 1e12:.2f} (1.00x, 1.00x, 1.00x) | train: test_convnext: "
            'the measuring process died') in train
    capsys.readouterr()


def test_cuda_count_checks_every_spec_before_counting(tool, tmp_path, capsys):
    """A bad suffix (cvt_13 has no @full switch) or name fails before the first row is counted, with the benchmark's
    own message (lsvision.bench.split_spec); sequence models pass."""
    for spec, message in (('cvt_13@full', 'only models starting with vil_ls_ have a full-attention switch'),
                          ('cvt_ls_31', 'did you mean cvt_ls_21, cvt_ls_17, cvt_ls_13')):
        assert tool.main(['cuda-count', '--models', 'cvt_ls_13', spec, '--out', str(tmp_path)]) == 2
        assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    tool.check_names(tool.parse_args(['cuda-count', '--models', sequence_models()[0], 'cvt_ls_13@flex']))


def segmentation_summary(rows) -> str:
    """docs/segmentation.md's sentence on the committed reports: cvt_ls_13's CPU time per kind and size against
    cvt_13's ('not measured' where either run did not finish), then its counts at the largest size on the fake CUDA
    device against cvt_13's."""
    by = {(r['label'], r['image']): r for r in rows}
    images = list(dict.fromkeys(r['image'] for r in rows))

    def cpu(kind: str) -> str:
        key = f'{kind}_cpu_ms_per_image'
        return ', '.join(f"{by['cvt_ls_13', i][key] / by['cvt_13', i][key]:.2f}x" if by['cvt_ls_13', i].get(key)
                         and by['cvt_13', i].get(key) else 'not measured' for i in images)

    counts = [by[m, images[-1]]['train_cuda'] for m in ('cvt_ls_13', 'cvt_13')]
    kernels, moved, flops = (f'{counts[0][k] / counts[1][k]:.2f}x' for k in ('kernels', 'bytes', 'flops'))
    return (f"cvt_ls_13's CPU time per image against cvt_13's at {', '.join(images)}: forward {cpu('inference')}; "
            f"training step {cpu('train')}. On the fake CUDA device at {images[-1]}, cvt_ls_13's training step "
            f"launches {kernels} the kernels of cvt_13's, moves {moved} the bytes and does {flops} the FLOPs.")


def test_docs_quote_the_segmentation_reports():
    rows = bench.read_report(ROOT / 'docs' / 'benchmarks' / 'segmentation.json')['rows']
    assert segmentation_summary(rows) in ' '.join((ROOT / 'docs' / 'segmentation.md').read_text().split())
