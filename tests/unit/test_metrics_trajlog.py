import io
import json

import pytest

from turnscale.learner.leases import LeaseManager
from turnscale.learner.metrics import ConsoleLogger, JsonlLogger, MultiLogger, NullLogger, StepMetrics, record_intake, record_train, record_trained
from turnscale.learner.tasks import TaskStream, parse_task_spec
from turnscale.learner.trajlog import TrajectoryLog
from tests.unit.fakes import make_group

TRAJ_KEYS = {"step", "version", "lease_id", "actor_id", "env", "data_idx", "task_id", "split", "category", "episode",
             "group_size", "turn_limit", "finish_reason", "reward", "success", "accepted", "drop_reason", "lease_s", "num_turns",
             "num_tokens", "prompt", "error", "turns"}
TURN_KEYS = {"index", "output_text", "action", "parse_error", "observation", "reward", "done", "policy_version",
             "gen_latency_s", "env_latency_s", "num_tokens", "logprob_mean", "logprob_min"}


def leases(n=2, group_size=4):
    m = LeaseManager(stream=TaskStream(parse_task_spec("0:10", "babyai")), group_size=group_size, groups_per_step=4,
                     max_staleness=1, ttl_s=10)
    return m.grant("a", n, now=0)


def test_reductions_are_applied_once_per_step():
    m = StepMetrics()
    for v in (1, 2, 3):
        m.add("x/mean", v)
        m.add("x/sum", v, "sum")
        m.add("x/max", v, "max")
        m.add("x/last", v, "last")
    assert m.reduce() == {"x/last": 3.0, "x/max": 3.0, "x/mean": 2.0, "x/sum": 6.0}
    assert m.reduce() == {}
    with pytest.raises(ValueError):
        m.add("x/sum", 1, "mean")
    with pytest.raises(ValueError):
        m.add("y", 1, "median")


def test_group_metrics_are_namespaced_per_env_and_category():
    l1, l2 = leases()
    m = StepMetrics()
    g1 = make_group(l1, rewards=[1, 0, 1, 1], category="GoToRedBall")
    record_intake(m, True, "")
    record_trained(m, g1, 1)
    record_intake(m, False, "failed")
    record_train(m, {"grad_norm": 0.5, "loss/pg": 0.1, "perf/x": float("nan")})
    out = m.reduce()
    assert out["rollout/groups_received"] == 2 and out["rollout/groups_accepted"] == 1
    assert out["rollout/dropped/failed"] == 1
    assert out["rollout/success"] == 0.75 and out["env/babyai/success"] == 0.75
    assert out["env/babyai/GoToRedBall/return"] == 0.75
    assert out["rollout/staleness/1"] == 1 and out["rollout/turns_per_episode"] == 2
    assert out["loss/grad_norm"] == 0.5 and out["loss/pg"] == 0.1 and "perf/x" not in out


def test_jsonl_and_console_loggers(tmp_path):
    path = tmp_path / "metrics.jsonl"
    buf = io.StringIO()
    clock = iter([0.0, 1.0, 10.0]).__next__
    lg = MultiLogger([JsonlLogger(str(path)), ConsoleLogger(5.0, stream=buf, clock=clock), NullLogger()])
    for s in range(3):
        lg.write(s, {"rollout/success": 0.5, "perf/version": s})
    lg.close()
    rows = [json.loads(l) for l in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["perf/version"] == 1
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in buf.getvalue()
    assert lines[0].startswith("step 0 | version 0") and "success 0.500" in lines[0]


def test_tensorboard_logger_writes_event_file(tmp_path):
    from turnscale.learner.metrics import TensorBoardLogger

    lg = TensorBoardLogger(str(tmp_path / "tb"))
    lg.write(1, {"loss/x": 1.0})
    lg.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_trajectory_log_writes_one_line_per_episode_with_stable_keys(tmp_path):
    l1, l2 = leases(group_size=3)
    log = TrajectoryLog(str(tmp_path), decode=lambda ids: " ".join(map(str, ids)))
    log.write_group(make_group(l1, rewards=[1, 0, 0]), step=3, version=2, accepted=True)
    log.write_group(make_group(l2, rewards=[0, 0, 0]), step=3, version=2, accepted=False, drop_reason="stale")
    log.close()
    rows = [json.loads(l) for l in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    assert all(set(r) == TRAJ_KEYS for r in rows)
    assert all(set(t) == TURN_KEYS for r in rows for t in r["turns"])
    r0 = rows[0]
    assert (r0["lease_id"], r0["episode"], r0["group_size"], r0["accepted"], r0["reward"]) == (l1.lease_id, 0, 3, True, 1.0)
    assert r0["prompt"] == "0 1 2 3"
    t0 = r0["turns"][0]
    assert t0["num_tokens"] == 3 and t0["logprob_min"] == pytest.approx(-0.7) and t0["logprob_mean"] == pytest.approx(-0.6)
    assert rows[3]["drop_reason"] == "stale" and rows[3]["accepted"] is False
