"""The README's opening: what lsvision is, the two commands of a fresh machine, then the install into an environment of
one's own; the commands are parsed from the README and checked against the Makefile, or run (pip, as a dry run)."""
import re
import subprocess
import sys
from pathlib import Path

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
