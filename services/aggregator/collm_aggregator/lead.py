"""How long before a round's deadline its participants must send, so that its version serves by then.

After the close a round still aggregates, evaluates its candidate on the replicas and publishes; on a CPU
that takes seconds (the evaluation dominates). Participants therefore get a deadline earlier than the
round's own by a *lead*: the longest close-to-publication time of the adapter's recent rounds (any
adapter's before its first), with headroom, at most a fraction of the round's span so that training keeps
most of the round. The collection itself still closes at the round's deadline: a late participant is
waited for as before. Pure: the runner feeds it measured durations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class PublishLead:
    """`fixed_s` (a setting) replaces the measurement when set; `initial_s` is used before any round
    has published."""

    initial_s: float = 5.0
    fixed_s: float | None = None
    headroom: float = 1.25
    max_frac: float = 0.25
    window: int = 5
    _recent: dict[str, deque[float]] = field(default_factory=dict)
    _any: deque[float] = field(default_factory=lambda: deque(maxlen=5))

    def observe(self, adapter: str, close_to_published_s: float) -> None:
        """A round of `adapter` published `close_to_published_s` after its collection closed."""
        if close_to_published_s < 0:
            return
        self._recent.setdefault(adapter, deque(maxlen=self.window)).append(close_to_published_s)
        self._any.append(close_to_published_s)

    def lead_s(self, adapter: str, round_span_s: float) -> float:
        """Seconds before the deadline that participants of a round of `adapter` lasting `round_span_s`
        (opening to deadline) must send by."""
        if self.fixed_s is not None:
            want = self.fixed_s
        else:
            seen = self._recent.get(adapter) or self._any
            want = max(seen) * self.headroom if seen else self.initial_s
        return max(0.0, min(want, self.max_frac * max(0.0, round_span_s)))
