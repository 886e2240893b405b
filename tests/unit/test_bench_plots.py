"""``benchmarks.plots.plot_results`` writes a real PNG chart of ratios vs targets."""

from __future__ import annotations

import os

from turnscale.benchmarks.common import result
from turnscale.benchmarks.plots import plot_results


def test_plot_results_writes_a_png_with_every_figure(tmp_path):
    results = [
        result("transport_4MB_mb_s", 900.0, "MB/s", "raw zmq", 1000.0, target=0.8),
        result("transport_64KB_mb_s", 100.0, "MB/s", "raw zmq", 400.0),
        result("weights_s", 2.0, "s", "memcpy", 1.0, target=0.5, lower_is_better=True),
        result("broken", 1.0, "x", "zero", 0.0),  # ratio inf must not break the chart
    ]
    out = tmp_path / "plots"
    paths = plot_results(results, str(out))
    assert paths == [str(out / "ratios.png")]
    data = open(paths[0], "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_results_handles_no_results(tmp_path):
    (path,) = plot_results([], str(tmp_path))
    assert os.path.getsize(path) > 0


def test_a_zero_or_failed_baseline_never_reports_ok():
    import math

    for kw in ({"baseline_value": 0.0}, {"baseline_value": float("nan")}):
        r = result("x", 5.0, "u", "b", target=0.5, **kw)
        assert math.isnan(r.ratio) and r.ok is False
    r = result("x", 0.0, "s", "b", 1.0, target=1.0, lower_is_better=True)
    assert math.isnan(r.ratio) and r.ok is False
    assert result("x", 2.0, "u", "b", 4.0, target=0.4).ok is True
