"""Large control messages are checked in a child process before the learner decodes them.

Parsing a msgpack header holds the GIL for as long as the C parser runs: ~55-85 ms for a
1 MiB header of a million empty maps (never a legal message), and every trio task of the
learner, the control loop included, waits meanwhile, however the decode is scheduled.  So
the learner first hands a large message's header, with the sizes of its data frames, to a
child process (its own interpreter and GIL), which runs the same ``codec.decode`` on the
header and zero-filled stand-ins of the data frames (virtual memory: never written), then
the learner's own bounds (``check_bounds``).  The learner decodes only messages the child
accepted: those are legal, so their headers are mostly strings and array references, cheap
to parse (a default group's ~0.3 MB header: ~5 ms).  Array *contents* are not checked by
the child (it never sees them); the learner's own decode and intake check them.

Wire between the two (pipes, no pickle): request = u32 frame count, then one u64 size per
frame, then frame 0's bytes; reply = u32 length, then the UTF-8 error text ("" = accepted).
The child exits when its stdin closes, and with its parent (``die_with_parent``); it runs
at a lower CPU priority (``NICE``).

``Screen`` is the learner's end: one request at a time (a lock), each with a deadline;
a child that fails or overruns is killed by its pid and a new one started for the next
message.  The child starts with the first request (~0.2 s), not with the learner.
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from turnscale.protocol import codec
from turnscale.protocol.errors import ProtocolError, clip
from turnscale.protocol.messages import Heartbeat


NICE = 10
"""The child runs at this lower CPU priority: on a busy host, checking a flood of large
messages must not take the cores from the learner's own loop."""


def check_bounds(msg: Any, max_lease_ids: int) -> None:
    """The learner's own bounds on a decoded control message (``ProtocolError`` if over)."""
    if isinstance(msg, Heartbeat) and len(msg.lease_ids) > max_lease_ids:
        raise ProtocolError(f"Heartbeat.lease_ids: {len(msg.lease_ids)} lease ids, but an actor holds at most "
                            f"{max_lease_ids} (learner.max_leases_per_actor): list only the leases this actor holds")


class ScreenFailed(Exception):
    """The child process died, overran its deadline or answered garbage (it is restarted)."""


class Screen:
    """The learner's end of the screening child (see the module docstring).  Thread-safe;
    ``check`` blocks, so call it from a worker thread."""

    def __init__(self, limits: codec.Limits, max_lease_ids: int, timeout_s: float = 10.0) -> None:
        self._arg = json.dumps({"limits": {f: getattr(limits, f) for f in codec.Limits.__dataclass_fields__},
                                "max_lease_ids": max_lease_ids})
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def check(self, frames: Sequence[Any]) -> str:
        """"" when the message passes the child's decode and bounds, else the error text
        (clipped).  Raises ``ScreenFailed`` when the child could not answer in time."""
        bufs = [codec._buffer(f) for f in frames]
        request = struct.pack(f"<I{len(bufs)}Q", len(bufs), *(b.nbytes for b in bufs))
        with self._lock:
            proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
            try:
                _write(proc.stdin, request)
                _write(proc.stdin, bufs[0])
                deadline = time.monotonic() + self.timeout_s
                n = int.from_bytes(_read(proc.stdout, 4, deadline), "little")
                if n > 64 << 10:
                    raise ScreenFailed(f"screen process answered a {n}-byte error")
                return _read(proc.stdout, n, deadline).decode("utf-8", "replace")
            except (OSError, ValueError, ScreenFailed) as exc:
                self._stop()
                raise ScreenFailed(f"screen process failed: {type(exc).__name__}: {clip(str(exc))}") from None

    def close(self) -> None:
        """End the child (by its pid).  Does not wait for a ``check`` in flight: that one
        fails with ``ScreenFailed``."""
        self._stop()

    def _start(self) -> subprocess.Popen:
        from turnscale.common.procs import die_with_parent

        self._proc = subprocess.Popen([sys.executable, "-m", "turnscale.learner.screen", self._arg],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                      preexec_fn=die_with_parent(os.getpid()))
        return self._proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()  # our own child, by its pid
        proc.wait(timeout=5)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def _write(f: Any, data: Any) -> None:
    """All of ``data`` to the unbuffered pipe ``f`` (a raw write may take part of it)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[f.write(view):]


def _read(f: Any, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes from the pipe ``f`` before ``deadline``."""
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([f], [], [], left)[0]:
            raise ScreenFailed("no answer before the deadline")
        chunk = os.read(f.fileno(), n - len(out))
        if not chunk:
            raise ScreenFailed("the screen process exited")
        out += chunk
    return bytes(out)


# ----------------------------------------------------------------------------- the child


def _read_exact(f: Any, n: int) -> bytes | None:
    out = bytearray()
    while len(out) < n:
        chunk = f.read(n - len(out))
        if not chunk:
            return None
        out += chunk
    return bytes(out)


def serve(arg: str) -> None:
    """The child: answer requests on stdin until it closes (see the module docstring)."""
    import numpy as np

    os.nice(NICE)
    cfg = json.loads(arg)
    limits = codec.Limits(**cfg["limits"])
    max_lease_ids = int(cfg["max_lease_ids"])
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = _read_exact(inp, 4)
        if head is None:
            return
        count = int.from_bytes(head, "little")
        sizes = struct.unpack(f"<{count}Q", _read_exact(inp, 8 * count) or b"")
        header = _read_exact(inp, sizes[0]) if sizes[0] else b""
        if header is None:
            return
        frames = [header, *(np.zeros(s, np.uint8) for s in sizes[1:])]
        try:
            check_bounds(codec.decode(frames, limits), max_lease_ids)
            text = ""
        except ProtocolError as exc:
            text = clip(str(exc))
        del frames, header
        _malloc_trim()
        data = text.encode()
        out.write(len(data).to_bytes(4, "little") + data)
        out.flush()


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    serve(sys.argv[1])
