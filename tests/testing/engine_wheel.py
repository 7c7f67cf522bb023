"""The pinned engine wheels (sglang; vllm with ``package="vllm"``): from a cache folder, or ``pip download --no-deps`` there."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from resilience.testing.emulator.config import SGLANG_VERSION

__all__ = ["DEFAULT_WHEEL_CACHE", "WheelUnavailable", "find_wheel", "wheel_version"]

DEFAULT_WHEEL_CACHE = Path("~/.cache/cpr/wheels").expanduser()
"""Where :func:`find_wheel` keeps wheels (``$CPR_WHEEL_CACHE`` overrides it)."""


class WheelUnavailable(RuntimeError):
    """The pinned wheel is not in the cache and could not be downloaded; the message says why."""


def find_wheel(
    version: str = SGLANG_VERSION,
    cache_dir: Path | None = None,
    *,
    download: bool = True,
    index_url: str | None = None,
    package: str = "sglang",
) -> Path:
    """The ``<package>-<version>`` wheel: ``$CPR_<PACKAGE>_WHEEL``, else one in ``cache_dir``, else downloaded there.

    ``package``: the distribution (default ``"sglang"``; ``"vllm"`` for the vLLM contract, whose wheel is ~336 MB).
    ``cache_dir``: default ``$CPR_WHEEL_CACHE`` or ``~/.cache/cpr/wheels``. ``download``: run ``pip download --no-deps
    <package>==<version>`` into the cache when it holds none (``index_url`` = pip's ``--index-url``, with pip's
    configuration ignored; None = pip's own configuration). Raises :class:`WheelUnavailable` naming what was tried.
    """
    variable = f"CPR_{package.upper()}_WHEEL"
    explicit = os.environ.get(variable)
    if explicit:
        if not Path(explicit).is_file():
            raise WheelUnavailable(f"{variable}={explicit!r} is not a file")
        return Path(explicit)
    cache = cache_dir or Path(os.environ.get("CPR_WHEEL_CACHE") or DEFAULT_WHEEL_CACHE)
    found = _cached(cache, version, package)
    if found is not None or not download:
        if found is None:
            raise WheelUnavailable(f"no {package}-{version} wheel in {cache} and downloading is off")
        return found
    cache.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", f"{package}=={version}", "-d", str(cache)]
    argv += ["--disable-pip-version-check", "--quiet", "--retries", "0", "--timeout", "15"]
    if index_url is not None:  # only this index: no configured extra index is asked
        argv += ["--isolated", "--index-url", index_url]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailable(f"pip download {package}=={version} failed: {exc}") from None
    found = _cached(cache, version, package)
    if found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise WheelUnavailable(f"pip download {package}=={version} into {cache} gave no wheel (exit {done.returncode}): {tail[0]}")
    return found


def _cached(cache: Path, version: str, package: str = "sglang") -> Path | None:
    for name in sorted(glob.glob(str(cache / f"{package}-{version}-*.whl"))):
        if zipfile.is_zipfile(name):
            return Path(name)
    return None


def wheel_version(archive: zipfile.ZipFile) -> str:
    """The ``Version:`` of an open wheel's ``*.dist-info/METADATA`` (``"unknown"`` when it has none)."""
    for name in archive.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in archive.read(name).decode("utf-8", errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return "unknown"
