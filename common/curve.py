"""A role's CURVE config -> the keys its sockets use (``protocol.curve`` reads the files).

``learner_curve(cfg.learner)`` and ``actor_curve(cfg.actor)`` return a ``CurveSetup`` when
CURVE is on for that role (``enabled: auto`` decides by the address: on unless it is
loopback), else None.  ``CurveSetup.server()`` is what a socket that *binds and serves*
uses, ``CurveSetup.client(server_public)`` what a socket that *connects* uses; a relay
socket between actors uses the same: the serving actor ``actor_curve(...).server()``
(its own key pair), the pulling actor ``actor_curve(...).client(that actor's public key)``
(``CurveSetup.public`` of the server, which it can announce).  Without a ZAP handler on
the serving actor's context, ZeroMQ admits any CURVE client that knows the server's public
key (encrypted, but clients are not authenticated); to authenticate them too, start a
``protocol.curve.ZapAuthenticator`` on that context with a copy of the learner's
authorized folder (every actor's public key).

A missing or unreadable key file raises ``CurveConfigError`` (a ``conf.ConfigError``: the
entry points print it and exit 2) naming the config key, the file and ``turnscale keys``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from turnscale.conf import ConfigError
from turnscale.conf.schema import ActorConfig, LearnerConfig
from turnscale.protocol.curve import is_loopback, load_authorized, load_cert, load_secret
from turnscale.protocol.transport import CurveKeys

log = logging.getLogger("turnscale.curve")

KEYS_HINT = "make keys with `turnscale keys DIR` (docs/cluster.md, \"CURVE between actors and the learner\")"


class CurveConfigError(ConfigError):
    """CURVE is on but a key file is missing or wrong."""


@dataclass(frozen=True)
class CurveSetup:
    """One process's CURVE material."""

    public: bytes
    secret: bytes
    server_public: bytes = b""
    """The learner's public key (actors)."""
    authorized: str = ""
    """Folder of the client keys a server accepts (the learner)."""
    secret_path: str = ""
    """Where ``secret`` came from (for error messages)."""
    server_key_path: str = ""

    def server(self) -> CurveKeys:
        """Keys for a socket that binds and serves CURVE (this process's own pair)."""
        return CurveKeys(public=self.public, secret=self.secret)

    def client(self, server_public: bytes | None = None) -> CurveKeys:
        """Keys for a socket that connects to a CURVE server: this process's pair and the
        server's public key (default: the learner's)."""
        sp = server_public or self.server_public
        if not sp:
            raise ValueError("a CURVE client needs the server's public key")
        return CurveKeys(public=self.public, secret=self.secret, server_public=sp)


def curve_on(enabled: str, host: str) -> bool:
    """The ``enabled`` rule: ``auto`` is on unless ``host`` is a loopback address."""
    if enabled == "auto":
        return not is_loopback(host)
    return enabled == "true"


def _load(path: str, key: str, what: str, loader):
    """``loader(path)``, or a ``CurveConfigError`` naming the config ``key`` (unset, unreadable
    or malformed file)."""
    if not path:
        raise CurveConfigError(f"config key '{key}': CURVE is on but {what} is not set; {KEYS_HINT}")
    try:
        return loader(path)
    except (OSError, ValueError) as exc:
        raise CurveConfigError(f"config key '{key}': cannot use {path!r} ({exc}); {KEYS_HINT}") from None


def _wanted(role: str, enabled: str, host: str, warn: bool) -> bool:
    """Whether ``role`` runs CURVE towards/on ``host``; ``warn``: log the insecure choice
    (``enabled=false`` off loopback)."""
    if curve_on(enabled, host):
        return True
    if warn and not is_loopback(host):
        log.warning("INSECURE: %s CURVE is off (%s.curve.enabled=false) on the non-loopback address %s: anyone who can "
                    "reach it can connect, read and send unauthenticated, unencrypted messages", role, role, host)
    return False


def learner_curve(lc: LearnerConfig, *, warn: bool = True) -> CurveSetup | None:
    """The learner's CURVE setup, or None when off (see the module docstring); ``warn``:
    log the insecure choice (``enabled=false`` off loopback)."""
    c = lc.curve
    if not _wanted("learner", c.enabled, lc.host, warn):
        return None
    public, secret = _load(c.secret_key, "learner.curve.secret_key", "the secret certificate", load_secret)
    keys = _load(c.authorized, "learner.curve.authorized", "the folder of authorized actor keys (every actor must be listed)",
                 load_authorized)
    if not keys:
        log.warning("learner.curve.authorized (%s) holds no *.key file yet: every actor is refused until one is added",
                    c.authorized)
    return CurveSetup(public=public, secret=secret, authorized=c.authorized, secret_path=c.secret_key)


def actor_curve(ac: ActorConfig, *, warn: bool = True) -> CurveSetup | None:
    """The actor's CURVE setup, or None when off (see the module docstring)."""
    c = ac.curve
    if not _wanted("actor", c.enabled, ac.learner_host, warn):
        return None
    public, secret = _load(c.secret_key, "actor.curve.secret_key", "the secret certificate", load_secret)
    server_public, _ = _load(c.server_key, "actor.curve.server_key", "the learner's public certificate", load_cert)
    return CurveSetup(public=public, secret=secret, server_public=server_public, secret_path=c.secret_key,
                      server_key_path=c.server_key)
