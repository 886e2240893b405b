"""A child process for the two-process transport test: a learner-shaped fake.

``python -m tests.integration.zmq_peer [--lifetime-s S]`` binds a ROUTER and a PUB on
127.0.0.1 (random ports), prints ``READY <router_port> <pub_port>`` and then, under trio:

- answers requests on the ROUTER (``Hello`` -> ``Welcome``, ``LeaseRequest`` ->
  ``LeaseGrant``, ``TrajectoryGroup`` -> ``GroupAck`` whose ``reason`` carries a digest
  of every array it received, ``Heartbeat`` -> ``HeartbeatAck``); a message that does
  not decode gets an ``ErrorReply(code="bad_message")`` and the loop goes on;
- publishes ``PolicyAnnouncement(version=k)`` every 20 ms on the PUB.

It exits by itself after ``--lifetime-s`` (a bound, in case its parent dies); the test
ends it by pid.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import trio
import zmq

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.transport import AsyncSocket, SocketLimits, configure, split_router_frames


def digest(group: m.TrajectoryGroup) -> str:
    h = hashlib.sha256()
    for ep in group.episodes:
        for arr in (ep.token_ids, ep.loss_mask, ep.logprobs, ep.versions):
            h.update(arr.tobytes())
    return h.hexdigest()


def answer(msg: object) -> object:
    if isinstance(msg, m.Hello):
        policy = m.PolicyAnnouncement(version=0, step=0)
        return m.Welcome(run_id="peer", actor_id=msg.actor_id, model_path="tiny", renderer="chatml", sampling=m.SamplingParams(),
                         envs=[], transfer_dtype="float32", pub_endpoint="", weights_endpoint="", heartbeat_interval_s=1.0, policy=policy)
    if isinstance(msg, m.LeaseRequest):
        leases = [m.Lease(lease_id=f"l-{i}", task=m.Task(env="babyai", data_idx=i), group_size=4, turn_limit=5, policy_version=0,
                          ttl_s=30.0, seed=i) for i in range(msg.max_leases)]
        return m.LeaseGrant(leases=leases, retry_after_s=0.0)
    if isinstance(msg, m.TrajectoryGroup):
        return m.GroupAck(lease_id=msg.lease_id, accepted=True, reason=digest(msg))
    if isinstance(msg, m.Heartbeat):
        return m.HeartbeatAck(unknown_lease_ids=[])
    return m.ErrorReply(code="unexpected", message=f"{type(msg).__name__} is not a request")


async def serve(router: AsyncSocket) -> None:
    while True:
        frames = await router.recv_multipart()
        try:
            prefix, body = split_router_frames(frames)
        except ProtocolError:
            continue  # no routing frames: nobody to answer
        try:
            reply = answer(codec.decode(body))
        except ProtocolError as exc:
            reply = m.ErrorReply(code="bad_message", message=str(exc))
        await router.send_msg(reply, prefix=prefix)


async def publish(pub: AsyncSocket) -> None:
    version = 0
    while True:
        version += 1
        await pub.send_msg(m.PolicyAnnouncement(version=version, step=version))
        await trio.sleep(0.02)


async def main(lifetime_s: float) -> None:
    ctx = zmq.Context()
    limits = SocketLimits(max_message_bytes=64 << 20)
    router = configure(ctx.socket(zmq.ROUTER), limits)
    pub = configure(ctx.socket(zmq.PUB), limits)
    router_port = router.bind_to_random_port("tcp://127.0.0.1")
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    print(f"READY {router_port} {pub_port} {os.getpid()}", flush=True)
    ar, ap = AsyncSocket(router), AsyncSocket(pub)
    with trio.move_on_after(lifetime_s):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, ar)
            nursery.start_soon(publish, ap)
    ar.close()
    ap.close()
    ctx.term()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lifetime-s", type=float, default=60.0)
    args = parser.parse_args()
    trio.run(main, args.lifetime_s)
    sys.exit(0)
