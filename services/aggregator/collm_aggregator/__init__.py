"""The CoLLM aggregator: federated rounds (collect, validate, aggregate, evaluate, publish).

Pure cores: `strategies` (aggregation math), `validation`, `machine` (round state machine), `evaluation`
(federated eval and the promotion gate), `planner` (built-in plans). Shell: `runner` (one round),
`service` (endpoints, the durable update consumer), `records` (round records in Redis).
"""
