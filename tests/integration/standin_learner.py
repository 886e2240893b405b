"""A small stand-in learner for actor tests: ROUTER + PUB speaking ``protocol.messages`` and
the real ``WeightPublisher`` for weights, run in a background thread with its own trio loop.

It grants one lease per request (``group_size`` episodes, ``turn_limit`` turns, the current
version), records every Hello, group, heartbeat and Goodbye, re-announces the current
policy every ``announce_every_s``, and can be stopped and started again on the same ports
(a learner restart resuming the same run, as the real learner does: the same ``run_id``
and version numbers, a new ``incarnation``, no memory of actors or leases; requests from
an actor that has not said Hello since get ``not_registered``).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any, Callable

import trio
import zmq

from turnscale.protocol import codec
from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.messages import (
    EnvEndpoint,
    ErrorReply,
    Goodbye,
    GroupAck,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Lease,
    LeaseGrant,
    LeaseRequest,
    PolicyAnnouncement,
    SamplingParams,
    Task,
    TrajectoryGroup,
    Welcome,
)
from turnscale.protocol.transport import AsyncSocket, configure, free_port, split_router_frames


class StandInLearner:
    def __init__(self, *, model_path: str, env_url: str, state_dict: dict, group_size: int = 2, turn_limit: int = 2,
                 max_new_tokens: int = 12, heartbeat_s: float = 0.5, announce_every_s: float = 0.3) -> None:
        from turnscale.learner.weights import WeightPublisher

        self.port, self.pub_port, self.weights_port = free_port(), free_port(), free_port()
        self.model_path, self.env_url, self.state_dict = model_path, env_url, state_dict
        self.group_size, self.turn_limit, self.max_new_tokens = group_size, turn_limit, max_new_tokens
        self.heartbeat_s, self.announce_every_s = heartbeat_s, announce_every_s
        self.publisher = WeightPublisher(f"tcp://127.0.0.1:{self.weights_port}", chunk_mb=0.25, dtype="float32")
        self.version = 0
        self.manifest = self.publisher.publish(0, state_dict)
        self.hellos: list[Hello] = []
        self.groups: list[tuple[TrajectoryGroup, Lease]] = []
        self.heartbeats: list[Heartbeat] = []
        self.goodbyes: list[Goodbye] = []
        self.errors: list[str] = []
        self.leases: dict[str, Lease] = {}
        self._n = 0
        self.run_id = uuid.uuid4().hex[:8]
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._ready = threading.Event()

    # ------------------------------------------------------------------ test side
    def start(self) -> None:
        self.incarnation = uuid.uuid4().hex[:8]
        self.registered: set[str] = set()  # a restarted learner knows no actor and no lease
        self.leases = {}
        self._ready.clear()
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stand-in learner did not start")

    def stop(self) -> None:
        if self._thread is None:
            return
        trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(10)
        self._thread = None

    def publish(self, version: int) -> None:
        """Publish the same tensors as a new version (the actor must pull and swap)."""
        self.manifest = self.publisher.publish(version, self.state_dict)
        self.version = version

    def close(self) -> None:
        self.stop()
        self.publisher.close()

    def wait_for(self, cond: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; errors: {self.errors[-3:]}")
            time.sleep(0.05)

    # ------------------------------------------------------------------ learner side
    def announcement(self) -> PolicyAnnouncement:
        return PolicyAnnouncement(version=self.version, step=self.version, manifest=self.manifest,
                                  incarnation=self.incarnation)

    async def _serve(self) -> None:
        ctx = zmq.Context()
        router = AsyncSocket(configure(ctx.socket(zmq.ROUTER), server=True))
        router.sock.bind(f"tcp://127.0.0.1:{self.port}")
        pub = AsyncSocket(configure(ctx.socket(zmq.PUB), server=True))
        pub.sock.bind(f"tcp://127.0.0.1:{self.pub_port}")
        self._token = trio.lowlevel.current_trio_token()
        try:
            with trio.CancelScope() as self._scope:
                self._ready.set()
                async with trio.open_nursery() as n:
                    n.start_soon(self._announce, pub)
                    while True:
                        frames = await router.recv_multipart()
                        prefix, body = split_router_frames(frames)
                        try:
                            reply = self._handle(codec.decode(body))
                        except ProtocolError as exc:
                            self.errors.append(str(exc))
                            reply = ErrorReply(code="bad_message", message=str(exc))
                        await router.send_msg(reply, prefix=prefix)
        finally:
            router.close()
            pub.close()
            ctx.destroy(linger=0)

    async def _announce(self, pub: AsyncSocket) -> None:
        while True:
            await pub.send_msg(self.announcement())
            await trio.sleep(self.announce_every_s)

    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, (LeaseRequest, Heartbeat)) and msg.actor_id not in self.registered:
            return ErrorReply(code="not_registered", message="send Hello first", retryable=True)
        if isinstance(msg, Hello):
            self.hellos.append(msg)
            self.registered.add(msg.actor_id)
            return Welcome(
                run_id=self.run_id, actor_id=msg.actor_id, model_path=self.model_path, renderer="auto",
                sampling=SamplingParams(temperature=1.0, max_new_tokens=self.max_new_tokens, max_context_tokens=2048),
                envs=[EnvEndpoint(name="babyai", url=self.env_url)], transfer_dtype="float32",
                pub_endpoint=f"tcp://0.0.0.0:{self.pub_port}", weights_endpoint=f"tcp://127.0.0.1:{self.weights_port}",
                heartbeat_interval_s=self.heartbeat_s, policy=self.announcement(),
            )
        if isinstance(msg, LeaseRequest):
            self._n += 1
            lease = Lease(lease_id=f"{self.incarnation}-{self._n}", task=Task(env="babyai", data_idx=self._n), group_size=self.group_size,
                          turn_limit=self.turn_limit, policy_version=self.version, ttl_s=30.0, seed=self._n)
            self.leases[lease.lease_id] = lease
            return LeaseGrant(leases=[lease], retry_after_s=0.0)
        if isinstance(msg, TrajectoryGroup):
            lease = self.leases.pop(msg.lease_id, None)
            if lease is None:
                return GroupAck(lease_id=msg.lease_id, accepted=False, reason="unknown_lease")
            self.groups.append((msg, lease))
            return GroupAck(lease_id=msg.lease_id, accepted=True)
        if isinstance(msg, Heartbeat):
            self.heartbeats.append(msg)
            return HeartbeatAck(unknown_lease_ids=[l for l in msg.lease_ids if l not in self.leases])
        if isinstance(msg, Goodbye):
            self.goodbyes.append(msg)
            return GroupAck(lease_id="", accepted=True)
        return ErrorReply(code="bad_message", message=type(msg).__name__)
