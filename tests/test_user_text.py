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
