"""Text a user reads is true for a user: it cites only files the user can open (the papers, the authors' public
repositories, files of this repository), never the project's internal notes."""
import re
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]

# the project's internal notes, which no user has: `specs/<name>.md`, anything under ../shared, "the sequence spec"
INTERNAL = re.compile(r'specs/\w+\.md|\.\./shared|shared/(?:specs|golden)\b|sequence spec', flags=re.I)


def _user_text() -> Iterator[Path]:
    """README, docs, model cards and the library's and tools' sources (docstrings, messages, help)."""
    yield ROOT / 'README.md'
    for folder, pattern in (('docs', '*.md'), ('model_cards', '*.md'), ('lsvision', '*.py'), ('tools', '*.py')):
        yield from sorted((ROOT / folder).rglob(pattern))


def _internal_citations(text: str) -> List[Tuple[int, str]]:
    return [(text.count('\n', 0, m.start()) + 1, m.group()) for m in INTERNAL.finditer(text)]


def test_the_pattern_finds_each_internal_form():
    found = _internal_citations('see specs/long_short.md §2\n(../shared/golden/x.json) and the Sequence spec §4')
    assert found == [(1, 'specs/long_short.md'), (2, '../shared'), (2, 'Sequence spec')]
    assert _internal_citations('Transformer-LS paper (arXiv:2107.02192), §4.3, Table 5; tests/golden/keys.json') == []


def test_no_user_text_cites_an_internal_file():
    files = list(_user_text())
    assert len(files) > 100  # the folders above are where they should be
    offenders = {str(path.relative_to(ROOT)): found for path in files
                 if (found := _internal_citations(path.read_text(encoding='utf-8')))}
    assert not offenders, ("cite the paper (section, table) or the authors' public repository file instead of the "
                           f"project's internal notes: {offenders}")


def _python_blocks(path: Path, marker: str) -> List[str]:
    return [b for b in re.findall(r'```python\n(.*?)```', path.read_text(), flags=re.S) if marker in b]


def test_docs_sequence_char_lm_block_is_the_one_test_loading_lines_runs():
    """docs/sequence.md's char-LM loading block is README's, which tests/test_loading_lines.py runs on a fairseq
    checkpoint in the authors' layout."""
    readme = _python_blocks(ROOT / 'README.md', 'load_official_checkpoint(model, ')
    docs = _python_blocks(ROOT / 'docs' / 'sequence.md', "load_official_checkpoint(model, 'checkpoint_best.pt')")
    assert len(readme) == 1 and docs == readme


def test_docs_sequence_lra_block_loads_what_the_authors_lra_script_saves(tmp_path, monkeypatch):
    """The LRA block, run as written where the authors' run_tasks.py saved its best model with its defaults."""
    import torch
    from _helpers import perturb
    from test_sequence_convert import _official_lra  # {'model_state_dict': the DataParallel model's official keys}

    import lsvision.sequence as seq
    (code,) = _python_blocks(ROOT / 'docs' / 'sequence.md', 'LRA_chks/')
    file = re.search(r"load_official_checkpoint\(model, '([^']+)'\)", code).group(1)
    torch.manual_seed(0)
    source = perturb(seq.create_model('ls_lra_listops')).eval()
    (tmp_path / file).parent.mkdir(parents=True)
    torch.save(_official_lra(source), tmp_path / file)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(code, namespace)  # the block as documented
    ids = torch.randint(1, 15, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(namespace['model'].eval()(ids), source(ids), rtol=0, atol=0)
