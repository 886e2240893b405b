"""The simulated long-tail workload (``env.options.sim_latency``) with a fake inner env."""

from __future__ import annotations

import numpy as np
import pytest

from turnscale import conf
from turnscale.envhub.base import ResetResult, StepResult
from turnscale.envhub.simwork import (
    SimLatencyFamily,
    SimWorkload,
    split_options,
    step_budget,
    step_latency,
    task_factor,
    wrap,
)


class FakeEnv:
    def __init__(self, done_after: int = 1000) -> None:
        self.done_after = done_after
        self.steps = 0
        self.closed = False

    def reset(self, data_idx: int) -> ResetResult:
        self.steps = 0
        return ResetResult(observation=f"task {data_idx}")

    def step(self, action: str) -> StepResult:
        self.steps += 1
        done = self.steps >= self.done_after
        return StepResult(observation=action, reward=1.0 if done else 0.0, done=done, info={"success": done})

    def observation(self) -> str:
        return "obs"

    def close(self) -> None:
        self.closed = True

    def hint(self) -> str:
        return "hint"


class FakeFamily:
    name = "fake"

    def __init__(self, done_after: int = 1000) -> None:
        self.done_after = done_after

    def create(self) -> FakeEnv:
        return FakeEnv(self.done_after)

    def num_tasks(self) -> int:
        return 7

    def close(self) -> None:
        pass


def test_option_absent_leaves_the_family_unwrapped():
    fam = FakeFamily()
    assert wrap(fam, SimWorkload.from_options({})) is fam
    assert SimWorkload.from_options({"sim_latency": None}) is None
    assert SimWorkload.from_options({"sim_latency": True}) == SimWorkload()


def test_unknown_or_bad_option_names_the_key():
    with pytest.raises(ValueError, match="sim_latency.median"):
        SimWorkload.from_options({"sim_latency": {"median": 1}})
    with pytest.raises(ValueError, match="sim_latency.sigma"):
        SimWorkload.from_options({"sim_latency": {"sigma": -1}})
    with pytest.raises(ValueError, match="sim_latency"):
        SimWorkload.from_options({"sim_latency": 3})


def test_hydra_override_reaches_the_options_and_the_family_never_sees_it():
    cfg = conf.load(["+env.options.sim_latency={median_s: 0.01, steps_median: 2}", "+env.options.other=1"])
    own, w = split_options(cfg.env)
    assert w == SimWorkload(median_s=0.01, steps_median=2)
    assert own.options == {"other": 1}
    assert cfg.env.options["sim_latency"]["median_s"] == 0.01  # the original is untouched


def test_draws_are_deterministic_and_long_tailed():
    w = SimWorkload(seed=3, median_s=0.05, sigma=1.0, max_s=5.0, steps_median=3, steps_sigma=1.0, steps_max=30)
    assert step_latency(w, 17, 2, 5) == step_latency(w, 17, 2, 5)
    lat = np.array([step_latency(w, i, 0, s) for i in range(200) for s in range(5)])
    assert np.median(lat) == pytest.approx(0.05, rel=0.15)
    assert lat.max() > 10 * np.median(lat)  # a long tail
    assert lat.max() <= 5.0
    budgets = np.array([step_budget(w, i) for i in range(500)])
    assert budgets.min() >= 1 and budgets.max() <= 30
    assert np.median(budgets) == 3
    assert (budgets >= 10).mean() > 0.05  # some tasks take many steps
    assert step_budget(SimWorkload(seed=4), 17) == step_budget(SimWorkload(seed=4), 17)
    assert [step_budget(SimWorkload(seed=4), i) for i in range(50)] != [step_budget(w, i) for i in range(50)]


def test_task_factor_slows_every_step_and_reset_of_a_task():
    w = SimWorkload(seed=2, median_s=0.1, sigma=0.0, max_s=100.0, task_sigma=1.0, reset_s=0.5)
    factors = [task_factor(w, i) for i in range(300)]
    assert np.median(factors) == pytest.approx(1.0, rel=0.2) and max(factors) > 5
    i = int(np.argmax(factors))
    assert step_latency(w, i, 0, 3) == pytest.approx(0.1 * factors[i])
    assert step_latency(w, i, 4, -1) == pytest.approx(0.5 * factors[i])
    assert task_factor(SimWorkload(), i) == 1.0


def test_zero_median_turns_each_part_off():
    w = SimWorkload(median_s=0, steps_median=0)
    assert step_latency(w, 1, 0, 0) == 0.0
    assert step_budget(w, 1) == 0


def test_wrapped_env_sleeps_the_drawn_latency_and_ends_at_the_task_budget():
    slept: list[float] = []
    w = SimWorkload(seed=1, median_s=0.02, sigma=0.5, steps_median=4, steps_sigma=0.0, reset_s=0.3)
    fam = SimLatencyFamily(FakeFamily(), w, sleep=slept.append)
    env = fam.create()
    assert env.reset(9).info["sim_latency_s"] == step_latency(w, 9, 0, -1) > 0
    assert slept == [step_latency(w, 9, 0, -1)]
    slept.clear()
    results = [env.step("a") for _ in range(4)]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].truncated and results[-1].info["success"] is False
    assert slept == [step_latency(w, 9, 0, s) for s in range(4)]
    assert [r.info["sim_latency_s"] for r in results] == slept
    # the second play of the same task is the episode k=1, on any instance
    other = fam.create()
    slept.clear()
    other.reset(9)
    other.step("a")
    assert slept == [step_latency(w, 9, 1, -1), step_latency(w, 9, 1, 0)]


def test_env_that_ends_first_is_not_overridden():
    w = SimWorkload(median_s=0, steps_median=10, steps_sigma=0.0)
    env = SimLatencyFamily(FakeFamily(done_after=2), w, sleep=lambda s: None).create()
    env.reset(0)
    env.step("a")
    r = env.step("b")
    assert r.done and not r.truncated and r.info["success"] is True and r.reward == 1.0


def test_wrapper_passes_everything_else_through():
    fam = SimLatencyFamily(FakeFamily(), SimWorkload(), sleep=lambda s: None)
    assert fam.name == "fake" and fam.num_tasks() == 7 and fam.done_after == 1000
    env = fam.create()
    assert env.observation() == "obs" and env.hint() == "hint"
    env.close()
    assert env._inner.closed
