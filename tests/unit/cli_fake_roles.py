"""Role modules for the CLI tests: one that loads the config from its overrides (as every
Hydra role does), one whose import needs a package that is not installed."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from turnscale import conf
    conf.load(argv)
    print("config ok")
    return 0
