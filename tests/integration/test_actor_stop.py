"""An actor told to stop exits within seconds, even when everything it talks to is gone.

Resource managers stop a job with SIGTERM and SIGKILL it ``KillWait`` seconds later (Slurm's
default: 30 s).  A scaled-down or preempted actor must be out by then, also when its node
lost the learner and the env server first (a dead node, a cancelled learner job).  Real
envhub, learner and actor processes on 127.0.0.1 with the tiny model; the actor keeps its
*default* timeouts (``actor.request_timeout_s=30``, ``actor.shutdown_grace_s=10``), which
are what a cluster run uses.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from turnscale.common.procs import Child
from tests.integration.test_failures import Cluster, cluster_factory  # noqa: F401  (the fixture)

KILL_WAIT_S = 30.0
"""Slurm's default ``KillWait``: SIGKILL follows SIGTERM this long after."""
STOP_BOUND_S = KILL_WAIT_S / 2
"""What the actor promises: ``shutdown_grace_s + 2 * stop_timeout_s`` (16 s with the
defaults) at worst; here the groups fail fast (the env server refuses connections), so it
is out within ~``2 * stop_timeout_s``; half of KillWait leaves room for a loaded machine."""


@pytest.fixture
def stop_cluster(cluster_factory) -> Cluster:
    """A cluster whose actors keep the shipped timeouts (the cluster fixture shortens them)
    and whose leases outlive the test (a dead actor's lease is never re-issued here)."""
    from turnscale.conf.schema import ActorConfig

    c = cluster_factory("learner.lease_ttl_s=60")
    d = ActorConfig()
    c.common += [f"actor.request_timeout_s={d.request_timeout_s}", f"actor.shutdown_grace_s={d.shutdown_grace_s}"]
    return c


@contextmanager
def _playing(c: Cluster) -> Iterator[tuple[Child, Child]]:
    """Envhub, learner and actor ``a1`` up, a step trained and ``a1`` holding a lease: yields
    ``(learner, actor)``; every process's log tail is printed when the block fails."""
    try:
        c.start_envhub()
        learner = c.start_learner()
        actor = c.start_actor("a1")
        c.wait("the first trained step", lambda: c.step() >= 1, 180)
        c.wait("a1 holding a lease", lambda: "granted to actor a1" in c.log(learner), 60)
        yield learner, actor
    except BaseException:
        c.dump()
        raise


def _sigterm_exits_cleanly_within_bound(actor: Child) -> None:
    """SIGTERM the actor: it exits with 0 within ``STOP_BOUND_S``."""
    t0 = time.monotonic()
    actor.popen.send_signal(signal.SIGTERM)
    rc = actor.popen.wait(timeout=KILL_WAIT_S + 30)
    took = time.monotonic() - t0
    print(f"actor exit after SIGTERM: {took:.1f}s")
    assert rc == 0, actor.tail(40)
    assert took < STOP_BOUND_S, f"the actor took {took:.1f}s to exit after SIGTERM (KillWait {KILL_WAIT_S:.0f}s)"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigtermed_actor_exits_within_kill_wait_when_learner_and_envhub_are_gone(stop_cluster):
    c = stop_cluster
    with _playing(c) as (learner, actor):
        learner.kill()
        c.procs.children[0].kill()  # the env server
        _sigterm_exits_cleanly_within_bound(actor)
        log = c.log(actor)
        assert "stopping: sigterm" in log and "stopped (sigterm)" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigtermed_actor_reconnecting_to_a_gone_learner_exits_within_kill_wait(stop_cluster):
    c = stop_cluster
    with _playing(c) as (learner, actor):
        learner.kill()
        c.wait("a1 noticing the lost learner", lambda: "learner lost" in c.log(actor), 120, alive=[actor])
        c.procs.children[0].kill()  # the env server too
        _sigterm_exits_cleanly_within_bound(actor)
