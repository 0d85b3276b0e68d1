"""One request contract (issue 35, scope 2): every numeric bound of a request field is a row of
pantheon.contract, and the published document, the validators and SamplingParams are generated from it.

* For every route's table, the JSON Schema made from each row is the one GET /openapi.json publishes,
  and the route's numeric properties are exactly the table's (no bound reaches the document another way).
* For every row, the values at and just past its edges are taken or refused by the route's validator as
  the row says (`Bound.holds`), a refusal being a 400 naming the field; SamplingParams likewise for the
  sampling knobs.
* No numeric bound is written a second time: pantheon/web/, the request types and the grammar module
  compare no request value against a literal that is one of the contract's bounds or sizes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pantheon import contract
from pantheon.contract import Bound
from pantheon.types import SamplingParams
from pantheon.web import schema
from test_openapi import BODY_ROUTES, _post, _refused_naming, _with, app, admin_app, no_downloads  # noqa: F401

PACKAGE = Path(__file__).resolve().parents[1] / "pantheon"

# The request component of each contract table, and its route in test_openapi's table of bodies.
ROUTE_OF = {"ChatCompletionRequest": "chat", "CompletionRequest": "completions", "ResponseRequest": "responses",
            "MessagesRequest": "messages", "EmbeddingRequest": "embeddings", "UnloadRequest": "unload",
            "LoadRequest": "load"}
BOUND_KEYS = ("type", "minimum", "exclusiveMinimum", "maximum", "examples")


def _unwrap(prop: dict) -> dict:
    """A property without its `null` alternative (an optional field may be null: absent)."""
    if "anyOf" in prop:
        rest = [p for p in prop["anyOf"] if p != {"type": "null"}]
        if len(rest) == 1:
            return _unwrap(rest[0])
    t = prop.get("type")
    if isinstance(t, list) and "null" in t and len(t) == 2:
        return {**prop, "type": next(x for x in t if x != "null")}
    return prop


def _numeric(props: dict) -> set[str]:
    return {k for k, p in props.items() if _unwrap(p).get("type") in ("integer", "number")}


def _bound_part(prop: dict) -> dict:
    return {k: prop[k] for k in BOUND_KEYS if k in prop}


def _probes(b: Bound) -> list[tuple[float, bool]]:
    """(value, the row takes it) at and just past each edge of `b`, and its example."""
    step = 1 if b.kind == "integer" else 1e-6
    out = [(b.example, True)]
    if b.lo is not None:
        out += [(b.lo, False), (b.lo + step, True)] if b.lo_open else [(b.lo, True), (b.lo - step, False)]
    if b.hi is not None:
        out += [(b.hi, True), (b.hi + step, False)]
    assert all(b.holds(v) == ok for v, ok in out), f"{b}: the probes misjudge the row"
    return out


def test_every_table_names_a_published_request_and_every_route_is_probed():
    assert set(contract.ROUTES) == set(ROUTE_OF)
    for component in contract.ROUTES:
        assert component in schema.COMPONENTS
        assert BODY_ROUTES[ROUTE_OF[component]].schema is schema.COMPONENTS[component]


def test_openapi_json_publishes_each_bound_as_the_table_generates_it(app):
    doc = app.test_client().get("/openapi.json").get_json()
    published = doc["components"]["schemas"]
    for component, table in contract.ROUTES.items():
        props = published[component]["properties"]
        assert _numeric(props) == set(table), f"{component}: a numeric field outside its table, or one missing"
        for name, b in table.items():
            assert _bound_part(_unwrap(props[name])) == _bound_part(schema.bound(b)), f"{component}.{name}"
    for component, s in published.items():  # the other request bodies have no numeric field of their own
        if component.endswith("Request") and component not in contract.ROUTES:
            assert not _numeric(s.get("properties", {})), component
    # the numbers nested in objects: a thinking budget, each logit_bias value
    thinking = _unwrap(published["MessagesRequest"]["properties"]["thinking"])
    assert _bound_part(thinking["properties"]["budget_tokens"]) == \
        _bound_part(schema.bound(contract.THINKING["budget_tokens"]))
    for component in ("ChatCompletionRequest", "CompletionRequest"):
        bias = _unwrap(published[component]["properties"]["logit_bias"])
        assert _bound_part(bias["additionalProperties"]) == _bound_part(schema.bound(contract.LOGIT_BIAS_VALUE))
        assert bias["maxProperties"] == contract.MAX_LOGIT_BIAS


CASES = [pytest.param(component, name, id=f"{component}.{name}")
         for component, table in contract.ROUTES.items() for name in table]


@pytest.mark.parametrize("component, name", CASES)
def test_each_validator_takes_exactly_what_its_row_holds(app, admin_app, component, name):
    route = BODY_ROUTES[ROUTE_OF[component]]
    target = admin_app if route.admin else app
    for value, ok in _probes(contract.ROUTES[component][name]):
        status, raw, ctype = _post(target, route, _with(route, name, value))
        if ok:
            assert status in route.at_edge.get(name, {route.ok}), f"{name}={value}: {status} {raw[:300]!r}"
        else:
            _refused_naming(route, name, status, raw, ctype)


def test_the_thinking_budget_and_a_logit_bias_follow_their_rows(app):
    messages, chat = BODY_ROUTES["messages"], BODY_ROUTES["chat"]
    cases = [(messages, "thinking", {"type": "enabled", "budget_tokens": v}, ok)
             for v, ok in _probes(contract.THINKING["budget_tokens"])]
    cases += [(chat, "logit_bias", {"5": v}, ok) for v, ok in _probes(contract.LOGIT_BIAS_VALUE)]
    for route, name, value, ok in cases:
        status, raw, ctype = _post(app, route, _with(route, name, value))
        if ok:
            assert status == 200, f"{name}={value}: {status} {raw[:300]!r}"
        else:
            _refused_naming(route, name, status, raw, ctype)


@pytest.mark.parametrize("name", [k for k in contract.SAMPLING if k != "seed"])
def test_sampling_params_checks_the_same_rows(name):
    for value, ok in _probes(contract.SAMPLING[name]):
        if ok:
            SamplingParams(**{name: value})
        else:
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: value})


def test_sampling_params_takes_its_defaults_from_the_table():
    p = SamplingParams()
    for name, b in contract.SAMPLING.items():
        assert getattr(p, name) == b.default, name
    # top_k's other "off" (-1, what the SMG router sends) is stored as the neutral 0
    assert SamplingParams(top_k=-1).top_k == 0
    # the seed is any integer taken mod 2**64 (choice_seed derives unsigned ones); the wire's int64 range is
    # the routes' alone
    assert SamplingParams(seed=contract.SEED_MAX + 1).resolved_seed() == contract.SEED_MAX + 1


# ---- no bound written twice ------------------------------------------------------------------------------
SCANNED = sorted([*PACKAGE.joinpath("web").glob("*.py"), PACKAGE / "types.py", PACKAGE / "text" / "structured.py"])
VALIDATORS = {"bounded", "number", "integer", "string", "stop_list", "top_logprobs", "choices_n"}


def contract_values() -> set[tuple[type, float]]:
    """Every bound and size the contract states, either sign, but 0 and 1 (every count and index compares with
    those), with its type: a float bound (temperature's 2.0) is written as a float, a count as an int."""
    rows = [b for table in (*contract.ROUTES.values(), contract.THINKING) for b in table.values()]
    rows.append(contract.LOGIT_BIAS_VALUE)
    values = {v for b in rows for v in (b.lo, b.hi) if v is not None}
    values |= {v for k, v in vars(contract).items() if k.isupper() and isinstance(v, int) and not isinstance(v, bool)}
    return {(type(v), s * v) for v in values for s in (1, -1) if v not in (0, 1, -1)}


def _literal(node: ast.AST) -> float | None:
    """The number `node` writes (a constant, a negated one, or a constant shift such as 1 << 31)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _literal(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.LShift, ast.Sub, ast.Add)):
        a, b = _literal(node.left), _literal(node.right)
        if a is not None and b is not None:
            return {ast.LShift: lambda: a << b, ast.Sub: lambda: a - b, ast.Add: lambda: a + b}[type(node.op)]()
    return None


def bound_literals(source: str) -> list[tuple[int, float]]:
    """(line, value) of each contract value written as a literal where a request value is checked: a
    comparison's operand, or an argument of a field validator."""
    values = contract_values()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and \
                str(getattr(node.func, "id", getattr(node.func, "attr", ""))).lstrip("_") in VALIDATORS:
            operands = [*node.args, *(k.value for k in node.keywords)]
        else:
            continue
        for op in operands:
            v = _literal(op)
            if v is not None and (type(v), v) in values:
                found.append((op.lineno, v))
    return found


def test_no_bound_is_written_outside_the_contract():
    found = [f"{p.relative_to(PACKAGE.parent)}:{line} writes {v!r}"
             for p in SCANNED for line, v in bound_literals(p.read_text())]
    assert found == []


def test_the_scan_finds_a_bound_written_again():
    # what the modules used to hold: a stop-list cap, a tool name's length, a sampling bound, 1 << 31
    assert [v for _, v in bound_literals("if len(s) > 4:\n    pass\n")] == [4]
    assert [v for _, v in bound_literals("ok = not name or len(name) > 64\n")] == [64]
    assert [v for _, v in bound_literals("t = number(body, 'temperature', 0.0, 2.0)\n")] == [2.0]
    assert [v for _, v in bound_literals("m = integer(body, 'max_tokens', 1, 1 << 31)\n")] == [1 << 31]
    assert bound_literals("if v < -2.0:\n    pass\n") == [(1, -2.0)]
    assert bound_literals("if len(x) > 0 or n == 1:\n    pass\n") == []  # counts and indices are not bounds
