"""The request contract: every bound a request field has, written once, as data.

Why one table: a bound used to be written in three places (the published JSON Schema, the route's
validator, and `SamplingParams.__post_init__`), and only tests kept them equal. Here each numeric
field's range, default and example is one `Bound`, each route's numeric fields are one mapping from
field name to `Bound` (`CHAT`, `COMPLETIONS`, `RESPONSES`, `MESSAGES`, `EMBEDDINGS`, `UNLOAD`), and the
size limits (characters, items) are named constants. Three readers, no copies:

    pantheon.web.schema    turns each Bound into its JSON Schema (`minimum`, `maximum`,
                           `exclusiveMinimum`, `examples`) for GET /openapi.json;
    pantheon.web.fields    checks a body's value against the same Bound (`fields.bounded`);
    pantheon.types         `SamplingParams` takes its defaults from `SAMPLING` and checks its knobs
                           against it, so a value the server refuses is refused in-process too.

tests/test_contract.py generates the schema and the validators' answers from this table and compares
them with /openapi.json, and scans pantheon/web/ and pantheon/types.py for a bound written as a literal.

Floor 0 (tests/test_layering.py): the request types read it, so it imports nothing of the package.
Bounds a loaded model sets (n by its slots, token ids by its vocabulary) are checked when the request
starts; the table gives the field's own range.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

# ---- sizes: characters, items, entries --------------------------------------------------------------------
ID_CHARS = 256  # model names, user, session_id, cache_salt, the session headers, ...
STOP_MAX = 4  # stop strings (stop, stop_sequences) per request
STOP_CHARS = 512  # characters per stop string
TOOL_NAME_CHARS = 64  # a declared tool's (or function's) name
FORMAT_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a json_schema format's name
METADATA_MAX = 16  # metadata entries
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
PROMPT_CACHE_KEY_CHARS = 1024
PROMPTS_MAX = 64  # prompts in one /v1/completions call
EMBED_INPUTS_MAX = 2048  # inputs in one /v1/embeddings call (OpenAI's limit)
TOKENS_MAX = 1 << 18  # token ids one /detokenize call takes and one /tokenize call returns (a long context)
ADMIN_NAME_CHARS = 4096  # admin string fields (paths, names)
ADMIN_DIES_MAX = 64
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's limit); the step returns this many per row
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit); the slot table holds this many
LOGIT_BIAS_KEY_DIGITS = 10  # a logit_bias key is a token id in decimal
TOKEN_LIMIT = 1 << 31  # an integer field's ceiling where the real bound is the model's context or slots
TOP_K_MAX = 1 << 30
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a signed 64-bit integer, as OpenAI's
UNLOAD_TIMEOUT_MAX_S = 86400


@dataclass(frozen=True)
class Bound:
    """One numeric field's range: `lo` (open when `lo_open`) to `hi`, both inclusive otherwise; None is
    no bound on that side. `default`: the value an absent field takes (None: absence means something
    of its own, e.g. a fresh seed); `example`: a valid value the published schema shows first."""

    kind: Literal["integer", "number"]
    lo: float | None
    hi: float | None
    example: float
    lo_open: bool = False
    default: float | None = None

    def holds(self, v: float) -> bool:
        """Whether `v` (already a number of the right kind) is in range."""
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return self.hi is None or v <= self.hi

    def interval(self) -> str:
        """The range as a message states it: "[0, 2]", "(0, 1]", "[1, ...)"."""
        def show(x: float | None) -> str:
            return "..." if x is None else (f"{x:g}" if isinstance(x, float) else str(x))
        return (f"{'(' if self.lo_open or self.lo is None else '['}{show(self.lo)}, {show(self.hi)}"
                f"{')' if self.hi is None else ']'}")


def _integer(lo: int | None, hi: int | None, example: int, default: int | None = None) -> Bound:
    return Bound("integer", lo, hi, example, default=default)


def _number(lo: float, hi: float, example: float, default: float | None = None, lo_open: bool = False) -> Bound:
    return Bound("number", lo, hi, example, lo_open=lo_open, default=default)


# ---- the sampling knobs: what SamplingParams holds, and every generation route takes ----------------------
PENALTY = _number(-2.0, 2.0, 0.5, default=0.0)
SAMPLING: dict[str, Bound] = {
    "temperature": _number(0.0, 2.0, 0.7, default=1.0),  # 0: greedy
    "top_p": _number(0.0, 1.0, 0.9, default=1.0, lo_open=True),  # 1: off
    "top_k": _integer(-1, TOP_K_MAX, 40, default=0),  # -1 and 0: off; 1: greedy
    "min_p": _number(0.0, 1.0, 0.05, default=0.0),  # 0: off
    "repetition_penalty": _number(0.0, 10.0, 1.1, default=1.0, lo_open=True),  # 1: off
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "seed": _integer(SEED_MIN, SEED_MAX, 42),  # absent: a fresh seed per request
}
# ---- the other numeric fields ----------------------------------------------------------------------------
MAX_TOKENS = _integer(1, TOKEN_LIMIT, 16)
CHOICES = _integer(1, TOKEN_LIMIT, 1)  # n, best_of: the model's slots bound them when the request starts
TOP_LOGPROBS = _integer(0, MAX_TOP_LOGPROBS, 2)
LOGIT_BIAS_VALUE = _number(-100.0, 100.0, -100.0)  # -100 bans a token, 100 forces it

CHAT: dict[str, Bound] = {
    **SAMPLING,
    "max_tokens": MAX_TOKENS,
    "max_completion_tokens": MAX_TOKENS,
    "n": CHOICES,
    "top_logprobs": TOP_LOGPROBS,
}
COMPLETIONS: dict[str, Bound] = {
    **SAMPLING,
    "max_tokens": replace(MAX_TOKENS, default=16),  # OpenAI's default for this route
    "n": CHOICES,
    "best_of": CHOICES,
    "logprobs": replace(TOP_LOGPROBS, example=0),  # 0: the chosen token only
}
RESPONSES: dict[str, Bound] = {
    **{k: SAMPLING[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
    "max_output_tokens": MAX_TOKENS,
    "priority": _integer(0, 0, 0),  # SGLang's request priority, which the SMG router sends: only 0
}
MESSAGES: dict[str, Bound] = {
    "max_tokens": MAX_TOKENS,
    "temperature": replace(SAMPLING["temperature"], hi=1.0),  # Anthropic's range
    "top_p": SAMPLING["top_p"],
    "top_k": replace(SAMPLING["top_k"], lo=0),
}
THINKING: dict[str, Bound] = {"budget_tokens": replace(MAX_TOKENS, example=1024)}  # Messages' thinking object
EMBEDDINGS: dict[str, Bound] = {"dimensions": _integer(1, None, 64)}  # the model's own dimensions only
UNLOAD: dict[str, Bound] = {"timeout_s": _number(0.0, UNLOAD_TIMEOUT_MAX_S, 30.0)}
MAX_SPEC_K = 16  # the most draft tokens a verify step takes per slot (speculative decoding)
LOAD: dict[str, Bound] = {"spec_k": _integer(0, MAX_SPEC_K, 6)}  # the admin load's per-model draft count

# Every route's numeric fields, by the component name of its request schema in GET /openapi.json.
ROUTES: dict[str, dict[str, Bound]] = {
    "ChatCompletionRequest": CHAT,
    "CompletionRequest": COMPLETIONS,
    "ResponseRequest": RESPONSES,
    "MessagesRequest": MESSAGES,
    "EmbeddingRequest": EMBEDDINGS,
    "UnloadRequest": UNLOAD,
    "LoadRequest": LOAD,
}
