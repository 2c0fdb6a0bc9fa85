"""NATS users and subject permissions of a secured CoLLM deployment: what deploy/nats/auth.conf holds.

One user per service role, each allowed exactly what that service does on the bus and nothing else:

* `gateway`: requests `generate`/`cancel`/`tokenize` of any replica, publishes training samples
  (JetStream) and asks the aggregator to `import`/`rollback` (its adapter admin API); listens to
  telemetry, routing weights and publications, and for its dashboard to coordinator decisions and
  round events, and reads the aggregator's round records (`rounds`) and the coordinator's `status`. It
  can send no control command and publish no adapter or round event.
* `replica-<id>`, one per replica: serves only its own endpoints (`collm.v1.replica.<id>.*`), publishes
  only its own telemetry and its own updates (`collm.v1.updates.*.<id>`, so the subject token of an
  update *is* the authenticated sender), consumes only its own samples (its durable consumer, bound to
  its own subject). It can publish no adapter version, no round event and no control command.
* `coordinator`: telemetry and round events in; routing weights, decisions, control commands (shares)
  and round plans (`aggregator.open_round`) out.
* `aggregator`: the only user that publishes round events and adapter versions; asks replicas to train
  and evaluate; creates the JetStream streams and consumes updates through its durable consumer.
* `admin`: everything, for operators (the NATS CLI in nats-box, the `collm` CLI).

Every service subscribes to its replies only under its own inbox prefix `_INBOX.<user>`
(`collm_common.bus.inbox_prefix`), so none can read another's replies; it answers requests through
`allow_responses` (to the reply subject of a request it received, never to an inbox of its choosing).
Passwords are `$NATS_PASSWORD_<USER>` variables, which nats-server reads from its environment.

Subjects come from `collm_common.subjects`, never typed here. `python -m collm_ops.nats_auth --write`
regenerates deploy/nats/auth.conf (replicas r0 r1 r2 g0 g1 by default; `--replicas r0,r1,site-a` for
others), and a test checks that the shipped file is current.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from collm_common import subjects
from collm_common.bus import inbox_prefix

DEFAULT_REPLICAS = ("r0", "r1", "r2", "g0", "g1")
AUTH_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "auth.conf"
# The aggregator's durable update consumer (AggregatorSettings.consumer_name's default) and a
# replica's durable samples consumer (collm_replica.samples: `replica-<id>`).
AGGREGATOR_CONSUMER = "collm-aggregator"
# How long a request's reply subject stays open to its responder: a generation may stream for up to
# the gateway's request deadline (600 s by default), evaluation and import take minutes at most.
RESPONSE_TTL = "15m"
JS_API = "$JS.API"
SRV = "$SRV"
MICRO_VERBS = ("PING", "INFO", "STATS")


def any_replica(verb: str) -> str:
    """`subjects.replica(<any id>, verb)` (subjects.replica itself refuses wildcards)."""
    if verb not in subjects.REPLICA_VERBS:
        raise ValueError(f"unknown replica verb {verb!r}")
    return subjects.subject("replica", "*", verb)


def replica_user(replica_id: str) -> str:
    return f"replica-{subjects.check_token(replica_id, 'replica id')}"


def samples_consumer(replica_id: str) -> str:
    return f"replica-{replica_id}"


def password_var(user: str) -> str:
    """`NATS_PASSWORD_<USER>`: the environment variable that holds `user`'s password."""
    return "NATS_PASSWORD_" + re.sub(r"[^A-Za-z0-9]", "_", user).upper()


@dataclass(frozen=True)
class Responses:
    max_msgs: int  # -1: any number (a token stream)
    expires: str = RESPONSE_TTL


@dataclass(frozen=True)
class User:
    name: str
    role: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    responses: Responses | None = None

    @property
    def password_var(self) -> str:
        return password_var(self.name)

    @property
    def inbox(self) -> str:
        return inbox_prefix(self.name) + ".>"


def _micro(service: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(publish, subscribe) of a NATS micro service: it answers discovery (`$SRV.PING|INFO|STATS`, by
    name, by name and id) and may ping its own name (its container health check)."""
    sub = tuple(f"{SRV}.{v}" for v in MICRO_VERBS) + (f"{SRV}.*.{service}", f"{SRV}.*.{service}.*")
    return (f"{SRV}.PING.{service}",), sub


def _stream_info() -> tuple[str, ...]:
    """Every service that touches JetStream checks that the streams exist (`streams.ensure_streams`)."""
    return (
        f"{JS_API}.STREAM.INFO.{subjects.STREAM_UPDATES}",
        f"{JS_API}.STREAM.INFO.{subjects.STREAM_SAMPLES}",
    )


def _consumer(stream: str, consumer: str, filter_subject: str) -> tuple[str, ...]:
    """A durable pull consumer: look it up, create it bound to `filter_subject` (the server refuses a
    create whose body filters another subject than the request subject names), fetch, acknowledge."""
    return (
        f"{JS_API}.CONSUMER.INFO.{stream}.{consumer}",
        f"{JS_API}.CONSUMER.CREATE.{stream}.{consumer}.{filter_subject}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
        f"$JS.ACK.{stream}.{consumer}.>",
    )


# Subjects that carry authority: adapter versions, round events, control commands, policy changes.
_AUTHORITY = (
    subjects.subject("adapters", ">"),  # subjects.adapter_published(<any name>)
    subjects.round_events_all(),
    any_replica("control"),
    subjects.coordinator("policy"),
)


def gateway() -> User:
    pub_micro, sub_micro = _micro(subjects.SERVICE_GATEWAY)
    name = "gateway"
    return User(
        name=name,
        role="gateway",
        publish=(
            any_replica("generate"),
            any_replica("cancel"),
            any_replica("tokenize"),  # POST /tokenize, /detokenize
            any_replica("status"),  # the liveness probe of a replica whose telemetry went stale
            subjects.subject("samples", "*"),  # POST /v1/samples (JetStream; acknowledged to its inbox)
            subjects.aggregator("import"),  # the adapter admin API (load)
            subjects.aggregator("rollback"),
            subjects.aggregator("rounds"),  # the dashboard: recent round records
            subjects.coordinator("status"),  # the dashboard: planned rounds
            *_stream_info(),
            *pub_micro,
        ),
        subscribe=(
            subjects.telemetry_all(),
            subjects.routing_weights(),
            subjects.adapter_published_all(),
            subjects.coordinator_decisions(),  # the dashboard
            subjects.round_events_all(),  # the dashboard
            subjects.gateway("*"),
            *sub_micro,
            inbox_prefix(name) + ".>",
        ),
        publish_deny=(*_AUTHORITY, any_replica("evaluate"), subjects.updates_all()),
        responses=Responses(max_msgs=1),
    )


def replica(replica_id: str) -> User:
    pub_micro, sub_micro = _micro(subjects.SERVICE_REPLICA)
    name = replica_user(replica_id)
    return User(
        name=name,
        role="replica",
        publish=(
            subjects.telemetry(replica_id),
            subjects.subject("updates", "*", replica_id),  # subjects.update(<any round>, replica_id)
            *_stream_info(),
            *_consumer(subjects.STREAM_SAMPLES, samples_consumer(replica_id), subjects.samples(replica_id)),
            *pub_micro,
        ),
        subscribe=(
            subjects.subject("replica", replica_id, "*"),  # its own endpoints only
            subjects.adapter_published_all(),
            *sub_micro,
            inbox_prefix(name) + ".>",
        ),
        publish_deny=(*_AUTHORITY, subjects.aggregator("*"), subjects.samples_all()),
        # A generation streams many replies (Accepted, token chunks, Finished) to one reply subject.
        responses=Responses(max_msgs=-1),
    )


def coordinator() -> User:
    pub_micro, sub_micro = _micro(subjects.SERVICE_COORDINATOR)
    name = "coordinator"
    return User(
        name=name,
        role="coordinator",
        publish=(
            subjects.routing_weights(),
            subjects.coordinator_decisions(),
            any_replica("control"),  # fine-tuning shares
            subjects.aggregator("open_round"),  # round plans
            *pub_micro,
        ),
        subscribe=(
            subjects.telemetry_all(),
            subjects.round_events_all(),
            subjects.coordinator("*"),
            *sub_micro,
            inbox_prefix(name) + ".>",
        ),
        publish_deny=(subjects.subject("adapters", ">"), subjects.round_events_all(), subjects.updates_all()),
        responses=Responses(max_msgs=1),
    )


def aggregator(consumer: str = AGGREGATOR_CONSUMER) -> User:
    pub_micro, sub_micro = _micro(subjects.SERVICE_AGGREGATOR)
    name = "aggregator"
    streams = (subjects.STREAM_UPDATES, subjects.STREAM_SAMPLES)
    return User(
        name=name,
        role="aggregator",
        publish=(
            subjects.round_events_all(),
            subjects.adapter_published_all(),
            any_replica("control"),  # StartTraining
            any_replica("evaluate"),
            *_stream_info(),
            *(f"{JS_API}.STREAM.CREATE.{s}" for s in streams),  # it creates the streams at start
            f"{JS_API}.STREAM.NAMES",  # the consumer looks its stream up by subject
            *_consumer(subjects.STREAM_UPDATES, consumer, subjects.updates_all()),
            *pub_micro,
        ),
        subscribe=(
            subjects.telemetry_all(),
            subjects.aggregator("*"),
            subjects.coordinator_decisions(),  # a coordinator that decides is present: no built-in plans
            *sub_micro,
            inbox_prefix(name) + ".>",
        ),
        publish_deny=(subjects.updates_all(), subjects.samples_all(), subjects.coordinator("policy")),
        responses=Responses(max_msgs=1),
    )


def admin() -> User:
    return User(name="admin", role="admin", publish=(">",), subscribe=(">",))


def users(replica_ids: Sequence[str] = DEFAULT_REPLICAS, consumer: str = AGGREGATOR_CONSUMER) -> list[User]:
    out = [gateway(), coordinator(), aggregator(consumer), *(replica(r) for r in replica_ids), admin()]
    seen: dict[str, str] = {}
    for u in out:
        if u.password_var in seen:
            raise ValueError(f"users {seen[u.password_var]!r} and {u.name!r} share {u.password_var}")
        seen[u.password_var] = u.name
    return out


# --- the config file ------------------------------------------------------------------------------------
def _list(items: Sequence[str], indent: str) -> str:
    inner = "".join(f'{indent}  "{s}"\n' for s in items)
    return f"[\n{inner}{indent}]"


def render_user(u: User, password: str | None = None) -> str:
    """One user of the `authorization` block; its password is `$NATS_PASSWORD_<USER>` (read from the
    server's environment), or `password` itself, quoted, when given."""
    i = " " * 6
    lines = [
        "    {",
        f"{i}user: {u.name}",
        f"{i}password: " + (f'"{password}"' if password is not None else f"${u.password_var}"),
        f"{i}permissions: {{",
        f"{i}  publish: {{",
        f"{i}    allow: {_list(u.publish, i + '    ')}",
    ]
    if u.publish_deny:
        lines.append(f"{i}    deny: {_list(u.publish_deny, i + '    ')}")
    lines += [
        f"{i}  }}",
        f"{i}  subscribe: {{",
        f"{i}    allow: {_list(u.subscribe, i + '    ')}",
        f"{i}  }}",
    ]
    if u.responses is not None:
        lines.append(
            f'{i}  allow_responses: {{max: {u.responses.max_msgs}, expires: "{u.responses.expires}"}}'
        )
    lines += [f"{i}}}", "    }"]
    return "\n".join(lines)


HEADER = """\
# NATS users and permissions of CoLLM (included by nats.conf). Generated from collm_common.subjects by
#   .venv/bin/python -m collm_ops.nats_auth --replicas {replicas} --write
# Do not edit by hand: change tools/collm_ops/nats_auth.py and regenerate (a test checks this file).
#
# Each `$NATS_PASSWORD_<USER>` is read from nats-server's environment (docker-compose.yml passes them);
# a service logs in with COLLM_NATS_USER / COLLM_NATS_PASSWORD. Use passwords of letters, digits, `-`
# and `_` that start with a letter (nats-server parses an environment value like a config value). For
# bcrypt instead, replace `$NATS_PASSWORD_<USER>` by the quoted hash from `nats server passwd`.
#
# Another replica: regenerate with its id in --replicas (its user is `replica-<id>`, its password
# $NATS_PASSWORD_REPLICA_<ID>); a replica can only serve, publish and consume as the id in its user.
"""


def render_authorization(users_: Sequence[User], passwords: Mapping[str, str] | None = None) -> str:
    """The `authorization { users: [...] }` block of `users_`; with `passwords` (user -> password) each
    password is written into the block instead of its `$NATS_PASSWORD_<USER>` variable."""
    body = "\n".join(render_user(u, None if passwords is None else passwords[u.name]) for u in users_)
    return f"authorization {{\n  users: [\n{body}\n  ]\n}}\n"


def render(replica_ids: Sequence[str] = DEFAULT_REPLICAS, consumer: str = AGGREGATOR_CONSUMER) -> str:
    return (
        HEADER.format(replicas=",".join(replica_ids))
        + "\n"
        + render_authorization(users(replica_ids, consumer))
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collm_ops.nats_auth", description=__doc__.split("\n")[0])
    p.add_argument("--replicas", default=",".join(DEFAULT_REPLICAS), help="replica ids, comma separated")
    p.add_argument("--consumer", default=AGGREGATOR_CONSUMER, help="the aggregator's COLLM_CONSUMER_NAME")
    p.add_argument("--write", nargs="?", const=str(AUTH_CONF), help=f"write the file (default {AUTH_CONF})")
    p.add_argument("--env", action="store_true", help="list the password variables instead")
    args = p.parse_args(argv)
    ids = [r.strip() for r in args.replicas.split(",") if r.strip()]
    if args.env:
        sys.stdout.write("".join(f"{u.password_var}  ({u.name})\n" for u in users(ids, args.consumer)))
        return 0
    text = render(ids, args.consumer)
    if args.write:
        Path(args.write).write_text(text)
        sys.stderr.write(f"wrote {args.write}\n")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
