"""The coordinator core: a pure discrete-event state machine, `on_tick(now_s, inputs) -> Decisions`.

This module does no I/O: no NATS, Redis, asyncio, Prometheus or clock of its own. The driver (the
service, the simulator, a test) calls `on_tick` with its clock's time and everything new since the
previous call; the core runs each loop that is due and says when it wants to be called next
(`Decisions.next_tick_s`). The fast loop is due every `fast_interval_s`, the slow loop every
`slow_interval_s` (the first one `warmup_s` after the first tick at which telemetry has arrived). When
both are due the slow loop runs first and the fast loop second, so a new plan's shares are already
capped by the current load in the same tick: the fast loop always has the last word.

An adapter the slow loop could not plan because it had no version yet, or because its previous round
was still in flight (collecting updates; with `rounds="sync"` also while the aggregator aggregates and
evaluates its candidate: with "async" that happens beside the next round's training), is planned at the
first fast tick where it has a version and no round in flight (and a live replica holds its data),
alone (the other adapters keep the slow cadence): an adapter created just after a slow tick does not
wait a whole `slow_interval_s` for its first round, and a round that outlasts the slow interval (its
evaluation on a loaded replica can take longer than the round) is followed by the next one as soon as
it ends instead of a whole interval later, so an adapter's rounds start at the later of the slow tick
and the end of its previous round. With "async" an adapter whose round closed its collection is also
planned at the next fast tick, whatever the slow cadence, so its data holders train round after round
with no gap. (An adapter without a data holder waits for the slow tick: replicas starting together
report one by one, and planning at the first report would leave the others out.)

Likewise an adapter that the slow loop (or such a catch-up) could not plan because every live replica
holding its data was at SLO risk at that tick (collm leaves such replicas out of a plan) is planned at
the first fast tick where one of them no longer is: a risk that clears within the slow interval (a
burst the fast loop already cut shares for, a slow request leaving the replica's latency window) does
not cost the adapter a whole slow interval without a round.

An adapter to train that has no version yet (one per domain the replicas report, unless configured) is
created at the first fast tick where a live replica holds its data: the core asks that replica
(`Decisions.creates`, the first holder by id) to create v1, the base model's behaviour, and asks again
every `CREATE_RETRY_S` until a version is known. Its first round then follows as above.
"""

from __future__ import annotations

from dataclasses import replace

from collm_coordinator.core.config import CoreConfig
from collm_coordinator.core.policies import Policy, make_policy
from collm_coordinator.core.slow_loop import adapters_to_plan
from collm_coordinator.core.state import ClusterState, ClusterView
from collm_coordinator.core.types import (
    AdapterCreation,
    Decisions,
    Diagnostics,
    FastDecision,
    SlowDecision,
    TickInputs,
)

# How long a request to create an adapter's v1 is given before it is sent again (to the first holder then).
CREATE_RETRY_S = 10.0


class CoordinatorCore:
    def __init__(self, config: CoreConfig, policy: str = "collm") -> None:
        self.config = config
        self._policy: Policy = make_policy(policy)
        self.state = ClusterState(config)
        self._next_fast_s: float | None = None
        self._next_slow_s: float | None = None
        self._last_fast_s: float | None = None
        self.last: Decisions | None = None
        self.last_fast: FastDecision | None = None
        self.last_slow: SlowDecision | None = None
        # Adapters the last slow run skipped for lack of a version or for a round in flight (see the
        # module docstring).
        self._waiting: frozenset[str] = frozenset()
        # ... and those it did not plan while every replica holding their data was at SLO risk.
        self._risk_waiting: frozenset[str] = frozenset()
        # Adapter -> when a replica was last asked to create its v1.
        self._create_asked: dict[str, float] = {}

    @property
    def policy(self) -> str:
        return self._policy.name

    def set_policy(self, name: str) -> None:
        """Switch policy at run time; history, rounds in flight and the virtual queue carry over."""
        if name != self._policy.name:
            self._policy = make_policy(name)
            # The next tick runs the fast loop under the new policy, whatever the cadence says.
            if self._next_fast_s is not None:
                self._next_fast_s = float("-inf")

    def on_tick(self, now_s: float, inputs: TickInputs) -> Decisions:
        """Ingest `inputs`, run the loops due at `now_s` (the slow one first), and return what they
        decided with the time of the next tick wanted."""
        cfg = self.config
        st = self.state
        self._ingest(now_s, inputs)
        assert self._next_fast_s is not None
        fast_due = now_s >= self._next_fast_s - 1e-9
        slow_due = self._next_slow_s is not None and now_s >= self._next_slow_s - 1e-9
        if fast_due:
            dt = cfg.fast_interval_s if self._last_fast_s is None else now_s - self._last_fast_s
            st.target.update(dt)
        view = st.view(now_s, record_history=fast_due)
        slow = self._slow_loop(view, now_s, slow_due=slow_due, fast_due=fast_due)
        if slow is not None:
            view = st.view(now_s, record_history=False)  # the fast loop sees the new plan's shares
        fast = self._fast_loop(view, now_s) if fast_due or slow is not None else None
        decisions = Decisions(
            now_s=now_s,
            policy=self._policy.name,
            fast=fast,
            slow=slow,
            next_tick_s=min(self._next_fast_s, self._next_slow_s or self._next_fast_s),
            diagnostics=_diagnostics(view, tuple(st.notes)),
            creates=self._creations(view, now_s) if fast_due else (),
        )
        self.last = decisions
        return decisions

    def _ingest(self, now_s: float, inputs: TickInputs) -> None:
        """Fold `inputs` into the cluster state, expire what is stale at `now_s`, queue the adapters whose
        round closed its collection for the next fast tick, and start the loops' cadences."""
        st = self.state
        st.notes.clear()
        for obs in inputs.telemetry:
            st.ingest_telemetry(obs)
        for v in inputs.adapter_versions:
            st.ingest_version(v)
        for ev in inputs.round_events:
            st.ingest_round_event(ev)
        st.expire(now_s)
        # Async rounds: an adapter whose round closed its collection is planned again at the next fast
        # tick, not at the next slow one, so its data holders keep training.
        self._waiting |= st.freed
        st.freed.clear()
        if self._next_fast_s is None:
            self._next_fast_s = now_s
        if self._next_slow_s is None and st.latest:
            self._next_slow_s = now_s + self.config.warmup_s

    def _slow_loop(
        self, view: ClusterView, now_s: float, *, slow_due: bool, fast_due: bool
    ) -> SlowDecision | None:
        """The slow loop when it is due, else at a fast tick the catch-up of the adapters that became
        ready (module docstring); its plans are added to the state. None when neither runs."""
        if slow_due:
            slow = self._scheduled_slow(view, now_s)
        elif fast_due:
            catch_up = tuple(
                sorted({*_now_ready(view, self._waiting), *_risk_cleared(view, self._risk_waiting)})
            )
            if not catch_up:
                return None
            slow = self._catch_up_slow(view, catch_up)
        else:
            return None
        for plan in slow.plans:
            self.state.add_plan(
                plan,
                {
                    p.replica_id: view.data_tokens.get((p.replica_id, plan.adapter), 0.0)
                    for p in plan.participants
                },
            )
        self.last_slow = slow
        return slow

    def _scheduled_slow(self, view: ClusterView, now_s: float) -> SlowDecision:
        """The slow loop at its cadence, over every adapter; records which ones wait for a catch-up."""
        slow = self._policy.slow(view)
        assert self._next_slow_s is not None
        self._next_slow_s = _next_due(self._next_slow_s, self.config.slow_interval_s, now_s)
        self._waiting = _not_ready(view)
        self._risk_waiting = _held_by_risk(view, {p.adapter for p in slow.plans})
        return slow

    def _catch_up_slow(self, view: ClusterView, catch_up: tuple[str, ...]) -> SlowDecision:
        """The slow loop over the `catch_up` adapters alone; they leave the waiting sets unless all their
        data holders are at risk now."""
        only = {a: view.adapter_domains[a] for a in catch_up}
        slow = self._policy.slow(replace(view, adapter_domains=only))
        self._waiting = self._waiting - set(catch_up)
        # One caught up while all its data holders are at risk now waits for the risk to clear.
        held = _held_by_risk(view, {p.adapter for p in slow.plans}) & set(catch_up)
        self._risk_waiting = (self._risk_waiting - set(catch_up)) | held
        return slow

    def _fast_loop(self, view: ClusterView, now_s: float) -> FastDecision:
        """The fast loop: the replicas' shares (none for stale ones), and its next due time."""
        cfg = self.config
        st = self.state
        fast = self._policy.fast(view)
        st.shares = {s.replica_id: s.share for s in fast.shares}
        for rid in view.stale:
            st.shares.pop(rid, None)
        self._last_fast_s = now_s
        assert self._next_fast_s is not None
        self._next_fast_s = _next_due(
            max(self._next_fast_s, now_s - cfg.fast_interval_s), cfg.fast_interval_s, now_s
        )
        self.last_fast = fast
        return fast

    def _creations(self, view: ClusterView, now_s: float) -> tuple[AdapterCreation, ...]:
        out = []
        for adapter in sorted(view.adapter_domains):
            if view.versions.get(adapter) or adapter in view.rounds:
                self._create_asked.pop(adapter, None)
                continue
            holders = view.replicas_for(adapter)
            asked = self._create_asked.get(adapter)
            if not holders or (asked is not None and now_s - asked < CREATE_RETRY_S):
                continue
            self._create_asked[adapter] = now_s
            out.append(AdapterCreation(adapter, holders[0]))
        return tuple(out)


def _diagnostics(view: ClusterView, notes: tuple[str, ...]) -> Diagnostics:
    """What a tick reports about the cluster view it acted on."""
    return Diagnostics(
        live=tuple(sorted(view.live)),
        stale=view.stale,
        arrivals_per_s=view.arrivals_now_per_s,
        demand=view.demand_now,
        attainment=view.attainment,
        virtual_queue=view.virtual_queue,
        headroom=view.headroom,
        spend=view.spend,
        notes=notes,
    )


def _not_ready(view: ClusterView) -> frozenset[str]:
    """Adapters that cannot be planned now: a round in flight, or no version yet."""
    return frozenset(a for a in view.adapter_domains if a in view.rounds or not view.versions.get(a))


def _now_ready(view: ClusterView, waiting: frozenset[str]) -> tuple[str, ...]:
    if not waiting:
        return ()
    ready, _ = adapters_to_plan(view)
    return tuple(sorted(a for a, _, _ in ready if a in waiting))


def _held_by_risk(view: ClusterView, planned: set[str]) -> frozenset[str]:
    """Ready adapters left unplanned while every live replica holding their data was at SLO risk."""
    ready, _ = adapters_to_plan(view)
    return frozenset(
        a
        for a, _, holders in ready
        if a not in planned and holders and all(r in view.at_risk for r in holders)
    )


def _risk_cleared(view: ClusterView, waiting: frozenset[str]) -> tuple[str, ...]:
    if not waiting:
        return ()
    ready, _ = adapters_to_plan(view)
    return tuple(
        sorted(a for a, _, holders in ready if a in waiting and any(r not in view.at_risk for r in holders))
    )


def _next_due(prev_due: float, interval_s: float, now_s: float) -> float:
    """Keep the cadence; after a long pause skip the missed ticks instead of running them all."""
    nxt = prev_due + interval_s
    return nxt if nxt > now_s else now_s + interval_s
