"""Pure parts of ``turnscale bench e2e``: reading a run back, and the command lines it starts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from turnscale import conf
from turnscale.benchmarks import e2e
from turnscale.benchmarks.e2e_stats import group_costs, load_run, read_jsonl, summarize
from turnscale.envhub.simwork import SimWorkload


def _episode(lease: str, i: int, turns: list[tuple[float, float, int]], accepted: bool = True, data_idx: int = 3) -> dict:
    return {"lease_id": lease, "episode": i, "data_idx": data_idx, "accepted": accepted, "num_turns": len(turns),
            "turns": [{"gen_latency_s": g, "env_latency_s": e, "num_tokens": n} for g, e, n in turns]}


def test_group_cost_is_the_slowest_episode_of_the_group():
    recs = [
        _episode("l1", 0, [(0.1, 0.2, 5), (0.1, 0.1, 5)]),
        _episode("l1", 1, [(0.5, 0.5, 7)]),
        _episode("l2", 0, [(0.1, 0.0, 3)], accepted=False),
    ]
    g1, g2 = group_costs(recs)
    assert g1.lease_id == "l1" and g1.episode_s == pytest.approx((0.5, 1.0)) and g1.duration_s == pytest.approx(1.0)
    assert g1.sampled_tokens == 17 and g1.turns == (2, 1) and g1.accepted
    assert g2.lease_id == "l2" and not g2.accepted and g2.duration_s == pytest.approx(0.1)


def test_group_cost_is_the_lease_wall_time_when_the_learner_logged_it():
    recs = [{**_episode("l1", 0, [(0.1, 0.2, 5)]), "lease_s": 0.9}, {**_episode("l1", 1, [(0.5, 0.5, 7)]), "lease_s": 0.9}]
    (g,) = group_costs(recs)
    assert g.lease_s == 0.9 and g.duration_s == 0.9 and g.episode_s == pytest.approx((0.3, 1.0))


def _metrics(times: list[float], gps: int = 2) -> list[dict]:
    out = []
    for i, t in enumerate(times, start=1):
        out.append({"step": i, "time": t, "perf/step_time_s": 0.5, "rollout/sampled_tokens": 100.0,
                    "rollout/staleness/0": 1.0, "rollout/staleness/1": 1.0 if i % 2 else 0.0,
                    **({"rollout/dropped/stale": 1.0} if i == 3 else {})})
    return out


def test_rates_exclude_the_warmup_steps():
    s = summarize(_metrics([100.0, 102.0, 104.0, 106.0]), [], groups_per_step=2, warmup=1)
    assert s.steps == 4 and s.window_s == pytest.approx(6.0)
    assert s.groups_trained == 6 and s.groups_per_s == pytest.approx(1.0)
    assert s.tokens_per_s == pytest.approx(300 / 6)
    assert s.learner_busy == pytest.approx(1.5 / 6) and s.step_time_s == pytest.approx(0.5)
    assert s.staleness_hist == {0: 4, 1: 2}
    assert s.dropped == {"stale": 1}
    # warm-up larger than the run is clamped: one step stays in the window
    assert summarize(_metrics([1.0, 3.0]), [], groups_per_step=2, warmup=5).window_s == pytest.approx(2.0)


def test_a_run_without_two_steps_is_an_error():
    with pytest.raises(ValueError, match="2 logged steps"):
        summarize(_metrics([1.0]), [], groups_per_step=2)
    with pytest.raises(ValueError, match="window"):
        summarize(_metrics([1.0, 1.0]), [], groups_per_step=2)


def test_load_run_reads_the_learner_files_and_skips_a_torn_line(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _metrics([0.0, 1.0, 2.0])) + '\n{"step": 4, "ti')
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(_episode("l1", 0, [(1.0, 1.0, 4)])) + "\n")
    s = load_run(tmp_path, groups_per_step=2)
    assert s.steps == 3 and s.trained_durations == [2.0]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_workload_override_is_what_the_envhub_option_parses():
    w = e2e.Workload(seed=5, median_s=0.2, steps_max=9)
    cfg = conf.load(["env=babyai", w.override()])
    assert SimWorkload.from_options(cfg.env.options) == SimWorkload(**{k: getattr(w, k) for k in w.__dataclass_fields__})


def test_learner_and_actor_command_lines_are_valid_configs(tmp_path: Path):
    spec = e2e.RunSpec(name="x", engine="sim", actors=3, max_groups=2, group_size=2, groups_per_step=6, steps=5, max_staleness=0, turn_limit=7)
    la = e2e.learner_args(spec, 9001, (9002, 9003, 9004), tmp_path)
    assert la[0] == "learner"
    cfg = conf.load(la[1:])
    assert cfg.learner.max_staleness == 0 and cfg.learner.groups_per_step == 6 and cfg.learner.steps == 5
    assert cfg.env.base_url == "http://127.0.0.1:9001" and cfg.schedule.turns == [7] and cfg.algo.group_size == 2
    assert (cfg.learner.port, cfg.learner.pub_port, cfg.learner.weights_port) == (9002, 9003, 9004)
    aa = e2e.actor_args(spec, 9002, 1)
    acfg = conf.load(aa[1:])
    assert aa[0] == "actor" and acfg.engine.name == "sim" and acfg.actor.learner_port == 9002 and acfg.actor.max_groups == 2
    assert acfg.actor.actor_id == "x-a1"


def test_default_flags_parse_and_size_the_comparison():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    args = p.parse_args([])
    assert args.e2e_actors == 4 and args.e2e_staleness == 2 and args.e2e_scaling == "1,2,4,8"
    args = p.parse_args(["--e2e-steps", "3", "--e2e-parts", "sim"])
    assert args.e2e_steps == 3 and args.e2e_parts == "sim"


def test_actor_engine_busy_and_weight_sync_come_from_the_logged_actor_counters():
    m = _metrics([10.0, 12.0, 14.0])
    m[0].update({"actors/count": 2, "actors/engine_busy_s": 5.0, "actors/weight_pulls": 2, "actors/weight_pull_s": 0.2})
    m[2].update({"actors/count": 2, "actors/engine_busy_s": 8.0, "actors/weight_pulls": 6, "actors/weight_pull_s": 0.6})
    s = summarize(m, [], groups_per_step=2)
    assert s.extra["actor_engine_busy"] == pytest.approx(3.0 / (4.0 * 2))
    assert s.extra["weight_sync_s"] == pytest.approx(0.1)
    assert summarize(_metrics([1.0, 2.0]), [], groups_per_step=2).extra == {}


def test_learner_logs_the_sum_of_actor_counters():
    from turnscale.learner.metrics import StepMetrics, record_actor_stats

    m = StepMetrics()
    record_actor_stats(m, [{"engine_busy_s": 1.5, "weight_pulls": 2.0}, {"engine_busy_s": 0.5, "bad": float("nan")}])
    out = m.reduce()
    assert out == {"actors/count": 2.0, "actors/engine_busy_s": 2.0, "actors/weight_pulls": 2.0}


def test_trajectory_log_carries_the_lease_wall_time(tmp_path: Path):
    from turnscale.learner.trajlog import TrajectoryLog
    from turnscale.protocol.messages import Lease
    from tests.unit.fakes import make_group, task

    lease = Lease(lease_id="l-1", task=task(3), group_size=2, turn_limit=10, policy_version=0, ttl_s=60.0, seed=1)
    log = TrajectoryLog(str(tmp_path))
    log.write_group(make_group(lease), step=0, version=0, accepted=True, lease_s=1.25)
    log.write_group(make_group(lease), step=0, version=0, accepted=False, drop_reason="duplicate")
    log.close()
    recs = read_jsonl(tmp_path / "trajectories.jsonl")
    assert [r["lease_s"] for r in recs] == [1.25, 1.25, -1.0, -1.0]
    g1, g2 = group_costs(recs)
    assert g1.duration_s == 1.25 and g1.accepted and not g2.accepted


def test_scaling_phase_rates_use_only_steps_with_that_many_actors():
    recs = [{"step": i + 1, "time": t, "actors/count": n, "perf/step_time_s": 0.2}
            for i, (t, n) in enumerate([(0, 1), (6, 1), (12, 1), (18, 1), (20, 2), (23, 2), (26, 2)])]
    one = e2e.phase_figures(recs, 1, groups_per_step=2, warmup=1)
    assert one.steps == 3 and one.window_s == 18 and one.groups_per_s == pytest.approx(6 / 18)
    assert one.learner_busy == pytest.approx(0.6 / 18)
    two = e2e.phase_figures(recs, 2, groups_per_step=2, warmup=1)
    assert two.steps == 2 and two.groups_per_s == pytest.approx(4 / 6)
    assert e2e.phase_figures(recs, 4, groups_per_step=2, warmup=1) is None
    assert e2e.phase_figures(recs[:5], 2, groups_per_step=2, warmup=1) is None  # only the warm-up step so far
    # settling: the window starts at the first step >= 5 s after the phase began (t=26)
    settled = e2e.phase_figures(recs, 2, groups_per_step=2, warmup=1, settle_s=5.0)
    assert settled is None
    settled = e2e.phase_figures(recs + [{"step": 8, "time": 30, "actors/count": 2}], 2, groups_per_step=2, warmup=1, settle_s=5.0)
    assert settled.steps == 1 and settled.window_s == 4
    (a, b, busy) = e2e.scaling_results([one, two])
    assert (a.name, a.ratio) == ("scaling_sim_1actors", 1.0) and b.ratio == pytest.approx(2.0)
    assert busy.name == "learner_busy_2actors" and busy.target == 2.0 and busy.ok


def test_a_run_folder_left_by_an_earlier_bench_is_emptied_before_a_run(tmp_path):
    run_dir = tmp_path / "scaling"
    (run_dir / "learner" / "checkpoints" / "step-4").mkdir(parents=True)
    (run_dir / "learner" / "metrics.jsonl").write_text('{"step": 4, "time": 1.0}\n')
    e2e.fresh_run_dir(run_dir)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []
    e2e.fresh_run_dir(tmp_path / "new")
    assert (tmp_path / "new").is_dir()
