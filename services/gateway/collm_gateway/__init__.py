"""The CoLLM gateway: an OpenAI-compatible HTTP API in front of the replicas, routing each request over
NATS to a replica chosen by a pure routing policy, streaming its tokens back, and recording per request
the latencies, the replica and the exact adapter version that served it."""

__version__ = "0.1.0"
