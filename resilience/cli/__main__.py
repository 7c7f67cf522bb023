"""``python -m resilience.cli``: the same as the ``cpr`` command."""

import sys

from resilience.cli.app import main

sys.exit(main())
