"""Hydra configs (the ``*.yaml`` groups beside this file) and their typed schema.

``load(overrides)`` is the one place a ``DictConfig`` exists: it composes
``config.yaml`` with the overrides, merges the result over ``schema.Config`` and
returns the typed, validated dataclass tree.  ``save`` writes a resolved config as YAML
(the learner keeps its own next to its checkpoints) and ``load_file`` reads it back.
"""

from __future__ import annotations

from typing import Sequence

from turnscale.conf.schema import Config


class ConfigError(ValueError):
    """A config key or value is wrong; the message names it."""


def load(overrides: Sequence[str] = (), config_name: str = "config") -> Config:
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        composed = _compose(compose, initialize_config_module, GlobalHydra, config_name, list(overrides))
        merged = OmegaConf.merge(OmegaConf.structured(Config), composed)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc)) from None
    except ValueError as exc:  # __post_init__ checks, Hydra override errors
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # hydra.errors.* (missing group option, bad override syntax)
        if type(exc).__module__.startswith("hydra"):
            raise ConfigError(str(exc)) from None
        raise
    assert isinstance(cfg, Config)
    return cfg


def save(cfg: Config, path: str) -> None:
    """Write the fully resolved ``cfg`` as YAML to ``path`` (atomically); ``load_file`` reads it back."""
    import os

    from omegaconf import OmegaConf

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
    os.replace(tmp, path)


def load_file(path: str) -> Config:
    """The config a run saved with ``save`` (validated against the schema like ``load``)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)))
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc)) from None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    assert isinstance(cfg, Config)
    return cfg


def _compose(compose, initialize_config_module, GlobalHydra, config_name: str, overrides: list[str]):
    """Compose, turning ``key=value`` for a key no yaml file sets (``learner.port=5600``)
    into Hydra's ``++key=value``; the merge over the schema then rejects misspelled keys."""
    import re

    for _ in range(len(overrides) + 1):
        GlobalHydra.instance().clear()
        try:
            with initialize_config_module(config_module="turnscale.conf", version_base="1.3"):
                return compose(config_name=config_name, overrides=overrides)
        except Exception as exc:
            m = re.match(r"Could not override '([^']+)'", str(exc))
            if m is None or not type(exc).__module__.startswith("hydra"):
                raise
            key = m.group(1)
            idx = [i for i, o in enumerate(overrides) if o.split("=", 1)[0] == key]
            if not idx:
                raise
            overrides = [("++" + o if i in idx else o) for i, o in enumerate(overrides)]
    raise RuntimeError("unreachable")


MOVED = {"run.levels": "env.options.levels"}
"""Keys that moved: the old name is refused with a message naming the new one."""


def _describe(exc: Exception) -> str:
    key = getattr(exc, "full_key", None)
    msg = getattr(exc, "msg", None) or str(exc).splitlines()[0]
    if key in MOVED:
        return f"config key '{key}' moved to '{MOVED[key]}' (BabyAI-specific: it is an env option now)"
    return f"config key '{key}': {msg}" if key else msg


__all__ = ["Config", "ConfigError", "load", "load_file", "save"]
