"""CoLLM coordinator: the two-timescale algorithm (`core/`, pure) and its NATS service shell."""
