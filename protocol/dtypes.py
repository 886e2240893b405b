"""The one dtype table: the names a tensor's dtype has on the wire and in the config.

A name here is what ``TensorInfo.dtype`` / ``WeightManifest.dtype`` carry and what the
config's ``model.dtype``, ``engine.dtype`` and ``learner.transfer_dtype`` accept.  ``WIRE_DTYPES``
maps each to its element size (numpy has no ``bfloat16``, so sizes are spelled out);
``FLOAT_DTYPES`` are the floating ones a model may be loaded, trained or transferred in.
``torch_dtype`` / ``wire_name`` translate to and from torch, importing torch only when
called (``protocol`` itself never imports torch).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

WIRE_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1,
                               "bool": 1}
"""Bytes per element of every dtype a weight tensor may travel in."""

FLOAT_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The floating dtypes: what a model is loaded or trained in, and the transfer dtype of
every floating weight tensor."""


@lru_cache(maxsize=1)
def _torch_table() -> dict[str, Any]:
    import torch

    return {name: getattr(torch, name) for name in WIRE_DTYPES}


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of wire name ``name``; ``ValueError`` naming the choices if unknown."""
    try:
        return _torch_table()[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} cannot travel as weights; choose one of {sorted(WIRE_DTYPES)}") from None


def float_torch_dtype(name: str, what: str = "dtype") -> Any:
    """The ``torch.dtype`` of floating dtype ``name``; ``ValueError`` naming ``what`` and the choices if it is not one."""
    if name not in FLOAT_DTYPES:
        raise ValueError(f"{what} {name!r}; choose one of {sorted(FLOAT_DTYPES)}")
    return torch_dtype(name)


def wire_name(dtype: Any) -> str | None:
    """The wire name of a ``torch.dtype``, or None when it cannot travel."""
    return _torch_names().get(dtype)


@lru_cache(maxsize=1)
def _torch_names() -> dict[Any, str]:
    return {dt: name for name, dt in _torch_table().items()}
