"""Every NATS subject, stream and service name CoLLM uses, built in one place.

Services never type a subject as a string literal: they call these functions. Subjects are versioned
(`collm.v1....`); a breaking change gets a `v2` family served beside `v1` during a rollout. Identifiers
that become subject tokens (replica ids, adapter names) are checked here, so a malformed id can never
address the wrong subscriber.
"""

from __future__ import annotations

import re

PREFIX = "collm"
VERSION = "v1"
ROOT = f"{PREFIX}.{VERSION}"

# NATS micro service names (what `nats micro ls` shows).
SERVICE_GATEWAY = "collm-gateway"
SERVICE_REPLICA = "collm-replica"
SERVICE_COORDINATOR = "collm-coordinator"
SERVICE_AGGREGATOR = "collm-aggregator"
SERVICE_NAMES = (SERVICE_GATEWAY, SERVICE_REPLICA, SERVICE_COORDINATOR, SERVICE_AGGREGATOR)

# JetStream streams: messages that must not be lost.
STREAM_UPDATES = "COLLM_UPDATES"
STREAM_SAMPLES = "COLLM_SAMPLES"

# One subject token (a replica id, an adapter name); wire schemas that carry such ids validate with it.
TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_TOKEN = re.compile(TOKEN_PATTERN)


def check_token(value: str, what: str = "identifier") -> str:
    """Return `value` if it is safe as one subject token, else raise ValueError naming the rule."""
    if not _TOKEN.match(value):
        raise ValueError(f"invalid {what} {value!r}: use 1-64 characters from A-Z a-z 0-9 _ -")
    return value


def subject(*tokens: str) -> str:
    """`collm.v1.<tokens...>`; wildcards `*` and `>` are allowed only as whole tokens."""
    for t in tokens:
        if t not in ("*", ">"):
            check_token(t, "subject token")
    return ".".join((ROOT, *tokens))


# --- replica (request path and control) -------------------------------------------------------------
REPLICA_VERBS = ("generate", "cancel", "control", "status", "evaluate", "tokenize")


def replica(replica_id: str, verb: str) -> str:
    """Endpoint of one replica: generate, cancel, control, status, evaluate, tokenize."""
    if verb not in REPLICA_VERBS:
        raise ValueError(f"unknown replica verb {verb!r}")
    return subject("replica", check_token(replica_id, "replica id"), verb)


# --- telemetry --------------------------------------------------------------------------------------
def telemetry(replica_id: str) -> str:
    return subject("telemetry", "replica", check_token(replica_id, "replica id"))


def telemetry_all() -> str:
    return subject("telemetry", "replica", "*")


# --- coordinator --------------------------------------------------------------------------------------
def routing_weights() -> str:
    """Published by the coordinator's fast loop; the gateway applies it per request."""
    return subject("coordinator", "routing")


def coordinator_decisions() -> str:
    """Every coordinator decision with its reasons (observability)."""
    return subject("coordinator", "decisions")


def coordinator(verb: str) -> str:
    """Coordinator endpoints: status, policy."""
    return subject("coordinator", verb)


# --- gateway ----------------------------------------------------------------------------------------
def gateway(verb: str) -> str:
    """Gateway endpoints: status (its view of the cluster)."""
    return subject("gateway", verb)


# --- aggregator and rounds -------------------------------------------------------------------------
def aggregator(verb: str) -> str:
    """Aggregator endpoints: open_round, status, rounds, round, rollback, import."""
    return subject("aggregator", verb)


def round_event(round_id: int, event: str) -> str:
    """Round lifecycle events, one per state the round enters (a `RoundOutcome` each): opened,
    collecting, aggregating, evaluating, published, held_back, aborted."""
    return subject("rounds", str(int(round_id)), check_token(event, "round event"))


def round_events_all() -> str:
    return subject("rounds", ">")


def update(round_id: int, replica_id: str) -> str:
    """A participant's local update (JetStream, stream COLLM_UPDATES)."""
    return subject("updates", str(int(round_id)), check_token(replica_id, "replica id"))


def updates_all() -> str:
    return subject("updates", ">")


def samples(replica_id: str) -> str:
    """New local training samples for one replica (JetStream, stream COLLM_SAMPLES)."""
    return subject("samples", check_token(replica_id, "replica id"))


def samples_all() -> str:
    return subject("samples", ">")


# --- adapters -------------------------------------------------------------------------------------------
def adapter_published(name: str) -> str:
    """A new immutable adapter version is current (after the store's pointer moved)."""
    return subject("adapters", check_token(name, "adapter name"), "published")


def adapter_published_all() -> str:
    return subject("adapters", "*", "published")
