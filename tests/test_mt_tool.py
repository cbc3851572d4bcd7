"""tools/train_mt.py end to end on a tiny generated task: checkpoints, averaging, report, exact resume, errors; its
BLEU pinned to sacrebleu's command line and to the formula; resumes that say what they do, a warm-up longer than the
run and a small corpus warned with the fix."""
import json
import logging
import math
import os
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _helpers import load_tool, torchrun

import lsvision.train.translation as translation
from lsvision.data.parallel_text import read_parallel, write_demo_task
from lsvision.train.translation import SMALL_CORPUS_FLAGS, corpus_bleu, load_translation_checkpoint, translate

train_mt = load_tool('train_mt')

TINY = ['--model', 'grc_transformer_iwslt_de_en_prenorm', '--model-kwargs', 'dim=16', 'encoder_depth=1',
        'decoder_depth=1', 'num_heads=2', 'ffn_dim=24', 'drop=0.1', 'grc_cache_len=8', '--vocab-size', '80',
        '--max-tokens', '800', '--warmup-updates', '3', '--lr', '3e-3', '--save-interval-updates', '2',
        '--average-last', '2', '--beam', '2', '--max-len-a', '1', '--max-len-b', '2', '--eval-max-sentences', '3',
        '--threads', '1', '--log-interval', '0']


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp('mt') / 'data'
    write_demo_task(str(path), dict(train=60, valid=6, test=4), seed=0)
    return path


def test_train_average_report_and_exact_resume(data_dir, tmp_path):
    full = tmp_path / 'full'
    assert train_mt.main(['--data-dir', str(data_dir), '--output', str(full), '--max-updates', '8', *TINY]) == 0
    result = json.loads((full / 'result.json').read_text())
    assert result['updates'] == 8 and result['epochs'] >= 1  # the run crossed an epoch boundary
    assert result['averaged_checkpoints'] == 2 and result['lr'] == 3e-3
    assert sorted(p.name for p in full.glob('checkpoint_*.pt')) == ['checkpoint_6.pt', 'checkpoint_8.pt']
    for key in ('last', 'averaged'):
        assert 0. <= result[key]['bleu'] <= 100. and result[key]['valid_ppl'] > 1.
    assert 'test BLEU' in (full / 'result.md').read_text()
    # the reported BLEU is sacrebleu's command line on the tool's own hypotheses and references (--eval-max-sentences
    # 3: all of them are the report's examples)
    examples = result['last']['examples']
    assert len(examples) == 3
    for side in ('hypothesis', 'reference'):
        (tmp_path / f'{side}.txt').write_text(''.join(e[side] + '\n' for e in examples), encoding='utf-8')
    assert result['last']['bleu'] == pytest.approx(
        _sacrebleu_cli(tmp_path / 'reference.txt', tmp_path / 'hypothesis.txt'), abs=0.005 + 5e-5)
    model, vocab = load_translation_checkpoint(str(full / 'averaged.pt'))
    averaged = {k: (torch.load(full / 'checkpoint_6.pt', weights_only=True)['model'][k]
                    + torch.load(full / 'checkpoint_8.pt', weights_only=True)['model'][k]) / 2
                for k in model.state_dict()}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, averaged[k].to(v.dtype))
    assert len(translate(model, vocab, ['wir kaufen drei äpfel .'], beam=2, max_len_b=2)) == 1

    # 3 updates, then resume to 8: the same weights, GRC caches and optimizer state as the run without a stop
    part = tmp_path / 'part'
    assert train_mt.main(['--data-dir', str(data_dir), '--output', str(part), '--max-updates', '3', *TINY]) == 0
    assert train_mt.main(['--output', str(part), '--resume', 'auto', '--max-updates', '8', *TINY]) == 0
    a = torch.load(full / 'last.pt', weights_only=True)
    b = torch.load(part / 'last.pt', weights_only=True)
    assert (a['updates'], a['epoch'], a['pos']) == (b['updates'], b['epoch'], b['pos'])
    assert a['model'].keys() == b['model'].keys()
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    for sa, sb in zip(a['optimizer']['state'].values(), b['optimizer']['state'].values()):
        assert torch.equal(sa['exp_avg_sq'], sb['exp_avg_sq'])


def _sacrebleu_cli(refs: Path, hyps: Path) -> float:
    """BLEU of two files by sacrebleu's command line (its defaults: 13a tokenization, exp smoothing), 4 decimals."""
    out = subprocess.run([sys.executable, '-m', 'sacrebleu', str(refs), '-i', str(hyps), '-m', 'bleu', '-b', '-w',
                          '4'], capture_output=True, text=True, check=True).stdout
    return float(out.strip())


def _bleu_by_hand(hyps, refs) -> float:
    """Corpus BLEU (Papineni et al. 2002) of whitespace-tokenized text: clipped n-gram precisions for n = 1..4 over
    the corpus, their geometric mean, the brevity penalty exp(1 - r / c) when c < r."""
    match, total, c, r = [0] * 4, [0] * 4, 0, 0
    for h, ref in zip(hyps, refs):
        h, ref = h.split(), ref.split()
        c, r = c + len(h), r + len(ref)
        for n in range(1, 5):
            hn = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rn = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
            match[n - 1] += sum(min(k, rn[g]) for g, k in hn.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    assert all(match), 'every n-gram order must match somewhere (no smoothing in this formula)'
    return 100 * min(1., math.exp(1 - r / c)) * math.exp(sum(math.log(m / t) for m, t in zip(match, total)) / 4)


# already tokenized as sacrebleu's 13a tokenizes (punctuation apart), so that whitespace splitting is its tokenization
PINNED_REFS = ['we buy three apples .', 'the house is small and old .', 'she reads a good book in the garden .',
               'Tomorrow we will go to the market , if it does not rain .']
PINNED_HYPS = ['we buy three apples .', 'the house is small .', 'she reads a book in the garden .',
               'tomorrow we will go to the market if it does not rain .']


def test_bleu_is_pinned_to_sacrebleus_command_line_and_to_the_formula(tmp_path):
    """The scorer of tools/train_mt.py's evaluation (`corpus_bleu`, on the lines as the tool reads them) gives the
    number of sacrebleu's command line and of the BLEU formula computed here, on the same files."""
    (tmp_path / 'test.hyp').write_text('\n'.join(PINNED_HYPS) + '\n', encoding='utf-8')
    (tmp_path / 'test.ref').write_text('\n'.join(PINNED_REFS) + '\n', encoding='utf-8')
    hyps, refs = read_parallel(str(tmp_path), 'test', 'hyp', 'ref')
    bleu, signature, _ = corpus_bleu(hyps, refs)
    cli = _sacrebleu_cli(tmp_path / 'test.ref', tmp_path / 'test.hyp')
    assert bleu == pytest.approx(cli, abs=5e-5)  # the command line prints 4 decimals
    assert bleu == pytest.approx(_bleu_by_hand(PINNED_HYPS, PINNED_REFS), abs=1e-9)
    assert 20 < bleu < 90 and 'tok:13a' in signature and 'case:mixed' in signature


def test_resume_says_what_it_does(data_dir, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO)
    run = tmp_path / 'run'
    assert train_mt.main(['--data-dir', str(data_dir), '--output', str(run), '--max-updates', '4', *TINY]) == 0
    spent = torch.load(run / 'last.pt', weights_only=True)['train_seconds']
    # a budget below the time trained (the budget is the run's total): an error with the fix, not 0 updates and the
    # old result reprinted
    assert train_mt.main(['--output', str(run), '--resume', 'auto', '--time-budget', f'{spent / 2}', *TINY]) == 2
    err = capsys.readouterr().err
    assert "is the run's total training time" in err and '--max-updates 4 to only evaluate' in err
    # --average-last given on the resume wins over the checkpoint's 2; --lr, which the checkpoint fixes, is named
    caplog.clear()
    assert train_mt.main(['--output', str(run), '--resume', 'auto', *TINY, '--max-updates', '4', '--average-last',
                          '1', '--lr', '1e-3']) == 0
    assert 'resumed at update 4 (epoch ' in caplog.text
    assert "resumed with the checkpoint's --lr 0.003 (given: --lr 0.001)" in caplog.text
    result = json.loads((run / 'result.json').read_text())
    assert result['averaged_checkpoints'] == 1 and result['updates'] == 4 and result['lr'] == 3e-3
    assert sorted(p.name for p in run.glob('checkpoint_*.pt')) == ['checkpoint_4.pt']


def test_warmup_longer_than_the_run_and_a_small_corpus_are_warned_with_the_recipe(data_dir, tmp_path, caplog,
                                                                                   monkeypatch):
    monkeypatch.setattr(translation, 'SMALL_CORPUS_MAX_PARAMS', 1000)  # the tiny model stands for IWSLT's 31.6M
    with caplog.at_level(logging.WARNING):
        assert train_mt.main(['--data-dir', str(data_dir), '--output', str(tmp_path / 'run'), *TINY,
                              '--max-updates', '1', '--warmup-updates', '50', '--eval-max-sentences', '1']) == 0
    text = ' '.join(caplog.text.split())
    assert '--warmup-updates 50 is not shorter than the run (1 updates): the lr rises from 1e-07' in text
    assert '60 training pairs for a model of' in text and text.count(SMALL_CORPUS_FLAGS) == 2


def test_the_documented_small_corpus_recipe_is_the_one_warned_and_parses():
    text = (Path(__file__).resolve().parents[1] / 'docs' / 'sequence.md').read_text().replace('\\\n', ' ')
    lines = [' '.join(line.split()) for line in text.splitlines() if line.startswith('python tools/train_mt.py')]
    (line,) = [line for line in lines if SMALL_CORPUS_FLAGS in line]
    args = train_mt.parse_args(shlex.split(line, comments=True)[2:])
    assert args.model_kwargs[0] == 'dim=128' and args.warmup_updates == 100 and args.time_budget_s > 0
    assert (f'fewer than {translation.SMALL_CORPUS_PAIRS:,} pairs with a model of more than '
            f'{translation.SMALL_CORPUS_MAX_PARAMS // 10 ** 6}M parameters') in ' '.join(text.split())


def test_errors_name_the_fix(tmp_path, capsys):
    out = ['--output', str(tmp_path / 'run')]
    assert train_mt.main(['--data-dir', str(tmp_path / 'none'), '--max-updates', '1', *out]) == 2
    assert '--data-dir' in capsys.readouterr().err
    assert train_mt.main(['--data-dir', str(tmp_path), *out]) == 2
    assert '--epochs, --max-updates or --time-budget' in capsys.readouterr().err
    assert train_mt.main(['--model', 'transformer_wmt', '--max-updates', '1', *out]) == 2
    assert 'grc_transformer_iwslt_de_en_prenorm' in capsys.readouterr().err
    assert train_mt.main(['--model', 'transformer_iwslt_de_en_prenrm', '--max-updates', '1', *out]) == 2
    assert 'did you mean transformer_iwslt_de_en_prenorm' in capsys.readouterr().err
    assert train_mt.main(['--model', 'txl_tiny', '--max-updates', '1', *out]) == 2  # a language model, not for MT
    assert "unknown translation model 'txl_tiny'" in capsys.readouterr().err


def test_demo_prints_both_models_and_the_caveat(tmp_path, monkeypatch, capsys):
    """tools/demo_mt.py end to end at a toy size: both models' BLEU, the caveat, the JSON and markdown reports."""
    demo_mt = load_tool('demo_mt')
    monkeypatch.setattr(demo_mt, 'SPLITS', dict(train=60, valid=4, test=3))
    monkeypatch.setattr(demo_mt, 'DEMO_SIZE', dict(dim=16, encoder_depth=1, decoder_depth=1, num_heads=2, ffn_dim=24,
                                                   drop=0.1))
    out = tmp_path / 'mt.json'
    assert demo_mt.main(['--budget', '1', '--threads', '1', '--output', str(tmp_path / 'demo'), '--out', str(out)]) == 0
    text = capsys.readouterr().out
    assert 'pre-norm Transformer + GRC' in text and "the paper's Table 4 gain" in text
    rows = json.loads(out.read_text())['results']
    assert [r['model'] for r in rows] == ['plain', 'grc'] and rows[1]['lr'] == 2 * rows[0]['lr']
    assert all(0. <= r['bleu_last'] <= 100. and r['updates'] >= 1 for r in rows)
    assert out.with_suffix('.md').read_text().count('\n') == 4


def test_two_processes_under_torchrun(data_dir, tmp_path):
    """torchrun, 2 gloo processes: one vocabulary (trained on rank 0), disjoint batches, GRC caches averaged after
    every update, every test sentence translated once (sharded), rank 0's report; both processes' RNG states kept."""
    root = Path(__file__).resolve().parents[1]
    run = tmp_path / 'ddp'
    proc = torchrun(['--standalone', '--nproc_per_node=2', str(root / 'tools' / 'train_mt.py'), '--data-dir',
                     str(data_dir), '--output', str(run), '--max-updates', '2', '--grc-sync-cache', *TINY],
                    tmp_path / 'logs', dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / 'result.json').read_text())
    assert result['world_size'] == 2 and result['updates'] == 2 and result['eval_sentences'] == 3
    assert proc.stderr.count('test BLEU') == 2  # last and averaged, logged by rank 0 only
    ckpt = torch.load(run / 'last.pt', weights_only=True)
    assert len(ckpt['rng']) == 2 and not torch.equal(ckpt['rng'][0]['torch'], ckpt['rng'][1]['torch'])
    assert any(c.abs().sum() > 0 for k, c in ckpt['model'].items() if k.endswith('grc.cache'))
