"""tools/gpu_check.py (`make gpu-check`) without a GPU: its dry run goes through the whole script on the CPU at tiny
sizes and writes the report, so that the session that gets a GPU does not lose its minutes on a typo; and a budget
that runs out still leaves a report."""
import json

from _helpers import load_tool


def _run(tmp_path, *args: str) -> int:
    """The dry run in this process (as `python tools/gpu_check.py --dry-run`; its points run in-process anyway)."""
    return load_tool('gpu_check').main(['--dry-run', '--out-dir', str(tmp_path), *args])


def test_plan_measures_the_calibration_points_first_then_profiles_both_models():
    gpu_check = load_tool('gpu_check')
    points = gpu_check.plan()
    labels = [gpu_check.label(p) for p in points]
    assert labels[:10] == [f'{m} {k} {s} b{b}' for k, s, b in (('train', 224, 256), ('train', 384, 64),
                                                                 ('train', 1024, 8), ('inference', 224, 32),
                                                                 ('inference', 1024, 8))
                           for m in ('cvt_ls_13', 'cvt_13')]
    assert [p.get('profile', False) for p in points[10:14]] == [True] * 4
    assert labels[10:14] == [f'{m} {k} {s} b{b}' for k, s, b in (('train', 384, 64), ('inference', 224, 32))
                             for m in ('cvt_ls_13', 'cvt_13')]
    assert labels[14:20] == ['ls_lm_enwik8_small train 4096 b4', 'ls_lm_enwik8_small, flex train 4096 b4',
                             'full_lm_enwik8_small train 4096 b4', 'ls_lm_enwik8_small inference 16384 b1',
                             'ls_lm_enwik8_small, chunk path inference 16384 b1',
                             'full_lm_enwik8_small inference 16384 b1']
    assert labels[20] == 'cvt_ls_13, span path train 384 b64'
    assert len(labels) == len(set(labels)) + 4  # each profiled step repeats a point's label


def test_dry_run_goes_through_every_step_and_writes_the_report(tmp_path):
    assert _run(tmp_path, '--budget-s', '3000') == 0
    report = json.loads((tmp_path / 'gpu.json').read_text())
    assert report['dry_run'] and report['commit'] and report['torch']
    assert report['tests']['returncode'] == 0  # tests/test_cuda.py collected
    errors = {r['label']: r['error'] for r in report['results'] if 'error' in r}
    assert all(e.startswith('skipped: FlexAttention has no CPU backward') for e in errors.values()), errors
    assert {r['point']['model'] for r in report['results'] if 'timing' in r} >= {
        'cvt_ls_13', 'cvt_13', 'cvt_ls_13@noattn', 'cvt_13@noattn', 'swin_tiny_patch4_window7_224', 'vil_ls_medium',
        'vil_ls_medium@full', 'ls_lm_enwik8_small', 'full_lm_enwik8_small'}
    variants = {(r['point'], r['variant']) for r in report['ratios']}
    assert ('inference 224 b32', 'cvt_ls_13, span path') in variants
    assert ('inference 224 b32', 'cvt_ls_13, compiled default') in variants
    assert ('inference 224 b32', 'cvt_ls_13, compiled reduce-overhead') in variants
    assert all(r['time_ratio'] > 0 for r in report['ratios'])
    assert len(report['profiles']) == 4 and all(p['table'] for p in report['profiles'])
    assert {(r['model'], r['against']) for r in report['pairs']} == {
        ('vil_ls_medium', 'vil_ls_medium@full'), ('cvt_ls_13', 'swin_tiny_patch4_window7_224'),
        ('ls_lm_enwik8_small', 'full_lm_enwik8_small')}
    text = (tmp_path / 'gpu.md').read_text()
    assert '## cvt_ls_13 against cvt_13' in text and '## Other comparisons' in text and '## torch.profiler' in text
    assert report['detection'] == 'wrote detection_gpu.md'  # the detection benchmark's command runs (on the CPU)
    assert json.loads((tmp_path / 'detection_gpu.json').read_text())['rows']


def test_a_spent_budget_still_writes_the_report(tmp_path):
    assert _run(tmp_path, '--budget-s', '0') == 1  # tests/test_cuda.py did not run
    report = json.loads((tmp_path / 'gpu.json').read_text())
    assert report['results'] and all(r['error'].startswith('skipped:') for r in report['results'])
    assert report['detection'].startswith('not run: ')
