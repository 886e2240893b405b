"""Env family name -> its factory, from ``conf.envs`` (``EnvSpec.server``, ``"<module>:<factory>"``
of a module inside ``envhub/``); imported lazily so a server loads only its own deps.

``factory(cfg: conf.schema.EnvConfig) -> envhub.base.EnvFamily``.  When
``cfg.options`` holds ``sim_latency`` the family is wrapped in the simulated long-tail
workload of ``envhub.simwork`` (benchmarks only; off by default).  Client-side keys
(``CLIENT_OPTIONS``: ``flavor``, which server the env *client* talks to) and server-wide
keys (``SERVER_OPTIONS``: ``server_threads``, read by ``envhub.main``) are not the family's
and are removed before it reads its options.
"""

from __future__ import annotations

import dataclasses
import importlib

from turnscale.conf.envs import ENVS


CLIENT_OPTIONS = ("flavor",)
"""``env.options`` keys read by env clients (``common.envclient.EnvClient``), not by families."""
SERVER_OPTIONS = ("server_threads",)
"""``env.options`` keys read by the server process (``envhub.main``), not by families."""


def make_family(cfg):
    foreign = (*CLIENT_OPTIONS, *SERVER_OPTIONS)
    if any(k in cfg.options for k in foreign):
        cfg = dataclasses.replace(cfg, options={k: v for k, v in cfg.options.items() if k not in foreign})
    if cfg.name not in ENVS:
        raise ValueError(f"config key 'env.name': unknown env {cfg.name!r}; choose one of {sorted(ENVS)}")
    from turnscale.envhub.simwork import split_options, wrap

    own, sim = split_options(cfg)
    return wrap(family_factory(cfg.name)(own), sim)


def family_factory(name: str):
    """The factory named by ``conf.envs.ENVS[name].server``, imported from ``envhub.<module>``."""
    module, attr = ENVS[name].server.split(":")
    return getattr(importlib.import_module(f"turnscale.envhub.{module}"), attr)
