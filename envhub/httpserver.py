"""The HTTP side of an env server: uvicorn with its connections bounded (``env.limits``).

uvicorn bounds keep-alive idleness but not how long a client may take to send a request's
head, how large that head may be, or how many connections it holds open.  ``LimitedHttp``
(uvicorn's httptools protocol plus three checks) adds them:

- a connection beyond ``max_connections``, or beyond ``max_connections_per_address`` from
  one peer IP address (default: seven eighths of ``max_connections``), is closed as soon as
  it is accepted, so one address holding (or re-opening) slow connections leaves room for
  every other address;
- a request's line and headers must arrive within ``header_timeout_s`` of the connection
  opening (or, on a kept-alive connection, of the request's first byte), else the
  connection is closed;
- a request head larger than ``MAX_HEAD_BYTES`` closes the connection;
- a request answered before its body was read (413) has the rest of its body discarded
  (never stored) for at most ``LINGER_S``, then the connection is closed: closing at once
  would reset the connection under a client still writing, and it would never read the 413.

The body's size and deadline are the app's (``envhub.bodies``); ``timeout_keep_alive`` and
the graceful-shutdown bound are uvicorn settings (``uvicorn_config``).  What it drops is
counted in ``STATS`` and logged through ``RateLimitedLog``, and uvicorn's own per-request
warnings (malformed requests) pass a ``RateLimitFilter``, so a flood cannot flood the log.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from typing import Any

from turnscale.conf.schema import ServerLimits
from turnscale.envhub.instances import per_address_limit

log = logging.getLogger("envhub")

MAX_HEAD_BYTES = 64 * 1024
"""Request line plus headers."""
LINGER_S = 5.0
"""How long the unread rest of an answered request's body is discarded before closing."""

STATS: collections.Counter[str] = collections.Counter()
"""``refused_connections`` (server-wide cap), ``refused_connections_per_address``,
``header_timeouts``, ``oversized_heads``, ``lingering_closes`` (this process)."""


class RateLimitedLog:
    """At most ``burst`` lines, refilled at ``per_s`` per second; the next line after a
    suppression says how many were dropped."""

    def __init__(self, logger: logging.Logger, per_s: float = 1.0, burst: int = 5) -> None:
        self.logger, self.per_s, self.burst = logger, per_s, burst
        self.tokens = float(burst)
        self.last = time.monotonic()
        self.suppressed = 0

    def _allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.per_s)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False

    def log(self, level: int, msg: str, *args: Any) -> None:
        if not self._allow():
            return
        if self.suppressed:
            msg, args = msg + " (%d similar lines suppressed)", (*args, self.suppressed)
            self.suppressed = 0
        self.logger.log(level, msg, *args)

    def info(self, msg: str, *args: Any) -> None:
        self.log(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.log(logging.WARNING, msg, *args)


_drop_log = RateLimitedLog(log, per_s=0.2, burst=3)


class RateLimitFilter(logging.Filter):
    """Lets through at most ``burst`` records, refilled at ``per_s`` per second (for uvicorn's
    one-line-per-bad-request warnings such as "Invalid HTTP request received.")."""

    def __init__(self, per_s: float = 0.2, burst: int = 5) -> None:
        super().__init__()
        self.bucket = RateLimitedLog(log, per_s, burst)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        allowed = self.bucket._allow()
        if allowed and self.bucket.suppressed:
            record.msg = f"{record.msg} ({self.bucket.suppressed} similar lines suppressed)"
            self.bucket.suppressed = 0
        return allowed


def limited_protocol(limits: ServerLimits) -> type:
    """uvicorn's httptools protocol with the connection limits of ``limits``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError as exc:
        raise ImportError(f"envhub's HTTP limits need httptools ({exc}); install it with: pip install 'uvicorn[standard]'") from exc

    per_address_cap = per_address_limit(limits.max_connections_per_address, limits.max_connections)
    open_by_address: collections.Counter[str] = collections.Counter()
    """Open connections per peer address (this server); addresses with none are not kept."""

    class LimitedHttp(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _address: str | None = None
        """Set while this connection counts in ``open_by_address``."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            address = self.client[0] if self.client else "?"
            if len(self.connections) > limits.max_connections:
                STATS["refused_connections"] += 1
                _drop_log.warning("connection limit (%d, env.limits.max_connections) reached: refusing a connection from %s",
                                  limits.max_connections, address)
                transport.abort()
                return
            if open_by_address[address] >= per_address_cap:
                STATS["refused_connections_per_address"] += 1
                _drop_log.warning("connection limit per address (%d, env.limits.max_connections_per_address) reached: refusing a connection from %s",
                                  per_address_cap, address)
                transport.abort()
                return
            open_by_address[address] += 1
            self._address = address
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                STATS["header_timeouts"] += 1
                _drop_log.info("closing a connection from %s: no complete request head within %.3g s (env.limits.header_timeout_s)",
                               self.client[0] if self.client else "?", limits.header_timeout_s)
                self.transport.abort()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            self._arm_head_timer()

        def _count_head(self, n: int) -> None:
            self._head_bytes += n
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                STATS["oversized_heads"] += 1
                _drop_log.info("closing a connection from %s: request head over %d bytes", self.client[0] if self.client else "?", MAX_HEAD_BYTES)
                self.transport.abort()

        def on_url(self, url: bytes) -> None:
            self._count_head(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_head(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm_head_timer()
            if self.transport.is_closing():
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self.cycle is None or self.transport.is_closing():
                return
            super().on_body(body)

        def on_message_complete(self) -> None:
            if self.cycle is None or self.transport.is_closing():
                return
            if self._linger_timer is not None:  # the discarded body ended: the connection goes on
                self._linger_timer.cancel()
                self._linger_timer = None
            super().on_message_complete()

        def on_response_complete(self) -> None:
            unread = self.cycle is not None and self.cycle.more_body
            super().on_response_complete()
            if unread and not self.transport.is_closing() and self._linger_timer is None:
                self._linger_timer = self.loop.call_later(LINGER_S, self._linger_over)

        def _linger_over(self) -> None:
            self._linger_timer = None
            if not self.transport.is_closing():
                STATS["lingering_closes"] += 1
                self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._address is not None:
                open_by_address[self._address] -= 1
                if open_by_address[self._address] <= 0:
                    del open_by_address[self._address]
                self._address = None
            self._disarm_head_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

    return LimitedHttp


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits) -> Any:
    """The ``uvicorn.Config`` of an env server with ``limits`` applied."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            http=limited_protocol(limits),
                            timeout_keep_alive=max(1, math.ceil(limits.keepalive_timeout_s)),
                            timeout_graceful_shutdown=max(1, math.ceil(limits.shutdown_timeout_s)))
    logging.getLogger("uvicorn.error").addFilter(RateLimitFilter())  # after Config: it configures logging
    return config
