"""Load generation and goodput measurement against any OpenAI-compatible endpoint."""
