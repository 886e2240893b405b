"""``turnscale.runcontrol`` and the stop/resume parts of ``turnscale.launch`` that need no
process: no default time limit, how a stop is recorded and reported, the estimates."""

from __future__ import annotations

import json
import signal

import pytest

from turnscale import conf
from turnscale.launch import DEFAULT_EXPERIMENT, Launcher
from turnscale.report import summary_table
from turnscale.runcontrol import RunPhases, RunStop, RunStopped, duration, eta_line, rl_pace


@pytest.mark.parametrize("experiment", [DEFAULT_EXPERIMENT, "run_web"])
def test_the_default_run_config_has_no_wall_clock_limit(experiment, tmp_path):
    cfg = conf.load([f"experiment={experiment}", f"run.dir={tmp_path}"])
    assert cfg.run.timeout_s == 0 and cfg.run.resume is False
    launcher = Launcher(cfg)
    assert launcher.deadline_left() == float("inf")
    launcher.check_limit()
    assert not launcher.stop.requested


def test_a_passed_explicit_limit_requests_a_stop_once(tmp_path):
    cfg = conf.load([f"experiment={DEFAULT_EXPERIMENT}", f"run.dir={tmp_path}", "run.timeout_s=0.001"])
    launcher = Launcher(cfg)
    launcher.t0 -= 1
    launcher.check_limit()
    assert launcher.stop.cause == "time limit" and not launcher.stop.skip_eval
    with pytest.raises(conf.ConfigError, match="run.timeout_s"):
        conf.load([f"experiment={DEFAULT_EXPERIMENT}", "run.timeout_s=-1"])


def test_the_first_signal_stops_training_the_second_skips_the_evaluation():
    said: list[str] = []
    stop = RunStop(said.append)
    stop.request("time limit")  # a later signal does not replace the first cause
    stop.on_signal(signal.SIGINT)
    assert (stop.cause, stop.signum, stop.skip_eval) == ("time limit", 0, False)
    stop.on_signal(signal.SIGINT)
    assert stop.skip_eval and "skipping the evaluation" in said[-1]
    stop = RunStop(said.append)
    stop.on_signal(signal.SIGTERM)  # only a flag: raising from a handler could break an import half-way
    assert stop.cause == "SIGTERM" and stop.exit_code(evaluated=False) == 128 + signal.SIGTERM
    assert stop.exit_code(evaluated=True) == 0 and RunStop().exit_code(evaluated=False) == 1


def test_phases_survive_a_new_process_and_a_fresh_run_clears_them(tmp_path):
    phases = RunPhases(tmp_path)
    phases.mark("prepared", {"files": {"test": "t.json"}})
    phases.mark("eval_warm_start", {"result": {"success": 0.25}, "wall_s": 3.0})
    assert RunPhases(tmp_path).get("eval_warm_start")["result"]["success"] == 0.25
    assert json.loads((tmp_path / RunPhases.FILE).read_text()).keys() == {"prepared", "eval_warm_start"}
    Launcher(conf.load([f"experiment={DEFAULT_EXPERIMENT}", f"run.dir={tmp_path}"]))  # not run.resume: starts over
    assert not (tmp_path / RunPhases.FILE).exists()


def test_resume_takes_the_stopped_runs_fitted_config_but_this_command_lines_limit(tmp_path):
    first = conf.load([f"experiment={DEFAULT_EXPERIMENT}", f"run.dir={tmp_path}", "schedule.turns=[4,9]"])
    conf.save(first, str(tmp_path / "run_config.yaml"))
    RunPhases(tmp_path).mark("prepared", {"files": {}, "sft_path": "", "model_path": "m", "recipe": None})
    again = conf.load([f"experiment={DEFAULT_EXPERIMENT}", f"run.dir={tmp_path}", "run.resume=true", "run.timeout_s=60"])
    cfg = Launcher(again).cfg
    assert cfg.schedule.turns == [4, 9] and cfg.run.timeout_s == 60 and cfg.run.resume


def test_rl_pace_measures_recent_steps_and_the_time_left():
    rows = [{"step": s, "time": 100.0 + 2.0 * s} for s in range(1, 6)]
    assert rl_pace(rows[:1], 10) is None
    step_s, left = rl_pace(rows, 10)
    assert step_s == pytest.approx(2.0) and left == pytest.approx(10.0)
    assert rl_pace(rows, 10, window=2) == pytest.approx((2.0, 10.0))


def test_eta_line_adds_the_phases_and_says_when_one_is_not_measured():
    assert duration(45) == "45 s" and duration(720) == "12 min" and duration(5400) == "1.5 h"
    line = eta_line([("RL", 600.0), ("final evaluation", 120.0)], now=0)
    assert line.startswith("RL 10 min + final evaluation 2 min -> done in ~12 min")
    assert "done in at least 10 min" in eta_line([("RL", 600.0), ("final evaluation", None)], now=0)


def test_summary_table_of_a_stopped_run_says_why_and_what_was_not_evaluated():
    table = summary_table({"stopped": "stopped: time limit after step 44 of 60", "warm_start": {"success": 0.125},
                           "final": None, "steps": 44, "steps_planned": 60, "wall_s": 1800.0})
    assert "stopped: time limit after step 44 of 60" in table and "not evaluated" in table and "44 of 60" in table


def test_a_signal_during_in_process_work_takes_effect_once_the_work_is_done(tmp_path):
    launcher = Launcher(conf.load([f"experiment={DEFAULT_EXPERIMENT}", f"run.dir={tmp_path}"]))
    finished = []

    def work() -> int:
        launcher.stop.on_signal(signal.SIGINT)  # what a Ctrl-C in the middle does
        finished.append(True)
        return 1

    with pytest.raises(RunStopped):
        launcher.in_process(work)
    assert finished and launcher.stop.cause == "SIGINT"
