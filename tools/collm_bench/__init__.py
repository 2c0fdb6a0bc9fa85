"""Load generation and goodput measurement against any OpenAI-compatible endpoint.

`python -m collm_bench loadgen|summarize|traces` (see README.md). Pure cores: `traces`, `arrivals`,
`workload`, `prompts`, `goodput`, `quality`; shells: `client` (one streamed request), `runner` (the
open-loop run), `quality_store` (quality records from the adapter store), `cli`. The other benchmarks,
`python -m collm_bench engine|faults|gate|federated NAME`: `groups` and its subpackages.
"""
