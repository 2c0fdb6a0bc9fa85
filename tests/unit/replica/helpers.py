"""Drive an engine synchronously from a test: submit requests, collect their events."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from collm_common.lora import AdapterWeights, LoraSpec
from collm_replica.engine import Engine, EngineRequest
from collm_replica.engine.executor import Executor
from collm_replica.lora_bank import LiveLora
from collm_replica.models import LoadedModel


@dataclass
class Collector:
    events: list[Any] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def __call__(self, ev: Any) -> None:
        self.events.append(ev)
        if ev.kind in ("finished", "error"):
            self.done.set()

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.kind == "token" for t in e.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "token")

    @property
    def finished(self) -> Any:
        return next(e for e in self.events if e.kind == "finished")

    @property
    def accepted(self) -> Any:
        return self.events[0]


def submit_all(engine: Engine, reqs: list[EngineRequest], timeout_s: float = 30.0) -> dict[str, Collector]:
    out = {}
    for r in reqs:
        c = Collector()
        engine.submit(r, c)
        out[r.request_id] = c
    for rid, c in out.items():
        assert c.done.wait(timeout_s), f"{rid} did not finish"
    return out


def random_adapter(tiny: LoadedModel, seed: int, scale: float = 0.5) -> AdapterWeights:
    ex = Executor(tiny)
    live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, tiny.name, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    for _a, b in live.params.values():
        b.data.copy_(torch.randn(b.shape, generator=g) * scale)
    return live.to_weights()


def greedy(
    rid: str, ids: list[int], n: int = 8, adapter: str | None = None, version: str | None = None, **kw: Any
) -> EngineRequest:
    return EngineRequest(
        rid, ids, adapter=adapter, version_id=version, max_tokens=n, temperature=0.0, ignore_eos=True, **kw
    )
