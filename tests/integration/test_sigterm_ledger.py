"""SIGTERM to a real learner process while a scripted actor keeps sending groups: no group
the learner acknowledged (``GroupAck.accepted``) is lost.  Each one is either in the
training ledger (``batches.jsonl``, outcome ``trained``) or its task is leased again later,
by the same learner or by the next one resumed from the checkpoint SIGTERM wrote.

Steps are slowed (``learner.debug_step_delay_s``, inside the train lock) while the actor
fills the admission window, so a SIGTERM usually lands during a step with the next batch
already buffered: the moment the old learner lost that batch (its train loop took it out of
the buffer before the signal handler got the lock; the checkpoint saw it nowhere).  The
unit tests in ``tests/unit/test_learner_service.py`` stop the loop at each point of the step
cycle with fakes; this is the same contract end to end.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from turnscale.common.procs import ProcessGroup
from turnscale.protocol import messages as m
from turnscale.protocol.transport import free_port
from tests.integration.scripted_actor import ScriptedActor, group_for

VOCAB = 1024


class Feeder:
    """A scripted actor answering every lease at once, in a thread, until its learner is gone;
    it records each lease and each accepted ack, in one sequence shared by every feeder."""

    events: list[tuple[int, str, int]] = []
    """(sequence number, ``lease`` | ``acked``, task data_idx), over all learners of the test."""
    _lock = threading.Lock()

    def __init__(self, ports: list[int], actor_id: str) -> None:
        self.actor = ScriptedActor(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", vocab=VOCAB,
                                   actor_id=actor_id)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"feed-{actor_id}", daemon=True)

    def _event(self, kind: str, idx: int) -> None:
        with Feeder._lock:
            Feeder.events.append((len(Feeder.events), kind, idx))

    def _run(self) -> None:
        a = self.actor
        try:
            while not self.stop.is_set():
                grant = a.ask(m.LeaseRequest(actor_id=a.actor_id, max_leases=4), 10)
                if not isinstance(grant, m.LeaseGrant):
                    return
                for lease in grant.leases:
                    self._event("lease", lease.task.data_idx)
                    ack = a.ask(group_for(lease, a.actor_id, VOCAB), 10)
                    if isinstance(ack, m.GroupAck) and ack.accepted:
                        self._event("acked", lease.task.data_idx)
                if not grant.leases:
                    time.sleep(max(0.02, min(grant.retry_after_s, 0.2)))
        except TimeoutError:
            return  # the learner went away

    def start(self) -> "Feeder":
        self.actor.hello(timeout_s=120)
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.actor.close()


def ledger(run_dir: Path) -> list[dict]:
    path = run_dir / "batches.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trained_steps(run_dir: Path) -> int:
    return max((r["step"] for r in ledger(run_dir) if r["outcome"] == "trained"), default=0)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sigterm_mid_step_loses_no_acknowledged_group(tmp_path, tiny_model_dir):
    ports = [free_port() for _ in range(3)]
    run_dir = tmp_path / "learner"
    args = ["learner", f"learner.port={ports[0]}", f"learner.pub_port={ports[1]}", f"learner.weights_port={ports[2]}",
            f"model.path={tiny_model_dir}", f"learner.dir={run_dir}", "learner.steps=1000", "learner.groups_per_step=2",
            "algo.group_size=2", "learner.max_staleness=2", "learner.debug_step_delay_s=0.4",
            "learner.checkpoint_every=1000", "env.tasks.train=0:1000", "logger.tensorboard=false",
            "logger.console_every_s=0", "learner.heartbeat_interval_s=1"]
    procs = ProcessGroup(tmp_path / "logs", "turnscale")
    Feeder.events = []
    # SIGTERM 0.2 s after a step's ledger lines appear (in the next step's delay, with the
    # batch after it buffered); then a resumed learner, to see the re-issues
    offsets = [0.2, None]
    stopped_at = 0  # events before the last SIGTERM: the acks the test accounts for
    try:
        for cycle, offset in enumerate(offsets):
            learner = procs.start(f"learner{cycle}", [*args, *(["learner.resume=true"] if cycle else [])])
            feeder = Feeder(ports, f"scripted{cycle}").start()
            try:
                if offset is None:  # until every group acked before the last SIGTERM is accounted for
                    deadline = time.monotonic() + 60
                    while _lost(run_dir, stopped_at) and time.monotonic() < deadline:
                        assert learner.alive(), learner.tail()
                        time.sleep(0.2)
                    break
                target = trained_steps(run_dir) + 2
                deadline = time.monotonic() + 120
                while trained_steps(run_dir) < target:
                    assert learner.alive() and time.monotonic() < deadline, learner.tail()
                    time.sleep(0.02)
                time.sleep(offset)
                assert learner.stop(60, signal.SIGTERM) == 0, learner.tail(40)
            finally:
                feeder.close()
            stopped_at = len(Feeder.events)
        log = "".join((tmp_path / "logs" / f).read_text(errors="replace") for f in sorted(
            p.name for p in (tmp_path / "logs").iterdir()))
        assert log.count("checkpointing and stopping") == 1
        assert "Traceback" not in log
        lost = _lost(run_dir, stopped_at)
        assert not lost, f"acknowledged, never trained, never leased again: tasks {lost}"
        acked = {idx: seq for seq, kind, idx in Feeder.events[:stopped_at] if kind == "acked"}
        again = {idx for seq, kind, idx in Feeder.events if kind == "lease" and idx in acked and seq > acked[idx]}
        assert again, "no acked group was untrained at the SIGTERM: the test missed the window it is about"
    finally:
        procs.close(grace_s=8)


def _lost(run_dir: Path, before: int) -> list[int]:
    """Tasks acked (``accepted``) in the first ``before`` events but neither trained nor
    leased again after the ack."""
    trained = {r["data_idx"] for r in ledger(run_dir) if r["outcome"] == "trained"}
    with Feeder._lock:
        events = list(Feeder.events)
    out = []
    for seq, kind, idx in events:
        if kind == "acked" and seq < before and idx not in trained and not any(k == "lease" and i == idx and s > seq for s, k, i in events):
            out.append(idx)
    return out
