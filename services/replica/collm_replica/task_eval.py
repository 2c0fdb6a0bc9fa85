"""A stored version's task metric on this replica's held-out share, from its own served generations.

`TaskEvaluator.score(adapter, version, n)`: for each domain of `adapter`'s held-out data that has a task
metric (`ReplicaSettings.task_metrics`), the first `n` held-out examples (in the data's order, so every
version is scored on the same ones) are answered greedily by `adapter@v{version}` through the serving
engine (the version loaded like a request's; chat template as in training; the metric's `max_tokens`),
and scored against their reference responses (`task_metrics`). The generations are internal requests:
served in the engine's iterations beside users' requests, kept out of the SLO telemetry. Returns per
domain the metric, the mean score and the examples scored.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from collm_common.data import Example
from collm_common.store import version_id
from collm_common.wire.inference import ChatMessage
from collm_replica.adapters import AdapterManager
from collm_replica.engine import Engine, EngineRequest
from collm_replica.errors import ReplicaError
from collm_replica.task_metrics import METRICS, TaskMetric
from collm_replica.tokenization import chat_ids


@dataclass(frozen=True)
class TaskResult:
    metric: str
    score: float  # mean over `examples`, in [0, 1]
    examples: int


class TaskEvaluator:
    """See module docstring."""

    def __init__(
        self, engine: Engine, adapters: AdapterManager, tokenizer: Any, metrics_by_domain: dict[str, str]
    ) -> None:
        self.engine = engine
        self.adapters = adapters
        self.tok = tokenizer
        self.metrics_by_domain = metrics_by_domain

    def examples(self, adapter: str, n: int) -> dict[str, list[Example]]:
        """Per domain with a task metric, the first `n` held-out examples of `adapter`'s data here."""
        _, held = self.engine.examples_for(adapter)
        out: dict[str, list[Example]] = {}
        for e in held:
            d = e.domain or adapter
            if d in self.metrics_by_domain and len(out.setdefault(d, [])) < n:
                out[d].append(e)
        return {d: es for d, es in out.items() if es}

    async def score(self, adapter: str, version: int, n: int) -> dict[str, TaskResult]:
        todo = self.examples(adapter, n)
        if not todo:
            return {}
        await self.adapters.ensure(adapter, version)
        out: dict[str, TaskResult] = {}
        for domain, examples in todo.items():
            metric = METRICS[self.metrics_by_domain[domain]]
            answers = await asyncio.gather(*(self.answer(adapter, version, e, metric) for e in examples))
            scores = [metric.score(a, e.response) for a, e in zip(answers, examples, strict=True)]
            out[domain] = TaskResult(metric.name, sum(scores) / len(scores), len(scores))
        return out

    async def answer(self, adapter: str, version: int, e: Example, metric: TaskMetric) -> str:
        """`adapter@v{version}`'s greedy answer to `e` (at most the metric's `max_tokens`)."""
        msgs = [ChatMessage(role=m["role"], content=m["content"]) for m in e.messages()]
        req = EngineRequest(
            request_id=f"task-{uuid.uuid4().hex[:12]}",
            prompt_ids=chat_ids(self.tok, msgs),
            adapter=adapter,
            version_id=version_id(adapter, version),
            max_tokens=metric.max_tokens,
            temperature=0.0,
            internal=True,
        )
        events: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(ev: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        await self.adapters.submit(req, sink, version)
        text: list[str] = []
        while True:
            ev = await events.get()
            if ev.kind == "token":
                text.append(ev.text)
            elif ev.kind == "finished":
                return "".join(text)
            elif ev.kind == "error":
                raise ReplicaError(ev.code, f"task generation failed: {ev.message}", ev.type)
