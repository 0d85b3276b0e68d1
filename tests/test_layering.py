"""The folder layout is the architecture map, and imports run one way down it.

Each room of `pantheon/` has a floor; a module may import its own room and the rooms on lower floors,
never a room on its own floor or above. So the request types and settings know nothing of JAX or
HTTP, the ops nothing of a model, a model nothing of the engine, the engine nothing of the scheduler,
and the web layer sits on top of all of them (and still imports no JAX: tests/test_engine_seam.py).
Function-level imports count too: a lazy import upward is still an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pantheon"

# room -> floor. The foundation (floor 0) is the package's own few modules: what a request is, the
# request contract (every field's bounds), the settings table, the error types, OS threads and locks.
FLOORS: dict[str, int] = {
    "__init__": 0, "types": 0, "contract": 0, "config": 0, "errors": 0, "osthread": 0,
    "ops": 1, "text": 1,          # how a weight is multiplied; how text becomes ids and back
    "formats": 2,                 # checkpoint files -> config + tensors (uses ops' weight type, text's tokenizer)
    "jax_models": 3,              # one architecture per file, pure functions
    "runtime": 4,                 # the engine, its decode state, sampler, memory, sharding
    "scheduler": 5,               # one driver thread per model over the engine's verbs
    "serving": 6,                 # registry, dies, metrics, registration, the multi-host cluster
    "web": 7,                     # the HTTP server
    "bench": 8,                   # in-process and served benchmarks
    "cli": 9,                     # the `pantheon` command: the one entry point above everything
}
MAX_TOP_LEVEL_MODULES = 10


def room_of(module: str) -> str:
    """'pantheon.runtime.engine' -> 'runtime'; 'pantheon' -> '__init__'; 'pantheon.__version__' -> '__init__'."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1] if parts[1] in FLOORS else "__init__"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every pantheon import in `source`, at any depth of the code.

    Relative imports are refused outright: with rooms, an absolute name says where a thing lives."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, "." * node.level + (node.module or "")))
            elif node.module and node.module.split(".")[0] == "pantheon":
                # `from pantheon import ops` names the room ops; `from pantheon.ops import x` the room too
                base = node.module
                found.extend((node.lineno, f"{base}.{a.name}" if base == "pantheon" else base) for a in node.names)
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "pantheon")
    return found


def violations(module: str, source: str) -> list[str]:
    """Every import in `source` (the code of `module`) that goes up or sideways, or is relative."""
    own = room_of(module)
    out = []
    for line, target in imported_modules(source):
        if target.startswith("."):
            out.append(f"{module}:{line} relative import {target!r}")
            continue
        room = room_of(target)
        if room == own and own != "__init__":
            continue
        if FLOORS[room] >= FLOORS[own] and not (FLOORS[own] == 0 and FLOORS[room] == 0):
            out.append(f"{module}:{line} imports {target} ({room}, floor {FLOORS[room]}) "
                       f"from {own} (floor {FLOORS[own]})")
    return out


def package_modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def test_every_room_has_a_floor():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PACKAGE.glob("*.py")}
    assert rooms <= set(FLOORS), f"rooms without a floor: {sorted(rooms - set(FLOORS))}"


def test_imports_run_one_way_down_the_floors():
    found = [v for mod, path in package_modules().items() for v in violations(mod, path.read_text())]
    assert not found, "imports against the floors:\n" + "\n".join(found)


def test_the_check_catches_an_upward_import():
    """The floors are enforced, not just listed: an engine that reached up into the web layer, a
    model that imported the engine lazily, and a relative import are each reported."""
    assert violations("pantheon.runtime.engine", "from pantheon.web import routes\n") == [
        "pantheon.runtime.engine:1 imports pantheon.web (web, floor 7) from runtime (floor 4)"]
    lazy = "def f():\n    from pantheon.runtime.engine import load\n"
    assert violations("pantheon.jax_models.llama", lazy) == [
        "pantheon.jax_models.llama:2 imports pantheon.runtime.engine (runtime, floor 4) from jax_models (floor 3)"]
    assert violations("pantheon.ops.weights", "from pantheon import text\n") == [
        "pantheon.ops.weights:1 imports pantheon.text (text, floor 1) from ops (floor 1)"]
    assert violations("pantheon.text.emitter", "from .tool_format import x\n") == [
        "pantheon.text.emitter:1 relative import '.tool_format'"]
    assert violations("pantheon.web.chat", "from pantheon.runtime import memory\nfrom pantheon import types\n") == []


def test_few_modules_live_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
