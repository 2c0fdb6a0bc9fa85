"""The running batch's bound: the KV pool and the token budget bound it, `max_batch` only from above, and
a full batch's decodes leave every iteration `prefill_reserve_tokens` for the prompts waiting."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from collm_replica.engine.batcher import check_request
from collm_replica.engine.kv import BlockManager
from collm_replica.engine.scheduler import (
    BackgroundSettings,
    BatchConfig,
    Plan,
    SeqView,
    plan_iteration,
    timings,
)
from collm_replica.engine.types import EngineConfig, EngineRefusal, EngineRequest


@dataclass
class Req:
    prompt: int
    max_out: int
    arrived: int  # the iteration it arrived in
    computed: int = 0
    out: int = 0
    first_token: int | None = None  # the iteration that gave its first token


@dataclass
class Driver:
    """`plan_iteration` over a block manager, each plan applied as the engine applies it: preempted
    sequences lose their blocks and go to the front of the queue, every planned token is computed (the
    block manager raises if the plan oversubscribed the pool), a sequence that has computed all its known
    tokens generates the next one, and one that has generated `max_out` tokens ends."""

    cfg: BatchConfig
    reqs: dict[str, Req] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    iteration: int = 0
    preemptions: int = 0
    peak_running: int = 0

    def __post_init__(self) -> None:
        self.blocks = BlockManager(self.cfg.num_blocks, self.cfg.block_size)

    def arrive(self, sid: str, prompt: int, max_out: int) -> None:
        self.reqs[sid] = Req(prompt, max_out, self.iteration)
        self.waiting.append(sid)

    def view(self, sid: str) -> SeqView:
        r = self.reqs[sid]
        return SeqView(sid, r.prompt, r.computed, output_len=r.out, blocks_held=self.blocks.held(sid))

    def step(self) -> Plan:
        self.iteration += 1
        plan = plan_iteration(
            self.cfg,
            [self.view(s) for s in self.running],
            [self.view(s) for s in self.waiting],
            free_blocks=self.blocks.num_free,
        )
        for sid in plan.preempted:
            self.blocks.free(sid)
            self.reqs[sid].computed = 0
            self.running.remove(sid)
        self.preemptions += len(plan.preempted)
        self.waiting = list(plan.preempted) + [s for s in self.waiting if s not in plan.admitted]
        self.running += plan.admitted
        self.peak_running = max(self.peak_running, len(self.running))
        for sid, n in plan.items:
            r = self.reqs[sid]
            self.blocks.grow(sid, r.computed + n)
            r.computed += n
            if r.computed == r.prompt + r.out:
                r.out += 1
                if r.first_token is None:
                    r.first_token = self.iteration
                if r.out >= r.max_out:
                    self.blocks.free(sid)
                    self.running.remove(sid)
        return plan

    def drain(self, most: int) -> None:
        while self.running or self.waiting:
            self.step()
            assert self.iteration < most, "the batch did not drain"


def test_the_default_bound_is_the_token_budget_less_one_prefill_chunk() -> None:
    cfg = BatchConfig()
    assert (cfg.max_batch, cfg.max_batch_tokens, cfg.prefill_chunk_tokens) == (128, 256, 128)
    assert cfg.prefill_reserve_tokens == 128 and cfg.max_running == 128
    # A chunk of the whole budget: decodes keep half of it. A budget of one token: one sequence.
    assert BatchConfig(max_batch=500, max_batch_tokens=256, prefill_chunk_tokens=256).max_running == 128
    assert BatchConfig(max_batch=8, max_batch_tokens=1).max_running == 1
    assert BatchConfig(max_batch=4).max_running == 4  # max_batch bounds from above


def test_a_pool_large_enough_admits_beyond_16() -> None:
    # 64 concurrent requests of 200 prompt and 128 output tokens: the default pool (2048 blocks) holds
    # them all (21 blocks each), so all 64 run at once and none is preempted.
    d = Driver(BatchConfig())
    for i in range(64):
        d.arrive(f"q{i}", 200, 128)
    d.drain(most=1000)
    assert d.peak_running == 64 and d.preemptions == 0
    # Prefill goes at the budget's pace (12800 prompt tokens, 256 per iteration less the decodes), and no
    # request waits for another's output: the last first token comes well before one request's 128.
    assert max(r.first_token or 0 for r in d.reqs.values()) < 100


def test_a_small_pool_bounds_the_batch() -> None:
    # 64 blocks of 16 tokens: a request's first chunk takes 8, its whole sequence 21; the pool, not
    # max_batch, bounds the batch, and preemption keeps every request going to its end.
    d = Driver(BatchConfig(kv_budget_tokens=64 * 16))
    for i in range(64):
        d.arrive(f"q{i}", 200, 128)
    d.drain(most=20_000)
    assert d.peak_running <= 64 // 8 < d.cfg.max_running
    assert all(r.out == r.max_out for r in d.reqs.values())


def test_the_token_budget_bounds_a_batch_that_max_batch_would_allow() -> None:
    # max_batch 1000 in a pool that holds them all: admission stops at max_running (256 - 128), and every
    # running sequence decodes every iteration.
    d = Driver(BatchConfig(max_batch=1000, kv_budget_tokens=1 << 20))
    for i in range(300):
        d.arrive(f"q{i}", 8, 64)
    while d.waiting or d.running:
        decoding = sum(1 for s in d.running if d.view(s).pending == 1 and not d.view(s).prefilling)
        plan = d.step()
        assert plan.tokens <= d.cfg.max_batch_tokens
        assert sum(1 for _, n in plan.items if n == 1) >= decoding  # no running decode left out
    assert d.peak_running == d.cfg.max_running == 128


@pytest.mark.parametrize("max_batch", [128, 1000])
def test_decodes_never_starve_a_waiting_prefill(max_batch: int) -> None:
    # A full batch of long decodes and a stream of new prompts: every iteration with prompt tokens to
    # compute and room to admit gives prefill at least `prefill_reserve_tokens` (or all that is pending),
    # so a 300-token prompt that arrives at a full batch's free slot has its first token 3 iterations on.
    cfg = BatchConfig(max_batch=max_batch, kv_budget_tokens=1 << 20)
    d = Driver(cfg)
    for i in range(cfg.max_running - 1):
        d.arrive(f"long{i}", 4, 10_000)
    while any(d.view(s).prefilling for s in d.running) or d.waiting:
        d.step()
    for k in range(40):
        if k % 4 == 0:
            d.arrive(f"new{k}", 300, 2)
        running = [d.view(s) for s in d.running]
        pending = sum(s.pending for s in running if s.prefilling)
        room = cfg.max_running - len(running)
        pending += sum(d.view(s).pending for s in d.waiting[: max(0, room)])
        plan = d.step()
        prefill = sum(n for sid, n in plan.items if sid.startswith("new"))
        assert prefill >= min(cfg.prefill_reserve_tokens, pending), (k, prefill, pending)
        assert sum(1 for sid, _ in plan.items if sid.startswith("long")) == cfg.max_running - 1
    ttft = [r.first_token - r.arrived for sid, r in d.reqs.items() if sid.startswith("new") and r.first_token]
    assert ttft and max(ttft) == 3  # ceil(300 / 128) iterations


def test_n_choices_must_fit_the_bound_and_the_background_model_sees_it() -> None:
    cfg = EngineConfig(batch=BatchConfig(max_batch=8, max_batch_tokens=8, prefill_chunk_tokens=4))
    assert cfg.batch.max_running == 4
    check_request(EngineRequest("a", [1, 2], max_tokens=4, n=4), cfg, 64)
    with pytest.raises(EngineRefusal, match="at most 4 sequences"):
        check_request(EngineRequest("b", [1, 2], max_tokens=4, n=5), cfg, 64)
    settings = BackgroundSettings(cfg.batch, 0.4, 0.5, 0.1, 128, 512)
    _, _, model = timings(0.0, [], [], [], settings, 10.0, 1.0)
    assert model.max_batch == 4
