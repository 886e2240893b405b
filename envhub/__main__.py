"""``python -m turnscale.envhub env=<name> host=... port=...``: the same as ``turnscale envhub``
(``envhub.main``, with the CLI's handling of a bad override: a message and exit 2)."""

import sys

from turnscale.conf import ConfigError
from turnscale.envhub.main import main

try:
    rc = main(sys.argv[1:])
except ConfigError as exc:
    print(f"turnscale envhub: {exc}", file=sys.stderr)
    rc = 2
except KeyboardInterrupt:
    rc = 130
raise SystemExit(int(rc or 0))
