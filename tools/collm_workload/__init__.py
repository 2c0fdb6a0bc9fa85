"""Workloads and their verdicts, shared by the benchmarks (`collm_bench`) and the simulator (`collm_sim`):
request traces and arrival processes (`traces`, `arrivals`, `workload`), prompts of a target length
(`prompts`, `tokens`), the per-request record (`records`), and goodput, SLO attainment and served quality
over records (`goodput`, `quality`; the SLO verdict itself is `collm_common.slo`), and the flags the
experiment CLIs share (`flags`)."""
