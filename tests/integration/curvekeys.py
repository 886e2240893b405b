"""CURVE keys and overrides for tests that start roles as processes.

``make_keys(dir, actors=N)`` writes what ``turnscale keys DIR --actors N`` writes;
``curve_overrides(dir, role)`` are the Hydra overrides that switch CURVE on for a role
with those keys (``role``: ``learner`` or ``actor``; an actor takes key pair ``actor``).
A multi-host test adds ``curve_overrides(keys, "learner")`` to the learner's command and
``curve_overrides(keys, "actor", actor=i)`` to actor i's (``enabled="auto"`` there: on,
since the namespaces' addresses are not loopback)."""

from __future__ import annotations

import os

from turnscale.protocol.curve import KeySet, create_keys


def make_keys(keys_dir: str, actors: int = 2) -> KeySet:
    return create_keys(str(keys_dir), actors)


def curve_overrides(keys_dir: str, role: str, *, actor: int = 1, enabled: str = "true",
                    secret_key: str = "", server_key: str = "") -> list[str]:
    """``secret_key`` / ``server_key`` replace the key files (a wrong key, in refusal tests)."""
    d = os.path.abspath(str(keys_dir))
    if role == "learner":
        return [f"learner.curve.enabled={enabled}", f"learner.curve.secret_key={secret_key or os.path.join(d, 'learner.key_secret')}",
                f"learner.curve.authorized={os.path.join(d, 'authorized')}"]
    if role == "actor":
        return [f"actor.curve.enabled={enabled}", f"actor.curve.server_key={server_key or os.path.join(d, 'learner.key')}",
                f"actor.curve.secret_key={secret_key or os.path.join(d, f'actor-{actor}.key_secret')}"]
    raise ValueError(f"role must be 'learner' or 'actor', not {role!r}")
