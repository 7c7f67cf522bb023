"""Series the dashboard reads that are not ours: the smg gateway's (standard library only, so tests import it freely)."""

__all__ = ["SMG_METRICS"]

SMG_METRICS = frozenset({"smg_rl_control_calls_total", "smg_rl_fanout_total", "smg_router_upstream_responses_total"})
"""The smg 1.13.0 series the gateway row reads (outside our metric contract; ``tests/smg`` checks a real smg exports each)."""
