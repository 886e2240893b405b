"""Relay fan-out on 127.0.0.1: an actor's RelayServer serves verified chunks to other
pullers; a puller verifies every chunk whatever its source and falls back (next relay,
ultimately the learner) on a dead, slow, refusing or corrupt relay, never returning a
torn or wrong version."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio
import zmq

from turnscale.actors.relay import RelayServer
from turnscale.actors.weight_sync import PullReport, ReceiveBuffer, pull_weights
from turnscale.learner.weights import WeightPublisher
from turnscale.protocol import checksums, codec
from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.messages import ErrorReply, WeightChunk, WeightChunkRequest
from turnscale.protocol.transport import AsyncSocket, configure, free_port

torch.set_num_threads(1)


def state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(200, 64, generator=g), "b": torch.randn(333, generator=g),
            "i": torch.arange(17, dtype=torch.int64)}


@pytest.fixture
def publisher():
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.004, dtype="bfloat16")  # ~4 KB chunks
    yield pub
    pub.close()


def dealer(ep):
    s = AsyncSocket(configure(zmq.Context.instance().socket(zmq.DEALER)))
    s.sock.connect(ep)
    return s


def stream_ok(buf, m):
    stream = buf.buf[: m.total_bytes]
    return all(checksums.checksum(m.checksum_algo, stream[c.offset:c.offset + c.nbytes]) == c.checksum for c in m.chunks)


async def pull_into(ep, m, buf, *, relays=(), relay=None, key="k", report=None, **kw):
    socks = [dealer(ep), *[dealer(r) for r in relays]]
    if relay is not None:
        relay.begin(key, m, buf.take(m.total_bytes))
    try:
        with trio.fail_after(20):
            return await pull_weights(socks[0], m, timeout_s=5, window=4, buffer=buf, relays=socks[1:],
                                      on_chunk=(lambda i: relay.mark(key, i)) if relay else None, report=report, **kw)
    finally:
        for s in socks:
            s.close()


def test_relay_answers_not_yet_until_a_chunk_is_verified(publisher):
    m = publisher.publish(1, state_dict())
    buf = np.zeros(m.total_bytes, dtype=np.uint8)
    with RelayServer("tcp://127.0.0.1:0") as relay:
        raw = configure(zmq.Context.instance().socket(zmq.DEALER))
        raw.connect(relay.endpoint)
        try:
            def ask(i):
                raw.send_multipart([b"r", *codec.encode(WeightChunkRequest(version=1, index=i))])
                assert raw.poll(5000)
                frames = raw.recv_multipart()
                return codec.decode(frames[1:], expect=(ErrorReply, WeightChunk))

            assert isinstance(ask(0), ErrorReply) and ask(0).code == "not_yet" and ask(0).retryable
            relay.begin("k", m, buf)
            c = m.chunks[0]
            buf[c.offset:c.offset + c.nbytes] = 7
            assert ask(0).code == "not_yet"  # written but not verified: never served
            relay.mark("k", 0)
            got = ask(0)
            assert isinstance(got, WeightChunk) and got.checksum == c.checksum and bytes(got.data) == bytes(buf[:c.nbytes])
            relay.begin("k", publisher.publish(2, state_dict(1)), buf)  # the buffer is reused: v1 withdrawn at once
            gone = ask(0)
            assert gone.code == "unknown_version" and not gone.retryable  # v1 will not come back: ask elsewhere
        finally:
            raw.close(linger=0)


def test_a_chain_pulls_every_chunk_from_the_relay_pipelined(publisher):
    m = publisher.publish(1, state_dict())
    a, b = ReceiveBuffer(), ReceiveBuffer()
    rep = PullReport()
    with RelayServer("tcp://127.0.0.1:0") as relay:
        async def main():
            async with trio.open_nursery() as n:
                n.start_soon(lambda: pull_into(publisher.endpoint, m, b, relays=[relay.endpoint], report=rep))
                await trio.sleep(0.05)  # b asks first: gets not_yet, waits for a's chunks
                await pull_into(publisher.endpoint, m, a, relay=relay)

        before = publisher.served_bytes
        trio.run(main)
    assert stream_ok(a, m) and stream_ok(b, m)
    assert rep.from_learner == 0 and rep.from_relays == len(m.chunks)
    assert publisher.served_bytes - before == m.total_bytes  # one copy left the learner


def test_a_child_on_a_slow_link_gets_every_run_from_its_relay_without_not_yet(publisher):
    """A child requests ``window`` runs ahead of its relay's own pull.  On a slow link the
    farthest run's first chunk reaches the relay long after the request: the relay must
    hold it until then (default ``hold_s``), not answer ``not_yet``, which sent the run to
    the back of the child's queue and stalled its window (stop 27: ~170 ms per hop of a
    chain at 50 Mbit/s).  Here chunks reach the relay one per 45 ms, the child keeps
    16 chunks (~0.7 s) ahead, and every run is held until served."""
    g = torch.Generator().manual_seed(3)
    m = publisher.publish(1, {"w": torch.randn(48 * 1024, generator=g)})  # ~24 chunks of ~4 KB
    n = len(m.chunks)
    assert n >= 20
    src = publisher._versions[1].buf
    held = np.zeros(m.total_bytes, dtype=np.uint8)
    b, rep = ReceiveBuffer(), PullReport()
    with RelayServer("tcp://127.0.0.1:0") as relay:
        relay.begin("k", m, held)

        async def arrive():  # the relay's own pull, on a slow link
            for c in m.chunks:
                await trio.sleep(0.045)
                held[c.offset:c.offset + c.nbytes] = src[c.offset:c.offset + c.nbytes]
                relay.mark("k", c.index)

        async def main():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(arrive)
                await pull_into(publisher.endpoint, m, b, relays=[relay.endpoint], report=rep,
                                run_bytes=4 * m.chunks[0].nbytes)

        trio.run(main)
        assert relay.not_yet == 0
    assert stream_ok(b, m)
    assert rep.from_learner == 0 and rep.from_relays == n and rep.fallbacks == 0


def test_a_relay_killed_mid_transfer_costs_a_retry_elsewhere(publisher):
    m = publisher.publish(1, state_dict())
    half = len(m.chunks) // 2
    a, b = ReceiveBuffer(), ReceiveBuffer()
    relay = RelayServer("tcp://127.0.0.1:0")
    relay.begin("k", m, a.take(m.total_bytes))

    async def main():
        await pull_into(publisher.endpoint, m, a)  # the relay's own copy, marked only half-way
        for i in range(half):
            relay.mark("k", i)
        rep = PullReport()
        async with trio.open_nursery() as n:
            async def kill():
                while relay.served_chunks < half // 2:
                    await trio.sleep(0.005)
                relay.close()  # dies mid-transfer: pending requests are never answered
            n.start_soon(kill)
            await pull_into(publisher.endpoint, m, b, relays=[relay.endpoint], report=rep, relay_timeout_s=0.5,
                            relay_patience_s=0.3)
        return rep

    rep = trio.run(main)
    relay.close()
    assert stream_ok(b, m)
    assert rep.from_relays >= half // 2 and rep.from_learner > 0 and rep.fallbacks > 0


def test_a_dead_relay_endpoint_falls_back_to_the_next_source(publisher):
    m = publisher.publish(1, state_dict())
    a, b = ReceiveBuffer(), ReceiveBuffer()
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens
    with RelayServer("tcp://127.0.0.1:0") as live:
        async def main():
            await pull_into(publisher.endpoint, m, a, relay=live)
            rep = PullReport()
            await pull_into(publisher.endpoint, m, b, relays=[dead, live.endpoint], report=rep, relay_timeout_s=0.3)
            return rep

        rep = trio.run(main)
    assert stream_ok(b, m)
    assert rep.dead_relays == [0] and rep.from_relays == len(m.chunks) and rep.from_learner == 0


def test_a_corrupt_relay_is_refused_by_checksum_and_refetched(publisher):
    m = publisher.publish(1, state_dict())
    a, b = ReceiveBuffer(), ReceiveBuffer()
    with RelayServer("tcp://127.0.0.1:0", corrupt=True) as bad:
        async def main():
            await pull_into(publisher.endpoint, m, a, relay=bad)
            rep = PullReport()
            got = await pull_into(publisher.endpoint, m, b, relays=[bad.endpoint], report=rep, copy=True)
            return rep, got

        rep, got = trio.run(main)
        assert bad.served_chunks > 0
    assert stream_ok(b, m)
    assert rep.from_relays == 0 and rep.from_learner == len(m.chunks) and rep.fallbacks == len(m.chunks)
    sd = state_dict()
    assert torch.equal(got["a"], sd["a"].to(torch.bfloat16)) and torch.equal(got["i"], sd["i"])


def test_a_relay_that_never_gets_the_version_hands_over_after_its_patience(publisher):
    m = publisher.publish(1, state_dict())
    b = ReceiveBuffer()
    with RelayServer("tcp://127.0.0.1:0") as empty:
        async def main():
            rep = PullReport()
            await pull_into(publisher.endpoint, m, b, relays=[empty.endpoint], report=rep, relay_patience_s=0.2)
            return rep

        rep = trio.run(main)
    assert stream_ok(b, m) and rep.from_learner == len(m.chunks) and rep.dead_relays == []


def test_a_curve_relay_serves_listed_curve_clients_and_strangers_and_plain_clients_fall_back(publisher):
    """Off loopback the relay serves CURVE with its actor's key pair (``Hello.relay_public_key``
    -> ``weight_source_keys``) and admits only the client keys the learner lists
    (``relay_clients`` -> ``allow_clients``): a listed client pulls from it; a CURVE client with
    an unlisted key pair (it knows the relay's public key: public keys are no secret) and a
    plain client fail the handshake, get nothing from the relay and take every chunk from the
    learner."""
    from turnscale.protocol.transport import CurveKeys, generate_curve_keys

    m = publisher.publish(1, state_dict())
    server, client, stranger = generate_curve_keys(), generate_curve_keys(), generate_curve_keys()
    a, b, c, d = ReceiveBuffer(), ReceiveBuffer(), ReceiveBuffer(), ReceiveBuffer()
    rep_curve, rep_plain, rep_stranger = PullReport(), PullReport(), PullReport()
    with RelayServer("tcp://127.0.0.1:0", curve=server) as relay:
        assert relay.public_key == server.public.decode()
        relay.allow_clients([client.public.decode(), "not a key"])

        def curve_dealer(keys):
            s = AsyncSocket(configure(zmq.Context.instance().socket(zmq.DEALER),
                                      curve=CurveKeys(public=keys.public, secret=keys.secret,
                                                      server_public=relay.public_key.encode())))
            s.sock.connect(relay.endpoint)
            return s

        async def main():
            await pull_into(publisher.endpoint, m, a, relay=relay)  # the relay holds v1
            learner = dealer(publisher.endpoint)
            secure, unlisted, plain = curve_dealer(client), curve_dealer(stranger), dealer(relay.endpoint)
            try:
                with trio.fail_after(60):
                    await pull_weights(learner, m, timeout_s=5, window=4, buffer=b, relays=[secure], report=rep_curve)
                    await pull_weights(learner, m, timeout_s=1, window=4, buffer=c, relays=[plain], report=rep_plain)
                    await pull_weights(learner, m, timeout_s=1, window=4, buffer=d, relays=[unlisted], report=rep_stranger)
            finally:
                for s in (learner, secure, unlisted, plain):
                    s.close()

        trio.run(main)
        assert relay.clients.refused >= 1  # the stranger's handshake
    assert stream_ok(b, m) and stream_ok(c, m) and stream_ok(d, m)
    assert rep_curve.from_relays == len(m.chunks) and rep_curve.from_learner == 0
    assert rep_plain.from_relays == 0 and rep_plain.from_learner == len(m.chunks)
    assert rep_stranger.from_relays == 0 and rep_stranger.from_learner == len(m.chunks)


def test_egress_is_counted_per_version_and_reported_when_the_version_is_retired():
    """A late pull of an old version counts for that version, not for whichever version is
    newest when the bytes leave (the learner logged 0 then 4 copies for two versions whose
    pulls straddled a publish; each was 2 copies)."""
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.004, dtype="bfloat16", keep=2) as pub:
        m1 = pub.publish(1, state_dict(1))
        trio.run(pull_into, pub.endpoint, m1, ReceiveBuffer())
        m2 = pub.publish(2, state_dict(2))
        trio.run(pull_into, pub.endpoint, m1, ReceiveBuffer())  # a late pull of version 1
        trio.run(pull_into, pub.endpoint, m2, ReceiveBuffer())
        assert pub.take_retired_egress() == []  # both still servable: their counts can grow
        pub.publish(3, state_dict(3))  # retires version 1
        assert pub.take_retired_egress() == [(1, 2 * m1.total_bytes, m1.total_bytes)]
        assert pub.take_retired_egress() == []  # each retired version is reported once
        pub.publish(4, state_dict(4))
        assert pub.take_retired_egress() == [(2, m2.total_bytes, m2.total_bytes)]


def test_runs_from_a_corrupt_relay_and_their_refetch_from_the_next_relay_lose_no_chunk(publisher):
    """A corrupt relay streams a run of chunks while each refused chunk is asked of the next
    relay as a run starting at the same chunk: both runs are in flight at once and every
    chunk must still arrive (keyed by chunk, the second run hid the first's rest: a hang)."""
    a, b, c = ReceiveBuffer(), ReceiveBuffer(), ReceiveBuffer()
    with RelayServer("tcp://127.0.0.1:0") as good, RelayServer("tcp://127.0.0.1:0", corrupt=True) as bad:
        for v in range(1, 6):
            m = publisher.publish(v, state_dict(v))

            async def main():
                async with trio.open_nursery() as n:  # the chain learner -> good -> bad, pulled at once
                    n.start_soon(lambda: pull_into(publisher.endpoint, m, a, relay=good, key=v % 2))
                    n.start_soon(lambda: pull_into(publisher.endpoint, m, b, relays=[good.endpoint], relay=bad, key=v % 2))
                    rep = PullReport()
                    await pull_into(publisher.endpoint, m, c, relays=[bad.endpoint, good.endpoint], report=rep,
                                    run_bytes=1 << 20)
                return rep

            rep = trio.run(main)  # pull_into bounds each pull in time
            assert stream_ok(c, m) and rep.fallbacks >= 1 and rep.from_relays + rep.from_learner == len(m.chunks)


def test_a_run_is_one_message_per_chunk_from_the_learner_and_from_a_relay_as_chunks_verify(publisher):
    """``WeightChunkRequest.count``: the learner answers the run (cut at the last chunk) with
    one message (header + data frame) per chunk, in order, so a relay downstream can verify
    and forward chunk ``i`` before ``i + 1`` has arrived (ZeroMQ delivers a message only
    whole: a run in one message made every hop wait for the whole run); a relay sends each
    chunk it has verified as its own message, the rest of the run as it verifies it; a bad
    count is refused."""
    m = publisher.publish(1, state_dict())
    n = len(m.chunks)

    def chunks(frames):
        got = [codec.decode(frames[k:k + 2], expect=WeightChunk) for k in range(1, len(frames), 2)]
        assert all(bytes(g.data) == bytes(m_buf[m.chunks[g.index].offset:][:m.chunks[g.index].nbytes]) for g in got)
        return [g.index for g in got]

    def messages(sock, count):
        out = []
        for _ in range(count):
            assert sock.poll(5000), f"only {len(out)} of {count} messages: {out}"
            out.append(chunks(sock.recv_multipart()))
        assert not sock.poll(200), "more messages than chunks"
        return out

    m_buf = publisher._versions[1].buf
    raw = configure(zmq.Context.instance().socket(zmq.DEALER))
    try:
        raw.connect(publisher.endpoint)
        raw.send_multipart([b"r", *codec.encode(WeightChunkRequest(version=1, index=n - 2, count=5))])
        assert messages(raw, 2) == [[n - 2], [n - 1]]
        raw.send_multipart([b"r", *codec.encode(WeightChunkRequest(version=1, index=0, count=3))])
        assert messages(raw, 3) == [[0], [1], [2]]
        with pytest.raises(ProtocolError, match="count"):
            WeightChunkRequest(version=1, index=0, count=0).check()
    finally:
        raw.close(linger=0)
    buf = np.zeros(m.total_bytes, dtype=np.uint8)
    with RelayServer("tcp://127.0.0.1:0", hold_s=5.0) as relay:
        raw = configure(zmq.Context.instance().socket(zmq.DEALER))
        raw.connect(relay.endpoint)
        try:
            relay.begin("k", m, buf)
            buf[:] = m_buf
            relay.mark("k", 0)
            relay.mark("k", 1)
            raw.send_multipart([b"r", *codec.encode(WeightChunkRequest(version=1, index=0, count=4))])
            assert messages(raw, 2) == [[0], [1]]  # what it holds, at once, a message each
            relay.mark("k", 3)
            relay.mark("k", 2)
            assert messages(raw, 2) == [[2], [3]]  # the rest, as it verified it
        finally:
            raw.close(linger=0)


def test_a_relay_that_refused_our_handshake_is_reached_on_a_fresh_connection_once_it_lists_us(publisher):
    """libzmq (4.3) never reconnects a DEALER whose CURVE handshake a ZAP handler refused:
    every later request on that socket is lost.  A relay refuses a new actor until its owner
    hears the newcomer's key (the owner's next ``HeartbeatAck``), so an actor's first pull
    from it can be refused.  The actor's weight path must reach that relay again on a fresh
    connection at its next pull, not time out on it at every pull (each timeout is a version
    at a fast learner: an actor in CI never got weights, every version retired before its
    fallback to the learner)."""
    from turnscale.actors.actor import ActorStats
    from turnscale.actors.engine import WeightSwap
    from turnscale.actors.main import pull_into as actor_pull
    from types import SimpleNamespace

    from turnscale.actors.weight_path import WeightPath
    from turnscale.common.curve import CurveSetup
    from turnscale.conf.schema import ActorConfig
    from turnscale.protocol.messages import PolicyAnnouncement
    from turnscale.protocol.transport import generate_curve_keys

    class Applies:
        version = -1

        def load_weights(self, version, tensors):
            swap = WeightSwap(version)
            swap.complete(WeightSwap.APPLIED)
            return swap

    server, own = generate_curve_keys(), generate_curve_keys()
    m1, m2 = publisher.publish(1, state_dict(1)), None
    held = [ReceiveBuffer(), ReceiveBuffer()]
    path = WeightPath(cfg=ActorConfig(verify_weights=False), stats=ActorStats(),
                      deps=SimpleNamespace(pull=actor_pull, new_buffer=ReceiveBuffer, relay=None))
    with RelayServer("tcp://127.0.0.1:0", curve=server) as relay:
        path.set_sources([relay.endpoint], [relay.public_key], [])

        async def main():
            nonlocal m2
            ctx = zmq.Context.instance()
            path.open_session(ctx, CurveSetup(public=own.public, secret=own.secret))
            learner = dealer(publisher.endpoint)
            try:
                await pull_into(publisher.endpoint, m1, held[0], relay=relay, key="v1")  # the relay holds v1
                with trio.fail_after(30):
                    await path.pull(learner, PolicyAnnouncement(version=1, step=1, manifest=m1, incarnation="A"), Applies())
                first = (path.stats.weight_chunks_from_relays, path.stats.weight_chunks_from_learner)
                relay.allow_clients([own.public.decode()])  # the owner's next HeartbeatAck lists us
                m2 = publisher.publish(2, state_dict(2))
                await pull_into(publisher.endpoint, m2, held[1], relay=relay, key="v2")
                with trio.fail_after(30):
                    await path.pull(learner, PolicyAnnouncement(version=2, step=2, manifest=m2, incarnation="A"), Applies())
                return first
            finally:
                learner.close()
                path.close_session()

        first = trio.run(main)
        assert relay.clients.refused >= 1
    assert first == (0, len(m1.chunks))  # refused: all of v1 from the learner
    assert path.applied == ("A", 2)
    assert path.stats.weight_chunks_from_relays == len(m2.chunks), \
        "the relay lists us now, but the pull still went to the learner (a refused DEALER was reused)"
