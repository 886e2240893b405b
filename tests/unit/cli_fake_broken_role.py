"""A role module whose import fails on a missing third-party package (not "not built yet")."""

import surely_not_an_installed_package  # noqa: F401


def main(argv: list[str]) -> int:
    return 0
