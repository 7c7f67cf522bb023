"""``python -m grafana.dashboard``: write (or ``--check``) the dashboard JSON and the alert rules."""

from grafana.dashboard.files import main

raise SystemExit(main())
