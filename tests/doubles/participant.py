"""`ParticipantDouble`: a process-free stand-in for a replica's federated-round role, for aggregator tests.

It speaks the real protocol over real NATS and Redis: a `collm-replica` micro service with `control`
(answers `StartTraining`, then "trains" and sends a `LocalUpdate` on JetStream with its blob stored by
`AdapterStore.put_update`) and `evaluate` (answers `EvaluateCandidate` with an `EvalReport`), telemetry
on `subjects.telemetry(id)`, and it loads every `AdapterPublished` version from the store (digest
checked) to record what it "serves". There is no model: each double has a fixed target matrix per LoRA
module, "training" takes gradient steps of ||scaling * B·A - T||^2 on B, and the "held-out loss" is that
distance (plus 1), so averaging honest updates really lowers the cohort's loss.

`mode` makes a double misbehave on purpose: `nan` (NaN in B), `wrong_base` (claims another base
version), `huge` (a change of enormous norm), `harmful` (steps away from its target), `silent` (accepts
StartTraining, never sends), `refuse` (ControlReply ok=False). `inject_update` sends an update for any
round without being asked (a stranger, or a second update).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from collm_common import subjects
from collm_common.bus import Bus, MicroService
from collm_common.lora import AdapterWeights, LoraSpec, decode_adapter, encode_adapter, lora_key
from collm_common.store import AdapterStore
from collm_common.wire.adapters import AdapterPublished
from collm_common.wire.control import CONTROL_COMMAND, ControlReply, StartTraining
from collm_common.wire.rounds import DomainLoss, EvalReport, EvaluateCandidate, LocalUpdate
from collm_common.wire.telemetry import ReplicaTelemetry, ResidentAdapter

Mode = Literal["honest", "nan", "wrong_base", "huge", "harmful", "silent", "refuse"]
BASE_MODEL = "double-base"


def tiny_adapter(seed: int = 0, layers: int = 2, hidden: int = 16, kv: int = 8, r: int = 4) -> AdapterWeights:
    """A v1 the way PEFT initialises one: A random, B zero (q_proj [hidden->hidden], v_proj [hidden->kv])."""
    g = torch.Generator().manual_seed(seed)
    spec = LoraSpec(r=r, alpha=2.0 * r, target_modules=("q_proj", "v_proj"))
    t: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for mod, out in (("self_attn.q_proj", hidden), ("self_attn.v_proj", kv)):
            t[lora_key(i, mod, "A")] = torch.randn(r, hidden, generator=g) / hidden**0.5
            t[lora_key(i, mod, "B")] = torch.zeros(out, r)
    return AdapterWeights(tensors=t, spec=spec, base_model=BASE_MODEL)


@dataclass
class ParticipantBehaviour:
    mode: Mode = "honest"
    train_delay_s: float = 0.05
    # Training waits until this is set (None: it does not wait), then `train_delay_s`.
    train_gate: asyncio.Event | None = None
    eval_delay_s: float = 0.0
    # Evaluations wait until this is set (None: they do not wait), then `eval_delay_s`.
    eval_gate: asyncio.Event | None = None
    num_samples: int = 100
    eval_examples: int = 10
    steps: int = 20
    step_size: float = 0.1
    domain: str = "general"
    eval_set: str = "held-out-1"  # digest of its held-out set (change it to simulate new eval samples)


@dataclass
class ParticipantDouble:
    bus: Bus
    store: AdapterStore
    replica_id: str
    behaviour: ParticipantBehaviour = field(default_factory=ParticipantBehaviour)
    served: dict[str, int] = field(default_factory=dict)
    started: list[StartTraining] = field(default_factory=list)
    evaluated: list[EvaluateCandidate] = field(default_factory=list)
    sent: list[LocalUpdate] = field(default_factory=list)
    # Every blob it stored, by key (a finished round's blobs are deleted from the store).
    blobs: dict[str, bytes] = field(default_factory=dict)
    _svc: MicroService | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    # --- lifecycle ------------------------------------------------------------------------------------
    async def start(self, telemetry: bool = True) -> ParticipantDouble:
        svc = await self.bus.service(
            subjects.SERVICE_REPLICA, "0.0.0-double", "participant double", {"replica_id": self.replica_id}
        )
        await svc.endpoint(
            "control", subjects.replica(self.replica_id, "control"), CONTROL_COMMAND, self._control
        )
        await svc.endpoint(
            "evaluate", subjects.replica(self.replica_id, "evaluate"), EvaluateCandidate, self._evaluate
        )
        self._svc = svc
        await self.bus.subscribe(subjects.adapter_published_all(), AdapterPublished, self._on_published)
        if telemetry:
            self._spawn(self._telemetry_loop())
        return self

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._svc is not None:
            await self._svc.stop()

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _telemetry_loop(self) -> None:
        while True:
            msg = ReplicaTelemetry(
                replica_id=self.replica_id,
                ts_unix_s=time.time(),
                interval_s=0.2,
                model=BASE_MODEL,
                local_samples=self.behaviour.num_samples,
                domains=[self.behaviour.domain],
                adapters=[
                    ResidentAdapter(name=n, version_id=f"{n}@v{v}", version=v) for n, v in self.served.items()
                ],
            )
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.telemetry(self.replica_id), msg)
            await asyncio.sleep(0.2)

    # --- the "model" ----------------------------------------------------------------------------------
    def target(self, key_prefix: str, shape: tuple[int, int]) -> np.ndarray:
        """A rank-2 target: a part every double shares (like a common language) plus its own part."""

        def rank1(name: str) -> np.ndarray:
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
            rng = np.random.default_rng(seed)
            return (
                rng.standard_normal((shape[0], 1))
                @ rng.standard_normal((1, shape[1]))
                / np.sqrt(shape[0] * shape[1])
            )

        return 0.4 * rank1(f"shared/{key_prefix}") + 0.2 * rank1(f"{self.replica_id}/{key_prefix}")

    def loss(self, w: AdapterWeights) -> float:
        total = 0.0
        for k in w.tensors:
            if not k.endswith(".lora_A.weight"):
                continue
            prefix = k[: -len(".lora_A.weight")]
            a = w.tensors[k].double().numpy()
            b = w.tensors[prefix + ".lora_B.weight"].double().numpy()
            t = self.target(prefix, (b.shape[0], a.shape[1]))
            total += float(np.sum((w.spec.scaling * b @ a - t) ** 2))
        return 1.0 + total

    def train(self, w: AdapterWeights) -> AdapterWeights:
        sign = -1.0 if self.behaviour.mode == "harmful" else 1.0
        out = {k: v.clone() for k, v in w.tensors.items()}
        for k in w.tensors:
            if not k.endswith(".lora_A.weight"):
                continue
            prefix = k[: -len(".lora_A.weight")]
            a = out[k].double().numpy()
            b = out[prefix + ".lora_B.weight"].double().numpy()
            t = self.target(prefix, (b.shape[0], a.shape[1]))
            s = w.spec.scaling
            for _ in range(self.behaviour.steps):
                grad_b = s * (s * b @ a - t) @ a.T
                b = b - sign * self.behaviour.step_size * grad_b
            out[prefix + ".lora_B.weight"] = torch.from_numpy(b).float()
        if self.behaviour.mode == "nan":
            first_b = next(k for k in out if k.endswith(".lora_B.weight"))
            out[first_b][0, 0] = float("nan")
        if self.behaviour.mode == "huge":
            out = {k: v + 1e4 for k, v in out.items()}
        return AdapterWeights(tensors=out, spec=w.spec, base_model=w.base_model)

    # --- endpoints --------------------------------------------------------------------------------------
    async def _control(self, cmd: object, _headers: Mapping[str, str]) -> ControlReply:
        if not isinstance(cmd, StartTraining):
            return ControlReply(ok=True, message=f"ignored {type(cmd).__name__}")
        self.started.append(cmd)
        if self.behaviour.mode == "refuse":
            return ControlReply(ok=False, message="refused by the participant double")
        if self.behaviour.mode != "silent" and cmd.round_id is not None:
            self._spawn(self._train_and_send(cmd))
        return ControlReply(ok=True, message="training")

    async def _train_and_send(self, cmd: StartTraining) -> None:
        if self.behaviour.train_gate is not None:
            await self.behaviour.train_gate.wait()
        await asyncio.sleep(self.behaviour.train_delay_s)
        base_version = cmd.base_version or await self.store.current(cmd.adapter)
        assert base_version is not None and cmd.round_id is not None
        await self.inject_update(cmd.round_id, cmd.adapter, base_version)

    async def inject_update(
        self, round_id: int, adapter: str, base_version: int, claimed_base: int | None = None
    ) -> LocalUpdate:
        """Train from `adapter@v{base_version}` and send the update for `round_id`, asked or not."""
        base = decode_adapter(await self.store.get_blob(adapter, base_version))
        blob = encode_adapter(self.train(base))
        key, sha = await self.store.put_update(round_id, self.replica_id, blob)
        self.blobs[key] = blob
        claimed = claimed_base if claimed_base is not None else base_version
        if self.behaviour.mode == "wrong_base" and claimed_base is None:
            claimed = base_version + 5
        update = LocalUpdate(
            round_id=round_id,
            adapter=adapter,
            replica_id=self.replica_id,
            base_version=claimed,
            blob_key=key,
            sha256=sha,
            num_samples=self.behaviour.num_samples,
            num_tokens=self.behaviour.num_samples * 50,
            created_unix_s=time.time(),
        )
        from collm_common.wire import encode

        await self.bus.js.publish(
            subjects.update(round_id, self.replica_id),
            encode(update),
            headers={"Nats-Msg-Id": f"{round_id}:{self.replica_id}:{sha[:12]}"},
        )
        self.sent.append(update)
        return update

    async def _evaluate(self, req: EvaluateCandidate, _headers: Mapping[str, str]) -> EvalReport:
        self.evaluated.append(req)
        if self.behaviour.eval_gate is not None:
            await self.behaviour.eval_gate.wait()
        await asyncio.sleep(self.behaviour.eval_delay_s)
        if req.candidate_version is not None:  # a stored version scored on its own (pre-scoring)
            cand = decode_adapter(await self.store.get_blob(req.adapter, req.candidate_version))
        else:
            cand = decode_adapter(await self.store.get_update(req.candidate_key, req.candidate_sha256))
        current_loss = None
        if req.current_version is not None and req.score_current:
            current_loss = self.loss(
                decode_adapter(await self.store.get_blob(req.adapter, req.current_version))
            )
        n = self.behaviour.eval_examples
        cand_loss = self.loss(cand)
        # Task metrics of a stored version: a score that rises as the loss falls (1 / (1 + loss)).
        task = (
            {
                "task_metric": "answer_accuracy",
                "task_score": 1 / (1 + cand_loss),
                "task_examples": req.task_examples,
            }
            if req.task_examples > 0 and req.candidate_version is not None
            else {}
        )
        return EvalReport(
            replica_id=self.replica_id,
            adapter=req.adapter,
            losses=[
                DomainLoss(
                    domain=self.behaviour.domain,
                    num_examples=n,
                    num_tokens=n * 40,
                    current_loss=current_loss,
                    candidate_loss=cand_loss,
                    eval_set=self.behaviour.eval_set,
                    **task,
                )
            ],
        )

    async def _on_published(self, ev: AdapterPublished, _msg: object) -> None:
        blob = await self.store.get_blob(ev.name, ev.version)  # digest-checked, like a replica's swap
        decode_adapter(blob)
        if ev.version > self.served.get(ev.name, 0):
            self.served[ev.name] = ev.version
