"""Draft tokens for speculative decoding: prompt lookup (n-gram matching), a draft model, and how
many to draft.

Prompt lookup proposes, after a sequence whose last n tokens also occurred earlier in it (the prompt
or the text generated so far), the tokens that followed that earlier occurrence. No second model:
the common case it serves is output that quotes its input -- a code block rewritten with a change, a
RAG answer quoting its document, JSON echoing field names. The engine's verify step then checks the
drafts (pantheon.runtime.decode_state.verify_and_advance), so a wrong draft costs compute, never a
token.

Each slot keeps one `PromptLookup` over its sequence (built at admission from the prompt, extended
with every emitted token) and one `DraftBudget` that adapts how many tokens it drafts to what the
verify steps accepted. Both are the driver thread's (no lock).

Where prompt lookup finds nothing, a `DraftModel` -- a second, smaller model with the same vocabulary
(`--draft-model`) -- proposes greedy tokens from its own slots; the slot keeps a second `DraftBudget`
for them. The draft model is stepped by the driver thread too, so it needs no lock either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pantheon.runtime import decode_state
from pantheon.runtime.engine import Chunk, Model, StepPlan
from pantheon.types import SamplingParams

# n-gram lengths matched, longest first: a longer match predicts better; 1 proposes too much noise
NGRAM_MAX, NGRAM_MIN = 3, 2


class PromptLookup:
    """An index of every n-gram (NGRAM_MIN <= n <= NGRAM_MAX) of one growing sequence to the position
    after its latest occurrence that has a continuation. O(1) per appended token and per proposal
    (a dict per n), whatever the sequence's length."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.seq: list[int] = []
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(NGRAM_MIN, NGRAM_MAX + 1)}
        for t in tokens:
            self.append(t)

    def append(self, tok: int) -> None:
        """Extend the sequence by `tok`: the n-grams that end just before it now have a continuation."""
        seq = self.seq
        end = len(seq)
        for n, index in self._after.items():
            if end >= n:
                index[tuple(seq[end - n:end])] = end
        seq.append(int(tok))

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to `k` tokens that followed the latest earlier occurrence of the sequence's last n tokens
        (the longest n that matches); () when nothing matches."""
        if k <= 0:
            return ()
        seq = self.seq
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(seq) <= n:
                continue
            at = self._after[n].get(tuple(seq[-n:]))
            if at is not None:
                return tuple(seq[at:at + k])
        return ()


class DraftBudget:
    """How many tokens one slot drafts next, adapted to its measured acceptance.

    All drafts accepted: draft twice as many next time (up to `k_max`); some accepted: one more than
    were accepted; none: half as many. A slot whose last few proposals were missing or all rejected
    rests for a while (`resting`): its steps decode plainly and keep the driver's one step of overlap
    (a verify step must see the slot's latest token, so planning one waits for the step in flight)."""

    MISSES_BEFORE_REST = 4
    REST_STEPS = 8

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.k = max(1, k_max // 2)
        self.misses = 0
        self.rest = 0

    @property
    def resting(self) -> bool:
        return self.rest > 0

    def rested(self) -> None:
        """One plain decode step of the slot while it rests."""
        self.rest = max(0, self.rest - 1)

    def missed(self) -> None:
        """A proposal found nothing to draft."""
        self._miss()

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify step accepted `accepted` of the slot's `drafted` tokens."""
        if accepted >= drafted:
            self.k = min(self.k_max, 2 * self.k)
            self.misses = 0
        elif accepted == 0:
            self.k = max(1, self.k // 2)
            self._miss()
        else:
            self.k = max(1, min(self.k_max, accepted + 1))
            self.misses = 0

    def _miss(self) -> None:
        self.misses += 1
        if self.misses >= self.MISSES_BEFORE_REST:
            self.misses = 0
            self.rest = self.REST_STEPS


class SpecGauge:
    """Whether verify steps pay on this machine, measured as the scheduler runs.

    Why: a verify step computes K + 1 rows per slot. On a GPU that costs about one row; on a CPU each
    row costs its share of compute, and a slot whose drafts are half rejected can end up slower than
    plain decoding (two streams of a code edit ran at 0.84x, measured). So per decoding-slot count d,
    the gauge keeps moving averages of a plain decode step's seconds, a verify step's seconds and a
    verify step's emitted tokens; once both have `MIN_SAMPLES`, a verify step must give at least as
    many tokens per second as plain steps (d per plain step), or speculation rests for `REST_STEPS`
    steps and then probes again from fresh verify samples. Driver thread only."""

    MIN_SAMPLES = 6
    REST_STEPS = 256
    ALPHA = 0.2  # weight of a new sample in the moving averages

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off (PANTHEON_SPEC_GAUGE=0): every verify step pays
        self.plain_s: dict[int, float] = {}
        self.verify_s: dict[int, float] = {}
        self.verify_tokens: dict[int, float] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self.steps = 0  # steps read so far (every kind): the clock of the rests
        self.rest_until: dict[int, int] = {}  # per slot count: no verify step before this step

    def tick(self) -> None:
        """One more step was read."""
        self.steps += 1

    def _avg(self, table: dict[int, float], d: int, x: float) -> None:
        table[d] = x if d not in table else (1 - self.ALPHA) * table[d] + self.ALPHA * x

    def plain(self, d: int, seconds: float) -> None:
        """A plain decode step of `d` slots took `seconds` (from the previous step's read to its own)."""
        self._avg(self.plain_s, d, seconds)
        self.samples[("plain", d)] = self.samples.get(("plain", d), 0) + 1

    def verify(self, d: int, seconds: float, tokens: int) -> None:
        """A verify step of `d` slots took `seconds` and emitted `tokens` tokens."""
        self._avg(self.verify_s, d, seconds)
        self._avg(self.verify_tokens, d, float(tokens))
        self.samples[("verify", d)] = self.samples.get(("verify", d), 0) + 1

    def pays(self, d: int) -> bool:
        """Whether to plan a verify step of `d` slots now."""
        if not self.enabled:
            return True
        if self.steps < self.rest_until.get(d, 0):
            return False
        if min(self.samples.get(("plain", d), 0), self.samples.get(("verify", d), 0)) < self.MIN_SAMPLES:
            return True
        if self.verify_tokens[d] / self.verify_s[d] >= d / self.plain_s[d]:
            return True
        self.rest_until[d] = self.steps + self.REST_STEPS
        self.samples[("verify", d)] = 0
        self.verify_s.pop(d, None)
        self.verify_tokens.pop(d, None)
        return False


class DraftMismatch(ValueError):
    """A draft model that cannot draft for its target: another vocabulary, or state that cannot be
    rolled back (recurrent layers, an image model)."""


def check_draft(target: Any, draft: Any) -> None:
    """Raise DraftMismatch unless `draft` can propose tokens for `target`: an attention-only text model
    (its cache is rolled back by moving a position, as the verify step's is) whose tokenizer has the
    very tokens and end ids of the target's -- a draft id must mean the same text to both."""
    names = f"draft model {draft.name!r} for {target.name!r}"
    if draft.caps.recurrent_state:
        raise DraftMismatch(f"{names}: its architecture ({draft.config.arch}) has recurrent state, which cannot be "
                            "rolled back past rejected drafts; a draft model must be attention-only")
    if getattr(draft, "vision", None) is not None:
        raise DraftMismatch(f"{names}: a model loaded with a vision projector cannot draft")
    a, b = target.tokenizer, draft.tokenizer
    if a.vocab_size != b.vocab_size:
        raise DraftMismatch(f"{names}: the vocabularies differ ({a.vocab_size} tokens in {target.name!r}, "
                            f"{b.vocab_size} in {draft.name!r}); the draft must share the target's tokenizer")
    diff = next((i for i in range(a.vocab_size) if a.token_bytes(i) != b.token_bytes(i)), None)
    if diff is not None:
        raise DraftMismatch(f"{names}: the vocabularies differ at token {diff} ({a.token_bytes(diff)!r} in "
                            f"{target.name!r}, {b.token_bytes(diff)!r} in {draft.name!r}); the draft must share "
                            "the target's tokenizer")
    if (a.eos_id, a.eot_ids) != (b.eos_id, b.eot_ids):
        raise DraftMismatch(f"{names}: the end-of-text ids differ ({a.eos_id}, {sorted(a.eot_ids)} in "
                            f"{target.name!r}; {b.eos_id}, {sorted(b.eot_ids)} in {draft.name!r})")


class DraftModel:
    """A second model that proposes drafts for the target's slots: draft slot i shadows target slot i.

    Why a model: prompt lookup drafts only text that repeats; a small model of the same family guesses
    most of any text's easy tokens. Its drafts are greedy -- a deterministic function of the sequence --
    so the verify step's rule (a draft is kept iff it equals the target's own sample there) stays the
    exact one for greedy and seeded sampling alike (docs/speculative.md).

    The draft's cache is attention-only, so a slot's rows are valid up to any prefix: `_held[i]` is
    the token sequence whose K/V rows slot i holds. `propose` brings each asked slot up to its target
    sequence -- what it holds of it is kept, the rest prefilled in chunks -- then decodes k tokens
    greedily, the steps chained on the device and read once at the end. Rows past what the target then
    accepts are not undone: the next `propose` finds where `_held` and the new sequence part and
    overwrites from there. Driver thread only (it owns `_state`, donated to every verb)."""

    def __init__(self, target: Any, draft: Model):
        check_draft(target, draft)
        self.model = draft
        self.vocab = int(target.config.vocab)  # a draft id the target has no logit for ends the draft
        self.max_seq = min(int(draft.max_seq), int(target.max_seq))
        self._greedy = SamplingParams(temperature=0.0, seed=0)
        self._state = draft.new_state()
        self._held: list[list[int]] = [[] for _ in range(draft.n_slots)]

    def warm(self, background: bool | None = None) -> None:
        """Make the draft's step programs (decode and prefill; no mixed or verify steps are asked of it)."""
        self._state = self.model.warmup(self._state, mixed=False, background=background)

    def propose(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        """For each (slot, sequence, k): up to k greedy tokens following the sequence (the target's
        prompt and every token it emitted, the last one not yet in the target's cache). The slots'
        decode steps are batched; each slot stops after its own k."""
        try:
            return self._propose(asks)
        except BaseException:
            # a failed verb donated the state: start over from empty slots (nothing held is valid)
            self._held = [[] for _ in range(self.model.n_slots)]
            self._state = self.model.new_state()
            raise

    def _propose(self, asks: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[int, ...]]:
        m = self.model
        live: list[tuple[int, int, int]] = []  # (slot, sequence length, k)
        for slot, seq, k in asks:
            seq = list(seq)
            k = min(k, self.max_seq - len(seq))
            if k <= 0 or not seq:
                continue
            held = self._held[slot]
            n = min(len(held), len(seq) - 1)  # at least the last token is fed: its row samples the first draft
            valid = n if held[:n] == seq[:n] else _common_prefix(held, seq, n)
            todo = seq[valid:-1]
            if todo:  # prefill what the slot lacks but the last token (chunks sample nothing)
                self._state = m.insert(self._state, self._slot_insert(slot, seq[:valid], valid, 1))
                for a in range(0, len(todo), m.chunk):
                    part = tuple(todo[a:a + m.chunk])
                    _, self._state = m.step(self._state, StepPlan(chunk=Chunk(slot, part, valid + a, False)))
            # decode from the last token: k steps sample k drafts (and write the K/V of all but the last)
            self._state = m.insert(self._state, self._slot_insert(slot, seq, len(seq) - 1, k, last=seq[-1]))
            self._held[slot] = seq
            live.append((slot, len(seq), k))
        steps = []
        for j in range(max((k for _, _, k in live), default=0)):
            rows = [(slot, length) for slot, length, k in live if k > j]
            plan = StepPlan(decode=tuple(slot for slot, _ in rows), reach=max(length + j for _, length in rows))
            h, self._state = m.step(self._state, plan)
            steps.append((rows, h))
        got: dict[int, list[int]] = {slot: [] for slot, _, _ in live}
        for rows, h in steps:  # (one wait: the last step's result comes after every earlier one)
            out = m.read(h)
            for i, (slot, _) in enumerate(rows):
                if int(out[i, 1]) != decode_state.IDLE:
                    got[slot].append(int(out[i, 0]))
        for slot, _, _ in live:  # each step that sampled wrote its input: the last token, then all drafts but the last
            self._held[slot] = self._held[slot] + got[slot][:max(0, len(got[slot]) - 1)]
        result = []
        for slot, _, _ in asks:
            d = got.get(slot, [])
            cut = next((i for i, t in enumerate(d) if not 0 <= t < self.vocab), len(d))
            result.append(tuple(d[:cut]))
        return result

    def _slot_insert(self, slot: int, seq: Sequence[int], at: int, k: int, last: int | None = None) -> Any:
        return decode_state.slot_insert(slot, seq, at, self._greedy, k, (), last=last)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    i = 0
    while i < limit and a[i] == b[i]:
        i += 1
    return i
