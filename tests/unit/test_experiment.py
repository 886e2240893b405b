"""turnscale.experiment's pure parts: arms, collapse events, mean ± sd, the table and the plot."""

import math

import pytest

from turnscale.conf import load
from turnscale.experiment import aggregate, arm_schedule, collapse_events, mean_sd, plot, table


def test_arms_share_the_configured_schedule_and_differ_only_in_turn_limits():
    cfg = load(["experiment=run_babyai"])
    assert arm_schedule(cfg, "scaling") == ([3, 5, 8], 20)
    assert arm_schedule(cfg, "short") == ([3], 20)
    assert arm_schedule(cfg, "long") == ([8], 20)
    with pytest.raises(ValueError, match="unknown arm 'medium'"):
        arm_schedule(cfg, "medium")


def test_a_collapse_is_a_fall_below_half_of_the_best_rolling_success_counted_once_per_fall():
    assert collapse_events([0.0] * 10) == 0  # never reached the floor: nothing to collapse from
    assert collapse_events([0.4] * 5 + [0.0] * 10) == 1
    assert collapse_events([0.4] * 5 + [0.0] * 10 + [0.5] * 10 + [0.0] * 10) == 2
    assert collapse_events([0.4, 0.3, 0.5, 0.35, 0.45] * 4) == 0  # noise is not a collapse


def test_mean_and_sample_sd():
    assert mean_sd([1.0]) == (1.0, 0.0)
    m, sd = mean_sd([0.1, 0.3])
    assert m == pytest.approx(0.2) and sd == pytest.approx(math.sqrt(0.02))
    assert all(math.isnan(x) for x in mean_sd([]))


def _run(arm, seed, final3, final6):
    return {"arm": arm, "seed": seed, "wall_s": 10.0 + seed, "warm_start": {"3": 0.1, "6": 0.2},
            "final": {"3": final3, "6": final6}, "collapses": 1 if arm == "long" else 0}


def test_aggregate_table_and_plot(tmp_path):
    runs = [_run("scaling", 0, 0.3, 0.5), _run("scaling", 1, 0.4, 0.6), _run("long", 0, 0.2, 0.4), _run("long", 1, 0.2, 0.3)]
    rows = aggregate(runs, [3, 6])
    by = {(r["arm"], r["eval_turns"]): r for r in rows}
    assert by[("scaling", 3)]["success_mean"] == pytest.approx(0.35) and by[("scaling", 3)]["seeds"] == 2
    assert by[("long", 6)]["success_sd"] == pytest.approx(math.sqrt(0.005))
    assert by[("long", 3)]["collapses"] == 2 and by[("scaling", 6)]["warm_start_mean"] == pytest.approx(0.2)
    text = table(rows)
    assert "scaling" in text and "0.350 ± 0.071" in text
    png = plot(rows, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
