"""Fault benchmarks (collm_bench.faults, results in bench/results/faults/)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def scenarios_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One row per fault scenario: what the clients got, the recovery time and the checks passed."""
    lines = [
        "| fault | requests sent | succeeded | retried | clear errors | lost | recovery s "
        "| recovery measured as | checks passed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        rec = f"{r['recovery_s']:.2f}" if r.get("recovery_s") is not None else "-"
        passed = sum(r["checks"].values())
        failed = "" if not r["failed_checks"] else f" (failed: {'; '.join(r['failed_checks'])})"
        lines.append(
            f"| {r['fault']} | {r['sent']} | {r['succeeded']} | {r['retried']} | {r['failed_clear']} "
            f"| {r['lost']} | {rec} | {r['recovery_what']} | {passed}/{len(r['checks'])}{failed} |"
        )
    return "\n".join(lines)


def supervision_table(doc: Mapping[str, Any]) -> str:
    """A replica SIGKILLed under `collm up`: how soon the other serves, when it serves again, every fate."""
    g, fates = doc["goals"], doc["fates"]
    lines = [
        "| measure | value | goal |",
        "|---|---:|---:|",
        "| kill -> a request sent after it accepted by the other replica "
        f"| {doc['first_new_accepted_s']:.2f} s | |",
        f"| kill -> such a request's first token | {doc['first_new_served_s']:.2f} s "
        f"| <= {g['first_new_served_s']:g} s |",
        f"| kill -> the killed replica started again by the launcher | {doc['restarted_s']:.2f} s | |",
        f"| kill -> the killed replica serving again (its first token) | {doc['serving_again_s']:.1f} s "
        f"| <= {g['serving_again_s']:g} s |",
        "| requests completed / moved before their first token and completed / ended with a clear error / "
        f"lost | {fates['completed']} / {fates['moved_and_completed']} / {fates['clear_error']} / "
        f"{fates['lost']} | {g['lost']} lost |",
    ]
    return "\n".join(lines)
