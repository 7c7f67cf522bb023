"""Transports and integrations: ``resilience.adapters.requests``, ``.sglang``, ``.ray``."""
