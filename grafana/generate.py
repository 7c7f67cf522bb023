"""``python grafana/generate.py``: the same as ``python -m grafana.dashboard``, for a shell in any folder.

The generated files name this script ("Regenerate: python grafana/generate.py"),
so it stays; the generator itself is the ``grafana.dashboard`` package.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root, where the grafana package lives

from grafana.dashboard.files import main

if __name__ == "__main__":
    raise SystemExit(main())
