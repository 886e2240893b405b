"""``turnscale.scaling.ScalingController`` on recorded signal traces (pure logic, no clock)."""

from __future__ import annotations

import pytest

from turnscale.scaling import (
    PoolPolicy, Sample, ScalingConfigError, ScalingController, ScalingPolicy, pick_drain,
)

CPU = PoolPolicy(name="cpu", min_actors=1, max_actors=4, cost=1.0)
GPU = PoolPolicy(name="gpu", min_actors=0, max_actors=3, cost=4.0)


def starved(cpu: int = 1, gpu: int = 0, cpu_tps: float = 100.0, gpu_tps: float = 0.0) -> Sample:
    return Sample(idle_fraction=0.8, ready_groups=0, actors={"cpu": cpu, "gpu": gpu},
                  tokens_per_s={"cpu": cpu_tps, "gpu": gpu_tps})


def saturated(cpu: int = 1, gpu: int = 0, stale: float = 0.0, ready: float = 6.0) -> Sample:
    return Sample(idle_fraction=0.0, ready_groups=ready, stale_drop_rate=stale, actors={"cpu": cpu, "gpu": gpu},
                  tokens_per_s={"cpu": 100.0 * cpu, "gpu": 800.0 * gpu})


def balanced() -> Sample:
    return Sample(idle_fraction=0.15, ready_groups=2, actors={"cpu": 1}, tokens_per_s={"cpu": 100.0})


def run(ctl: ScalingController, trace: list[Sample]):
    return [ctl.observe(s) for s in trace]


def test_starved_learner_raises_leases_first_then_adds_actors_after_a_full_window_each_time():
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=3, max_leases=3), leases=2)
    ds = run(ctl, [starved()] * 9)
    changed = [(i, d.reason) for i, d in enumerate(ds) if d.changed]
    assert [i for i, _ in changed] == [2, 5, 8]  # one action per full window, never sooner
    assert ds[2].max_leases_per_actor == 3 and ds[2].wanted == {"cpu": 1}
    assert ds[5].wanted == {"cpu": 2} and ds[8].wanted == {"cpu": 3}


def test_a_short_spike_does_not_scale_hysteresis():
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=4), wanted={"cpu": 2})
    trace = [balanced(), starved(), starved(), balanced(), balanced(), saturated(), balanced(), balanced()]
    assert not any(d.changed for d in run(ctl, trace))
    assert ctl.wanted == {"cpu": 2}


def test_readings_between_the_thresholds_hold_steady():
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=2), wanted={"cpu": 2})
    assert not any(d.changed for d in run(ctl, [balanced()] * 20))


def test_scale_up_prefers_best_measured_throughput_per_cost():
    # gpu: 800 tok/s per actor at cost 4 = 200 per cost; cpu: 100 per cost -> gpu wins
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=1, max_leases=1), wanted={"cpu": 1, "gpu": 1})
    d = ctl.observe(starved(cpu=1, gpu=1, cpu_tps=100, gpu_tps=800))
    assert d.changed and d.wanted == {"cpu": 1, "gpu": 2}
    # the gpu pool got cheap per token only at 2x the cpu price: cpu wins now
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=1, max_leases=1), wanted={"cpu": 1, "gpu": 1})
    d = ctl.observe(starved(cpu=1, gpu=1, cpu_tps=100, gpu_tps=300))
    assert d.wanted == {"cpu": 2, "gpu": 1}


def test_scale_up_goes_elsewhere_when_the_best_pool_is_full():
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=1, max_leases=1), wanted={"cpu": 1, "gpu": 3})
    d = ctl.observe(starved(cpu=1, gpu=3, cpu_tps=100, gpu_tps=2400))
    assert d.wanted == {"cpu": 2, "gpu": 3}
    ctl.wanted = {"cpu": 4, "gpu": 3}
    d = ctl.observe(starved(cpu=4, gpu=3))
    assert not d.changed and "max_actors" in d.reason


def test_saturated_learner_lowers_leases_before_draining_the_worst_pool():
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=2, min_leases=1, max_leases=2),
                            wanted={"cpu": 3, "gpu": 2})
    ds = run(ctl, [saturated(cpu=3, gpu=2)] * 6)
    acts = [d for d in ds if d.changed]
    assert acts[0].max_leases_per_actor == 1 and acts[0].wanted == {"cpu": 3, "gpu": 2}
    # then the pool with the worst throughput per cost loses actors: cpu (100/1) < gpu (800/4)
    assert acts[1].wanted == {"cpu": 2, "gpu": 2}
    assert acts[2].wanted == {"cpu": 1, "gpu": 2}


def test_stale_drops_count_as_saturation_even_with_an_empty_ready_buffer():
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=2, max_leases=1), wanted={"cpu": 3})
    ds = run(ctl, [saturated(cpu=3, stale=0.5, ready=0.0)] * 2)
    assert ds[-1].changed and ds[-1].wanted == {"cpu": 2}


def test_never_below_min_nor_above_max_and_out_of_bounds_counts_are_fixed_at_once():
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=1, max_leases=1), wanted={"cpu": 9, "gpu": 0})
    d = ctl.observe(balanced())
    assert d.changed and d.wanted == {"cpu": 4, "gpu": 0} and "bounds" in d.reason
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=1, max_leases=1), wanted={"cpu": 1})
    d = ctl.observe(saturated(cpu=1))
    assert not d.changed and d.wanted == {"cpu": 1} and "min_actors" in d.reason


def test_an_unmeasured_pool_is_credited_the_mean_rate_so_it_gets_tried():
    # gpu has no actors yet: credited cpu's 100 tok/s, at cost 4 it loses to cpu...
    ctl = ScalingController(ScalingPolicy(pools=(CPU, GPU), window=1, max_leases=1), wanted={"cpu": 4, "gpu": 0})
    d = ctl.observe(starved(cpu=4, cpu_tps=400))
    # ...but cpu is full, so gpu is tried
    assert d.wanted == {"cpu": 4, "gpu": 1}


def test_recorded_trace_ramp_up_then_learner_saturates_then_steady():
    """A run's shape: the learner waits at first, actors are added until it is busy, then
    groups pile up and the controller backs off, then it holds."""
    ctl = ScalingController(ScalingPolicy(pools=(CPU,), window=2, min_leases=1, max_leases=2), wanted={"cpu": 1}, leases=2)
    trace = [starved(cpu=1)] * 4 + [balanced()] * 4 + [saturated(cpu=3)] * 4 + [balanced()] * 6
    ds = run(ctl, trace)
    wanted = [d.wanted["cpu"] for d in ds]
    leases = [d.max_leases_per_actor for d in ds]
    assert max(wanted) == 3 and wanted[-1] == 2 and leases[-1] == 1
    assert [d.changed for d in ds[-6:]] == [False] * 6


def test_invalid_policies_name_the_field():
    with pytest.raises(ScalingConfigError, match="min_actors"):
        PoolPolicy(name="x", min_actors=3, max_actors=1)
    with pytest.raises(ScalingConfigError, match="dead band"):
        ScalingPolicy(pools=(CPU,), up_idle=0.1, down_idle=0.2)
    with pytest.raises(ScalingConfigError, match="duplicate"):
        ScalingPolicy(pools=(CPU, CPU))
    with pytest.raises(ScalingConfigError, match="cost"):
        PoolPolicy(name="x", cost=0)


def test_pick_drain_takes_the_least_busy_actors_of_the_pool():
    actors = [("a", "cpu", 2), ("b", "cpu", 0), ("c", "gpu", 0), ("d", "cpu", 1)]
    assert pick_drain(actors, "cpu", 2) == ["b", "d"]
    assert pick_drain(actors, "gpu", 5) == ["c"]
    assert pick_drain(actors, "cpu", 0) == []
