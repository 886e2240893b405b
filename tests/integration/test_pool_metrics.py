"""Per-pool metrics from a real run: envhub, learner and two hf actors in two pools on
127.0.0.1 (``cpu``: float32, the learner's own numerics; ``cpu_bf16``: bfloat16 weights,
standing in for another engine or device).  Synchronous (``max_staleness=0``, one lease
per actor) so every trained group is at staleness 0 and each step trains one group from
each pool: both pools' ``pool/<name>/logprob_gap_mean...`` are finite, the float32 pool's
gap is ~0 (its ``mu`` equals the learner's ``pi_prox`` up to float rounding) and the
bfloat16 pool's is larger — the gap the behaviour weights absorb."""

from __future__ import annotations

import math

import pytest

from tests.integration.test_failures import Cluster, check_groups, check_ledger, cluster_factory  # noqa: F401  (the fixture)

STEPS = 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_pool_reports_its_behaviour_vs_learner_logprob_gap(cluster_factory):
    c: Cluster = cluster_factory()
    c.common = [("learner.max_staleness=0" if x.startswith("learner.max_staleness=") else
                 "actor.max_groups=1" if x.startswith("actor.max_groups=") else x) for x in c.common]
    try:
        c.start_envhub()
        learner = c.start_learner(f"learner.steps={STEPS}", "learner.max_leases_per_actor=1")
        a1 = c.procs.start("a1", ["actor", *c.common, "actor.actor_id=a1", "actor.pool=cpu", "engine.dtype=float32"])
        a2 = c.procs.start("a2", ["actor", *c.common, "actor.actor_id=a2", "actor.pool=cpu_bf16", "engine.dtype=bfloat16"])
        c.actors.update(a1=a1, a2=a2)
        assert learner.popen.wait(timeout=240) == 0, learner.tail(40)
        for a in (a1, a2):
            assert a.popen.wait(timeout=60) == 0, a.tail(40)
        check_groups(c.trajs())
        trained = check_ledger(c.dir)
        assert {r["staleness"] for r in trained} == {0}
        rows = [m for m in c.metrics() if "step" in m]
        assert len(rows) >= STEPS
        for pool in ("cpu", "cpu_bf16"):
            gaps = [m[f"pool/{pool}/logprob_gap_mean_staleness0"] for m in rows if f"pool/{pool}/logprob_gap_mean_staleness0" in m]
            assert gaps, f"no step trained a group of pool {pool}"
            for m in rows:
                if f"pool/{pool}/logprob_gap_mean" in m:
                    assert math.isfinite(m[f"pool/{pool}/logprob_gap_mean"]) and math.isfinite(m[f"pool/{pool}/behaviour_weight_mean"])
                    assert m[f"pool/{pool}/staleness_mean"] == 0
        fp32 = [m["pool/cpu/logprob_gap_mean_staleness0"] for m in rows if "pool/cpu/logprob_gap_mean_staleness0" in m]
        bf16 = [m["pool/cpu_bf16/logprob_gap_mean_staleness0"] for m in rows if "pool/cpu_bf16/logprob_gap_mean_staleness0" in m]
        assert max(fp32) < 1e-4, fp32  # the learner's own numerics: float32 on cpu, float32 weights
        assert min(bf16) > max(fp32), (bf16, fp32)
        for m in rows:
            if "pool/cpu/behaviour_weight_mean_staleness0" in m:
                assert abs(m["pool/cpu/behaviour_weight_mean_staleness0"] - 1.0) < 1e-3
    except BaseException:
        c.dump()
        raise
