"""Reports of the evaluation tools: markdown tables laid out like the Transformer-LS paper's Tables 6, 13 and 14, and
a PNG chart of ImageNet-C CE per corruption and error per severity (the JSON file: `lsvision.reports.write_json`).

The input is the tools' results dict: ``{'models': [{'model': name, 'params': n, 'suites': {suite: result}}, ...]}``
with the per-suite dicts of `lsvision.eval.runner`.
"""
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..reports import markdown_lines as _table
from .suites import ALL_CORRUPTIONS, CORRUPTIONS, IN9_VARIANTS, V2_VARIANTS

__all__ = ['markdown_report', 'plot_corruptions']


def _f(value: Optional[float], digits: int = 2) -> str:
    return '-' if value is None else f'{value:.{digits}f}'


def _c_suites(m: Dict[str, Any]) -> List[tuple]:
    return [(k, m['suites'][k]) for k in ('imagenet_c', 'imagenet_c_on_the_fly') if m['suites'].get(k)]


def _summary_columns(models: List[Dict[str, Any]], has: Callable[[str], bool]
                     ) -> List[Tuple[str, Callable[[Dict[str, Any]], str]]]:
    """The columns of the summary table (the paper's Table 6): one per headline number of the suites present."""
    cols = [('params (M)', lambda m: _f(m['params'] / 1e6, 1) if m.get('params') else '-')]
    if has('folder'):
        cols += [('folder top-1', lambda m: _f(m['suites'].get('folder', {}).get('top1'))),
                 ('top-5', lambda m: _f(m['suites'].get('folder', {}).get('top5'))),
                 ('images', lambda m: _evaluated(m['suites']['folder']) if m['suites'].get('folder') else '-')]
    if has('imagenet'):
        cols += [('ImageNet top-1', lambda m: _f(m['suites'].get('imagenet', {}).get('top1'))),
                 ('top-5', lambda m: _f(m['suites'].get('imagenet', {}).get('top5'))),
                 ('ReaL', lambda m: _f((m['suites'].get('imagenet', {}).get('real') or {}).get('top1')))]
    if has('imagenet_v2'):
        cols += [(f'V2 {v}', lambda m, v=v: _f(m['suites'].get('imagenet_v2', {}).get(v, {}).get('top1')))
                 for v in V2_VARIANTS if any(v in (m['suites'].get('imagenet_v2') or {}) for m in models)]
    if has('imagenet_c'):
        cols += [('mCE ↓', lambda m: _f(m['suites'].get('imagenet_c', {}).get('mce'))),
                 ('rel. mCE ↓', lambda m: _f(m['suites'].get('imagenet_c', {}).get('relative_mce')))]
    for suite, label in (('imagenet_a', 'IN-A'), ('imagenet_r', 'IN-R')):
        if has(suite):
            cols.append((label, lambda m, s=suite: _f(m['suites'].get(s, {}).get('top1'))))
    if has('imagenet_9'):
        for v in ('original', 'mixed_same', 'mixed_rand'):
            cols.append((f'IN-9 {v}', lambda m, v=v: _f(
                m['suites'].get('imagenet_9', {}).get('variants', {}).get(v, {}).get('top1'))))
        cols.append(('BG-gap', lambda m: _f(m['suites'].get('imagenet_9', {}).get('bg_gap'))))
    return cols


def _corruption_sections(models: List[Dict[str, Any]]) -> List[str]:
    """One ImageNet-C (or on-the-fly) section per model: error, CE and relative CE per corruption and severity."""
    lines: List[str] = []
    for m in models:
        for key, res in _c_suites(m):
            title = 'ImageNet-C' if key == 'imagenet_c' else 'ImageNet-C-style corruptions applied on the fly ' \
                                                              '(not the released ImageNet-C)'
            present = [c for c in ALL_CORRUPTIONS if c in res['corruptions']]
            per = res['corruptions']
            lines += ['', f'## {title}: {m["model"]}', '',
                      "Top-1 error (%) is the mean over the severities evaluated, unnormalised (what the paper's "
                      'Table 13 most likely holds); CE = error / AlexNet error x 100 (15 corruptions only; the 4 '
                      'extra ones have no normaliser).', '']
            rows = [[c, 'extra' if per[c]['extra'] else '15 of mCE', _f(per[c]['mean_error']), _f(per[c]['ce']),
                     _f(per[c]['relative_ce'])] + [_f(per[c]['severities'].get(str(s), {}).get('error'))
                                                   for s in res['severities']] for c in present]
            lines += _table(['corruption', 'group', 'error (%)', 'CE', 'relative CE']
                            + [f'error s{s}' for s in res['severities']], rows)
            lines += ['', f"mCE {_f(res['mce'])}, relative mCE {_f(res['relative_mce'])} (clean error "
                          f"{_f(res['clean_error'])}, AlexNet clean error {_f(res['alexnet_clean_error'])}); "
                          + '; '.join(_mean_error_phrases(res)) + '.']
            lines += [f'- note: {n}' for n in res['notes']]
    return lines


def _mean_error_phrases(res: Dict[str, Any]) -> List[str]:
    """The mean errors of a corruption result, each named for the corruptions and severities it averages."""
    phrases = []
    if res['mean_error_15'] is not None:
        phrases.append(f"mean error over the 15 at severities 1-5 {_f(res['mean_error_15'])}")
    for key, group in (('mean_error', 'of the 15'), ('mean_error_extra', 'extra')):
        mean = res.get(key)
        if mean is None or (key == 'mean_error' and res['mean_error_15'] is not None):
            continue
        sev = mean['severities']
        at = (f"severit{'y' if len(sev) == 1 else 'ies'} {', '.join(map(str, sev))}" if isinstance(sev, list)
              else 'severities ' + ', '.join(f"{c} {'/'.join(map(str, v))}" for c, v in sev.items()))
        phrases.append(f"mean error over {len(mean['corruptions'])} {group} ({', '.join(mean['corruptions'])}) "
                       f"at {at} {_f(mean['value'])}")
    return phrases or ['no mean error']


def _protocol_lines(models: List[Dict[str, Any]]) -> List[str]:
    """The preprocessing of every suite of every model, and each model's checkpoint, precision and batch size."""
    lines = ['', '## Protocols', '']
    for m in models:
        ident = m['model'] + (f" (checkpoint {m['checkpoint']}, sha256 {m['checkpoint_sha256'][:16]}...)"
                              if m.get('checkpoint') else ' (no checkpoint)')
        lines.append(f'- **{ident}**')
        if m.get('precision'):
            p = m['precision']
            lines.append(f"  - precision: {p['autocast'] + ' autocast' if p['autocast'] else 'float32'} "
                         f"({p['source']}), batch size {m.get('batch_size')}")
        for suite, res in m['suites'].items():
            if not res:
                continue
            proto = res.get('protocol') or next(iter(res.values())).get('protocol')
            lines.append(f"  - {suite}: {proto['description']}, input {proto['input_size'][1]}x"
                         f"{proto['input_size'][2]}" + ('' if proto['standard'] else ' **(non-standard)**'))
    return lines


def markdown_report(results: Dict[str, Any]) -> str:
    """Markdown tables of every suite present in ``results`` (the tools' JSON), plus protocols and warnings."""
    models = results['models']
    lines: List[str] = []

    def has(suite: str) -> bool:
        return any(m['suites'].get(suite) for m in models)

    cols = _summary_columns(models, has)
    lines += ['## Summary (accuracy in %' + (', mCE with AlexNet = 100)' if has('imagenet_c') else ')'), '']
    lines += _table(['model'] + [c for c, _ in cols], [[m['model']] + [fn(m) for _, fn in cols] for m in models])
    lines += [f"- {m['model']}: {m['suites']['imagenet']['real_note']}" for m in models
              if (m['suites'].get('imagenet') or {}).get('real_note')]

    for m in models:
        res = m['suites'].get('folder')
        if res:
            lines += ['', f"## Folder {res['root']}: {m['model']}, per class", '']
            lines += _table(['class', 'images', 'top-1'], [[c, str(r['count']), _f(r['top1'])]
                                                           for c, r in res['per_class'].items()])

    if has('imagenet_v2'):
        lines += ['', '## ImageNetV2 (labels = int(folder name))', '']
        rows = [[m['model'], v, _f(r['top1']), _f(r['top5']), _evaluated(r)]
                for m in models for v, r in (m['suites'].get('imagenet_v2') or {}).items()]
        lines += _table(['model', 'variant', 'top-1', 'top-5', 'images'], rows)

    lines += _corruption_sections(models)

    ar = [(s, label) for s, label in (('imagenet_a', 'ImageNet-A'), ('imagenet_r', 'ImageNet-R')) if has(s)]
    if ar:
        lines += ['', '## ImageNet-A / ImageNet-R (logits sliced to the 200 classes)', '']
        rows = [[m['model'], label, _f(r['top1']), _f(r['top5']), _f(r['top1_unmasked']), _evaluated(r)]
                for m in models for s, label in ar for r in [m['suites'].get(s)] if r]
        lines += _table(['model', 'suite', 'top-1', 'top-5', 'top-1 without slicing', 'images'], rows)

    if has('imagenet_9'):
        variants = [v for v in IN9_VARIANTS if any(v in (m['suites'].get('imagenet_9') or {}).get('variants', {})
                                                   for m in models)]
        lines += ['', '## ImageNet-9 (accuracy in %; argmax over 1000 mapped to 9 classes, unmapped = wrong)', '']
        rows = [[m['model']] + [_f(r['variants'].get(v, {}).get('top1')) for v in variants] + [_f(r['bg_gap'])]
                for m in models for r in [m['suites'].get('imagenet_9')] if r]
        lines += _table(['model'] + variants + ['BG-gap'], rows)

    lines += _protocol_lines(models)
    warnings = sorted({w for m in models for w in _all_warnings(m)})
    if warnings:
        lines += ['', '## Layout warnings', ''] + [f'- {w}' for w in warnings]
    return '\n'.join(lines) + '\n'


def _evaluated(res: Dict[str, Any]) -> str:
    """The images a result scored, and how many unreadable ones were left out."""
    skipped = len(res.get('skipped') or [])
    return f"{res['count']}" + (f' ({skipped} unreadable left out)' if skipped else '')


def _all_warnings(obj: Any) -> List[str]:
    if isinstance(obj, dict):
        return list(obj.get('layout_warnings', [])) + [w for v in obj.values() for w in _all_warnings(v)]
    if isinstance(obj, list):
        return [w for v in obj for w in _all_warnings(v)]
    return []


def plot_corruptions(results: Dict[str, Any], path: str) -> bool:
    """PNG of ImageNet-C per model: CE (or raw error) per corruption, and mean error per severity.

    Returns:
        False (and writes nothing) if no model has ImageNet-C results.
    """
    series = [(m['model'] + ('' if key == 'imagenet_c' else ' (on the fly)'), res)
              for m in results['models'] for key, res in _c_suites(m)]
    if not series:
        return False
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    corruptions = [c for c in ALL_CORRUPTIONS if any(c in res['corruptions'] for _, res in series)]
    use_ce = all(res['corruptions'][c]['ce'] is not None for _, res in series for c in corruptions
                 if c in res['corruptions'] and c in CORRUPTIONS)
    fig, (ax_c, ax_s) = plt.subplots(1, 2, figsize=(max(10, 0.6 * len(corruptions) + 6), 4.5),
                                     gridspec_kw=dict(width_ratios=[3, 1]))
    width = 0.8 / len(series)
    for i, (label, res) in enumerate(series):
        values = []
        for c in corruptions:
            row = res['corruptions'].get(c)
            values.append(float('nan') if row is None else (row['ce'] if use_ce and row['ce'] is not None
                                                             else row['mean_error']))
        bars = ax_c.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(corruptions))], values, width,
                        label=label)
        for bar, c in zip(bars, corruptions):
            if c not in CORRUPTIONS:  # the extras: raw error, no AlexNet normaliser
                bar.set_hatch('//')
        sev = res['severities']
        main = [c for c in res['corruptions'] if c in CORRUPTIONS] or list(res['corruptions'])
        mean_by_sev = [sum(res['corruptions'][c]['severities'][str(s)]['error'] for c in main) / len(main)
                       for s in sev]
        ax_s.plot(sev, mean_by_sev, marker='o', label=label)
    if use_ce:
        ax_c.axhline(100, color='grey', lw=0.8, ls='--')
    n_main = sum(c in CORRUPTIONS for c in corruptions)
    if 0 < n_main < len(corruptions):
        ax_c.axvline(n_main - 0.5, color='black', lw=0.8)
    ax_c.set_xticks(range(len(corruptions)))
    ax_c.set_xticklabels(corruptions, rotation=60, ha='right', fontsize=8)
    ax_c.set_ylabel('CE (AlexNet = 100); hatched extras: error %' if use_ce else 'top-1 error (%)')
    ax_c.set_title('ImageNet-C per corruption')
    ax_c.legend(fontsize=8)
    ax_s.set_xlabel('severity')
    n_15 = max(sum(c in CORRUPTIONS for c in res['corruptions']) for _, res in series)
    ax_s.set_ylabel('top-1 error (%), mean over ' + ('the 15 mCE corruptions' if n_15 == len(CORRUPTIONS) else
                                                     f'the {n_15} of the 15 evaluated' if n_15 else 'the extras'))
    ax_s.set_xticks(list(range(1, 6)))
    ax_s.set_title('error per severity')
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

