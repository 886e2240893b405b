"""The one exception hierarchy for everything that crosses a process boundary.

Every error says what was wrong and, where it can, how to fix it.  Retry loops retry
only the explicit tuple ``RETRYABLE`` (see STYLE.md: retry an explicit tuple, with
capped backoff).
"""

from __future__ import annotations


class TurnscaleError(Exception):
    """Base class of every error this project raises on purpose."""


class ProtocolError(TurnscaleError, ValueError):
    """A payload is not a valid message: bad msgpack, wrong schema version, unknown or
    missing fields, wrong types or dtypes, inconsistent lengths, or over a size limit.

    The message names the offending field path (``TrajectoryGroup.episodes[3].loss_mask``).
    Whoever receives it logs it and drops the message; it never crashes a process.
    """


class TransportError(TurnscaleError):
    """A socket operation failed (peer gone, timed out, context closed)."""


class PeerTimeout(TransportError):
    """A request got no reply within its deadline.  Retryable."""


class RemoteError(TurnscaleError):
    """The peer answered with an ``ErrorReply``; ``code`` is its machine-readable code."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retryable = retryable


RETRYABLE: tuple[type[BaseException], ...] = (PeerTimeout,)
