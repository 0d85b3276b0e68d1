"""Draft tokens for speculative decoding: prompt lookup (n-gram matching), and how many to draft.

Prompt lookup proposes, after a sequence whose last n tokens also occurred earlier in it (the prompt
or the text generated so far), the tokens that followed that earlier occurrence. No second model:
the common case it serves is output that quotes its input -- a code block rewritten with a change, a
RAG answer quoting its document, JSON echoing field names. The engine's verify step then checks the
drafts (pantheon.runtime.decode_state.verify_and_advance), so a wrong draft costs compute, never a
token.

Each slot keeps one `PromptLookup` over its sequence (built at admission from the prompt, extended
with every emitted token) and one `DraftBudget` that adapts how many tokens it drafts to what the
verify steps accepted. Both are the driver thread's (no lock).
"""

from __future__ import annotations

from collections.abc import Sequence

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
