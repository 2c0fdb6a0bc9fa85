"""What every CoLLM service shares: settings, subjects, wire schemas, bus, adapter store, clock,
tracing, metrics and logging. Nothing here knows about a particular service's policy."""

__version__ = "0.1.0"
