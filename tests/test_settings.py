"""Settings are one declared table (pantheon.config.SETTINGS), parsed in one module, documented once.

What this file holds the code to:
* every `Settings` field is filled by exactly one row, every row's name is `PANTHEON_*` and its
  aliases are the design's `QWEN35_*` / `BS_*` names;
* an alias means what its `PANTHEON_*` name means, and the `PANTHEON_*` name wins when both are set;
* the rules every row shares (empty is unset, flags, floors, errors naming the variable as set);
* docs/settings.md's table is the table generated from the rows;
* every `PANTHEON_*` / `QWEN35_*` / `BS_*` name the code mentions is declared, and only config.py
  reads one from the environment.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from pantheon.config import (SETTINGS, TABLE_BEGIN, TABLE_END, Settings, load_settings, setting,
                             settings_table_markdown)

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
NAME = re.compile(r"\b(?:PANTHEON|QWEN35|BS)_[A-Z0-9][A-Z0-9_]*\b")
DECLARED = {n for row in SETTINGS for n in (row.name, *row.aliases)}


def _code_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if p.resolve() != THIS)


# ---- the table's shape -------------------------------------------------------------------------------

def test_every_settings_field_is_filled_by_exactly_one_row():
    row_fields = [row.field for row in SETTINGS]
    assert len(row_fields) == len(set(row_fields)), "two rows fill one field"
    assert set(row_fields) == {f for f in Settings.__dataclass_fields__}


def test_every_name_is_pantheon_and_every_alias_is_the_designs():
    names = [n for row in SETTINGS for n in (row.name, *row.aliases)]
    assert len(names) == len(set(names)), "a name is declared twice"
    for row in SETTINGS:
        assert row.name.startswith("PANTHEON_"), row.name
        assert all(a.startswith(("QWEN35_", "BS_")) for a in row.aliases), row.aliases
        assert row.doc and "\n" not in row.doc, f"{row.name}: the doc is one line of the table"


def test_an_empty_environment_gives_the_dataclass_defaults():
    """The rows' defaults are the dataclass's (tests build Settings directly), home aside."""
    assert load_settings({}) == Settings(home=Path.home() / ".cache" / "pantheon")


def test_the_seeds_names_have_pantheon_names():
    assert {a: setting(a).name for row in SETTINGS for a in row.aliases} == {
        "QWEN35_MAX_SEQ": "PANTHEON_MAX_SEQ",
        "QWEN35_BATCH_SLOTS": "PANTHEON_BATCH_SLOTS",
        "QWEN35_BS_PREFILL_CHUNK": "PANTHEON_PREFILL_CHUNK",
        "BS_QUEUE_DEPTH": "PANTHEON_QUEUE_DEPTH",
        "QWEN35_BS_STATS": "PANTHEON_STEP_STATS",
    }


# ---- aliases -----------------------------------------------------------------------------------------

ALIASED = [  # (alias, its value, the PANTHEON_* name's value, field, what each gives)
    ("QWEN35_MAX_SEQ", "64", "96", "max_seq", 64, 96),
    ("QWEN35_BATCH_SLOTS", "2", "4", "batch_slots", 2, 4),
    ("QWEN35_BS_PREFILL_CHUNK", "16", "32", "prefill_chunk", 16, 32),
    ("BS_QUEUE_DEPTH", "5", "7", "queue_depth", 5, 7),
    ("QWEN35_BS_STATS", "1", "0", "bs_stats", True, False),
]


@pytest.mark.parametrize("alias, alias_raw, name_raw, field, from_alias, from_name", ALIASED)
def test_an_alias_works_and_the_pantheon_name_wins(alias, alias_raw, name_raw, field, from_alias, from_name):
    name = setting(alias).name
    assert getattr(load_settings({alias: alias_raw}), field) == from_alias
    assert getattr(load_settings({name: name_raw}), field) == from_name
    assert getattr(load_settings({alias: alias_raw, name: name_raw}), field) == from_name
    assert getattr(load_settings({alias: alias_raw, name: ""}), field) == from_alias  # empty is unset


def test_load_settings_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("QWEN35_MAX_SEQ", "77")
    monkeypatch.delenv("PANTHEON_MAX_SEQ", raising=False)
    assert load_settings().max_seq == 77
    monkeypatch.setenv("PANTHEON_MAX_SEQ", "78")
    assert load_settings().max_seq == 78


def test_a_malformed_value_is_reported_under_the_name_it_was_set_as():
    with pytest.raises(ValueError, match=r"QWEN35_MAX_SEQ='lots' is not an integer"):
        load_settings({"QWEN35_MAX_SEQ": "lots"})
    with pytest.raises(ValueError, match=r"PANTHEON_QUEUE_WAIT_S='soon' is not a number"):
        load_settings({"PANTHEON_QUEUE_WAIT_S": "soon"})


@pytest.mark.parametrize("name", ["QWEN35_BATCH_SLOTS", "PANTHEON_BATCH_SLOTS"])
def test_batch_slots_keeps_the_seeds_meaning_under_both_names(name):
    """The seed's QWEN35_BATCH_SLOTS=1 switched batching on (8 slots); 0 is the single-user setting."""
    assert load_settings({name: "1"}).batch_slots == 8
    assert load_settings({name: "0"}).batch_slots == 0
    assert load_settings({name: "-3"}).batch_slots == 0
    assert load_settings({name: "3"}).batch_slots == 3


# ---- the rules every row shares ----------------------------------------------------------------------

PARSED = [  # (environment, field, value)
    ({"PANTHEON_HOME": "~/ph"}, "home", Path.home() / "ph"),
    ({"PANTHEON_HOME": ""}, "home", Path.home() / ".cache" / "pantheon"),
    ({"PANTHEON_MODELS": "a@0,1,b;c"}, "models", ("a@0,1", "b", "c")),
    ({"PANTHEON_CORS_ORIGINS": " http://a , ,http://b"}, "cors_origins", ("http://a", "http://b")),
    ({"PANTHEON_API_KEY": ""}, "api_key", None),
    ({"PANTHEON_API_KEY": " k "}, "api_key", " k "),  # a key is taken as written
    ({"PANTHEON_MAX_BODY_BYTES": " "}, "max_body_bytes", 4 * 1024 * 1024),  # blank number: the default
    ({"PANTHEON_HEADER_TIMEOUT_S": "0"}, "header_timeout_s", 0.1),  # floors raise, never refuse
    ({"PANTHEON_MAX_CONNECTIONS": "2"}, "max_connections", 8),
    ({"PANTHEON_PREFILL_CHUNK": "0"}, "prefill_chunk", 1),
    ({"PANTHEON_REGISTRY_INTERVAL_S": "0"}, "registry_interval_s", 0.2),
    ({"PANTHEON_CLUSTER_TIMEOUT_S": "0"}, "cluster_timeout_s", 1.0),
    ({"PANTHEON_NUM_PROCESSES": "0"}, "num_processes", 1),
    ({"PANTHEON_FORBID_COMPILE": "yes"}, "forbid_compile", True),
    ({"PANTHEON_WARMUP": "Off"}, "warmup", False),
    ({"PANTHEON_WARMUP": ""}, "warmup", True),
    ({"PANTHEON_KV_DTYPE": " BF16 "}, "kv_dtype", "bfloat16"),
    ({"PANTHEON_DTYPE": ""}, "dtype", "auto"),
    ({"PANTHEON_NODE_ID": "  "}, "node_id", "node0"),
    ({"PANTHEON_COORDINATOR": " h:1 "}, "coordinator", "h:1"),
    ({"PANTHEON_REGISTRY_URL": "http://r:1/"}, "registry_url", "http://r:1"),
    ({"PANTHEON_TEST_PRESSURE": "2"}, "test_pressure", 2),
    ({"PANTHEON_FIXTURES": "/f"}, "fixtures", Path("/f")),
]


@pytest.mark.parametrize("env, field, value", PARSED)
def test_each_variable_parses_as_documented(env, field, value):
    assert getattr(load_settings(env), field) == value


@pytest.mark.parametrize("env, complaint", [
    ({"PANTHEON_KV_DTYPE": "int8"}, "must be auto, float32, float16 or bfloat16"),
    ({"PANTHEON_TEST_PRESSURE": "4"}, "must be 0..3"),
    ({"PANTHEON_ADVERTISE_URL": "10.0.0.2:8000"}, "must be an http:// or https:// URL"),
])
def test_a_value_outside_its_choices_is_refused(env, complaint):
    ((name, raw),) = env.items()
    with pytest.raises(ValueError, match=re.escape(f"environment variable {name}={raw!r} {complaint}")):
        load_settings(env)


# ---- the documentation -------------------------------------------------------------------------------

def test_the_docs_table_is_the_declared_table():
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page.count(TABLE_BEGIN) == 1 and page.count(TABLE_END) == 1
    table = page.split(TABLE_BEGIN + "\n", 1)[1].split(TABLE_END, 1)[0]
    assert table == settings_table_markdown(), "docs/settings.md is stale: run python tools/settings_doc.py"


def test_every_row_is_one_line_of_the_docs_table():
    lines = settings_table_markdown().splitlines()[2:]
    assert [line.split(" | ")[0] for line in lines] == [f"| `{row.name}`" for row in SETTINGS]
    aliased = next(line for line in lines if line.startswith("| `PANTHEON_QUEUE_DEPTH`"))
    assert aliased.startswith("| `PANTHEON_QUEUE_DEPTH` | `BS_QUEUE_DEPTH` | 32 | ")
    assert "*tests only:*" in next(line for line in lines if "`PANTHEON_TEST_PRESSURE`" in line)


def test_the_doc_tool_rewrites_only_the_table():
    spec = importlib.util.spec_from_file_location("settings_doc", ROOT / "tools" / "settings_doc.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    stale = f"intro\n{TABLE_BEGIN}\n| old |\n{TABLE_END}\noutro\n"
    assert tool.with_current_table(stale) == f"intro\n{TABLE_BEGIN}\n{settings_table_markdown()}{TABLE_END}\noutro\n"


# ---- the code ----------------------------------------------------------------------------------------

def test_every_variable_the_code_names_is_declared():
    """A name in pantheon/, tools/ or tests/ that is not a row is a setting nobody documented (or a typo)."""
    undeclared = {}
    for path in _code_files("pantheon", "tools", "tests"):
        for name in set(NAME.findall(path.read_text())) - DECLARED:
            undeclared.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"not in pantheon.config.SETTINGS: {undeclared}"


# Reads of a declared name that are allowed outside config.py, and why.
OUTSIDE_CONFIG = {("tools/make_random_qwen35moe.py", "PANTHEON_FIXTURES")}  # runs stand-alone, without pantheon
# Modules of pantheon/ that touch os.environ without reading a setting: they hand it to a child process.
HANDS_ON_ENVIRON = {"pantheon/config.py", "pantheon/web/launch.py", "pantheon/osthread.py"}


def _environment_reads(tree: ast.AST) -> set[str]:
    """Declared-looking names read by `x.get(NAME)`, `os.getenv(NAME)`, `x[NAME]`, `NAME in x`, `x.pop(NAME)`."""
    found: set[str] = set()

    def named(node: Any) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            return node.value
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "getenv", "pop", "setdefault") and named(node.args[0]):
                found.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and named(node.slice):
            found.add(node.slice.value)
        elif isinstance(node, ast.Compare) and named(node.left) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and any(
                "env" in ast.unparse(c).lower() for c in node.comparators):
            found.add(node.left.value)  # `NAME in env` (not `NAME in message`: a test naming a setting)
    return found


def test_only_config_reads_a_setting_from_the_environment():
    reads = set()
    for path in _code_files("pantheon", "tools", "tests"):
        rel = str(path.relative_to(ROOT))
        if rel != "pantheon/config.py":
            reads |= {(rel, name) for name in _environment_reads(ast.parse(path.read_text()))}
    assert reads <= OUTSIDE_CONFIG, f"read outside pantheon.config: {sorted(reads - OUTSIDE_CONFIG)}"


def test_pantheon_touches_os_environ_only_to_hand_it_on():
    touching = {str(p.relative_to(ROOT)) for p in _code_files("pantheon")
                if re.search(r"\bos\.(environ|getenv)\b", p.read_text())}
    assert touching <= HANDS_ON_ENVIRON, sorted(touching - HANDS_ON_ENVIRON)


# ---- `pantheon serve` reads PANTHEON_MODELS through the settings ------------------------------------------

def _serve(monkeypatch, env: dict[str, str]) -> tuple[int, dict[str, str] | None]:
    from pantheon.web import launch
    for name in DECLARED:
        monkeypatch.delenv(name, raising=False)
    for name, raw in env.items():
        monkeypatch.setenv(name, raw)
    monkeypatch.setattr("pantheon.formats.catalog.resolve_model", lambda source: Path(source))
    execs: list[dict[str, str]] = []
    monkeypatch.setattr(launch.os, "execve", lambda exe, argv, child_env: execs.append(dict(child_env)))
    args = argparse.Namespace(model=None, host="127.0.0.1", port=8000, timeout=0)
    rc = launch.serve(args)
    return rc, (execs[0] if execs else None)


def test_serve_without_model_flags_serves_pantheon_models(monkeypatch):
    rc, child = _serve(monkeypatch, {"PANTHEON_MODELS": "a=/m/a.gguf;b=/m/b.gguf"})
    assert rc == 0 and child is not None
    assert child["PANTHEON_MODELS"] == "a=/m/a.gguf;b=/m/b.gguf"


def test_serve_stops_on_a_malformed_setting(monkeypatch, capsys):
    rc, child = _serve(monkeypatch, {"PANTHEON_MODELS": "a=/m/a.gguf", "BS_QUEUE_DEPTH": "many"})
    assert (rc, child) == (2, None)
    assert "BS_QUEUE_DEPTH='many' is not an integer" in capsys.readouterr().err


def test_config_imports_nothing_of_pantheons():
    """conftest and the tools read settings first thing; config.py must stay that cheap to import."""
    tree = ast.parse((ROOT / "pantheon" / "config.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] == "pantheon"}


def test_a_test_servers_own_setting_replaces_the_base_one_under_any_name():
    """server_util's BASE_ENV sets PANTHEON_MAX_SEQ; a test asking for QWEN35_MAX_SEQ must still get it."""
    from server_util import Server
    asked, base = Server(["tiny"], env={"QWEN35_MAX_SEQ": "512"}), Server(["tiny"])
    for srv in (asked, base):
        srv.log_path.unlink()  # never started: only its environment is looked at
    assert (load_settings(asked.env).max_seq, load_settings(base.env).max_seq) == (512, 128)
