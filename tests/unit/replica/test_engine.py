"""The engine on the tiny model: batching, multi-LoRA, shadow swap, training, refusals, stops."""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable

import pytest
import torch

from collm_common.data import Example, LocalDataset
from collm_common.lora import LoraSpec
from collm_common.step_log import BackgroundWork, InferenceStep
from collm_replica.costs import FinishedSample, predicted_queue_wait_s
from collm_replica.engine import Engine, EngineConfig, EngineRefusal, EngineRequest, NotResident
from collm_replica.engine.cosched import NoTraining, SloAwareCoScheduler
from collm_replica.engine.scheduler import BatchConfig
from collm_replica.lora_bank import LiveLora
from collm_replica.models import LoadedModel, load_model
from collm_replica.training import JobConfig, JobSpec
from tests.unit.replica.helpers import Collector, greedy, random_adapter, submit_all

P1 = [5, 17, 42, 99, 120, 7, 3, 250, 11, 64, 33]
P2 = [8, 9, 10, 200, 201, 202]
P3 = [300, 301, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]


def until(check: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def hf_greedy(tiny: LoadedModel, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def test_batched_greedy_equals_hf_generate(tiny: LoadedModel) -> None:
    cfg = EngineConfig(batch=BatchConfig(max_batch=4, max_batch_tokens=8, prefill_chunk_tokens=4))
    with Engine(tiny, cfg, NoTraining()) as eng:
        res = submit_all(eng, [greedy("a", P1, 12), greedy("b", P2, 12), greedy("c", P3, 12)])
    for rid, p in (("a", P1), ("b", P2), ("c", P3)):
        assert res[rid].token_ids == hf_greedy(tiny, p, 12)
        fin = res[rid].finished
        assert fin.finish_reason == "length" and fin.completion_tokens == 12
        assert fin.adapter_version_id == "base" and res[rid].accepted.adapter_version_id == "base"
        assert [e.seq for e in res[rid].events if e.kind == "token"] == list(range(12))
    # The forward passes are part of the inference iterations' time, not all of it.
    assert 0 < eng.forward_ms_total < eng.infer_ms_total


def test_chunked_prefill_does_not_stall_decodes(tiny: LoadedModel) -> None:
    """A long prompt arriving while another request decodes: the decode gets a token every iteration."""
    cfg = EngineConfig(batch=BatchConfig(max_batch=4, max_batch_tokens=9, prefill_chunk_tokens=8))
    eng = Engine(tiny, cfg, NoTraining())
    short = Collector()
    eng.submit(greedy("short", P2, 30), short)
    eng._iteration()  # prefill of the short prompt (6 tokens)
    long = Collector()
    eng.submit(greedy("long", (P1 * 6)[:64], 2), long)
    before = len(short.token_ids)
    iters = 0
    while not long.token_ids:
        eng._iteration()
        iters += 1
        assert len(short.token_ids) == before + iters  # one decode token per iteration, no stall
    assert iters == 8  # 64 prompt tokens in chunks of 8
    eng.stop()


def test_mixed_adapter_batch_equals_alone(tiny: LoadedModel) -> None:
    cfg = EngineConfig(max_resident_adapters=4)
    with Engine(tiny, cfg, NoTraining()) as eng:
        eng.install_version("med@v1", random_adapter(tiny, 1)).result(10)
        eng.install_version("bank@v2", random_adapter(tiny, 2)).result(10)
        reqs = [("a", P1, "med"), ("b", P2, "bank"), ("c", P3, None), ("d", P2, "med"), ("e", P1, "bank")]
        alone = {rid: submit_all(eng, [greedy(rid, p, 10, adapter=ad)])[rid].token_ids for rid, p, ad in reqs}
        together = submit_all(eng, [greedy(rid + "2", p, 10, adapter=ad) for rid, p, ad in reqs])
    for rid, _p, ad in reqs:
        assert together[rid + "2"].token_ids == alone[rid]
        assert (
            together[rid + "2"].finished.adapter_version_id
            == {"med": "med@v1", "bank": "bank@v2", None: "base"}[ad]
        )
    assert alone["a"] != alone["e"]  # the adapters really differ


def test_unknown_adapter_is_not_resident(tiny: LoadedModel) -> None:
    eng = Engine(tiny, EngineConfig(), NoTraining())
    with pytest.raises(NotResident):
        eng.submit(greedy("x", P1, 2, adapter="nope"), Collector())
    with pytest.raises(NotResident):
        eng.submit(greedy("x", P1, 2, adapter="nope", version="nope@v3"), Collector())


def test_swap_is_atomic_per_request(tiny: LoadedModel) -> None:
    """A version published mid-stream: running requests finish on theirs, new ones get the new one."""
    cfg = EngineConfig(max_resident_adapters=4)
    v1, v2 = random_adapter(tiny, 1), random_adapter(tiny, 2)
    with Engine(tiny, cfg, NoTraining()) as eng:
        eng.install_version("med@v1", v1).result(10)
        ref_v1 = submit_all(eng, [greedy("r1", P1, 24, adapter="med")])["r1"].token_ids
        eng.install_version("med@v9", v2).result(10)
        ref_v2 = submit_all(eng, [greedy("r2", P1, 24, adapter="med")])["r2"].token_ids
        eng.install_version("med@v1", v1).result(10)  # make v1 current again
        assert eng.current_version("med") == "med@v1"
        old = Collector()
        eng.submit(greedy("old", P1, 24, adapter="med"), old)
        while len(old.token_ids) < 3:
            time.sleep(0.001)
        eng.install_version("med@v9", v2).result(10)  # swap while "old" streams
        new = submit_all(eng, [greedy("new", P1, 24, adapter="med")])["new"]
        assert old.done.wait(10)
    assert old.accepted.adapter_version_id == old.finished.adapter_version_id == "med@v1"
    assert old.token_ids == ref_v1
    assert new.accepted.adapter_version_id == new.finished.adapter_version_id == "med@v9"
    assert new.token_ids == ref_v2
    assert ref_v1 != ref_v2


def test_eviction_is_lru_and_never_evicts_in_use(tiny: LoadedModel) -> None:
    cfg = EngineConfig(max_resident_adapters=2)
    with Engine(tiny, cfg, NoTraining()) as eng:
        eng.install_version("a@v1", random_adapter(tiny, 1)).result(10)
        eng.install_version("b@v1", random_adapter(tiny, 2)).result(10)
        submit_all(eng, [greedy("x", P2, 2, adapter="a")])  # a used more recently than b
        eng.install_version("c@v1", random_adapter(tiny, 3)).result(10)
        assert eng.is_resident("a@v1") and eng.is_resident("c@v1") and not eng.is_resident("b@v1")
    # Pin every resident version with queued requests (acquired at admission): a new version must wait.
    eng = Engine(tiny, cfg, NoTraining())  # not started: iterations run by hand, deterministically
    eng.install_version("a@v1", random_adapter(tiny, 1))
    eng.install_version("c@v1", random_adapter(tiny, 3))
    eng._iteration()
    ca, cc = Collector(), Collector()
    eng.submit(greedy("pa", P2, 3, adapter="a"), ca)
    eng.submit(greedy("pc", P2, 3, adapter="c"), cc)
    fut = eng.install_version("d@v1", random_adapter(tiny, 4), timeout_s=0.0)
    eng._iteration()
    with pytest.raises(EngineRefusal) as exc:
        fut.result(1)
    assert exc.value.code == 503 and eng.is_resident("a@v1") and eng.is_resident("c@v1")
    while not (ca.done.is_set() and cc.done.is_set()):
        eng._iteration()
    assert ca.finished.adapter_version_id == "a@v1" and cc.finished.adapter_version_id == "c@v1"
    fut = eng.install_version("d@v1", random_adapter(tiny, 4))
    eng._iteration()
    assert fut.result(1) == "d@v1" and eng.is_resident("d@v1")
    assert len(eng.snapshot().adapters) == 2


def test_context_limit_refusal(tiny: LoadedModel) -> None:
    """A prompt that, with max_tokens, does not fit the context is OpenAI's `context_length_exceeded` in
    vLLM's words (clients such as litellm and LangChain match them); the caller names the field."""
    eng = Engine(tiny, EngineConfig(), NoTraining())
    limit = tiny.max_model_len
    for prompt, max_tokens in ((limit, 1), (limit - 10, 20)):
        with pytest.raises(EngineRefusal) as exc:
            eng.submit(greedy("x", [5] * prompt, max_tokens), Collector())
        err = exc.value
        assert err.code == 400 and err.error_code == "context_length_exceeded" and err.param is None
        assert err.message.startswith(f"This model's maximum context length is {limit} tokens. ")
        assert f"you requested {prompt + max_tokens} tokens ({prompt} in the prompt" in err.message
    eng.submit(greedy("fits", [5] * (limit - 20), 20), Collector())


def test_queue_full_refusal(tiny: LoadedModel) -> None:
    eng = Engine(tiny, EngineConfig(max_queue=2), NoTraining())  # not started: nothing leaves the queue
    eng.submit(greedy("a", P1, 2), Collector())
    eng.submit(greedy("b", P1, 2), Collector())
    with pytest.raises(EngineRefusal) as exc:
        eng.submit(greedy("c", P1, 2), Collector())
    assert exc.value.code == 429


def test_a_predicted_wait_past_the_slo_is_refused_when_asked(tiny: LoadedModel) -> None:
    """`admit_wait_slo_factor`: the queue's wait is predicted from the pace of recent completions
    (here 10 in 30 s: a slot frees every 3 s), and a request that would wait more than the factor times
    its TTFT SLO is refused with 429; without the setting only `max_queue` bounds the queue."""
    now = [100.0]
    cfg = EngineConfig(admit_wait_slo_factor=2.0, default_ttft_slo_ms=2000.0, slo_window_s=30.0)
    eng = Engine(tiny, cfg, NoTraining(), clock=lambda: now[0])  # not started: nothing leaves the queue
    now[0] = 130.0
    for i in range(10):
        eng.window.add(FinishedSample(101.0 + 3 * i, 50.0, 10.0, True))
    eng.submit(greedy("a", P1, 2), Collector())  # 1 x 3 s ahead of it: within 2 x 2 s
    with pytest.raises(EngineRefusal) as exc:
        eng.submit(greedy("b", P1, 2), Collector())  # 2 x 3 s
    assert exc.value.code == 429 and "TTFT SLO" in exc.value.message
    eng.submit(greedy("c", P1, 2, ttft_slo_ms=10_000.0), Collector())  # its own SLO leaves room
    plain = Engine(tiny, EngineConfig(), NoTraining(), clock=lambda: now[0])
    for i in range(10):
        plain.window.add(FinishedSample(101.0 + 3 * i, 50.0, 10.0, True))
    for rid in ("x", "y", "z"):
        plain.submit(greedy(rid, P1, 2), Collector())


def test_the_queue_wait_is_predicted_from_recent_completions() -> None:
    assert predicted_queue_wait_s(0, 10, 30.0) == pytest.approx(3.0)
    assert predicted_queue_wait_s(4, 10, 30.0) == pytest.approx(15.0)
    assert predicted_queue_wait_s(4, 3, 30.0) is None  # too few completions to know the pace
    assert predicted_queue_wait_s(4, 10, 0.0) is None


def test_a_request_dropped_at_its_deadline_counts_as_a_miss(tiny: LoadedModel) -> None:
    """The replica's SLO window (telemetry's attainment, the coordinator's virtual queue) counts a request
    dropped from the queue at its deadline as finished and not good, without latencies."""
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(
            eng, [greedy("late", P1, 4, deadline_unix_s=time.time() - 1.0), greedy("served", P2, 4)]
        )
        window = eng.snapshot().latency
    assert res["late"].finished.finish_reason == "deadline"
    assert res["served"].finished.finish_reason == "length"
    assert window["finished"] == 2 and window["slo_attainment"] == pytest.approx(window["good"] / 2)
    assert window["good"] <= 1


@pytest.mark.parametrize("trained_ms_per_read", [0.0, 1e6])
def test_a_finished_request_is_judged_also_without_the_training_while_it_was_in_flight(
    tiny: LoadedModel, trained_ms_per_read: float
) -> None:
    """The window counts `good_alone`: the request's TTFT less the replica's training between its intake
    and its first token, its TPOT less the training after, against its SLOs. The replica's training
    counter here moves by `trained_ms_per_read` at each read (intake, first token, end): a request that
    misses its 1-us TTFT SLO is good alone only when that much training ran while it was in flight."""
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        reads = iter(range(1, 100))
        eng.output.train_ms_total = lambda: next(reads) * trained_ms_per_read
        submit_all(eng, [greedy("r", P1, 6, ttft_slo_ms=0.001, tpot_slo_ms=0.001)])
        window = eng.snapshot().latency
    assert window["finished"] == 1 and window["good"] == 0
    assert window["good_alone"] == (1 if trained_ms_per_read else 0)


def test_stop_string_across_token_boundaries(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        free = submit_all(eng, [greedy("free", P1, 24)])["free"]
        text = free.text
        # A stop string that straddles tokens: the text of tokens 3..5, cut inside both ends.
        start = len(tiny.tokenizer.decode(free.token_ids[:3]))
        stop = text[start + 1 : start + 5]
        assert len(stop) >= 2
        res = submit_all(eng, [greedy("stopped", P1, 24, stop=[stop])])["stopped"]
    assert res.finished.finish_reason == "stop"
    assert res.text == text[: text.index(stop)]
    assert stop not in res.text


def test_eos_ends_generation(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        free = submit_all(eng, [greedy("free", P1, 16)])["free"]
        first = free.token_ids[4]
        eng.eos_ids = {first}  # pretend the 5th token is EOS
        res = submit_all(eng, [EngineRequest("e", P1, max_tokens=16, temperature=0.0)])["e"]
    assert res.finished.finish_reason == "stop"
    assert res.token_ids == free.token_ids[:4]
    assert res.finished.completion_tokens == 4


def test_an_answer_without_tokens_has_ttft_equal_to_e2e(tiny: LoadedModel) -> None:
    """A request whose first token is EOS completes with no token: its TTFT is its whole latency."""
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        first = submit_all(eng, [greedy("free", P1, 4)])["free"].token_ids[0]
        eng.eos_ids = {first}
        res = submit_all(eng, [EngineRequest("e", P1, max_tokens=4, temperature=0.0)])["e"]
    fin = res.finished
    assert fin.finish_reason == "stop" and fin.completion_tokens == 0
    assert fin.ttft_ms == pytest.approx(fin.e2e_ms) and fin.ttft_ms > 0


def test_seeded_sampling_is_reproducible(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:

        def mk(rid: str, seed: int) -> EngineRequest:
            return EngineRequest(
                rid,
                P1,
                max_tokens=12,
                temperature=1.0,
                top_p=0.9,
                seed=seed,
                ignore_eos=True,
            )

        res = submit_all(eng, [mk("a", 7), mk("b", 7), mk("c", 8), greedy("g", P2, 12)])
    assert res["a"].token_ids == res["b"].token_ids
    assert res["a"].token_ids != res["c"].token_ids


def test_cancel_stops_generation(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        c = Collector()
        eng.submit(greedy("long", P1, 400), c)
        while len(c.token_ids) < 2:
            time.sleep(0.001)
        assert eng.cancel("long")
        assert c.done.wait(5)
    assert c.finished.finish_reason == "cancelled"
    assert len(c.token_ids) < 400
    assert not eng.cancel("long")


def dataset(n: int = 24) -> LocalDataset:
    ds = LocalDataset([], [])
    for i in range(n):
        ds.add(Example(f"ex{i}", f"hello world {i}", f"the quick brown fox {i % 5}", domain="med"), 0.25)
    return ds


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_training_changes_live_not_served(tiny: LoadedModel, matmul_dtype: str) -> None:
    cfg = EngineConfig(job=JobConfig(micro_tokens=32, batch_tokens=32, publish_every_steps=1000))
    if matmul_dtype != "float32":  # every pass multiplies in bf16: the same guarantees hold
        tiny = load_model("tiny", device="cpu", tiny_seed=0, matmul_dtype=matmul_dtype)
        assert tiny.matmul_dtype is not None
    eng = Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset())
    assert eng.executor.fast_all is (matmul_dtype != "float32")
    w = random_adapter(tiny, 1)
    eng.start()
    eng.install_version("med@v1", w).result(10)
    served_before = (
        {k: t.clone() for k, t in eng.bank.a.items()},
        {k: t.clone() for k, t in eng.bank.b.items()},
    )
    ref = submit_all(eng, [greedy("r", P1, 8, adapter="med")])["r"].token_ids
    live = LiveLora.from_weights(w, eng.executor.n_layers, eng.executor.shapes)
    live_before = live.snapshot()
    eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=10_000, learning_rate=1e-2)).result(10)
    deadline = time.time() + 20
    while eng.snapshot().jobs[0].steps_done < 2 and time.time() < deadline:
        time.sleep(0.01)
    eng.pause_training()
    time.sleep(0.1)
    assert eng.snapshot().jobs[0].steps_done >= 2
    changed = max(float((a.detach() - live_before[k][0]).abs().max()) for k, (a, _b) in live.params.items())
    assert changed > 0
    for k, t in eng.bank.a.items():
        assert torch.equal(t, served_before[0][k])
    for k, t in eng.bank.b.items():
        assert torch.equal(t, served_before[1][k])
    again = submit_all(eng, [greedy("r2", P1, 8, adapter="med")])["r2"]
    assert again.token_ids == ref and again.finished.adapter_version_id == "med@v1"
    eng.stop()


def test_pause_and_resume_training(tiny: LoadedModel) -> None:
    cfg = EngineConfig(job=JobConfig(micro_tokens=32, batch_tokens=64, publish_every_steps=1000))
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset()) as eng:
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=100_000)).result(10)
        until(lambda: eng.snapshot().ft_tokens_total > 0, "some training")
        eng.pause_training().result(10)  # in force (between iterations, no stretch in progress)
        snap = eng.snapshot()
        assert snap.training_paused and snap.jobs[0].state == "paused"
        t1 = snap.ft_tokens_total
        assert t1 > 0
        time.sleep(0.3)
        assert eng.snapshot().ft_tokens_total == t1  # nothing trains while paused
        eng.resume_training().result(10)
        until(lambda: eng.snapshot().ft_tokens_total > t1, "training after the resume")
        snap = eng.snapshot()
        assert snap.ft_tokens_total > t1 and snap.jobs[0].state == "running"


def test_serving_iterations_count_what_bounded_training(tiny: LoadedModel) -> None:
    cfg = EngineConfig(ft_share_default=0.0, job=JobConfig(micro_tokens=32, batch_tokens=32))
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset()) as eng:
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=100_000)).result(10)
        submit_all(eng, [greedy("r", P1, 12)])
        snap = eng.snapshot()
    # a zero share: every iteration that served while the job was active was bounded by the share
    assert snap.train_limits.get("share", 0) >= 11 and set(snap.train_limits) == {"share"}
    assert snap.ft_tokens_total == 0


class RecordingCoScheduler(SloAwareCoScheduler):
    """The SLO-aware co-scheduler, keeping the inputs it was asked about (a test double's window)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list = []

    def budget_ms(self, inp):  # noqa: ANN001, ANN201
        self.inputs.append(inp)
        return super().budget_ms(inp)


@pytest.mark.parametrize("reserve", [0.0, 0.5])
def test_background_work_plans_against_the_slos_less_the_reserve(tiny: LoadedModel, reserve: float) -> None:
    """A decoding request's next token is due `tpot_slo x (1 - reserve)` after the previous one's due
    time: consecutive deadlines of a lone request are that far apart (less the step-time noise). (A job
    and a share: without background work to grant, the decision computes no deadlines.)"""
    cfg = EngineConfig(
        train_slo_reserve_frac=reserve, ft_share_default=1.0, job=JobConfig(micro_tokens=32, batch_tokens=32)
    )
    rec = RecordingCoScheduler()
    with Engine(tiny, cfg, rec, dataset=dataset()) as eng:
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=100_000)).result(10)
        submit_all(eng, [greedy("r", P1, 8, tpot_slo_ms=1000.0, ttft_slo_ms=20_000.0)])
    decoding = [i.deadlines_s[0] for i in rec.inputs if i.running == 1 and i.deadlines_s][1:]
    gaps = [b - a for a, b in zip(decoding, decoding[1:], strict=False)]
    assert len(gaps) >= 4
    assert all(abs(g - (1.0 - reserve)) < 0.05 for g in gaps), gaps


def round_update_catcher() -> tuple[list, threading.Event, Callable[[object], None]]:
    """Job events as they come, and an event set at the first round update."""
    events: list = []
    got = threading.Event()

    def on_job(ev) -> None:  # noqa: ANN001
        events.append(ev)
        if ev.kind == "round_update":
            got.set()

    return events, got, on_job


def test_round_job_produces_an_update_and_no_local_version(tiny: LoadedModel) -> None:
    events, got, on_job = round_update_catcher()

    cfg = EngineConfig(job=JobConfig(micro_tokens=64, batch_tokens=64, publish_every_steps=1))
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), on_job_event=on_job) as eng:
        w = random_adapter(tiny, 1, scale=0.0)
        eng.install_version("med@v1", w).result(10)
        live = LiveLora.from_weights(w, eng.executor.n_layers, eng.executor.shapes)
        eng.start_job(
            JobSpec("med", "med@v1", 1, live, token_budget=600, learning_rate=5e-3, round_id=7)
        ).result(10)
        assert got.wait(60)
        upd = next(e for e in events if e.kind == "round_update")
        assert upd.round_id == 7 and upd.base_version == 1 and upd.weights is not None
        # It only trained: no losses of its own (the gate scores the candidate), and no replica-local
        # version (what serves changes when the round publishes).
        assert upd.num_tokens >= 600 and upd.eval_loss_before is None and upd.eval_loss_after is None
        assert upd.train_loss is not None
        assert not [e for e in events if e.kind == "refresh"] and eng.current_version("med") == "med@v1"


def test_evaluate_candidates(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining(), dataset=dataset(40)) as eng:
        runs = eng.evaluate([("base", None), ("cand", random_adapter(tiny, 3))], max_examples=8).result(30)
    base, cand = runs["base"].per_domain(), runs["cand"].per_domain()
    assert set(base) == set(cand) == {"med"}
    assert base["med"] != cand["med"] and base["med"] > 0


def test_round_job_stops_before_its_deadline(tiny: LoadedModel) -> None:
    """A round job whose deadline is near sends what it has (no final evaluation) instead of its budget."""
    events, got, on_job = round_update_catcher()

    cfg = EngineConfig(round_deadline_margin_s=0.5, job=JobConfig(micro_tokens=32, batch_tokens=64))
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), on_job_event=on_job) as eng:
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        spec = JobSpec(
            "med", "med@v1", 1, live, token_budget=10**9, round_id=3, deadline_unix_s=time.time() + 1.5
        )
        eng.start_job(spec).result(10)
        assert got.wait(10)
    upd = next(e for e in events if e.kind == "round_update")
    assert 0 < upd.num_tokens < 10**9 and upd.eval_loss_after is None


def test_cut_keeps_the_response_in_small_windows() -> None:
    from collm_replica.training import Rendered, cut

    r = Rendered("x", "d", list(range(30)), [-100] * 20 + list(range(20, 30)))
    w = cut(r, 12)
    assert len(w.ids) == 12 and w.ids[0] == 14 and w.labels.count(-100) == 6


def test_jobs_never_stall_on_adapter_slots(tiny: LoadedModel) -> None:
    """More adapters in use than slots: a job for a third adapter trains anyway (training needs no slot),
    its local refresh reports why it waits instead of stalling, and succeeds once a slot frees (the idle
    least recently used version is evicted, never a pinned one)."""
    cfg = EngineConfig(
        replica_id="rs",
        max_resident_adapters=2,
        ft_share_default=1.0,
        # SLOs that leave the running requests slack, and a training piece room within the guard
        # (0.4 x TTFT), on a machine of any speed (a decode step or a training piece of the tiny model
        # takes a few ms here, tens of ms when the machine is busy): training goes on while they run.
        default_ttft_slo_ms=1000.0,
        default_tpot_slo_ms=200.0,
        job=JobConfig(micro_tokens=32, batch_tokens=32, publish_every_steps=1000),
    )
    eng = Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset())  # iterations run by hand
    eng.install_version("a@v1", random_adapter(tiny, 1))
    eng.install_version("b@v1", random_adapter(tiny, 2))
    eng._iteration()
    ca, cb = Collector(), Collector()
    eng.submit(greedy("pa", P2, 400, adapter="a"), ca)
    eng.submit(greedy("pb", P2, 400, adapter="b"), cb)
    live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
    started = eng.start_job(JobSpec("c", "c@v1", 1, live, token_budget=10**6, learning_rate=1e-2))
    for _ in range(30):
        eng._iteration()
    assert started.result(0).state == "running"
    trained = eng.snapshot().ft_tokens_total
    assert trained > 0  # both slots pinned: training goes on regardless
    fut = eng.publish_now("c")
    eng._iteration()
    assert fut.result(0) is None  # no slot now: answered at once, nothing stalls
    status = eng.snapshot().jobs[0]
    assert status.state == "running" and "slot" in status.message and "pinned" in status.message
    # Training still goes on beside the two running requests (a micro-step completes within a few dozen
    # iterations).
    for _ in range(60):
        eng._iteration()
        if eng.snapshot().ft_tokens_total > trained:
            break
    assert eng.snapshot().ft_tokens_total > trained
    assert eng.current_version("c") is None  # every refresh so far was blocked
    assert eng.cancel("pa")
    # The pending refresh is retried after each piece of work: it goes through once pa's slot is free.
    # (How many refreshes follow it depends on how fast training improves on this machine: a periodic
    # evaluation that improves offers another.)
    for _ in range(200):
        eng._iteration()
        if ca.done.is_set() and eng.current_version("c") is not None:
            break
    assert re.fullmatch(r"c@v1\+rs\.\d+", eng.current_version("c") or "")
    assert not eng.is_resident("a@v1") and eng.is_resident("b@v1")  # idle a evicted, pinned b kept
    assert eng.snapshot().jobs[0].message == ""
    assert eng.cancel("pb")
    while not cb.done.is_set():
        eng._iteration()


def test_a_local_job_without_a_slot_fails_with_a_clear_status(tiny: LoadedModel) -> None:
    cfg = EngineConfig(
        max_resident_adapters=1,
        refresh_slot_wait_s=0.0,
        default_ttft_slo_ms=100.0,
        default_tpot_slo_ms=20.0,
        job=JobConfig(micro_tokens=32, batch_tokens=32, publish_every_steps=1000),
    )
    events = []
    eng = Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), on_job_event=events.append)
    eng.install_version("a@v1", random_adapter(tiny, 1))
    eng._iteration()
    eng.submit(greedy("pa", P2, 400, adapter="a"), Collector())
    live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
    eng.start_job(JobSpec("c", "c@v1", 1, live, token_budget=10**6))
    eng._iteration()
    fut = eng.publish_now("c")
    eng._iteration()
    assert fut.result(0) is None
    status = eng.snapshot().jobs[0]
    assert status.state == "failed" and "COLLM_MAX_RESIDENT_ADAPTERS" in status.message
    assert [e.kind for e in events] == ["failed"]
    trained = eng.snapshot().ft_tokens_total
    for _ in range(5):
        eng._iteration()
    assert eng.snapshot().ft_tokens_total == trained  # a failed job does not train on


def long_dataset(n: int = 12) -> LocalDataset:
    words = "the quick brown fox jumps over the lazy dog hello world numbers 0 1 2 3 4 5 6 7 8 9"
    ds = LocalDataset([], [])
    for i in range(n):
        ds.add(Example(f"long{i}", f"{words} {i} " * 6, f"{words} {i % 3} " * 8, domain="math"), 0.2)
    return ds


def test_long_examples_train_in_pieces_within_the_guard_and_at_full_speed_when_idle(
    tiny: LoadedModel,
) -> None:
    """No traffic, examples far longer than a micro-step's token size, and a guard (0.4 x a 5 ms TTFT SLO)
    shorter than any whole micro-step: training still progresses, one layer-sized piece per iteration.
    With the default guard, an idle replica chains pieces back to back until its guard is spent (how many
    fit depends on how fast the machine runs a piece: 5 to 40 here, fewer when it is busy)."""
    job = JobConfig(micro_tokens=64, batch_tokens=128, max_seq_len=480, publish_every_steps=1000)
    ds = long_dataset()
    assert min(len(e.prompt) + len(e.response) for e in ds.train) > 900  # hundreds of tokens each
    eng = Engine(tiny, EngineConfig(default_ttft_slo_ms=5.0, job=job), SloAwareCoScheduler(), dataset=ds)
    live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
    eng.start_job(JobSpec("math", "math@v1", 1, live, token_budget=10**6, learning_rate=1e-2))
    eng._iteration()
    assert eng.jobs["math"].train_items and min(len(r.ids) for r in eng.jobs["math"].train_items) > 256
    pieces = []
    while eng.snapshot().jobs[0].steps_done < 2:
        eng._iteration()
        assert eng.last_work is not None
        pieces.append(eng.last_work.pieces)
        assert len(pieces) < 2000, "training does not progress"
    j = eng.jobs["math"]
    assert j.tokens_done / j.micro_steps > 256  # whole long examples, not cut to the 64-token size
    # The guard admits the one piece an idle replica always runs and whatever else fits in 2 ms: a few
    # pieces, while a micro-step is 8 or more (2 layers forward, >= 4 LM-head chunks, 2 layers backward).
    assert max(pieces) <= 4 < 8 <= sum(pieces) / j.micro_steps
    fast = Engine(tiny, EngineConfig(job=job), SloAwareCoScheduler(), dataset=ds)
    live2 = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
    fast.start_job(JobSpec("math", "math@v1", 1, live2, token_budget=10**6, learning_rate=1e-2))
    guard_ms = 0.4 * fast.cfg.default_ttft_slo_ms
    stretches = []
    while not ("math" in fast.jobs and fast.jobs["math"].micro_steps >= 1):
        fast._iteration()
        assert fast.last_work is not None
        stretches.append((fast.last_work.pieces, fast.last_work.train_ms))
        assert len(stretches) < 200, "training does not progress"
    # Some stretch chained more pieces than the 5-ms TTFT SLO allowed (4 at most), or pieces over most of
    # the guard (a busy machine runs fewer in it).
    assert any(n > 4 or (n > 1 and ms >= 0.5 * guard_ms) for n, ms in stretches), (guard_ms, stretches)


def test_jobs_take_turns_and_a_due_round_job_sends_in_time(tiny: LoadedModel) -> None:
    """Two jobs on one replica (a federated round and a local adapter): both train, neither starves the
    other, and the round job sends its update at its deadline although the other job keeps training."""
    events, got, on_job = round_update_catcher()

    cfg = EngineConfig(round_deadline_margin_s=0.3, job=JobConfig(micro_tokens=32, batch_tokens=64))
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), on_job_event=on_job) as eng:
        ex = eng.executor
        local = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, "tiny", seed=1)
        eng.start_job(JobSpec("loc", "loc@v1", 1, local, token_budget=10**9)).result(10)
        shared = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, "tiny", seed=2)
        deadline = time.time() + 2.0
        spec = JobSpec(
            "shared", "shared@v1", 1, shared, token_budget=10**9, round_id=5, deadline_unix_s=deadline
        )
        eng.start_job(spec).result(10)
        assert got.wait(10)
        sent_at = time.time()
        jobs = {j.adapter: j for j in eng.snapshot().jobs}
    upd = next(e for e in events if e.kind == "round_update")
    assert sent_at < deadline  # wrapped up within the margin, not after the other job's turn
    assert upd.num_tokens > 0 and jobs["loc"].tokens_done > 0
    # Turns at micro-step boundaries: neither job got the replica to itself.
    assert min(upd.num_tokens, jobs["loc"].tokens_done) > 0.2 * max(upd.num_tokens, jobs["loc"].tokens_done)


def test_a_round_job_only_trains_and_a_local_job_scores_its_starting_point(tiny: LoadedModel) -> None:
    """A local job scores its starting point before it trains (the baseline of its shadow refreshes); a
    round job evaluates nothing itself (the aggregator's gate scores the candidate) and spends its whole
    time on its token budget."""
    from collm_replica.engine.executor import Executor
    from collm_replica.training import TrainingJob

    ex = Executor(tiny)
    ds = dataset()
    cfg = JobConfig(micro_tokens=32, batch_tokens=32, eval_max_examples=4, publish_every_steps=1)

    def job(round_id: int | None) -> TrainingJob:
        live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, "tiny", seed=3)
        spec = JobSpec("med", "med@v1", 1, live, token_budget=64, learning_rate=1e-2, round_id=round_id)
        return TrainingJob(spec, ex, tiny.tokenizer, ds.train, ds.eval, cfg)

    local, shared = job(None), job(4)
    assert local._next(0.0)[0].startswith("eval_")
    start = {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in shared.live.params.items()}
    kinds = set()
    while shared.active:
        nxt = shared._next(0.0)
        kinds.add(nxt[0] if nxt else None)
        shared.step(64)
    assert not any(k and k.startswith("eval_") for k in kinds)
    assert shared.steps_done > 0 and shared.finished_update and shared.tokens_done >= 64
    assert shared.eval_loss_before is None and shared.eval_loss_after is None and not shared.refreshes
    moved = max(float((shared.live.params[k][1].detach() - b).abs().max()) for k, (_a, b) in start.items())
    assert moved > 0


@pytest.mark.parametrize(("done_before", "bound_ms"), [(0, math.inf), (1, math.inf), (0, 0.0)])
def test_a_round_job_completes_its_first_micro_step_at_the_deadline(
    tiny: LoadedModel, done_before: int, bound_ms: float
) -> None:
    """At its deadline a round job drops a micro-step still in its forward, unless it is the job's first
    and its rest is predicted within the wrap-up bound: dropped, the update would hold no samples and
    the aggregator would reject it. The wrap-up's tokens and time are reported by `work`, as the
    pieces' are."""
    from collm_replica.costs import PieceCosts
    from collm_replica.engine.executor import Executor
    from collm_replica.training import TrainingJob

    ex = Executor(tiny)
    now = [0.0]
    live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, "tiny", seed=3)
    spec = JobSpec("med", "med@v1", 1, live, token_budget=10**6, round_id=4, deadline_unix_s=100.0)
    cfg = JobConfig(micro_tokens=32, batch_tokens=64)
    job = TrainingJob(spec, ex, tiny.tokenizer, dataset().train, [], cfg, wall=lambda: now[0])
    costs = PieceCosts()
    for _ in range(done_before):  # whole micro-steps before the deadline
        job.work(float("inf"), time.perf_counter, costs, force_one=True, yield_at_boundary=True)
    assert job.micro_steps == done_before
    job.work(0.0, time.perf_counter, costs, force_one=True)  # one piece: the next forward began
    assert job._pass is not None and job._pass.next_piece == "fwd" and job.micro_steps == done_before
    assert job._pass.remaining_ms(costs) > 0
    now[0] = 100.0  # the deadline
    out = job.work(0.0, time.perf_counter, costs, wrap_up_ms=bound_ms)
    assert not job.active and job.finished_update
    if bound_ms == 0.0:
        assert job.micro_steps == 0 and job.samples_seen == 0 and out.train_tokens == 0  # over the bound
    elif done_before == 0:
        assert job.micro_steps == 1 and job.samples_seen > 0 and job.steps_done == 1
        assert out.train_tokens == job.tokens_done > 0 and out.train_ms > 0 and len(out.micro_steps) == 1
    else:
        assert job.micro_steps == 1 and out.train_tokens == 0  # the second micro-step was dropped


@pytest.mark.parametrize("why", ["zero share", "paused"])
def test_round_job_sends_its_update_at_the_deadline_without_training_time(
    tiny: LoadedModel, why: str
) -> None:
    """The co-scheduler grants no training (share 0, or training paused): the round job still wraps up at
    its deadline (less the margin) and sends what it has, so the round does not lose its participant."""
    events, got, on_job = round_update_catcher()
    share = 0.0 if why == "zero share" else 1.0
    cfg = EngineConfig(
        round_deadline_margin_s=0.5, ft_share_default=share, job=JobConfig(micro_tokens=32, batch_tokens=64)
    )
    with Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), on_job_event=on_job) as eng:
        if why == "paused":
            eng.pause_training()
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        deadline = time.time() + 1.5
        spec = JobSpec("med", "med@v1", 1, live, token_budget=10**9, round_id=4, deadline_unix_s=deadline)
        eng.start_job(spec).result(10)
        assert got.wait(10), [e.kind for e in events]
        sent_at = time.time()
    upd = next(e for e in events if e.kind == "round_update")
    assert upd.round_id == 4 and upd.num_tokens == 0 and upd.weights is not None
    assert sent_at < deadline  # sent before the deadline, not when some later work ran


def test_an_evaluation_behind_its_deadline_runs_past_the_slack(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load with no slack an evaluation advances one piece per iteration; one whose requester stops
    waiting soon (here: already) catches up within the guard for the next arrival instead."""

    def iterations_to_evaluate(eng: Engine, deadline_unix_s: float | None, tag: str) -> int:
        reqs = [
            EngineRequest(
                f"{tag}{i}",
                list(range(5, 25)),
                max_tokens=400,
                ignore_eos=True,
                ttft_slo_ms=60_000,
                tpot_slo_ms=1e-3,
            )  # fmt: skip
            for i in range(3)
        ]
        collectors = {}
        for r in reqs:
            collectors[r.request_id] = c = Collector()
            eng.submit(r, c)
        start = eng.iteration
        while eng.iteration < start + 3:  # the requests run
            time.sleep(0.01)
        it0 = eng.iteration
        fut = eng.evaluate([("base", None)], max_examples=40, deadline_unix_s=deadline_unix_s)
        # The engine's iteration when it delivers the result (the callback runs in the engine's thread);
        # read after `result()` instead, it also counts the iterations the engine ran before this thread
        # woke up, as many as a loaded machine delays it.
        done_at: list[int] = []
        fut.add_done_callback(lambda _: done_at.append(eng.iteration))
        fut.result(60)
        took = done_at[0] - it0
        assert all(not c.done.is_set() for c in collectors.values())  # still serving throughout
        for rid in collectors:
            eng.cancel(rid)
        return took

    cfg = EngineConfig(job=JobConfig(eval_chunk_tokens=48))  # small batches: many pieces
    with Engine(tiny, cfg, NoTraining(), dataset=dataset(40)) as eng:
        # Background work may use what is left of an inference step predicted slower than it ran; the
        # learned prediction follows the machine's load, so here every step is predicted to take no time
        # and "no slack" leaves no window at all, however busy the machine.
        monkeypatch.setattr(eng.core.step_costs.line, "predict", lambda _tokens: 0.0)
        slack_only = iterations_to_evaluate(eng, None, "a")
        paced = iterations_to_evaluate(eng, time.time(), "b")
    # Paced, the evaluation is taken up at an iteration boundary and scored and delivered within the next
    # (2 iterations here, one more when the ask lands as an iteration begins); slack only, a piece each.
    assert paced <= 3 and slack_only >= paced + 3, (slack_only, paced)


def test_the_step_log_records_each_step_as_it_ran(tiny: LoadedModel) -> None:
    """Every inference step's shape (decodes and their context, prefill chunks, adapters) and time, and
    every stretch of training, reach the step log; the shapes are the ones the batch planner gave."""
    records: list[InferenceStep | BackgroundWork] = []
    cfg = EngineConfig(
        batch=BatchConfig(max_batch=4, max_batch_tokens=8, prefill_chunk_tokens=4),
        max_resident_adapters=2,
        job=JobConfig(micro_tokens=32, batch_tokens=32, publish_every_steps=1000),
    )
    eng = Engine(tiny, cfg, SloAwareCoScheduler(), dataset=dataset(), step_log=records.append)
    eng.start()
    eng.install_version("med@v1", random_adapter(tiny, 1)).result(10)
    res = submit_all(eng, [greedy("a", P1, 5), greedy("b", P2, 5, adapter="med")])
    assert all(c.finished.completion_tokens == 5 for c in res.values())
    steps = [r for r in records if isinstance(r, InferenceStep)]
    # Prompt tokens prefilled in chunks of at most 4, each chunk once, starting where the last ended.
    chunks = [c for s in steps for c in s.prefill]
    assert sum(n for n, _ in chunks) == len(P1) + len(P2) and all(n <= 4 for n, _ in chunks)
    assert sorted(start for _, start in chunks) == sorted([*range(0, len(P1), 4), *range(0, len(P2), 4)])
    # 4 decode steps per request after its first token; the context before the one that feeds its j-th
    # output token (j = 1..4) is its prompt and the j - 1 tokens before that one.
    assert sum(s.decodes for s in steps) == 8
    assert sum(s.decode_context_tokens for s in steps) == sum(
        p + k for p in (len(P1), len(P2)) for k in range(4)
    )
    assert {s.adapters for s in steps} <= {0, 1} and any(s.adapters == 1 for s in steps)
    assert all(0 < s.forward_ms <= s.step_ms for s in steps)
    assert [s.t_s for s in steps] == sorted(s.t_s for s in steps)
    # No job to train yet: no training budget, nothing bounding it.
    assert all(s.train_budget_ms == 0.0 and s.train_limit is None for s in steps)
    live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
    eng.start_job(JobSpec("med", "med@v1", 1, live, token_budget=64)).result(10)
    deadline = time.time() + 20
    while eng.snapshot().ft_tokens_total < 64 and time.time() < deadline:
        time.sleep(0.02)
    eng.stop()
    train = [r for r in records if isinstance(r, BackgroundWork) and r.kind == "train"]
    assert sum(r.tokens for r in train) == eng.ft_tokens_total >= 64
    assert sum(t for r in train for t, _ in r.micro_steps) == eng.ft_tokens_total
    assert sum(r.ms for r in train) == pytest.approx(eng.train_ms_total)


def test_the_step_log_and_the_co_scheduler_see_a_round_jobs_wrap_up(tiny: LoadedModel) -> None:
    """A round job's wrap-up at its deadline runs no piece of its own (the rest of a micro-step, the last
    optimizer step), and with training paused no piece runs around it: its time and tokens still reach
    the step log and the co-scheduler's charge, so the log's training sums equal the engine's counters."""
    records: list[InferenceStep | BackgroundWork] = []
    events, got, on_job = round_update_catcher()
    # No optimizer step before the deadline (the batch never fills): the wrap-up always runs one.
    cfg = EngineConfig(round_deadline_margin_s=0.2, job=JobConfig(micro_tokens=32, batch_tokens=10**6))
    charged: list[float] = []

    class ChargeRecorder(SloAwareCoScheduler):
        def charge(self, train_ms: float) -> None:
            charged.append(train_ms)
            super().charge(train_ms)

    eng = Engine(tiny, cfg, ChargeRecorder(), dataset=dataset(), on_job_event=on_job, step_log=records.append)
    with eng:
        live = LiveLora.init_new(LoraSpec(), eng.executor.n_layers, eng.executor.shapes, "tiny")
        deadline = time.time() + 3.0
        spec = JobSpec("med", "med@v1", 1, live, token_budget=10**9, round_id=5, deadline_unix_s=deadline)
        eng.start_job(spec).result(10)
        while eng.snapshot().ft_tokens_total == 0 and time.time() < deadline - 1.0:
            time.sleep(0.01)
        eng.pause_training().result(10)
        assert 0 < eng.snapshot().ft_tokens_total and time.time() < deadline - 0.2 and not got.is_set()
        ms_paused = eng.train_ms_total
        assert got.wait(10), [e.kind for e in events]
    assert eng.train_ms_total > ms_paused  # the wrap-up ran (at least its optimizer step)
    upd = next(e for e in events if e.kind == "round_update")
    assert upd.num_tokens > 0
    train = [r for r in records if isinstance(r, BackgroundWork) and r.kind == "train"]
    assert sum(r.tokens for r in train) == eng.ft_tokens_total == upd.num_tokens
    assert sum(r.ms for r in train) == pytest.approx(eng.train_ms_total)
    assert sum(charged) == pytest.approx(eng.train_ms_total + eng.eval_ms_total)


def test_every_round_job_trains_its_examples_in_its_own_order(tiny: LoadedModel) -> None:
    """Rounds train a few hundred tokens each: each round starts at other examples, and a round repeated
    from the same base (its candidate held back) does not train the same candidate again."""
    from collm_replica.engine.executor import Executor
    from collm_replica.training import TrainingJob

    ex = Executor(tiny)
    ds = dataset(40)
    cfg = JobConfig(micro_tokens=32, batch_tokens=32)

    def first_ids(round_id: int | None, base: str = "med@v3") -> list[str]:
        live = LiveLora.init_new(LoraSpec(), ex.n_layers, ex.shapes, "tiny", seed=3)
        spec = JobSpec("med", base, 3, live, token_budget=64, round_id=round_id)
        return [
            r.example_id for r in TrainingJob(spec, ex, tiny.tokenizer, ds.train, ds.eval, cfg).train_items
        ]

    assert first_ids(7) == first_ids(7)  # reproducible
    assert first_ids(7)[:5] != first_ids(8)[:5]
    assert first_ids(7)[:5] != first_ids(7, "med@v4")[:5]
    assert sorted(first_ids(7)) == sorted(first_ids(8))


def test_logprobs_per_token_in_a_mixed_batch(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(eng, [greedy("lp", P1, 6, logprobs=3), greedy("plain", P1, 6)])
    chunks = [e for e in res["lp"].events if e.kind == "token"]
    assert all(e.logprobs is None for e in res["plain"].events if e.kind == "token")
    assert res["lp"].token_ids == res["plain"].token_ids
    for c in chunks:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 1
        lp = c.logprobs[0]
        assert lp.token_id == c.token_ids[0]
        assert len(lp.top) == 3 and lp.logprob <= 0.0
        # Greedy: the chosen token is the most likely one, and the top list is sorted.
        assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob == lp.logprob
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert lp.token == tiny.tokenizer.decode([lp.token_id], clean_up_tokenization_spaces=False)


def test_logprobs_carry_each_tokens_raw_bytes(tiny: LoadedModel) -> None:
    """A byte-level token of a multi-byte character decodes alone as U+FFFD; its bytes are its own byte."""
    tok = tiny.tokenizer
    ids = tok.encode("\u2603", add_special_tokens=False)  # a snowman: three one-byte tokens here
    partial = next(i for i in ids if tok.decode([i]) == "\ufffd")
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        res = submit_all(eng, [greedy("b", P1, 2, logprobs=2, logit_bias={partial: 100.0})])
    lps = [lp for e in res["b"].events if e.kind == "token" for lp in e.logprobs or []]
    assert [lp.token_id for lp in lps] == [partial, partial]
    assert all(lp.token == "\ufffd" and lp.token_bytes is not None and len(lp.token_bytes) == 1 for lp in lps)
    assert lps[0].token_bytes in "\u2603".encode()
    for lp in lps:
        for t in lp.top:
            assert (
                t.token_bytes is not None
                and t.token_bytes.decode("utf-8", "replace") == t.token
                or (len(t.token_bytes) < len(t.token.encode()))
            )


def test_penalties_change_greedy_output_only_for_their_request(tiny: LoadedModel) -> None:
    with Engine(tiny, EngineConfig(), NoTraining()) as eng:
        plain = submit_all(eng, [greedy("plain", P1, 24)])["plain"].token_ids
        first = plain[0]
        res = submit_all(
            eng,
            [
                greedy("bias", P1, 24, logit_bias={first: -100.0}),
                greedy("freq", P1, 24, frequency_penalty=2.0, presence_penalty=2.0),
                greedy("same", P1, 24),
            ],
        )
    assert res["same"].token_ids == plain
    assert res["bias"].token_ids[0] != first and first not in res["bias"].token_ids
    freq = res["freq"].token_ids
    assert len(set(freq)) >= len(set(plain))
    assert freq != plain
