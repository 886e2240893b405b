"""What every benchmark returns and how results are printed and written.

JSON (DESIGN.md §8, a stable interface): ``{"machine": {...}, "results": [{"name",
"value", "unit", "baseline", "baseline_value", "ratio", "target", "ok"}]}`` with
``ratio = value / baseline_value`` oriented so that higher is better.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass
class Result:
    name: str
    """Figure name, e.g. ``transport_4mb``."""
    value: float
    """Measured value of the system."""
    unit: str
    """Unit of ``value`` and ``baseline_value`` (``MB/s``, ``groups/s``, ``s``)."""
    baseline: str
    """What the baseline is, in words (``raw zmq bytes``)."""
    baseline_value: float
    """The baseline measured in the same run."""
    ratio: float
    """value / baseline_value, oriented so that higher is better."""
    target: float | None = None
    """Ratio the figure aims for (None: reported only)."""
    ok: bool | None = None
    """ratio >= target, or None without a target."""


def result(name: str, value: float, unit: str, baseline: str, baseline_value: float, *, target: float | None = None, lower_is_better: bool = False) -> Result:
    """Build a Result with the ratio oriented so that higher is better.

    A zero, negative or non-finite denominator means a measurement failed (nothing ran,
    or the clock did not move): the ratio is NaN and the figure is never ``ok``."""
    num, den = (baseline_value, value) if lower_is_better else (value, baseline_value)
    measured = math.isfinite(num) and math.isfinite(den) and den > 0 and num >= 0
    ratio = num / den if measured else float("nan")
    ok = None if target is None else bool(measured and ratio >= target)
    return Result(name, float(value), unit, baseline, float(baseline_value), float(ratio), target, ok)


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def format_table(results: Sequence[Result]) -> str:
    head = f"{'figure':<32} {'value':>12} {'baseline':>12} {'ratio':>7} {'target':>7}  ok  unit / baseline"
    lines = [head, "-" * len(head)]
    for r in results:
        tgt = "" if r.target is None else f"{r.target:.2f}"
        ok = "" if r.ok is None else ("yes" if r.ok else "NO")
        lines.append(f"{r.name:<32} {r.value:>12.4g} {r.baseline_value:>12.4g} {r.ratio:>7.3f} {tgt:>7} {ok:>3}  {r.unit} / {r.baseline}")
    return "\n".join(lines)


def write_json(path: str, results: Sequence[Result]) -> None:
    with open(path, "w") as f:
        json.dump({"machine": machine_info(), "results": [asdict(r) for r in results]}, f, indent=2)
