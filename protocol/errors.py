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


class TooManyFrames(ProtocolError):
    """A multipart message has more frames than the receiver's limit.  Raised by
    ``AsyncSocket.recv_multipart(max_frames=...)`` once the whole message has been taken
    off the socket (frames past the limit are dropped as they arrive, never kept)."""

    def __init__(self, message: str, head: list, count: int) -> None:
        super().__init__(message)
        self.head = head
        """The first frames (at most ``HEAD_FRAMES``): a ROUTER's routing frames, to reply to."""
        self.count = count
        """How many frames the message had."""

    HEAD_FRAMES = 2


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


MAX_ERROR_CHARS = 300
"""Longest error text sent to a peer or written to a log line (``clip``)."""


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters, saying how much was cut: error
    messages and logged exception texts can quote what a peer sent, and neither a reply
    nor a log line may grow with it."""
    if len(text) <= limit:
        return text
    tail = f"... [{len(text) - limit} more characters]"
    return text[: max(0, limit - len(tail))] + tail


RETRYABLE: tuple[type[BaseException], ...] = (PeerTimeout,)
