"""An actor-shaped client for learner tests that need the *same* groups in two runs: over
real ZeroMQ sockets it registers, takes leases and answers each with a synthetic group that
is a pure function of the lease (task index and policy version), so two learners with the
same seed train on identical batches.  Then it reads the final published weights."""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import numpy as np
import zmq

from turnscale.benchmarks.synthetic import synthetic_episode
from turnscale.protocol import codec
from turnscale.protocol import messages as m


def group_for(lease: m.Lease, actor_id: str, vocab: int) -> m.TrajectoryGroup:
    """Episodes seeded by the task index, sampled "at" the lease's version; rewards 1, 0, ...
    (never all equal)."""
    rng = np.random.default_rng(1000 + lease.task.data_idx)
    eps = [synthetic_episode(rng, vocab=vocab, prompt_len=8, turns=2, tokens_per_turn=6 + 2 * (lease.task.data_idx % 3),
                             obs_len=4, reward=float(k == 0 or (k > 1 and rng.random() < 0.5)), turn_limit=lease.turn_limit,
                             version=lease.policy_version) for k in range(lease.group_size)]
    eps = [dataclasses.replace(ep, finish_reason="done") for ep in eps]
    return m.TrajectoryGroup(lease_id=lease.lease_id, actor_id=actor_id, task=lease.task, turn_limit=lease.turn_limit,
                             episodes=eps)


class ScriptedActor:
    def __init__(self, control: str, pub: str, *, vocab: int, actor_id: str = "scripted") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(control)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.actor_id, self.vocab = actor_id, vocab
        self.sent = 0
        self.requests = 0
        self.welcome: m.Welcome | None = None

    def ask(self, msg: object, timeout_s: float) -> object:
        """One request, one reply (``[request id, message...]``: ``transport.split_router_frames``)."""
        self.requests += 1
        rid = self.requests.to_bytes(8, "little")
        self.sock.send_multipart([rid, *codec.encode(msg)])
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer to {type(msg).__name__} within {timeout_s}s")
        frames = self.sock.recv_multipart()
        assert frames[0] == rid, frames[:1]
        return codec.decode(frames[1:])

    def hello(self, timeout_s: float = 120.0) -> m.Welcome:
        w = self.ask(m.Hello(actor_id=self.actor_id, host=socket.gethostname(), pid=os.getpid(), engine="scripted",
                             device="cpu", max_groups=4), timeout_s)
        assert isinstance(w, m.Welcome), w
        self.welcome = w
        return w

    def feed(self, deadline_s: float, max_groups: int | None = None) -> None:
        """Answer leases until the learner says ``Shutdown`` (or ``max_groups`` were sent)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and (max_groups is None or self.sent < max_groups):
            grant = self.ask(m.LeaseRequest(actor_id=self.actor_id, max_leases=4), 60)
            if isinstance(grant, m.Shutdown):
                return
            assert isinstance(grant, m.LeaseGrant), grant
            for lease in grant.leases:
                ack = self.ask(group_for(lease, self.actor_id, self.vocab), 60)
                assert isinstance(ack, m.GroupAck) and ack.accepted, ack
                self.sent += 1
            if not grant.leases:
                time.sleep(max(0.05, grant.retry_after_s))
        if max_groups is None:
            raise TimeoutError(f"the learner did not end the run within {deadline_s}s")

    def announcement(self, version: int, timeout_s: float = 30.0) -> m.PolicyAnnouncement:
        """The first ``PolicyAnnouncement`` of ``version`` on the PUB (re-sent every few seconds)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sub.poll(200):
                msg = codec.decode(self.sub.recv_multipart())
                if isinstance(msg, m.PolicyAnnouncement) and msg.version == version and msg.manifest is not None:
                    return msg
        raise TimeoutError(f"no announcement of version {version} within {timeout_s}s")

    def goodbye(self) -> None:
        self.ask(m.Goodbye(actor_id=self.actor_id, reason="done"), 30)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
