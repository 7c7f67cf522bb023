"""Load a framework's source file by path, with stand-in modules for the names it imports (verl's and SkyRL's clients).

A leaf module (standard library only), shared by ``frameworks.py`` and ``skyrl.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["framework_file", "load_stubbed", "never_called"]


def framework_file(package: str, relative: str, env: str, missing: Exception) -> Path:
    """``relative`` (from the site-packages root) in an installed ``package``, else in the folder ``env`` names (default
    ``~/.cache/cpr/<package>``, where ``scripts/setup.sh`` unpacks the wheel); raises ``missing`` when neither has it."""
    spec = importlib.util.find_spec(package)
    roots = [Path(r).parent for r in (spec.submodule_search_locations or [])] if spec is not None else []
    for root in [*roots, Path(os.environ.get(env, f"~/.cache/cpr/{package}")).expanduser()]:
        if (root / relative).exists():
            return root / relative
    raise missing


def never_called(owner: str, name: str) -> Callable[..., Any]:
    """A stand-in for ``owner``'s function ``name`` that raises if called (the rigs drive the control path only)."""

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"the rig's stub of {owner}'s {name} was called: only the control path is driven")

    return stub


def load_stubbed(name: str, path: Path, stubs: dict[str, types.ModuleType]) -> types.ModuleType:
    """Run the file ``path`` as module ``name`` while ``stubs`` (module name -> stand-in) sit in ``sys.modules``.

    The stand-ins are taken out again afterwards (what was there before is put back), so they live only in the
    loaded module's namespace. The module is ``sys.modules[name]`` from before it runs (dataclasses look their
    module up while a class is made); it is removed again when running it fails.
    """
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value
    return module
