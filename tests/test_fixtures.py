"""The oracle fixtures in tests/fixtures are the ones the project was given, byte for byte.

Their digests are in tests/fixtures/SHA256SUMS; a file that changed, went missing or appeared without an
entry fails here before any parity test can pass or fail for the wrong reason.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from conftest import FIXTURES

MANIFEST = Path(__file__).resolve().parent / "fixtures" / "SHA256SUMS"


def test_every_fixture_file_matches_its_recorded_digest():
    want = dict(reversed(line.split(None, 1)) for line in MANIFEST.read_text().splitlines() if line.strip())
    have = {str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*") if p.is_file() and p.name != "SHA256SUMS"}
    # the manifest lists exactly the files present (PROVENANCE.md is this copy's own note, not a fixture)
    assert have - {"PROVENANCE.md"} == set(want), sorted(have ^ set(want))
    for rel, digest in want.items():
        assert hashlib.sha256((FIXTURES / rel).read_bytes()).hexdigest() == digest, rel
