from __future__ import annotations

import pytest

from collm_aggregator.lead import PublishLead


def test_initial_lead_before_any_round_then_the_longest_recent_with_headroom() -> None:
    lead = PublishLead(initial_s=5.0, headroom=1.25, window=3)
    assert lead.lead_s("a", 120.0) == 5.0
    for s in (4.0, 8.0, 6.0):
        lead.observe("a", s)
    assert lead.lead_s("a", 120.0) == pytest.approx(10.0)
    lead.observe("a", 2.0)
    lead.observe("a", 2.0)  # 8.0 left the window of 3
    assert lead.lead_s("a", 120.0) == pytest.approx(7.5)


def test_an_adapter_without_history_uses_every_adapter_s() -> None:
    lead = PublishLead(initial_s=5.0)
    lead.observe("a", 12.0)
    assert lead.lead_s("b", 600.0) == pytest.approx(15.0)


def test_lead_is_capped_by_a_fraction_of_the_round_and_a_fixed_setting_wins() -> None:
    lead = PublishLead(initial_s=5.0, max_frac=0.25)
    lead.observe("a", 40.0)
    assert lead.lead_s("a", 60.0) == pytest.approx(15.0)
    assert lead.lead_s("a", -1.0) == 0.0
    assert PublishLead(fixed_s=0.0).lead_s("a", 60.0) == 0.0
    assert PublishLead(fixed_s=3.0).lead_s("a", 60.0) == 3.0


def test_negative_durations_are_ignored() -> None:
    lead = PublishLead(initial_s=5.0)
    lead.observe("a", -1.0)
    assert lead.lead_s("a", 100.0) == 5.0
