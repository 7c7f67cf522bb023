"""The telemetry package imports each optional dependency only where it is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import resilience.telemetry as telemetry


def loaded_after(code: str) -> set[str]:
    """Top-level optional packages present in sys.modules after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in ('opentelemetry', 'prometheus_client') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import resilience.telemetry", set()),
        ("from resilience.telemetry import MetricsObserver", {"prometheus_client"}),
        ("from resilience.telemetry import TracingObserver", {"opentelemetry"}),
    ],
)
def test_optional_dependencies_load_lazily(code: str, expected: set[str]) -> None:
    """Importing the package loads neither OpenTelemetry nor prometheus-client; each name loads only its own."""
    assert loaded_after(code) == expected


def test_public_api_is_all() -> None:
    """``__all__`` names exactly the four public objects, each importable from the package."""
    assert sorted(telemetry.__all__) == ["MetricsObserver", "MetricsServer", "TracingObserver", "start_metrics_server"]
    for name in telemetry.__all__:
        assert getattr(telemetry, name).__name__ == name
