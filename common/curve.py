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

from conf import ConfigError
from conf.schema import ActorConfig, LearnerConfig
from protocol.curve import is_loopback, load_authorized, load_cert, load_secret
from protocol.transport import CurveKeys

log = logging.getLogger("turnscale.curve")

KEYS_HINT = "make keys with `turnscale keys DIR` (README, \"Security and limits\")"


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


def _secret(path: str, key: str) -> tuple[bytes, bytes]:
    if not path:
        raise CurveConfigError(f"config key '{key}': CURVE is on but no secret certificate is set; {KEYS_HINT}")
    try:
        return load_secret(path)
    except (OSError, ValueError) as exc:
        raise CurveConfigError(f"config key '{key}': cannot use {path!r} ({exc}); {KEYS_HINT}") from None


def _insecure(role: str, key: str, host: str) -> None:
    log.warning("INSECURE: %s CURVE is off (%s=false) on the non-loopback address %s: anyone who can reach it "
                "can connect, read and send unauthenticated, unencrypted messages", role, key, host)


def learner_curve(lc: LearnerConfig, *, warn: bool = True) -> CurveSetup | None:
    """The learner's CURVE setup, or None when off (see the module docstring); ``warn``:
    log the insecure choice (``enabled=false`` off loopback)."""
    c = lc.curve
    if not curve_on(c.enabled, lc.host):
        if warn and not is_loopback(lc.host):
            _insecure("learner", "learner.curve.enabled", lc.host)
        return None
    public, secret = _secret(c.secret_key, "learner.curve.secret_key")
    if not c.authorized:
        raise CurveConfigError("config key 'learner.curve.authorized': CURVE is on but no folder of authorized actor "
                               f"keys is set (every actor must be listed); {KEYS_HINT}")
    try:
        keys = load_authorized(c.authorized)
    except (OSError, ValueError) as exc:
        raise CurveConfigError(f"config key 'learner.curve.authorized': cannot use {c.authorized!r} ({exc}); {KEYS_HINT}") from None
    if not keys:
        log.warning("learner.curve.authorized (%s) holds no *.key file yet: every actor is refused until one is added",
                    c.authorized)
    return CurveSetup(public=public, secret=secret, authorized=c.authorized, secret_path=c.secret_key)


def actor_curve(ac: ActorConfig, *, warn: bool = True) -> CurveSetup | None:
    """The actor's CURVE setup, or None when off (see the module docstring)."""
    c = ac.curve
    if not curve_on(c.enabled, ac.learner_host):
        if warn and not is_loopback(ac.learner_host):
            _insecure("actor", "actor.curve.enabled", ac.learner_host)
        return None
    public, secret = _secret(c.secret_key, "actor.curve.secret_key")
    if not c.server_key:
        raise CurveConfigError("config key 'actor.curve.server_key': CURVE is on but the learner's public certificate "
                               f"is not set; {KEYS_HINT}")
    try:
        server_public, _ = load_cert(c.server_key)
    except (OSError, ValueError) as exc:
        raise CurveConfigError(f"config key 'actor.curve.server_key': cannot use {c.server_key!r} ({exc}); {KEYS_HINT}") from None
    return CurveSetup(public=public, secret=secret, server_public=server_public, secret_path=c.secret_key,
                      server_key_path=c.server_key)
