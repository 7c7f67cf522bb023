"""The core and the requests adapter work with none of the optional extras importable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.servers import Reply, scripted

_BLOCKED = ("opentelemetry", "prometheus_client", "ray", "fastapi", "uvicorn", "torch", "grafana_foundation_sdk", "rich", "matplotlib")


def test_core_and_adapter_run_without_extras() -> None:
    """With every extra made unimportable, a retried call through resilient_session still succeeds."""
    with scripted(Reply(502, b""), Reply(200, b"fine")) as srv:
        code = textwrap.dedent(
            f"""
            import importlib.abc, sys
            BLOCKED = {_BLOCKED!r}
            class Block(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in BLOCKED:
                        raise ImportError(f"blocked extra: {{name}}")
                    return None
            sys.meta_path.insert(0, Block())
            import resilience, resilience.adapters.sglang, resilience.barrier, resilience.testing.faults
            from resilience import EndpointPolicy, PolicyTable, RetryPolicy
            from resilience.adapters.requests import resilient_session
            s = resilient_session(PolicyTable({{"GET /x": EndpointPolicy(retry=RetryPolicy(base_s=0, cap_s=0))}}))
            r = s.get("{srv.url}/x")
            assert r.text == "fine" and len(r.attempts) == 2, r.attempts
            assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "an extra was imported"
            print("ok")
            """
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
