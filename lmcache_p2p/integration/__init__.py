"""Integrations of the cache engine into serving engines (vLLM)."""
