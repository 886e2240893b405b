"""``python -m envhub env=<name> host=... port=...``: the same as ``turnscale envhub``."""

import sys

from turnscale.cli import main

raise SystemExit(main(["envhub", *sys.argv[1:]]))
