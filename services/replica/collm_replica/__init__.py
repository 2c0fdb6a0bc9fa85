"""CoLLM replica: the base model once, unmerged multi-LoRA continuous batching, co-executed fine-tuning
and shadow adapters, served over NATS (`python -m collm_replica`)."""

__version__ = "0.1.0"
