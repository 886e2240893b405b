"""Byte-offset index over a run's JSONL files, so the viewer serves a 1 GB file without loading it.

``JsonlIndex`` scans a JSONL file once, keeping for every valid line its byte offset and a small
summary (the fields filters need); full records are read back with one ``seek`` + ``readline``.
``refresh()`` indexes only bytes appended since the last call, so a run that is still writing
is followed live.  Invariants:

- An episode's id is its position among the *valid* lines of the file, in file order; ids never
  change as the file grows (the file is append-only).
- A final line without a trailing newline is not indexed yet (the writer may be mid-line); it is
  picked up by a later ``refresh`` once complete.
- A line that is not UTF-8, not JSON, or not a JSON object is skipped and counted; the first
  ``MAX_BAD_EXAMPLES`` are kept with their line number and reason.

Thread safety: ``refresh`` holds the instance lock while it scans; with ``blocking=False`` it
returns at once when another thread is scanning, so requests are served from what is indexed so
far (lists only grow, and ``offsets[i]`` is set before ``summaries[i]``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

MAX_BAD_EXAMPLES = 20

SUMMARY_FIELDS = (
    "step", "version", "lease_id", "actor_id", "env", "data_idx", "task_id", "split", "category",
    "episode", "group_size", "turn_limit", "finish_reason", "reward", "success", "accepted",
    "drop_reason", "num_turns", "num_tokens", "checkpoint", "sample",
)
"""Fields of an episode record kept in memory for filtering and listing (everything but text)."""


class FilterError(ValueError):
    """A filter parameter has a bad value; the message names the parameter and says what is expected."""


@dataclass
class BadLine:
    line: int
    """1-based line number in the file."""
    offset: int
    reason: str


@dataclass
class JsonlIndex:
    """Offsets and summaries of the valid JSON-object lines of one file.

    ``summarize`` maps a parsed object to what is kept in memory (default: the object itself)."""

    path: str
    summarize: Callable[[dict], dict] = lambda obj: obj
    offsets: list[int] = field(default_factory=list)
    summaries: list[dict] = field(default_factory=list)
    bad_count: int = 0
    bad_examples: list[BadLine] = field(default_factory=list)
    scanned: int = 0
    """Bytes consumed so far (always at a line boundary)."""
    lines: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def exists(self) -> bool:
        return os.path.isfile(self.path)

    @property
    def busy(self) -> bool:
        """A ``refresh`` is scanning right now."""
        return self._lock.locked()

    def size(self) -> int:
        return os.path.getsize(self.path) if self.exists() else 0

    def refresh(self, chunk_bytes: int = 1 << 20, blocking: bool = True) -> int:
        """Index complete lines appended since the last call; returns how many valid lines were added
        (0 at once when ``blocking`` is False and another thread is scanning)."""
        if not self._lock.acquire(blocking=blocking):
            return 0
        try:
            if not self.exists():
                return 0
            size = os.path.getsize(self.path)
            if size < self.scanned:  # truncated or replaced: start over
                self._reset()
            added = 0
            with open(self.path, "rb") as f:
                f.seek(self.scanned)
                parts: list[bytes] = []  # pieces of the current, still unfinished line
                while True:
                    chunk = f.read(chunk_bytes)
                    if not chunk:
                        break
                    start = 0
                    nl = chunk.find(b"\n")
                    while nl >= 0:
                        line = b"".join(parts) + chunk[start:nl] if parts else chunk[start:nl]
                        parts = []
                        added += self._add_line(line, self.scanned)
                        self.scanned += len(line) + 1
                        start = nl + 1
                        nl = chunk.find(b"\n", start)
                    if start < len(chunk):
                        parts.append(chunk[start:])
            return added
        finally:
            self._lock.release()

    def _reset(self) -> None:
        self.offsets.clear()
        self.summaries.clear()
        self.bad_count = 0
        self.bad_examples.clear()
        self.scanned = 0
        self.lines = 0

    def _add_line(self, raw: bytes, offset: int) -> int:
        self.lines += 1
        if not raw.strip():
            return 0
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            return self._bad(offset, "not UTF-8")
        except json.JSONDecodeError as exc:
            return self._bad(offset, f"not JSON: {exc.msg} at column {exc.colno}")
        if not isinstance(obj, dict):
            return self._bad(offset, f"a JSON {type(obj).__name__}, not an object")
        try:
            summary = self.summarize(obj)
        except (TypeError, ValueError, KeyError) as exc:
            return self._bad(offset, f"bad record: {exc}")
        self.offsets.append(offset)
        self.summaries.append(summary)
        return 1

    def _bad(self, offset: int, reason: str) -> int:
        self.bad_count += 1
        if len(self.bad_examples) < MAX_BAD_EXAMPLES:
            self.bad_examples.append(BadLine(self.lines, offset, reason))
        return 0

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> dict:
        """The full record of valid line ``i`` (raises ``IndexError`` when there is none)."""
        if not 0 <= i < len(self.offsets):
            raise IndexError(i)
        with open(self.path, "rb") as f:
            f.seek(self.offsets[i])
            return json.loads(f.readline().decode("utf-8"))

    def bad_info(self) -> dict:
        return {"count": self.bad_count, "examples": [vars(b) for b in self.bad_examples]}


def episode_summary(obj: dict) -> dict:
    """What the viewer keeps in memory per episode: scalar fields only (no prompt or turn text)."""
    out = {k: obj.get(k) for k in SUMMARY_FIELDS if k in obj}
    if "num_turns" not in out and isinstance(obj.get("turns"), list):
        out["num_turns"] = len(obj["turns"])
    return out


# ---------------------------------------------------------------- filters (pure)

@dataclass(frozen=True)
class EpisodeFilter:
    """Filters of ``/api/episodes``; ``None`` means "any"."""

    env: str | None = None
    task: str | None = None
    """A ``data_idx`` (digits) or a ``task_id`` string."""
    split: str | None = None
    category: str | None = None
    checkpoint: str | None = None
    finish_reason: str | None = None
    success: bool | None = None
    step_min: int | None = None
    step_max: int | None = None
    version_min: int | None = None
    version_max: int | None = None
    step: int | None = None
    """Exactly this learner step (the curve click)."""
    turn_limit: int | None = None
    """Exactly this turn limit (an eval sweep's point, a ScalingInter stage)."""

    @staticmethod
    def from_query(q: dict[str, str]) -> "EpisodeFilter":
        """Parse query parameters (empty values mean "any"); raises ``FilterError`` on bad values."""
        def s(name: str) -> str | None:
            v = q.get(name, "").strip()
            return v or None

        def i(name: str) -> int | None:
            v = s(name)
            if v is None:
                return None
            try:
                return int(v)
            except ValueError:
                raise FilterError(f"parameter '{name}': expected an integer, got {v!r}") from None

        succ = s("success")
        if succ is not None and succ not in ("true", "false", "1", "0"):
            raise FilterError(f"parameter 'success': expected true or false, got {succ!r}")
        return EpisodeFilter(
            env=s("env"), task=s("task"), split=s("split"), category=s("category"), checkpoint=s("checkpoint"),
            finish_reason=s("finish_reason"), success=None if succ is None else succ in ("true", "1"),
            step_min=i("step_min"), step_max=i("step_max"), version_min=i("version_min"),
            version_max=i("version_max"), step=i("step"), turn_limit=i("turn_limit"),
        )

    def matches(self, e: dict) -> bool:
        eq = (("env", self.env), ("split", self.split), ("category", self.category),
              ("checkpoint", self.checkpoint), ("finish_reason", self.finish_reason))
        for key, want in eq:
            if want is not None and str(e.get(key, "")) != want:
                return False
        if self.task is not None:
            if self.task.lstrip("-").isdigit():
                if e.get("data_idx") != int(self.task):
                    return False
            elif e.get("task_id") != self.task:
                return False
        if self.success is not None and bool(e.get("success")) != self.success:
            return False
        if self.turn_limit is not None and e.get("turn_limit") != self.turn_limit:
            return False
        return _in_range(e.get("step"), self.step_min, self.step_max, self.step) and _in_range(
            e.get("version"), self.version_min, self.version_max, None)


def _in_range(v: Any, lo: int | None, hi: int | None, exact: int | None) -> bool:
    if lo is None and hi is None and exact is None:
        return True
    if not isinstance(v, (int, float)):
        return False
    return (lo is None or v >= lo) and (hi is None or v <= hi) and (exact is None or v == exact)


def select(summaries: list[dict], flt: EpisodeFilter, offset: int, limit: int) -> tuple[int, list[tuple[int, dict]]]:
    """``(total matching, [(id, summary)])`` for one page, in file order."""
    total = 0
    page: list[tuple[int, dict]] = []
    for i, e in enumerate(summaries):
        if flt.matches(e):
            if offset <= total < offset + limit:
                page.append((i, e))
            total += 1
    return total, page


def facets(summaries: Iterable[dict]) -> dict:
    """Distinct values for the filter drop-downs, and the step/version ranges."""
    keys = ("env", "split", "category", "finish_reason", "checkpoint")
    seen: dict[str, set] = {k: set() for k in keys}
    lo_hi: dict[str, list] = {"step": [None, None], "version": [None, None]}
    for e in summaries:
        for k in keys:
            v = e.get(k)
            if v is not None and v != "":
                seen[k].add(str(v))
        for k, rng in lo_hi.items():
            v = e.get(k)
            if isinstance(v, (int, float)):
                rng[0] = v if rng[0] is None else min(rng[0], v)
                rng[1] = v if rng[1] is None else max(rng[1], v)
    return {**{k: sorted(v) for k, v in seen.items()}, "step_range": lo_hi["step"], "version_range": lo_hi["version"]}


NON_METRIC_KEYS = frozenset({"step", "time", "wall_time", "timestamp"})
"""Keys of a ``metrics.jsonl`` row that are not curves (the learner writes ``step`` and ``time``)."""


def metric_series(rows: Iterable[dict]) -> dict[str, list[list[float]]]:
    """``{key: [[step, value], ...]}`` for every numeric key, rows in file order (non-numbers and
    ``NON_METRIC_KEYS`` skipped)."""
    out: dict[str, list[list[float]]] = {}
    for r in rows:
        step = r.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        for k, v in r.items():
            if k in NON_METRIC_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if v != v or v in (float("inf"), float("-inf")):  # NaN/inf are not valid JSON for the page
                continue
            out.setdefault(k, []).append([step, v])
    return out
