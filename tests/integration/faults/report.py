"""What a fault scenario saw: `FaultReport` (requests, recovery, named checks, details)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .probe import Outcome, tally


@dataclass
class FaultReport:
    fault: str
    sent: int = 0
    succeeded: int = 0
    retried: int = 0
    failed_clear: int = 0
    lost: int = 0
    recovery_s: float | None = None
    recovery_what: str = ""
    checks: dict[str, bool] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool) -> None:
        self.checks[name] = bool(ok)

    @property
    def failed_checks(self) -> list[str]:
        return [k for k, ok in self.checks.items() if not ok]

    def add_outcomes(self, outcomes: list[Outcome]) -> None:
        t = tally(outcomes)
        self.sent += t["sent"]
        self.succeeded += t["succeeded"]
        self.failed_clear += t["failed_clear"]
        self.lost += t["lost"]
        problems = self.details.setdefault("not_ok_examples", [])
        for o in outcomes:
            if o.kind != "ok" and len(problems) < 5:
                problems.append(f"{o.kind} {o.status} {o.code}: {o.message[:160]}")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failed_checks"] = self.failed_checks
        return d

    def print(self) -> None:
        """The summary line, then the details (what a test run with -s shows, and the figures record)."""
        print(self.summary())  # noqa: T201
        print(json.dumps(self.details, default=str)[:4000])  # noqa: T201

    def summary(self) -> str:
        rec = f"{self.recovery_s:.2f}s" if self.recovery_s is not None else "-"
        return (
            f"{self.fault}: sent {self.sent}, succeeded {self.succeeded}, retried {self.retried}, "
            f"clear errors {self.failed_clear}, lost {self.lost}, recovery {rec} ({self.recovery_what}); "
            f"failed checks: {self.failed_checks or 'none'}"
        )
