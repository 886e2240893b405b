"""``env.options`` handling shared by the env families: known keys, defaults, clear errors."""

from __future__ import annotations

from typing import Any, Mapping


def read_options(options: Mapping[str, Any] | None, defaults: Mapping[str, Any], env: str) -> dict[str, Any]:
    """``defaults`` overlaid with ``options``; an unknown key raises ``ValueError`` naming it.

    A value of ``None`` means the default.  Types are not coerced here: each family converts
    the values it reads (``int(...)``) so a wrong type fails there with the key in the message.
    """
    options = dict(options or {})
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(
            f"config key 'env.options': unknown {env} option(s) {unknown}; allowed: {sorted(defaults)}"
        )
    out = dict(defaults)
    out.update({k: v for k, v in options.items() if v is not None})
    return out
