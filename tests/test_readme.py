"""The README's opening: what lsvision is, the two commands of a fresh machine, then the install into an environment of
one's own; the commands are parsed from the README and checked against the Makefile, or run (pip, as a dry run)."""
import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

from _helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / 'README.md').read_text()


def _opening() -> str:
    """Everything before the first second-level heading."""
    return README.split('\n## ', 1)[0]


def _code_blocks(text: str, lang: str):
    return re.findall(rf'```{lang}\n(.*?)```', text, flags=re.S)


def test_readme_opens_with_what_lsvision_is_then_the_two_commands_then_pip():
    opening = _opening()
    first_block = opening.index('```')
    assert 'lsvision is a zoo of vision backbones' in opening[:first_block], 'say what lsvision is before any command'
    bash = _code_blocks(opening, 'bash')
    assert len(bash) >= 2, 'the opening needs the two make commands, then the pip install line'
    commands = [line.split('#')[0].split() for line in bash[0].splitlines() if line.strip()]
    assert commands == [['make', 'demo'], ['make', 'test']]
    makefile = (ROOT / 'Makefile').read_text()
    for _, target in commands:
        assert re.search(rf'^{target}:', makefile, flags=re.M), f'Makefile has no {target} target'
    assert bash[1].strip() == 'pip install -c constraints.txt -e .'


def test_readme_pip_line_resolves_with_the_pins():
    """The documented install, as a dry run in this environment (pip reaches the package index, as CI does)."""
    line = _code_blocks(_opening(), 'bash')[1].strip()
    args = line.split()[1:] + ['--dry-run', '--quiet']
    result = subprocess.run([sys.executable, '-m', 'pip', *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_readme_names_no_path_outside_the_checkout():
    assert '../shared' not in README
    for card in (ROOT / 'model_cards').glob('*.md'):
        assert '../shared' not in card.read_text(), card.name


# The README is a front door: short, about the project as it is (no history), every link and snippet working.

MAX_LINES = 300
ISSUE_NUMBER = re.compile(r'\bissues?\s*#?\d+|(?<![\w&/#])#\d+\b', flags=re.I)
HEX_WORD = re.compile(r'\b[0-9a-f]{7,40}\b')
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
# python blocks that another test runs as written (on files it writes, or on a tiny model): the marker each starts
# with or holds, and that test
RUN_ELSEWHERE = {
    'load_official_checkpoint(model, ': ('test_loading_lines.py',
                                         'test_readme_char_lm_block_loads_a_fairseq_checkpoint'),
    '# ONNX export': ('test_onnx_export.py', 'test_readme_export_line_runs'),
}


def _python_blocks():
    """(block, the test that runs it elsewhere or None) for every ```python block of the README."""
    blocks = []
    for block in _code_blocks(README, 'python'):
        elsewhere = [test for marker, test in RUN_ELSEWHERE.items() if marker in block]
        blocks.append((block, elsewhere[0] if elsewhere else None))
    return blocks


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def test_readme_is_at_most_300_lines():
    lines = len(README.splitlines())
    assert lines <= MAX_LINES, f'README.md has {lines} lines; move details to docs/ (at most {MAX_LINES})'


def test_readme_has_no_history():
    """No issue numbers, commit hashes or machine load: those belong to docs/ (the benchmark pages carry them)."""
    issues = ISSUE_NUMBER.findall(README)
    assert not issues, f'issue numbers in README.md: {issues}'
    hashes = [w for w in HEX_WORD.findall(README) if re.search(r'\d', w) and re.search(r'[a-f]', w)]
    assert not hashes, f'commit hashes in README.md: {hashes}'
    assert 'load average' not in README.lower()


def test_readme_relative_links_point_at_files():
    anchors = {_slug(h) for h in re.findall(r'^#+ (.+)$', README, flags=re.M)}
    links = LINK.findall(README)
    assert any(link.startswith('docs/') for link in links), 'the README links to no docs/ page'
    broken = []
    for link in links:
        if re.match(r'[a-z]+:', link):  # https:, mailto:
            continue
        path, _, anchor = link.partition('#')
        if not path:
            if anchor not in anchors:
                broken.append(link)
        elif not (ROOT / path).exists():
            broken.append(link)
    assert not broken, f'README.md links to what does not exist: {broken}'


def test_readme_python_blocks_run_elsewhere_exist():
    for block, elsewhere in _python_blocks():
        if elsewhere:
            file, name = elsewhere
            assert f'def {name}(' in (ROOT / 'tests' / file).read_text(), f'{file} lost {name}, which runs:\n{block}'


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    """Every python block, as written, in an empty folder: all but the blocks another test runs (RUN_ELSEWHERE) and
    the `pretrained=True` lines (tests/test_loading_lines.py runs each of those against filled caches)."""
    blocks = _python_blocks()
    assert blocks, 'README.md has no python block'
    run = 0
    monkeypatch.chdir(tmp_path)
    for block, elsewhere in blocks:
        if elsewhere:
            continue
        code = '\n'.join(line for line in block.splitlines() if 'pretrained=True' not in line)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, 'README.md', 'exec'), {'__name__': '__readme__'})
        run += 1
    assert run, 'no README python block ran'


def test_make_install_gives_uv_where_this_machines_pip_looks():
    """tools/uv_install_args.py turns `pip config list` into uv flags: the install section or a PIP_ variable wins
    over global (as in pip), list values become one flag each; and on this machine its output is what uv accepts."""
    uv_install_args = load_tool('uv_install_args')
    listed = ("global.extra-index-url='file:///a/simple file:///b/simple'\n"
              "global.find-links='/global/wheels'\n"
              ":env:.find-links='/env/wheels'\n"
              "install.constraint='/etc/pins.txt'\n"
              "global.cert='/etc/ssl/certs/ca.crt'\n")
    assert uv_install_args.uv_args(uv_install_args.pip_options(listed)) == [
        '--index-strategy', 'unsafe-best-match',
        '--extra-index-url', 'file:///a/simple', '--extra-index-url', 'file:///b/simple',
        '--find-links', '/env/wheels', '--constraint', '/etc/pins.txt']
    assert uv_install_args.uv_args(uv_install_args.pip_options('')) == ['--index-strategy', 'unsafe-best-match']
    printed = subprocess.run([sys.executable, str(ROOT / 'tools' / 'uv_install_args.py')], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    uv = Path(sys.executable).with_name('uv')
    if uv.exists():  # the Makefile's venv: uv resolves the pins with these flags (no install)
        check = subprocess.run([str(uv), 'pip', 'install', '--dry-run', '-q', '--python', sys.executable,
                                *shlex.split(printed), '-c', 'constraints.txt', 'timm'],
                               cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert check.returncode == 0, check.stderr[-2000:]
