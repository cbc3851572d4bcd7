"""Word-level LM data and training (lsvision.data.text_corpus, lsvision.train.lm, tools/train_lm.py): the vocabulary
as Transformer-XL builds it, evaluation streams that score each token once, perplexity with the state carried, a
WikiText-format run with its reports, exact resume, bad input explained, and torchrun equal to one process; the
shared thread policy, progress on a clock, and resumes that say what they do (a spent budget refused, the learning rate
never rising back, a fixed setting named as kept)."""
import json
import logging
import math
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from _helpers import ROOT, load_tool, torchrun

import lsvision.sequence as seq
import lsvision.train.lm as lm
from lsvision.data.text_corpus import EOS, UNK, build_vocab, encode_lines, eval_streams, load_wikitext
from lsvision.train.checkpoint import load_checkpoint
from lsvision.train.lm import evaluate_perplexity

TINY_KWARGS = ['dim=16', 'depth=1', 'num_heads=2', 'head_dim=8', 'mlp_hidden=24', 'mem_len=8', 'drop=0.1']


def _write_wikitext(folder: Path, seed: int = 0) -> Path:
    """A WikiText-format folder of generated text: sentences of a small grammar over 30 words, headings, blank lines."""
    g = torch.Generator().manual_seed(seed)
    words = [f'w{i}' for i in range(30)] + [UNK, ',', '.']
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (('train', 120), ('valid', 20), ('test', 20)):
        lines = [' = Heading = \n', ' \n']
        for _ in range(n):
            idx = torch.randint(0, len(words), (int(torch.randint(3, 12, (1,), generator=g)),), generator=g)
            lines.append(' ' + ' '.join(words[i] for i in idx.tolist()) + ' . \n')
        (folder / f'wiki.{split}.tokens').write_text(''.join(lines))
    return folder


def test_vocabulary_and_tokens_as_transformer_xl_builds_them():
    lines = ['b a b\n', ' \n', 'c a b <unk>\n']
    vocab = build_vocab(lines)
    assert vocab.symbols == [EOS, 'b', 'a', 'c', UNK]  # <eos>, then by count, ties in order of first appearance
    ids, unknown = encode_lines(lines, vocab)
    assert ids.tolist() == [1, 2, 1, 0, 0, 3, 2, 1, 4, 0] and unknown == 0  # a blank line is one <eos>
    with pytest.raises(ValueError, match="word 'd' is not in the vocabulary"):
        encode_lines(['d\n'], build_vocab(['a b\n']))
    rare = build_vocab(['a b a\n'], min_freq=2)  # following the hint: rare words become <unk>
    assert rare.symbols == [EOS, 'a', UNK]
    ids, unknown = encode_lines(['d a\n'], rare)
    assert ids.tolist() == [2, 1, 0] and unknown == 1


@pytest.mark.parametrize('n,rows,tgt_len', [(2, 1, 4), (7, 3, 2), (50, 8, 3), (101, 4, 64), (33, 40, 5)])
def test_eval_streams_score_every_token_but_the_first_once(n, rows, tgt_len):
    data = torch.randperm(1000)[:n].to(torch.int32)
    segments = eval_streams(data, rows, tgt_len)
    scored = torch.cat([s.targets[s.mask] for s in segments])
    assert sorted(scored.tolist()) == sorted(data[1:].long().tolist())
    position = {int(t): i for i, t in enumerate(data)}
    for s in segments:  # each scored target follows its input in the stream
        for x, y in zip(s.inputs[s.mask].tolist(), s.targets[s.mask].tolist()):
            assert position[y] == position[x] + 1
        assert s.inputs.shape[1] <= tgt_len


@pytest.mark.parametrize('name', ['txl_tiny', 'grc_txl_tiny'])
def test_perplexity_carries_the_state_over_the_stream(name):
    torch.manual_seed(0)
    model = seq.create_model(name, vocab_size=20, dim=16, depth=1, num_heads=2, head_dim=8, mlp_hidden=24,
                             mem_len=4).double().eval()
    data = torch.randint(0, 20, (23,), dtype=torch.int32)
    got = evaluate_perplexity(model, data, tgt_len=4, batch_size=1)
    state, nll = None, 0.
    for i in range(0, 22, 4):  # the authors' loop: one stream, segments in order, the state carried
        x, y = data[i:i + 4].long()[None], data[i + 1:i + 5].long()[None]
        x = x[:, :y.shape[1]]
        out, state = model(x, y, state)
        nll += float(out.detach().sum())
    assert got['tokens'] == 22
    assert got['ppl'] == pytest.approx(math.exp(nll / 22), rel=1e-12)
    with torch.no_grad():
        fresh = sum(float(model(data[i:i + 4].long()[None][:, :len(data[i + 1:i + 5])],
                                data[i + 1:i + 5].long()[None])[0].sum()) for i in range(0, 22, 4))
    assert abs(fresh - nll) > 1e-6  # the carried state matters, so the check above can tell


def _train(tmp_path: Path, out: str, *extra: str) -> int:
    return load_tool('train_lm').main(['--data-dir', str(tmp_path / 'wt'), '--model', 'grc_txl_tiny',
                                       '--model-kwargs', *TINY_KWARGS, '--batch-size', '4', '--tgt-len', '8',
                                       '--lr', '3e-3', '--min-lr', '3e-3', '--log-interval', '2',
                                       '--eval-interval', '3', '--eval-batch-size', '2', '--threads', '1', '--output',
                                       str(tmp_path / out), *extra])


def test_wikitext_run_reports_and_resumes_exactly(tmp_path):
    _write_wikitext(tmp_path / 'wt')
    assert _train(tmp_path, 'straight', '--max-steps', '6', '--amp') == 0
    result = json.loads((tmp_path / 'straight' / 'result.json').read_text())
    corpus = load_wikitext(tmp_path / 'wt')
    assert result['vocab'] == len(corpus.vocab) and result['steps'] == 6
    assert result['test']['tokens'] == len(corpus.test) - 1 and math.isfinite(result['test']['ppl'])
    assert '| test |' in (tmp_path / 'straight' / 'result.md').read_text()
    ckpt = load_checkpoint(str(tmp_path / 'straight' / 'last.pth.tar'))  # weights_only=True
    assert ckpt['step'] == 6 and ckpt['vocab'] == corpus.vocab.symbols
    # 3 steps, stop, resume to 6: the same weights bit for bit (dropout on: the RNG states come back too; a constant
    # learning rate, since the cosine follows --max-steps)
    assert _train(tmp_path, 'split', '--max-steps', '3', '--amp') == 0
    assert _train(tmp_path, 'split', '--resume', 'auto', '--max-steps', '6') == 0
    resumed = load_checkpoint(str(tmp_path / 'split' / 'last.pth.tar'))
    for k, v in ckpt['model'].items():
        assert torch.equal(resumed['model'][k], v), k
    streams = load_checkpoint(str(tmp_path / 'split' / 'streams-rank0.pth'))
    assert streams['state']['kind'] == 'grc' and streams['step'] == 6
    # resuming at the checkpoint's step only evaluates, with the evaluation settings given: one stream here
    assert _train(tmp_path, 'split', '--resume', 'auto', '--max-steps', '6', '--eval-batch-size', '1') == 0
    again = json.loads((tmp_path / 'split' / 'result.json').read_text())
    assert again['steps'] == 6 and again['eval_batch_size'] == 1 and again['test']['tokens'] == len(corpus.test) - 1
    # the authors' eval.py protocol (2 rows of N // 2 tokens, each predicting its own tokens but the first), and
    # --eval-clamp-len -1 as theirs: no clamp, the model's own (unclamped) result; 1 clamps
    results = {}
    for clamp in ('-1', None, '1'):
        extra = ['--eval-clamp-len', clamp] if clamp else []
        assert _train(tmp_path, 'split', '--resume', 'auto', '--max-steps', '6', '--eval-protocol', 'authors',
                      *extra) == 0
        results[clamp] = json.loads((tmp_path / 'split' / 'result.json').read_text())
    assert results['-1']['eval_protocol'] == 'authors'
    assert results['-1']['test']['tokens'] == 2 * (len(corpus.test) // 2 - 1)
    assert "the authors' eval.py protocol" in (tmp_path / 'split' / 'result.md').read_text()
    assert results['-1']['test']['nll'] == pytest.approx(results[None]['test']['nll'], abs=1e-9)
    assert abs(results['1']['test']['nll'] - results[None]['test']['nll']) > 1e-7  # small: 6 steps from init


def _lrs(caplog) -> list:
    """(step, lr) of the progress lines logged."""
    lines = (re.match(r'step (\d+)(?:/\d+)? \| epoch \d+ \| lr (\S+) ', r.getMessage()) for r in caplog.records)
    return [(int(m[1]), float(m[2])) for m in lines if m]


def test_threads_clock_progress_and_a_spent_budget_on_resume(tmp_path, caplog, capsys):
    _write_wikitext(tmp_path / 'wt')
    caplog.set_level(logging.INFO)
    # --log-interval 1000 alone would print no progress line in 5 steps; the clock (0 s here) prints one per step.
    # The budget is spent by the first step: the time schedule ends there, at 2 % of the lr
    assert _train(tmp_path, 'run', '--time-budget-s', '1e-6', '--max-steps', '5', '--log-interval', '1000',
                  '--log-interval-s', '0', '--threads', '0') == 0
    assert re.search(r'torch threads: \d+ \(auto: ', caplog.text)  # --threads 0: the shared policy, said
    assert [step for step, _ in _lrs(caplog)] == [1]
    caplog.clear()
    # resuming with the budget spent (it is the run's total): an error with the fix, not 0 steps and the old result
    assert _train(tmp_path, 'run', '--resume', 'auto') == 2
    err = capsys.readouterr().err
    assert "--time-budget-s 1e-06 is the run's total training time" in err and '--max-steps 1 to only evaluate' in err
    # following the hint, a larger total: the lr stays at the 2 % the schedule had reached (it used to jump back to
    # the full lr); --lr given on the resume is named as kept, the checkpoint's
    assert _train(tmp_path, 'run', '--resume', 'auto', '--time-budget-s', '1000', '--max-steps', '3', '--lr',
                  '1e-3', '--log-interval', '1') == 0
    assert 'resumed at step 1 (epoch 0' in caplog.text
    assert "resumed with the checkpoint's --lr 0.003 (given: --lr 0.001)" in caplog.text
    assert [step for step, _ in _lrs(caplog)] == [2, 3]
    assert all(lr == pytest.approx(0.02 * 3e-3) for _, lr in _lrs(caplog))
    assert load_checkpoint(str(tmp_path / 'run' / 'last.pth.tar'))['step'] == 3


def test_more_steps_on_resume_continue_the_cosine_down_not_up(tmp_path, caplog):
    """A resume with a larger --max-steps: the cosine over the new total, capped at the lr reached, so the lr never
    rises (it used to stay at the first run's end, --min-lr, for all the new steps)."""
    _write_wikitext(tmp_path / 'wt')
    caplog.set_level(logging.INFO)
    cosine = ['--min-lr', '0', '--log-interval', '1', '--eval-interval', '100']
    assert _train(tmp_path, 'cos', *cosine, '--max-steps', '4') == 0
    assert _train(tmp_path, 'cos', *cosine, '--max-steps', '8', '--resume', 'auto') == 0
    steps, lrs = zip(*_lrs(caplog))
    assert steps == tuple(range(1, 9))
    assert all(b <= a for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0, lrs


def test_a_warmup_longer_than_the_run_and_a_small_corpus_are_warned_with_the_fix(tmp_path, caplog, monkeypatch):
    _write_wikitext(tmp_path / 'wt')
    max_params = lm.SMALL_CORPUS_MAX_PARAMS
    monkeypatch.setattr(lm, 'SMALL_CORPUS_MAX_PARAMS', 1000)  # the tiny model stands for the 151M-parameter default
    with caplog.at_level(logging.WARNING):
        assert _train(tmp_path, 'warm', '--warmup-steps', '5', '--max-steps', '2', '--eval-interval', '100') == 0
    assert ('--warmup-steps 5 is not shorter than the run (2 steps): the lr rises from 0 and never reaches 0.003; '
            'lower --warmup-steps (the run: --max-steps 2)') in caplog.text
    tokens = len(load_wikitext(tmp_path / 'wt').train)
    assert f'{tokens:,} training tokens for a model of' in caplog.text and lm.SMALL_CORPUS_FLAGS in caplog.text
    # the recipe is in docs/sequence.md as a command that parses
    text = (ROOT / 'docs' / 'sequence.md').read_text().replace('\\\n', ' ')
    (line,) = [' '.join(ln.split()) for ln in text.splitlines()
               if ln.startswith('python tools/train_lm.py') and lm.SMALL_CORPUS_FLAGS in ' '.join(ln.split())]
    assert load_tool('train_lm').build_parser().parse_args(shlex.split(line, comments=True)[2:]).model == 'txl_tiny'
    assert (f'under {lm.SMALL_CORPUS_TOKENS // 10 ** 6}M training tokens with a model of over '
            f'{max_params // 10 ** 6}M parameters') in ' '.join(text.split())


def test_bad_input_is_explained_and_the_hint_works(tmp_path, capsys):
    tool = load_tool('train_lm')
    _write_wikitext(tmp_path / 'wt')
    (tmp_path / 'wt' / 'wiki.test.tokens').rename(tmp_path / 'test.txt')
    assert tool.main(['--data-dir', str(tmp_path / 'wt'), '--output', str(tmp_path / 'x')]) == 2
    assert 'lacks wiki.test.tokens' in capsys.readouterr().err
    args = ['--train-file', str(tmp_path / 'wt' / 'wiki.train.tokens'), '--test-file', str(tmp_path / 'test.txt'),
            '--model', 'txl_tiny', '--batch-size', '2', '--tgt-len', '4', '--max-steps', '1', '--eval-batch-size',
            '2', '--output', str(tmp_path / 'y'), '--model-kwargs', *TINY_KWARGS]
    assert tool.main(args + ['cutoffs=[]', '--model', 'txl_tiyn']) == 2
    assert 'did you mean txl_tiny' in capsys.readouterr().err
    assert tool.main(args + ['cutoffs=[100]']) == 2
    assert "--model-kwargs 'cutoffs=[]'" in capsys.readouterr().err
    assert tool.main(args + ['cutoffs=[]']) == 0  # following the hint


def test_two_processes_train_as_one_process(tmp_path):
    _write_wikitext(tmp_path / 'wt')
    common = ['--model-kwargs', *TINY_KWARGS[:-1], 'drop=0.0', '--batch-size', '4', '--tgt-len', '8',
              '--max-steps', '4', '--eval-interval', '100', '--eval-batch-size', '2', '--data-dir',
              str(tmp_path / 'wt'), '--model', 'txl_tiny']
    assert load_tool('train_lm').main(common + ['--output', str(tmp_path / 'one')]) == 0
    proc = torchrun(['--standalone', '--nproc_per_node=2', str(ROOT / 'tools' / 'train_lm.py'), *common,
                     '--output', str(tmp_path / 'two')], tmp_path / 'logs',
                    dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS='1'))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = load_checkpoint(str(tmp_path / 'one' / 'last.pth.tar'))
    two = load_checkpoint(str(tmp_path / 'two' / 'last.pth.tar'))
    for k, v in one['model'].items():
        torch.testing.assert_close(two['model'][k], v, rtol=1e-5, atol=1e-6, msg=k)
    r1 = json.loads((tmp_path / 'one' / 'result.json').read_text())
    r2 = json.loads((tmp_path / 'two' / 'result.json').read_text())
    assert r2['world_size'] == 2 and r2['test']['tokens'] == r1['test']['tokens']
    assert r2['test']['ppl'] == pytest.approx(r1['test']['ppl'], rel=1e-4)
