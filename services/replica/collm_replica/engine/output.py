"""The output processor: turns a request's sampled tokens into its stream of events.

After the core step has sampled a token and appended it to the sequence (`Seq.record`), `token`
detokenises it, matches the stop strings, the end-of-sequence ids, the grammar's end and `max_tokens`,
and sends the `TokenChunk`; when the choice ends, `finish` records its `ChoiceFinish` and hands the
sequence back to the scheduler (`release`), and once every choice of the request has ended sends the
request's `Finished` and adds its latencies to the SLO window. `fail` and `error` send a request's one
`GenerateError`. Events go to the request's sink in the order they are made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from collm_common.slo import meets_slo, meets_slo_alone
from collm_common.wire.inference import (
    ChoiceFinish,
    Finished,
    GenerateError,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
)
from collm_replica.constrain import Grammars
from collm_replica.costs import FinishedSample, LatencyWindow
from collm_replica.engine.sequence import Seq
from collm_replica.sampling import TokenLogprobs


class OutputProcessor:
    """The stream of each request (see the module doc). `window` (guarded by `lock`) gets a sample per
    request served to its end (a miss for one dropped at its deadline), judged also as if the replica
    had not trained meanwhile (`train_ms_total`: the replica's training so far, ms; its engine core sets
    it); `generated_tokens_total` counts the sampled tokens of client requests."""

    def __init__(
        self,
        tokenizer: Any,
        grammars: Grammars,
        replica_id: str,
        window: LatencyWindow,
        lock: threading.Lock,
        release: Callable[[Seq], None],
    ) -> None:
        self.tok = tokenizer
        self.grammars = grammars
        self.replica_id = replica_id
        self.window = window
        self._lock = lock
        self._release = release
        self.generated_tokens_total = 0
        self.train_ms_total: Callable[[], float] = lambda: 0.0

    def token(self, seq: Seq, tok: int, now: float, lp: TokenLogprobs | None = None) -> None:
        """Stream `tok`, the token `seq` just recorded, and finish the choice when it ends there."""
        if not seq.req.internal:
            self.generated_tokens_total += 1
        if tok in seq.eos:
            tail = seq.stops.flush()
            if tail:
                self._chunk(seq, [], tail)
            self.finish(seq, "stop", now)
            return
        text = seq.stops.push(seq.detok.push(tok))
        if seq.stops.stopped:
            self._chunk(seq, [tok], text, lp)
            self.finish(seq, "stop", now)
            return
        if seq.constraint is not None and seq.constraint.complete:  # the grammar admits nothing more
            self._chunk(seq, [tok], text + seq.stops.flush(), lp)
            self.finish(seq, "stop", now)
            return
        if len(seq.output) >= seq.req.max_tokens:
            self._chunk(seq, [tok], text + seq.stops.flush(), lp)
            self.finish(seq, "length", now)
            return
        self._chunk(seq, [tok], text, lp)

    def _chunk(self, seq: Seq, token_ids: list[int], text: str, lp: TokenLogprobs | None = None) -> None:
        logprobs = None if lp is None else [self._wire_logprob(lp)]
        seq.sink(
            TokenChunk(
                request_id=seq.req.request_id,
                seq=seq.group.next_chunk(),
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                index=seq.index,
            )
        )

    def _token_text(self, token_id: int) -> str:
        return str(self.tok.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _wire_logprob(self, lp: TokenLogprobs) -> TokenLogprob:
        tb = self.grammars.token_bytes
        return TokenLogprob(
            token_id=lp.token_id,
            token=self._token_text(lp.token_id),
            logprob=lp.logprob,
            top=[
                TopLogprob(token_id=t, token=self._token_text(t), logprob=v, token_bytes=tb(t))
                for t, v in lp.top
            ],
            token_bytes=tb(lp.token_id),
        )

    def finish(self, seq: Seq, reason: str, now: float) -> None:
        """Choice `seq` ended for `reason`; when it was the request's last, its `Finished` goes out."""
        if seq.done:
            return
        g = seq.group
        g.ends[seq.index] = ChoiceFinish(
            index=seq.index,
            finish_reason=reason,  # type: ignore[arg-type]
            completion_tokens=seq.completion_tokens(),
        )
        if not g.forked:  # ended before its first token: the other choices never start
            g.forked = True
            for i in range(1, g.n):
                g.ends[i] = ChoiceFinish(index=i, finish_reason=reason, completion_tokens=0)  # type: ignore[arg-type]
        self._release(seq)
        if g.all_ended and not g.failed:
            self._finished(g.seqs[0], now)

    def _finished(self, seq: Seq, now: float) -> None:
        """The request's `Finished`: choice 0's reason and timings, the choices' tokens summed."""
        g = seq.group
        ends = [g.ends[i] for i in range(g.n)]
        reason = ends[0].finish_reason
        completion = sum(e.completion_tokens for e in ends)
        e2e_ms = ((seq.t_last or now) - seq.t_arrival) * 1e3
        # No token at all: the answer's first token counts as out at its end (TTFT = e2e).
        ttft_ms = (seq.t_first - seq.t_arrival) * 1e3 if seq.t_first is not None else e2e_ms
        tpot_ms = (e2e_ms - ttft_ms) / (len(seq.output) - 1) if len(seq.output) > 1 else 0.0
        queue_ms = ((seq.t_admit or now) - seq.t_arrival) * 1e3
        seq.sink(
            Finished(
                request_id=seq.req.request_id,
                seq=g.next_chunk(),
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=completion,
                adapter_version_id=seq.version_id,
                replica_id=self.replica_id,
                queue_ms=queue_ms,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=e2e_ms,
                choices=ends if g.n > 1 else None,
            )
        )
        if seq.req.internal:
            pass
        elif reason in ("stop", "length"):
            tpot = tpot_ms if len(seq.output) > 1 else None
            good = meets_slo(ttft_ms, tpot, seq.ttft_slo * 1e3, seq.tpot_slo * 1e3)
            trained_ms = self.train_ms_total()
            first_ms = trained_ms if seq.train_ms_first is None else seq.train_ms_first
            alone = good or meets_slo_alone(
                ttft_ms, tpot, len(seq.output) - 1, first_ms - seq.train_ms_arrival, trained_ms - first_ms,
                seq.ttft_slo * 1e3, seq.tpot_slo * 1e3,
            )  # fmt: skip
            with self._lock:
                self.window.add(FinishedSample(now, ttft_ms, tpot, good, alone))
        elif reason == "deadline":  # dropped from the queue at its deadline: a miss, without latencies
            with self._lock:
                self.window.add(FinishedSample(now, None, None, False))
        span = seq.req.span
        if span is not None:
            span.add_event("finished", {"finish_reason": reason, "completion_tokens": completion})
            span.set_attribute("collm.finish_reason", reason)
            span.set_attributes(  # GenAI semantic conventions (collm_replica.observe sets the request's)
                {
                    "gen_ai.usage.input_tokens": seq.prompt_len,
                    "gen_ai.usage.output_tokens": completion,
                    "gen_ai.response.finish_reasons": tuple(e.finish_reason for e in ends),
                }
            )
            span.end()

    def fail(self, seq: Seq, code: int, message: str) -> None:
        """The request of `seq` fails: one error event, and every choice of it is released."""
        self.error(seq, code, message)
        seq.group.forked = True
        for s in list(seq.group.seqs):
            self._release(s)

    def error(self, seq: Seq, code: int, message: str, type_: str = "server_error") -> None:
        """The request's one `GenerateError` (nothing when it already failed or every choice ended)."""
        g = seq.group
        if g.failed or (g.forked and all(s.done for s in g.seqs)):
            return
        g.failed = True
        with contextlib.suppress(Exception):
            seq.sink(GenerateError(request_id=seq.req.request_id, code=code, type=type_, message=message))
        if seq.req.span is not None:
            seq.req.span.add_event("error", {"code": code, "message": message})
            seq.req.span.end()
