"""Operating CoLLM: the launcher (`collm up`), the `collm` CLI, and helpers that run real servers."""
