"""`python -m collm_bench`: the CoLLM load generator and goodput summariser.

    python -m collm_bench loadgen --url http://127.0.0.1:8000 --trace conv --rate 2 --duration 60 \\
        --mix medical=0.5,math=0.5 --slo-ttft-ms 2000 --slo-tpot-ms 200 --out bench/results/run1
    python -m collm_bench summarize bench/results/run1/requests.jsonl --slo-ttft-ms 1000
    python -m collm_bench traces conv
    python -m collm_bench readme [--check] [--plots]       # bench/README.md's tables from bench/results/
    python -m collm_bench frontier --sim --replicas 64   # trade-off curves (collm_bench.frontier)
    python -m collm_bench frontier --preset headline     # each policy at its default, live (make bench)
    python -m collm_bench engine|faults|gate|federated|gateway|sim|adaptation NAME ...   # collm_bench.groups
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from collm_bench.client import ClientOptions, endpoint_url
from collm_bench.groups import GROUPS
from collm_bench.groups import main as group_main
from collm_bench.report import format_summary
from collm_workload import flags
from collm_workload.goodput import SloOverride, summarize
from collm_workload.prompts import PromptBuilder, PromptError, discover_domains, parse_mix, read_domain_dir
from collm_workload.quality import QualityTable
from collm_workload.records import RequestRecord, read_records, write_records
from collm_workload.tokens import CharEstimateCounter, HFTokenizerCounter, TokenCounter
from collm_workload.traces import (
    NAMED_TRACES,
    LengthPolicy,
    TraceError,
    load_trace,
    resolve_trace,
    trace_stats,
)
from collm_workload.workload import (
    ArrivalSpec,
    ModelMap,
    PlannedRequest,
    Slo,
    plan_requests,
    request_shapes,
)

if TYPE_CHECKING:
    from collm_bench.runner import RunResult

# Default data locations: the project's sibling `shared/data` (never copied into the project).
_REPO = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = _REPO.parent / "shared" / "data"


# What `ArgumentParser.add_subparsers` returns: where each command adds its parser.
_Subcommands = argparse._SubParsersAction  # argparse names no public type for it


class UsageError(Exception):
    """Bad command-line input: reported as one clear line, exit status 2."""


# --- small parsers ----------------------------------------------------------------------------------------
def _pairs(values: Sequence[str] | None, what: str) -> dict[str, str]:
    """`a=b,c=d` (repeatable) -> {a: b, c: d}."""
    out: dict[str, str] = {}
    for value in values or []:
        for part in value.split(","):
            if not part.strip():
                continue
            key, sep, val = part.partition("=")
            if not sep or not key.strip():
                raise UsageError(f"{what}: {part!r} is not KEY=VALUE")
            out[key.strip()] = val.strip()
    return out


def _float_pairs(values: Sequence[str] | None, what: str) -> dict[str, float]:
    out = {}
    for k, v in _pairs(values, what).items():
        try:
            out[k] = float(v)
        except ValueError as e:
            raise UsageError(f"{what}: {k}={v!r} is not a number") from e
    return out


def _domain_slos(values: Sequence[str] | None, default: Slo) -> dict[str, Slo]:
    out = {}
    for domain, spec in _pairs(values, "--slo").items():
        ttft, _, tpot = spec.partition(":")
        try:
            out[domain] = Slo(
                float(ttft) if ttft else default.ttft_ms, float(tpot) if tpot else default.tpot_ms
            )
        except ValueError as e:
            raise UsageError(f"--slo {domain}={spec!r}: want TTFT_MS:TPOT_MS (either may be empty)") from e
    return out


# --- argument parser --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The parser of `loadgen`, `summarize` and `traces` (the other commands have their own)."""
    p = argparse.ArgumentParser(
        prog="python -m collm_bench",
        description="CoLLM load generator: replay traces or synthetic arrivals against any "
        "OpenAI-compatible endpoint and measure TTFT, TPOT, ITL, errors, goodput and served quality.",
        epilog="More commands, each with its own --help: frontier, readme; "
        f"{', '.join(GROUPS)} NAME (the group alone lists its names).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_loadgen(sub)
    _add_summarize(sub)
    _add_traces(sub)
    return p


def _add_loadgen(sub: _Subcommands) -> None:
    """`loadgen` and its flags, by group."""
    lg = sub.add_parser(
        "loadgen",
        help="run a load test and write requests.jsonl + summary.json",
        description="Open-loop load generation. Writes OUT/requests.jsonl (one record per request, "
        "written as each finishes) and OUT/summary.json (schema collm-bench-summary/1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add_group in (
        _target_args,
        _arrival_args,
        _length_args,
        _prompt_args,
        _slo_args,
        _client_args,
        _output_args,
        _quality_args,
    ):
        add_group(lg)


def _target_args(p: argparse.ArgumentParser) -> None:
    """loadgen's server: URL, endpoint, API key."""
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)")
    g.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions or /v1/completions",
    )
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")


def _arrival_args(p: argparse.ArgumentParser) -> None:
    """loadgen's arrivals: trace, process, rate, duration, seed."""
    g = p.add_argument_group("arrivals")
    flags.add_trace(
        g,
        default=None,
        help=f"trace to replay: {', '.join(NAMED_TRACES)} (in --traces-dir) or a path "
        "(.csv Azure format, .jsonl Mooncake format)",
    )
    flags.add_traces_dir(g, default=DEFAULT_DATA_DIR / "traces")
    g.add_argument(
        "--trace-start-s",
        type=float,
        default=0.0,
        help="start of the replayed slice, in seconds of trace time",
    )
    g.add_argument(
        "--arrivals",
        choices=("trace", "poisson", "gamma", "constant"),
        default=None,
        help="arrival process (default: trace when --trace is given, else poisson); "
        "synthetic arrivals take token lengths from --trace when one is given",
    )
    g.add_argument(
        "--rate",
        type=float,
        default=None,
        help="mean request rate (req/s). With trace arrivals: the N = rate x duration "
        "consecutive trace requests are time-scaled to fill the duration; omitted: the "
        "trace's own timing",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape k: inter-arrival CV = 1/sqrt(k); 1 = Poisson, < 1 burstier",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=60.0,
        help="seconds of arrivals; requests still running afterwards get --drain-timeout-s",
    )
    g.add_argument("--num-requests", type=int, default=None, help="cap on the number of requests")
    flags.add_seed(g, help="seed of arrivals, domain draws and prompts")


def _length_args(p: argparse.ArgumentParser) -> None:
    """loadgen's token lengths (scaled, then clipped)."""
    g = p.add_argument_group("token lengths (scaled, then clipped)")
    g.add_argument("--input-tokens", type=int, default=256, help="prompt tokens without a trace")
    g.add_argument("--output-tokens", type=int, default=64, help="output tokens without a trace")
    flags.add_length_scales(
        g, input_help="multiply trace prompt lengths", output_help="multiply trace output lengths"
    )
    g.add_argument("--max-input-tokens", type=int, default=None, help="clip prompt lengths")
    g.add_argument("--max-output-tokens", type=int, default=None, help="clip output lengths (max_tokens)")
    g.add_argument("--min-output-tokens", type=int, default=1, help="lower bound of max_tokens")
    g.add_argument(
        "--max-context-tokens",
        type=int,
        default=None,
        help="model context: prompt + output are kept within it (e.g. 2048)",
    )


def _prompt_args(p: argparse.ArgumentParser) -> None:
    """loadgen's prompts, domains, models and tokenizer."""
    g = p.add_argument_group("prompts and models")
    g.add_argument(
        "--mix",
        default=None,
        help="domain weights, e.g. medical=0.5,math=0.5 (default: equal over all domains)",
    )
    g.add_argument(
        "--domains-dir",
        type=Path,
        default=DEFAULT_DATA_DIR / "domains",
        help="one sub-directory of prompt/response files per domain",
    )
    g.add_argument(
        "--dataset",
        action="append",
        metavar="DOMAIN=DIR",
        help="a collm_common.data dataset directory for a domain (overrides --domains-dir)",
    )
    g.add_argument(
        "--model-map",
        action="append",
        metavar="DOMAIN=MODEL",
        help="model (adapter) that a domain's requests name; DOMAIN= (empty) sends the base model",
    )
    g.add_argument(
        "--model-template",
        default="{domain}",
        help="model for domains not in --model-map; empty: the base model",
    )
    g.add_argument("--base-model", default=None, help="model named by requests without an adapter")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer (HF directory or .gguf file) to size prompts; default: a "
        "chars-per-token estimate per domain",
    )
    g.add_argument(
        "--chars-per-token", type=float, default=None, help="force one chars-per-token ratio for the estimate"
    )
    g.add_argument(
        "--chat-overhead-tokens",
        type=int,
        default=None,
        help="tokens the chat template adds (default: measured with --tokenizer, else 0)",
    )


def _slo_args(p: argparse.ArgumentParser) -> None:
    """loadgen's SLOs (scoring, and optionally sent in the body)."""
    g = p.add_argument_group("SLOs (always used for scoring)")
    flags.add_slo(g, ttft_help="TTFT SLO of every request", tpot_help="TPOT SLO of every request")
    g.add_argument(
        "--slo",
        action="append",
        metavar="DOMAIN=TTFT_MS:TPOT_MS",
        help="per-domain SLO override (either part may be empty)",
    )
    g.add_argument(
        "--send-slo",
        action="store_true",
        help="send the SLO in the body as CoLLM's extension slo: {ttft_ms, tpot_ms}",
    )


def _client_args(p: argparse.ArgumentParser) -> None:
    """loadgen's client: concurrency, timeouts, sampling, extra body."""
    g = p.add_argument_group("client")
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (excess wait locally; wait is recorded, not in TTFT)",
    )
    g.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request timeout")
    g.add_argument(
        "--drain-timeout-s",
        type=float,
        default=None,
        help="after the last arrival, wait this long for running requests (default: --request-timeout-s)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the server to generate exactly max_tokens (CoLLM and vLLM extension)",
    )
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")


def _output_args(p: argparse.ArgumentParser) -> None:
    """loadgen's output directory, progress, dry run and timeline."""
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, required=True, help="output directory")
    g.add_argument("--progress-interval-s", type=float, default=5.0, help="status line period; 0: off")
    g.add_argument("--dry-run", action="store_true", help="write OUT/plan.jsonl and stop without sending")
    g.add_argument("--timeline-bin-s", type=float, default=10.0, help="bin width of summary.timeline")


def _add_summarize(sub: _Subcommands) -> None:
    """`summarize` and its flags."""
    sm = sub.add_parser(
        "summarize",
        help="(re)compute a summary from requests.jsonl",
        description="Recompute goodput, attainment, percentiles and served quality from per-request "
        "records, optionally with other SLOs; prints a table and writes JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sm.add_argument("records", type=Path, help="requests.jsonl written by loadgen")
    flags.add_slo(sm, ttft_help="re-score with this TTFT SLO", tpot_help="re-score with this TPOT SLO")
    sm.add_argument("--out", type=Path, default=None, help="write the summary JSON here (default: stdout)")
    sm.add_argument("--timeline-bin-s", type=float, default=10.0, help="bin width of summary.timeline")
    _quality_args(sm)


def _add_traces(sub: _Subcommands) -> None:
    """`traces` and its flags."""
    tr = sub.add_parser("traces", help="statistics of a trace file", description="Print trace statistics.")
    tr.add_argument("trace", help=f"{', '.join(NAMED_TRACES)} or a path")
    flags.add_traces_dir(tr, default=DEFAULT_DATA_DIR / "traces")


def _quality_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("served quality (optional)")
    g.add_argument(
        "--quality",
        type=Path,
        default=None,
        help='JSON: {"base": {domain: loss}, "name@vN": {domain: loss} | loss, ...}',
    )
    g.add_argument(
        "--quality-redis-url",
        default=None,
        help="read quality records from the adapter store at this Redis URL",
    )
    g.add_argument("--quality-redis-prefix", default="collm", help="the store's key prefix")
    g.add_argument(
        "--base-loss",
        action="append",
        metavar="DOMAIN=LOSS",
        help="base-model eval loss of a domain (overrides the file and the store)",
    )


# --- commands ---------------------------------------------------------------------------------------------
def _load_quality(args: argparse.Namespace, records: Sequence[RequestRecord]) -> QualityTable | None:
    table: QualityTable | None = None
    if args.quality_redis_url:
        from collm_bench.quality_store import adapter_names, load_quality_from_store

        names = adapter_names(r.adapter_version for r in records)
        table = asyncio.run(load_quality_from_store(args.quality_redis_url, args.quality_redis_prefix, names))
    if args.quality:
        try:
            file_table = QualityTable.load(args.quality)
        except (OSError, ValueError) as e:
            raise UsageError(f"--quality {args.quality}: {e}") from e
        table = file_table if table is None else table.merge(file_table)
    base = _float_pairs(args.base_loss, "--base-loss")
    if base:
        table = table or QualityTable()
        table.base.update(base)
    return table


def _counter(args: argparse.Namespace) -> TokenCounter:
    if args.tokenizer:
        try:
            return HFTokenizerCounter.load(args.tokenizer, args.chat_overhead_tokens)
        except (OSError, ValueError) as e:
            raise UsageError(f"--tokenizer {args.tokenizer}: {e}") from e
    overhead = args.chat_overhead_tokens or 0
    return CharEstimateCounter(args.chars_per_token, overhead if args.endpoint == "chat" else 0)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class _LoadPlan:
    """The requests a loadgen run sends, and what they were drawn from."""

    requests: list[PlannedRequest]
    arrivals: str  # the arrival process: trace, poisson, gamma or constant
    trace_path: Path | None
    lengths: LengthPolicy
    mix: dict[str, float]
    models: ModelMap
    default_slo: Slo
    slo_by_domain: dict[str, Slo]
    token_counter: str


def _client_options(args: argparse.Namespace) -> ClientOptions:
    """How each request is sent (endpoint, key, SLO and body extensions, timeout) from the flags."""
    try:
        extra = json.loads(args.extra_body) if args.extra_body else {}
    except json.JSONDecodeError as e:
        raise UsageError(f"--extra-body is not JSON: {e}") from e
    if not isinstance(extra, dict):
        raise UsageError("--extra-body must be a JSON object")
    return ClientOptions(
        url=endpoint_url(args.url, args.endpoint),
        endpoint=args.endpoint,
        api_key=args.api_key,
        send_slo=args.send_slo,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout_s,
        extra_body=extra,
    )


def _plan_load(args: argparse.Namespace, err: TextIO) -> _LoadPlan:
    """The run's requests: arrivals and token lengths (from the trace or synthetic), a domain, prompt,
    model and SLO each. Raises UsageError when the plan is empty; warns on `err` when no SLO is given."""
    trace = None
    trace_path = None
    if args.trace:
        trace_path = resolve_trace(args.trace, args.traces_dir)
        trace = load_trace(trace_path)
    kind = args.arrivals or ("trace" if trace is not None else "poisson")
    spec = ArrivalSpec(
        kind=kind,
        duration_s=args.duration,
        rate_rps=args.rate,
        burstiness=args.burstiness,
        trace_start_s=args.trace_start_s,
        max_requests=args.num_requests,
        seed=args.seed,
    )
    lengths = LengthPolicy(
        input_scale=args.input_scale,
        output_scale=args.output_scale,
        max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens,
        min_output_tokens=args.min_output_tokens,
        max_context_tokens=args.max_context_tokens,
    )
    shapes = request_shapes(spec, trace, lengths, args.input_tokens, args.output_tokens)
    datasets = {k: Path(v) for k, v in _pairs(args.dataset, "--dataset").items()}
    available = sorted(set(discover_domains(args.domains_dir)) | set(datasets))
    mix = parse_mix(args.mix, available)
    corpora = {d: read_domain_dir(datasets.get(d, args.domains_dir / d), d) for d in mix}
    counter = _counter(args)
    builder = PromptBuilder(corpora, counter, chat=args.endpoint == "chat")
    models = ModelMap(_pairs(args.model_map, "--model-map"), args.model_template, args.base_model)
    default_slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    slo_by_domain = _domain_slos(args.slo, default_slo)
    plan = plan_requests(shapes, mix, builder, models, default_slo, slo_by_domain, args.seed)
    if not plan:
        raise UsageError("the plan is empty: raise --rate or --duration")
    if default_slo.ttft_ms is None and default_slo.tpot_ms is None and not slo_by_domain:
        err.write("collm-bench: no SLO given: every completed request counts as good\n")
    return _LoadPlan(plan, kind, trace_path, lengths, mix, models, default_slo, slo_by_domain, counter.name)


def _run_info(args: argparse.Namespace, opts: ClientOptions, load: _LoadPlan) -> dict[str, Any]:
    """summary.json's `run`: the run's settings and its plan's size and means."""
    plan = load.requests
    return {
        "tool": "collm_bench loadgen",
        "argv": sys.argv[1:],
        "url": opts.url,
        "endpoint": args.endpoint,
        "arrivals": load.arrivals,
        "trace": str(load.trace_path) if load.trace_path else None,
        "trace_start_s": args.trace_start_s,
        "rate_rps": args.rate,
        "burstiness": args.burstiness if load.arrivals == "gamma" else None,
        "duration_s": args.duration,
        "seed": args.seed,
        "mix": load.mix,
        "models": {d: load.models.model_for(d) for d in load.mix},
        "slo": asdict(load.default_slo),
        "slo_by_domain": {d: asdict(s) for d, s in load.slo_by_domain.items()},
        "send_slo": args.send_slo,
        "ignore_eos": args.ignore_eos,
        "max_concurrency": args.max_concurrency,
        "request_timeout_s": args.request_timeout_s,
        "drain_timeout_s": args.drain_timeout_s
        if args.drain_timeout_s is not None
        else args.request_timeout_s,
        "token_counter": load.token_counter,
        "lengths": asdict(load.lengths),
        "planned_requests": len(plan),
        "plan_input_tokens_mean": sum(p.target_input_tokens for p in plan) / len(plan),
        "plan_output_tokens_mean": sum(p.max_tokens for p in plan) / len(plan),
        "plan_estimated_input_tokens_mean": sum(p.estimated_input_tokens for p in plan) / len(plan),
        "plan_last_arrival_s": plan[-1].scheduled_s,
    }


def _write_plan(out_dir: Path, plan: Sequence[PlannedRequest], run_info: dict[str, Any]) -> None:
    """A dry run's output: OUT/plan.jsonl (one planned request a line) and OUT/run.json."""
    with (out_dir / "plan.jsonl").open("w", encoding="utf-8") as f:
        for p in plan:
            f.write(json.dumps(p.as_dict()) + "\n")
    _write_json(out_dir / "run.json", run_info)


def _send_plan(
    args: argparse.Namespace,
    plan: Sequence[PlannedRequest],
    opts: ClientOptions,
    err: TextIO,
    records_path: Path,
) -> RunResult:
    """Run `plan` open-loop until it ends or SIGINT / SIGTERM, appending each record to `records_path`
    as it finishes (completion order); progress lines go to `err`."""
    from collm_bench.runner import run_plan  # httpx import only for real runs

    with records_path.open("w", encoding="utf-8") as sink:

        def on_record(rec: RequestRecord) -> None:
            sink.write(rec.to_json() + "\n")
            sink.flush()

        async def run() -> RunResult:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            return await run_plan(
                plan,
                opts,
                max_concurrency=args.max_concurrency,
                drain_timeout_s=args.drain_timeout_s,
                on_record=on_record,
                progress_interval_s=args.progress_interval_s or None,
                progress_out=err,
                stop=stop,
                duration_s=args.duration,
            )

        return asyncio.run(run())


def cmd_loadgen(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Plan the run, then write the plan (`--dry-run`) or send it and write its records and summary;
    130 when it was interrupted."""
    opts = _client_options(args)
    load = _plan_load(args, err)
    args.out.mkdir(parents=True, exist_ok=True)
    run_info = _run_info(args, opts, load)
    if args.dry_run:
        _write_plan(args.out, load.requests, run_info)
        out.write(f"planned {len(load.requests)} requests -> {args.out / 'plan.jsonl'}\n")
        return 0

    records_path = args.out / "requests.jsonl"
    result = _send_plan(args, load.requests, opts, err, records_path)
    # Rewrite in request order (the live file is in completion order).
    write_records(records_path, result.records)
    run_info.update(
        {"started_unix_s": result.started_unix_s, "wall_s": result.wall_s, "interrupted": result.interrupted}
    )
    quality = _load_quality(args, result.records)
    summary = {"run": run_info, **summarize(result.records, None, quality, args.timeline_bin_s or None)}
    _write_json(args.out / "summary.json", summary)
    out.write(format_summary(summary) + "\n")
    out.write(f"records: {records_path}\nsummary: {args.out / 'summary.json'}\n")
    return 130 if result.interrupted else 0


def cmd_summarize(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        records = read_records(args.records)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from e
    if not records:
        raise UsageError(f"{args.records} holds no request records")
    override = None
    if args.slo_ttft_ms is not None or args.slo_tpot_ms is not None:
        override = SloOverride(args.slo_ttft_ms, args.slo_tpot_ms)
    quality = _load_quality(args, records)
    summary = summarize(records, override, quality, args.timeline_bin_s or None)
    run_json = args.records.parent / "summary.json"
    if run_json.is_file():
        try:
            summary = {"run": json.loads(run_json.read_text(encoding="utf-8")).get("run"), **summary}
        except json.JSONDecodeError:
            err.write(f"collm-bench: ignoring unreadable {run_json}\n")
    if args.out:
        _write_json(args.out, summary)
        out.write(format_summary(summary) + "\n")
    else:
        out.write(json.dumps(summary, indent=2) + "\n")
    return 0


def cmd_traces(args: argparse.Namespace, out: TextIO, _err: TextIO) -> int:
    path = resolve_trace(args.trace, args.traces_dir)
    stats = trace_stats(load_trace(path))
    out.write(json.dumps({"trace": str(path), **stats.as_dict()}, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["frontier"]:
        # Each policy's trade-off curve over its knob grid (collm_bench.frontier).
        from collm_bench.frontier.cli import main as frontier_main

        return frontier_main(argv[1:], out, err)
    if argv[:1] == ["readme"]:
        # bench/README.md's tables regenerated from the committed result files (collm_bench.readme).
        from collm_bench.readme.cli import main as readme_main

        return readme_main(argv[1:], out, err)
    if argv[:1] and argv[0] in GROUPS:
        # The other benchmarks, GROUP NAME (collm_bench.groups).
        return group_main(argv[0], argv[1:], out, err)
    args = build_parser().parse_args(argv)
    commands = {"loadgen": cmd_loadgen, "summarize": cmd_summarize, "traces": cmd_traces}
    try:
        return commands[args.command](args, out, err)
    except (UsageError, TraceError, PromptError, ValueError, FileNotFoundError) as e:
        err.write(f"collm-bench {args.command}: {e}\n")
        return 2
