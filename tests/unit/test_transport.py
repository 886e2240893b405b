"""trio + ZeroMQ helpers in one process: fast path, many tasks on one socket, cancellation,
request timeouts, CURVE and MAXMSGSIZE.  Every test runs under ``trio.fail_after``."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio
import trio.testing
import zmq

from turnscale.protocol import codec
from turnscale.protocol import messages as m
from turnscale.protocol.errors import PeerTimeout, ProtocolError, RemoteError, TransportError
from turnscale.protocol.transport import (
    AsyncSocket,
    Requester,
    SocketLimits,
    configure,
    free_port,
    generate_curve_keys,
    split_router_frames,
    tcp_endpoint,
)
from turnscale.protocol.transport import CurveKeys

LIMIT_S = 20


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _pair(ctx: zmq.Context, kind_a: int, kind_b: int, limits: SocketLimits = SocketLimits()) -> tuple[zmq.Socket, zmq.Socket]:
    a = configure(ctx.socket(kind_a), limits)
    b = configure(ctx.socket(kind_b), limits)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(tcp_endpoint("127.0.0.1", port))
    return a, b


def _inproc_pair(ctx: zmq.Context, kind_a: int, kind_b: int) -> tuple[zmq.Socket, zmq.Socket]:
    """Over ``inproc://`` a sent message is in the peer's pipe when ``send`` returns: tests
    that need messages already queued at the receiver need no sleep."""
    import uuid

    a, b = configure(ctx.socket(kind_a)), configure(ctx.socket(kind_b))
    name = f"inproc://t-{uuid.uuid4().hex}"
    a.bind(name)
    b.connect(name)
    return a, b


async def _until_readable(sock: zmq.Socket, timeout_s: float = 10.0) -> None:
    """Wait (bounded, without taking anything) until ``sock`` has a message queued."""
    with trio.fail_after(timeout_s):
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            await trio.sleep(0.005)


def run(fn, *args):
    async def main():
        with trio.fail_after(LIMIT_S):
            return await fn(*args)

    return trio.run(main)


# ----------------------------------------------------------------------------- fast path


def test_messages_arrive_in_order_and_whole_through_the_fast_path(ctx):
    a, b = _pair(ctx, zmq.PAIR, zmq.PAIR)
    n = 2000

    async def main():
        sa, sb = AsyncSocket(a), AsyncSocket(b)
        got = []

        async def recv():
            for _ in range(n):
                got.append(await sb.recv_msg(expect=m.WeightChunkRequest))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(recv)
            for i in range(n):
                await sa.send_msg(m.WeightChunkRequest(version=i, index=i % 7))
        assert [g.version for g in got] == list(range(n))
        assert all(g.index == g.version % 7 for g in got)
        sa.close()
        sb.close()

    run(main)


def test_a_flood_of_ready_messages_does_not_starve_other_tasks(ctx):
    a, b = _inproc_pair(ctx, zmq.PAIR, zmq.PAIR)
    for i in range(500):
        a.send(i.to_bytes(4, "little"))  # all queued at b when this returns (inproc)

    async def main():
        sb = AsyncSocket(b)
        ticks = 0
        received = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0)
            for _ in range(500):
                await sb.recv_multipart()
                received += 1
            nursery.cancel_scope.cancel()
        assert received == 500
        assert ticks >= 500 // 16 // 2  # the receiver yielded every few fast-path operations
        sb.close()

    run(main)


# ----------------------------------------------------------------------------- many tasks


def test_many_tasks_send_and_receive_on_one_socket_with_small_queues(ctx):
    """40 senders and 40 receivers share one DEALER; HWMs of 4 make most of them wait
    (one on the FD, the rest parked).  Every message comes back exactly once.  (The echo
    peer is a DEALER too: a ROUTER drops, rather than blocks, at its HWM.)"""
    limits = SocketLimits(sndhwm=4, rcvhwm=4)
    router, dealer = _pair(ctx, zmq.DEALER, zmq.DEALER, limits)
    tasks, per_task = 40, 50

    async def main():
        r, d = AsyncSocket(router), AsyncSocket(dealer)
        got: list[int] = []

        async def echo():
            for _ in range(tasks * per_task):
                frames = await r.recv_multipart()
                await r.send_multipart(frames)

        async def sender(k: int):
            for j in range(per_task):
                await d.send_multipart([(k * per_task + j).to_bytes(4, "little"), b"x" * 100])

        async def receiver():
            for _ in range(per_task):
                frames = await d.recv_multipart()
                assert len(frames) == 2 and frames[1].bytes == b"x" * 100
                got.append(int.from_bytes(frames[0].bytes, "little"))

        most_parked = 0

        async def watch():
            nonlocal most_parked
            while True:
                most_parked = max(most_parked, len(d._lot))
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as workers:
                workers.start_soon(echo)
                for k in range(tasks):
                    workers.start_soon(sender, k)
                    workers.start_soon(receiver)
            nursery.cancel_scope.cancel()
        assert sorted(got) == list(range(tasks * per_task))
        assert most_parked > 1  # the test did make tasks park behind the FD waiter
        r.close()
        d.close()

    run(main)


def test_a_receive_waiting_on_the_fd_wakes_when_another_task_sends(ctx):
    """Regression: libzmq drains the socket's command mailbox (and so the FD's edge) inside
    a send.  A reply that arrives while the event loop is busy, followed by a send from
    another task, leaves the FD quiet with a message ready: the task waiting on the FD
    must still be woken to receive it.  (A thread echoes every message but ``noreply``.)"""
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            if router.poll(20):
                frames = router.recv_multipart()
                if frames[1] != b"noreply":
                    router.send_multipart(frames)

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    rounds = 10

    async def main():
        d = AsyncSocket(dealer)
        for i in range(rounds):
            got = trio.Event()

            async def receiver():
                await d.recv_multipart()
                got.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.testing.wait_all_tasks_blocked()  # the receiver now waits on the FD
                await d.send_multipart([b"ping"])
                time.sleep(0.02)  # block the loop: the reply arrives and signals the FD
                await d.send_multipart([b"noreply"])  # drains the mailbox inside libzmq
                with trio.move_on_after(2) as scope:
                    await got.wait()
                assert not scope.cancelled_caught, f"round {i}: ready reply never woke the waiting task"
        d.close()

    try:
        run(main)
    finally:
        stop.set()
        t.join(5)


# ----------------------------------------------------------------------------- cancellation


def test_a_cancelled_receive_takes_nothing_off_the_socket(ctx):
    a, b = _inproc_pair(ctx, zmq.PAIR, zmq.PAIR)
    for i in range(3):
        a.send_multipart([b"part1-%d" % i, b"part2-%d" % i])  # queued at b (inproc)

    async def main():
        sb = AsyncSocket(b)
        with trio.CancelScope() as cs:
            cs.cancel()
            await sb.recv_multipart()
        assert cs.cancelled_caught
        frames = await sb.recv_multipart()
        assert [f.bytes for f in frames] == [b"part1-0", b"part2-0"]
        sb.close()

    run(main)


def test_receives_cancelled_at_random_moments_lose_no_message(ctx):
    a, b = _pair(ctx, zmq.PAIR, zmq.PAIR)
    n = 400

    async def main():
        sa, sb = AsyncSocket(a), AsyncSocket(b)
        got: list[int] = []
        rng = np.random.default_rng(0)

        async def send():
            for i in range(n):
                await sa.send_multipart([i.to_bytes(4, "little"), b"tail"])
                if i % 3 == 0:
                    await trio.sleep(0.0005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            while len(got) < n:
                with trio.move_on_after(float(rng.choice([0.0, 0.0001, 0.001]))):
                    frames = await sb.recv_multipart()
                    assert len(frames) == 2 and frames[1].bytes == b"tail"
                    got.append(int.from_bytes(frames[0].bytes, "little"))
        assert got == list(range(n))
        sa.close()
        sb.close()

    run(main)


def test_a_cancelled_send_sends_nothing_and_never_half_a_message(ctx):
    """A PULL peer that does not read yet and HWMs of 1: sends succeed until the queues and
    kernel buffers fill, then block and are cancelled.  The peer must later receive exactly
    the messages whose send returned, each whole, in order."""
    push = configure(ctx.socket(zmq.PUSH), SocketLimits(sndhwm=1, rcvhwm=1))
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull = configure(ctx.socket(zmq.PULL), SocketLimits(sndhwm=1, rcvhwm=1))
    pull.connect(tcp_endpoint("127.0.0.1", port))
    middle = b"b" * 256_000  # above pyzmq's copy threshold: the zero-copy path

    async def main():
        sp, sl = AsyncSocket(push), AsyncSocket(pull)
        await sp.send_multipart([b"probe"])  # connected once the probe arrives
        assert [f.bytes for f in await sl.recv_multipart()] == [b"probe"]
        with trio.CancelScope() as cs:
            cs.cancel()
            await sp.send_multipart([b"never", b"sent"])
        assert cs.cancelled_caught
        sent = []
        for i in range(60):
            with trio.move_on_after(0.05):
                await sp.send_multipart([b"a%d" % i, middle, b"c%d" % i])
                sent.append(i)
        assert 0 < len(sent) < 60, len(sent)  # some went through, later ones blocked and were cancelled
        got = []
        while True:
            with trio.move_on_after(0.5):
                frames = await sl.recv_multipart()
                assert len(frames) == 3 and frames[1].bytes == middle
                assert frames[0].bytes[1:] == frames[2].bytes[1:]
                got.append(int(frames[0].bytes[1:]))
                continue
            break
        assert got == sent
        sp.close()
        sl.close()

    run(main)


def test_close_wakes_every_waiting_task_with_transport_error(ctx):
    a, _b = _pair(ctx, zmq.PAIR, zmq.PAIR)

    async def main():
        sa = AsyncSocket(a)
        errors = []

        async def waiter():
            try:
                await sa.recv_multipart()
            except TransportError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()  # all five are parked on the socket
            sa.close()
        assert len(errors) == 5
        with pytest.raises(TransportError):
            await sa.send_multipart([b"x"])

    run(main)


# ----------------------------------------------------------------------------- request / reply


async def _serve(router: AsyncSocket, handle, n: int) -> None:
    """A ROUTER answering ``n`` requests; ``handle(msg) -> (delay_s, reply)``."""
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            frames = await router.recv_multipart()
            prefix, body = split_router_frames(frames)
            msg = codec.decode(body)
            delay, reply = handle(msg)

            async def answer(prefix=prefix, delay=delay, reply=reply):
                await trio.sleep(delay)
                await router.send_msg(reply, prefix=prefix)

            nursery.start_soon(answer)


def test_request_times_out_and_its_late_reply_is_discarded(ctx):
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)

    def handle(msg):
        if isinstance(msg, m.LeaseRequest) and msg.max_leases == 1:
            return 0.5, m.LeaseGrant(leases=[], retry_after_s=111.0)  # too late
        return 0.0, m.LeaseGrant(leases=[], retry_after_s=float(msg.max_leases))

    async def main():
        r, d = AsyncSocket(router), AsyncSocket(dealer)
        req = Requester(d)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, r, handle, 3)
            with pytest.raises(PeerTimeout, match="LeaseRequest"):
                await req.request(m.LeaseRequest(actor_id="a", max_leases=1), timeout_s=0.1, expect=m.LeaseGrant)
            await _until_readable(dealer)  # the late reply is now queued at the dealer
            g2 = await req.request(m.LeaseRequest(actor_id="a", max_leases=2), timeout_s=5, expect=m.LeaseGrant)
            g3 = await req.request(m.LeaseRequest(actor_id="a", max_leases=3), timeout_s=5, expect=m.LeaseGrant)
        assert (g2.retry_after_s, g3.retry_after_s) == (2.0, 3.0)
        r.close()
        d.close()

    run(main)


def test_request_surfaces_error_replies_and_wrong_reply_types(ctx):
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    replies = [m.ErrorReply(code="not_registered", message="send Hello first", retryable=True), m.Shutdown(reason="x")]

    async def main():
        r, d = AsyncSocket(router), AsyncSocket(dealer)
        req = Requester(d)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, r, lambda msg: (0.0, replies.pop(0)), 2)
            with pytest.raises(RemoteError) as info:
                await req.request(m.LeaseRequest(actor_id="a", max_leases=1), timeout_s=5, expect=m.LeaseGrant)
            assert (info.value.code, info.value.retryable) == ("not_registered", True)
            with pytest.raises(ProtocolError, match="got Shutdown, expected LeaseGrant"):
                await req.request(m.LeaseRequest(actor_id="a", max_leases=1), timeout_s=5, expect=m.LeaseGrant)
        r.close()
        d.close()

    run(main)


def test_request_times_out_when_it_cannot_even_be_sent(ctx):
    dealer = configure(ctx.socket(zmq.DEALER), SocketLimits(sndhwm=1))
    dealer.connect(tcp_endpoint("127.0.0.1", free_port()))  # nobody listens
    with pytest.raises(zmq.Again):
        for _ in range(100):  # fill the pipe to its HWM: further sends block
            dealer.send(b"x", zmq.NOBLOCK)

    async def main():
        req = Requester(AsyncSocket(dealer))
        with pytest.raises(PeerTimeout):
            await req.request(m.Goodbye(actor_id="a"), timeout_s=0.2)

    run(main)


def test_split_router_frames_rejects_missing_routing_frames():
    with pytest.raises(ProtocolError, match="identity, request id"):
        split_router_frames([b"id", b"frame0"])
    prefix, body = split_router_frames([b"id", b"rid", b"m0", b"m1"])
    assert prefix == [b"id", b"rid"] and body == [b"m0", b"m1"]


# ----------------------------------------------------------------------------- CURVE, limits


def _curve_pair(ctx: zmq.Context, client_knows: bytes) -> tuple[zmq.Socket, zmq.Socket]:
    server_keys = generate_curve_keys()
    client_own = generate_curve_keys()
    client_keys = CurveKeys(public=client_own.public, secret=client_own.secret, server_public=client_knows or server_keys.public)
    router = configure(ctx.socket(zmq.ROUTER), curve=server_keys, server=True)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = configure(ctx.socket(zmq.DEALER), curve=client_keys)
    dealer.connect(tcp_endpoint("127.0.0.1", port))
    return router, dealer


def test_curve_pair_with_the_right_server_key_talks(ctx):
    router, dealer = _curve_pair(ctx, b"")
    assert router.curve_server

    async def main():
        r, d = AsyncSocket(router), AsyncSocket(dealer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, r, lambda msg: (0.0, m.HeartbeatAck(unknown_lease_ids=["l-7"])), 1)
            ack = await Requester(d).request(m.Heartbeat(actor_id="a", lease_ids=[], policy_version=7), timeout_s=5, expect=m.HeartbeatAck)
        assert ack.unknown_lease_ids == ["l-7"]

    run(main)


def test_curve_client_with_the_wrong_server_key_gets_nothing(ctx):
    router, dealer = _curve_pair(ctx, generate_curve_keys().public)

    async def main():
        r, d = AsyncSocket(router), AsyncSocket(dealer)
        await d.send_msg(m.Goodbye(actor_id="intruder"))
        with trio.move_on_after(1.0) as scope:
            await r.recv_multipart()
        assert scope.cancelled_caught  # the handshake failed: nothing reached the server

    run(main)


def test_curve_client_without_server_key_is_refused_at_configure(ctx):
    with pytest.raises(ValueError, match="server's public key"):
        configure(ctx.socket(zmq.DEALER), curve=generate_curve_keys())


def test_maxmsgsize_drops_an_oversize_message_and_the_receiver_keeps_working(ctx):
    limits = SocketLimits(max_message_bytes=10_000)
    router = configure(ctx.socket(zmq.ROUTER), limits)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    big = configure(ctx.socket(zmq.DEALER))
    big.connect(tcp_endpoint("127.0.0.1", port))
    small = configure(ctx.socket(zmq.DEALER))
    small.connect(tcp_endpoint("127.0.0.1", port))

    async def main():
        r = AsyncSocket(router)
        chunk = m.WeightChunk(version=1, index=0, checksum=0, data=np.zeros(50_000, np.uint8))
        await AsyncSocket(big).send_multipart([b"rid", *codec.encode(chunk)])
        await AsyncSocket(small).send_multipart([b"rid", *codec.encode(m.Goodbye(actor_id="small"))])
        frames = await r.recv_multipart()
        _, body = split_router_frames(frames)
        assert codec.decode(body) == m.Goodbye(actor_id="small")
        with trio.move_on_after(0.5) as scope:
            await r.recv_multipart()
        assert scope.cancelled_caught  # the oversize message never arrived

    run(main)


def test_socket_limits_are_applied(ctx):
    s = configure(ctx.socket(zmq.DEALER), SocketLimits(max_message_bytes=1234, sndhwm=7, rcvhwm=9, linger_ms=0))
    assert (s.getsockopt(zmq.MAXMSGSIZE), s.getsockopt(zmq.SNDHWM), s.getsockopt(zmq.RCVHWM), s.getsockopt(zmq.LINGER)) == (1234, 7, 9, 0)


def test_free_port_is_outside_the_ephemeral_range_and_never_handed_out_twice():
    """A ``bind(0)`` port lies in the range outgoing connections draw their source ports
    from, so under load another process's connection took one before a learner bound it
    ("Address already in use" in CI); ``free_port`` picks outside that range."""
    import socket

    from turnscale.protocol.transport import _ephemeral_range

    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(100)]
    assert len(set(ports)) == len(ports)
    assert not any(lo <= p <= hi for p in ports), (lo, hi, sorted(ports)[:5])
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # and it is free


# ----------------------------------------------------------------------------- frame limit


def test_a_message_over_max_frames_is_dropped_whole_and_the_next_one_arrives(ctx):
    """The receiver keeps at most ``max_frames`` frames: the rest of a many-frame message
    is taken off the socket and dropped (other tasks run meanwhile), ``TooManyFrames``
    carries the routing frames to reply to, and the following messages are intact."""
    from turnscale.protocol.errors import TooManyFrames

    router, dealer = _inproc_pair(ctx, zmq.ROUTER, zmq.DEALER)
    n = 50_000
    dealer.send_multipart([b"rid-1", *([b""] * n)])
    dealer.send_multipart([b"rid-2", b"at", b"the", b"limit"])
    dealer.send_multipart([b"rid-3", b"small"])

    async def main():
        sock = AsyncSocket(router)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            await trio.sleep(0)
            with pytest.raises(TooManyFrames) as info:
                await sock.recv_multipart(max_frames=5)
            assert info.value.count == n + 2  # identity, request id, n empty frames
            assert info.value.head[1] == b"rid-1" and len(info.value.head) == 2
            assert "over the limit of 5" in str(info.value)
            assert ticks >= n // 8192 - 1  # the drop yielded to other tasks
            at_limit = await sock.recv_multipart(max_frames=5)
            assert [bytes(f) for f in at_limit[1:]] == [b"rid-2", b"at", b"the", b"limit"]
            small = await sock.recv_multipart(copy=True, max_frames=5)
            assert small[1:] == [b"rid-3", b"small"]
            nursery.cancel_scope.cancel()
        sock.close()

    run(main)


def test_a_receive_with_max_frames_waits_for_its_message_and_decodes_it(ctx):
    a, b = _pair(ctx, zmq.DEALER, zmq.ROUTER)

    async def main():
        sa, sb = AsyncSocket(a), AsyncSocket(b)
        async with trio.open_nursery() as nursery:
            async def later():
                await trio.sleep(0.05)
                await sa.send_multipart([b"rid", *codec.encode(m.WeightChunkRequest(version=3, index=1))])

            nursery.start_soon(later)
            frames = await sb.recv_multipart(max_frames=4)
        prefix, body = split_router_frames(frames)
        assert prefix[1] == b"rid" and codec.decode(body, expect=m.WeightChunkRequest).version == 3
        sa.close()
        sb.close()

    run(main)
