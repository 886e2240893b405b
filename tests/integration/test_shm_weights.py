"""Same-host weights through shared memory (``protocol/shmweights.py``): a real
``WeightPublisher`` with ``shm=True`` and the actor-side pull, on 127.0.0.1.

The segment path gives the same tensors as the TCP path and needs no TCP chunk; a segment
that does not open from here or holds another token costs nothing but the TCP pull; a
segment overwritten while it is being copied (the publisher reuses its buffer) is never
applied; nothing is left in ``/dev/shm`` after a run or after either side is SIGKILLed."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import trio
import zmq

from turnscale.actors.weight_sync import PullReport, ReceiveBuffer, drop_segment_readers, pull_weights, pull_weights_blocking
from turnscale.learner.weights import WeightPublisher
from turnscale.protocol import codec
from turnscale.protocol.errors import RemoteError
from turnscale.protocol.messages import WeightManifest
from turnscale.protocol.shmweights import HEADER_BYTES, SegmentChanged, SegmentReader, SegmentRef, SegmentUnavailable
from turnscale.protocol.transport import AsyncSocket, configure

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 170, generator=g), "b.weight": torch.randn(33, 65, generator=g),
            "positions": torch.arange(11, dtype=torch.int64)}


@pytest.fixture(autouse=True)
def _fresh_readers():
    drop_segment_readers()
    yield
    drop_segment_readers()


def _same(got: dict, sd: dict) -> None:
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


def test_same_host_pull_reads_the_segment_and_gives_the_tcp_tensors():
    sd = state_dict()
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.05, dtype="float32", shm=True) as pub:
        manifest = pub.publish(1, sd)
        ref = pub.segment_ref(1)
        assert ref is not None and ref.path.startswith(f"/proc/{os.getpid()}/fd/")
        report = PullReport()
        got = pull_weights_blocking(pub.endpoint, manifest, timeout_s=10, shm=ref, report=report, copy=True)
        _same(got, sd)
        assert report.from_shm == len(manifest.chunks) > 1 and report.from_learner == 0
        assert pub.served_chunks == 0  # not one TCP chunk
        tcp = pull_weights_blocking(pub.endpoint, manifest, timeout_s=10, copy=True)
        _same(tcp, sd)


@pytest.mark.parametrize("bad", ["missing path", "other token"])
def test_a_segment_that_does_not_open_from_here_costs_only_the_tcp_pull(bad):
    sd = state_dict(1)
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.05, dtype="float32", shm=True) as pub:
        manifest = pub.publish(3, sd)
        ref = pub.segment_ref(3)
        ref = SegmentRef(path="/proc/0/fd/999", token=ref.token) if bad == "missing path" else SegmentRef(path=ref.path, token="00" * 16)
        report = PullReport()
        got = pull_weights_blocking(pub.endpoint, manifest, timeout_s=10, shm=ref, report=report, copy=True)
        _same(got, sd)
        assert report.from_shm == 0 and report.from_learner == len(manifest.chunks)
        assert report.shm_error


def test_a_held_segment_is_never_rewritten_and_is_reused_once_released():
    """keep=1: the next publication would reuse the segment of the version an actor holds;
    it takes another one instead, so the held tensors stay the version they were verified
    as.  Once released, the segment is reused."""
    sd1, sd2, sd3 = state_dict(1), state_dict(2), state_dict(3)
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.05, dtype="float32", keep=1, shm=True) as pub:
        m1 = pub.publish(1, sd1)
        ref1 = pub.segment_ref(1)
        buf = ReceiveBuffer()
        report = PullReport()
        got = pull_weights_blocking(pub.endpoint, m1, timeout_s=10, buffer=buf, shm=ref1, report=report)
        assert report.from_shm == len(m1.chunks) and buf.hold is not None
        pub.publish(2, sd2)  # v1 retired; its segment is held: not rewritten
        assert pub.segment_ref(2) != ref1
        _same(got, sd1)
        buf.release()
        pub.publish(3, sd3)  # v2 retired and free, v1's segment free: one of them is reused
        assert len({x[2].fd for x in pub._spare} | {pub._versions[3].segment.fd}) == 2  # two segments in all


def test_a_segment_being_written_is_not_read_and_tcp_takes_over():
    sd = state_dict(5)
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.05, dtype="float32", keep=2, shm=True) as pub:
        m = pub.publish(4, sd)
        seg = pub._versions[4].segment
        assert seg.try_lock()  # as the publisher does before rewriting it
        seg.begin_write()
        report = PullReport()
        got = pull_weights_blocking(pub.endpoint, m, timeout_s=10, shm=seg.ref, report=report, copy=True)
        assert report.from_shm == 0 and report.from_learner == len(m.chunks)
        _same(got, sd)  # the TCP copy: the stream bytes themselves were not touched
        seg.end_write(4)
        seg.unlock()


def test_a_hold_refuses_bytes_changed_under_it():
    """Even a writer that ignored the lock cannot get a changed chunk accepted: the
    checksum catches the bytes, the header's seq catches a rewrite that kept them."""
    sd = state_dict(4)
    with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.05, dtype="float32", keep=1, shm=True) as pub:
        m = pub.publish(7, sd)
        reader = SegmentReader(pub.segment_ref(7))
        hold = reader.hold(7)
        assert hold is not None and reader.hold(8) is None
        c = m.chunks[0]
        hold.verify(c.offset, c.nbytes, c.checksum, m.checksum_algo)  # intact: passes
        seg = pub._versions[7].segment
        assert not seg.try_lock()  # the hold keeps the publisher out
        seg.stream[c.offset] ^= 0xFF
        with pytest.raises(SegmentChanged, match="checksum"):
            hold.verify(c.offset, c.nbytes, c.checksum, m.checksum_algo)
        seg.stream[c.offset] ^= 0xFF
        seg.begin_write()
        seg.end_write(7)
        with pytest.raises(SegmentChanged, match="rewritten"):
            hold.verify(c.offset, c.nbytes, c.checksum, m.checksum_algo)
        with pytest.raises(SegmentChanged, match="outside"):
            hold.verify(reader.capacity - 1, 2, 0, m.checksum_algo)
        hold.release()
        assert seg.try_lock()
        seg.unlock()
        reader.close()


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


_PEER = r'''
import base64, os, signal, sys, time
import torch
torch.set_num_threads(1)
from turnscale.protocol import codec
from turnscale.protocol.messages import WeightManifest
role = sys.argv[1]
if role == "publish":
    from turnscale.learner.weights import WeightPublisher
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.25, dtype="float32", shm=True)
    m = pub.publish(1, {"w": torch.arange(300_000, dtype=torch.float32)})
    ref = pub.segment_ref(1)
    print(pub.endpoint, ref.path, ref.token, base64.b64encode(bytes(codec.encode(m)[0])).decode(), flush=True)
else:
    from turnscale.actors.weight_sync import PullReport, pull_weights_blocking
    from turnscale.protocol.shmweights import SegmentRef
    endpoint, path, token, blob = sys.argv[2:6]
    m = codec.decode([base64.b64decode(blob)], expect=WeightManifest)
    r = PullReport()
    t = pull_weights_blocking(endpoint, m, timeout_s=20, shm=SegmentRef(path, token), report=r, copy=True)
    ok = torch.equal(t["w"], torch.arange(300_000, dtype=torch.float32))
    print("pulled", r.from_shm, r.from_learner, ok, flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.2)
'''


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PEER, *args], stdout=subprocess.PIPE, cwd=ROOT, env=env)


def _line(proc: subprocess.Popen, timeout_s: float = 60.0) -> list[str]:
    import select

    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        raise TimeoutError("peer gave no line")
    return proc.stdout.readline().decode().split()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()


def test_no_shared_memory_is_left_behind_when_either_side_is_killed():
    before = _shm_files()
    pub = _start("publish")
    actors = []
    try:
        endpoint, path, token, blob = _line(pub)
        for _ in range(2):
            actors.append(_start("pull", endpoint, path, token, blob))
            assert _line(actors[-1]) == ["pulled", "5", "0", "True"]  # every chunk from the segment
        _kill(actors[0])  # an actor crashes: the learner's segment still serves the next one
        actors.append(_start("pull", endpoint, path, token, blob))
        assert _line(actors[-1]) == ["pulled", "5", "0", "True"]
        assert _shm_files() == before  # a memfd has no name in /dev/shm
        _kill(pub)  # the learner crashes while actors still map its segment
        with pytest.raises(SegmentUnavailable):
            SegmentReader(SegmentRef(path=path, token=token))
    finally:
        for p in [pub, *actors]:
            _kill(p)
    assert _shm_files() == before
    assert HEADER_BYTES % 4096 == 0
