"""What lets ``turnscale run`` stop gracefully, resume, and say how long it will take.

- ``RunStop``: why the run is stopping.  The first cause (``run.timeout_s`` passing, SIGINT,
  SIGTERM, SIGHUP) ends *training* (the warm start's SFT, or RL: the learner checkpoints on
  SIGTERM); held-out evaluations of the newest checkpoint still run.  A second signal skips
  them too.  Signal handlers only set it; the launcher polls it.
- ``RunPhases``: ``<run.dir>/run_state.json``, the phases already done and what they
  produced (task files, model, warm-start model, its evaluation, whether RL finished);
  ``run.resume=true`` skips them.  Written atomically after each phase.
- ``rl_pace``, ``eta_line``, ``duration``: pure estimates of the time left.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunStopped(Exception):
    """Raised by the launcher when a stop ends a phase (its child stopped, or in-process work
    done); never from a signal handler, which could interrupt an import half-way (a C
    extension half loaded crashes the next import of it)."""


class RunStop:
    """Why the run is stopping; ``None`` while it is not.

    Invariants: ``cause`` is set once, by the first request; ``skip_eval`` becomes true on the
    second signal (never by the time limit, which only ends training)."""

    def __init__(self, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
        self.cause: str | None = None
        """``"time limit"``, ``"SIGINT"``, ``"SIGTERM"`` or ``"SIGHUP"``."""
        self.signum = 0
        """The first signal's number (0: stopped by the time limit)."""
        self.signals = 0
        self.skip_eval = False
        self.say = say

    @property
    def requested(self) -> bool:
        return self.cause is not None

    def request(self, cause: str, signum: int = 0) -> None:
        if self.cause is None:
            self.cause, self.signum = cause, signum

    def on_signal(self, signum: int, frame: Any = None) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        if self.signals == 1:
            self.request(name, signum)
            self.say(f"turnscale run: {name}; stopping gracefully: training stops (the learner checkpoints), then the newest "
                     f"checkpoint is evaluated held out and summary.json written (Ctrl-C again to skip the evaluation)")
        else:
            self.skip_eval = True
            self.say(f"turnscale run: {name} again; skipping the evaluation, writing what is there")

    def install(self) -> dict[int, Any]:
        """Handle ``STOP_SIGNALS`` with ``on_signal``; returns the handlers replaced (none off
        the main thread, where handlers cannot be set)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.on_signal) for sig in STOP_SIGNALS}

    def exit_code(self, evaluated: bool) -> int:
        """0 when something was evaluated; else 128 + the signal, or 1 (time limit, failure)."""
        if evaluated:
            return 0
        return 128 + self.signum if self.signum else 1


# ----------------------------------------------------------------------------- phases


class RunPhases:
    """``<run.dir>/run_state.json``: ``{phase: result}`` of the phases done, in order
    ``prepared``, ``warm_start``, ``eval_warm_start``, ``rl``."""

    FILE = "run_state.json"

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.FILE
        self.done: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, phase: str) -> Any:
        return self.done.get(phase)

    def mark(self, phase: str, result: Any) -> None:
        self.done[phase] = result
        tmp = self.path.with_name(f"{self.FILE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.done, indent=2))
        os.replace(tmp, self.path)

    def clear(self) -> None:
        self.done = {}
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- estimates


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``1.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def rl_pace(rows: Sequence[dict], total_steps: int, window: int = 10) -> tuple[float, float] | None:
    """``(seconds per step, seconds to step total_steps)`` from the learner's ``metrics.jsonl``
    rows (``step``, ``time``), measured over the last ``window`` steps; None before two rows."""
    rows = [r for r in rows if isinstance(r.get("time"), (int, float)) and isinstance(r.get("step"), int)]
    if len(rows) < 2:
        return None
    a, b = rows[max(0, len(rows) - 1 - window)], rows[-1]
    if b["step"] <= a["step"]:
        return None
    step_s = (b["time"] - a["time"]) / (b["step"] - a["step"])
    return step_s, max(0, total_steps - b["step"]) * step_s


def eta_line(parts: Sequence[tuple[str, float | None]], now: float | None = None) -> str:
    """``RL 12 min + final evaluation 2 min -> done in ~14 min (around 15:02)``; a part with an
    unknown time (None) is named without one and the total becomes a lower bound."""
    known = [s for _, s in parts if s is not None]
    text = " + ".join(f"{name} {duration(s)}" if s is not None else f"{name} (not measured yet)" for name, s in parts)
    total = sum(known)
    at = time.strftime("%H:%M", time.localtime((time.time() if now is None else now) + total))
    bound = "at least " if len(known) < len(parts) else "~"
    return f"{text} -> done in {bound}{duration(total)} (around {at})"
