"""The frontier benchmark (see cli)."""
