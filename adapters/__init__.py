"""Transports and integrations: ``resilience.adapters.requests``, ``.httpx``, ``.aiohttp``, ``.sglang``, ``.ray``."""
