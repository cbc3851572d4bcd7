"""The golden data ships with the repository, byte for byte as generated (tests/golden/SHA256SUMS)."""
import hashlib

import pytest
from conftest import GOLDEN_ROOT, golden_path


def _listed_sums() -> dict:
    lines = golden_path('SHA256SUMS').read_text().splitlines()
    return {name: digest for digest, name in (line.split(maxsplit=1) for line in lines if line.strip())}


def test_every_golden_file_is_present_and_unchanged():
    sums = _listed_sums()
    assert {'vil_ls_official/tiny224.pth', 'char_lm_official/keys.json'} <= set(sums)
    for name, digest in sums.items():
        assert hashlib.sha256(golden_path(name).read_bytes()).hexdigest() == digest, (
            f'{name} differs from the file in SHA256SUMS (a git-lfs pointer or an edit?); '
            'regenerate it as its README says and update SHA256SUMS')


def test_every_golden_file_is_listed():
    on_disk = {p.relative_to(GOLDEN_ROOT).as_posix() for p in GOLDEN_ROOT.glob('*/*') if p.is_file()}
    assert on_disk == set(_listed_sums())


def test_missing_golden_data_fails_the_test_instead_of_skipping_it():
    with pytest.raises(pytest.fail.Exception, match='golden data missing at .*no_such_folder'):
        golden_path('no_such_folder')
