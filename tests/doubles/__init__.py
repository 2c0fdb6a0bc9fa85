"""Test doubles: clearly named stand-ins for real CoLLM processes, for tests only."""
