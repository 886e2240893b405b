"""Weight publication over real ZeroMQ sockets on 127.0.0.1: publisher thread + actor-side pull."""

from __future__ import annotations

import time

import pytest
import torch
import trio
import zmq

from turnscale.actors.weight_sync import ChecksumMismatch, ReceiveBuffer, WeightSyncError, pull_weights, pull_weights_blocking
from turnscale.learner.weights import WeightPublisher
from turnscale.protocol import checksums, codec
from turnscale.protocol.errors import RemoteError
from turnscale.protocol.messages import ErrorReply, WeightChunkRequest
from turnscale.protocol.transport import AsyncSocket, configure, free_port
from turnscale.protocol.weights import chunk_reply_frames


def state_dict(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 17, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(33, 65, generator=g),
        "model.norm.weight": torch.randn(17, generator=g),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "positions": torch.arange(11, dtype=torch.int64),
    }


@pytest.fixture(params=checksums.ALGOS)
def publisher(request):
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.002, dtype="bfloat16", checksum_algo=request.param)  # ~2 KB chunks
    yield pub
    pub.close()


def test_actor_pull_reconstructs_the_exact_tensors(publisher):
    sd = state_dict()
    manifest = publisher.publish(1, sd)
    assert len(manifest.chunks) > 4 and manifest.checksum_algo == publisher.checksum_algo
    buf = ReceiveBuffer()
    got = pull_weights_blocking(publisher.endpoint, manifest, timeout_s=5, window=3, buffer=buf)
    assert list(got) == list(sd)
    for name, t in sd.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    stream = buf.buf[: manifest.total_bytes]
    for c in manifest.chunks:
        assert checksums.checksum(manifest.checksum_algo, stream[c.offset:c.offset + c.nbytes]) == c.checksum


def test_trio_pull_reuses_one_buffer_across_versions(publisher):
    buf = ReceiveBuffer()
    m1 = publisher.publish(1, state_dict(1))
    m2 = publisher.publish(2, state_dict(2))

    async def main():
        ctx = zmq.Context.instance()
        sock = AsyncSocket(configure(ctx.socket(zmq.DEALER)))
        sock.sock.connect(publisher.endpoint)
        try:
            a = await pull_weights(sock, m1, timeout_s=5, buffer=buf, copy=True)
            ptr = buf.buf.ctypes.data
            b = await pull_weights(sock, m2, timeout_s=5, buffer=buf)
            assert buf.buf.ctypes.data == ptr  # same allocation
            return a, b
        finally:
            sock.close()

    a, b = trio.run(main)
    assert torch.equal(a["model.norm.weight"], state_dict(1)["model.norm.weight"].to(torch.bfloat16))
    assert torch.equal(b["model.norm.weight"], state_dict(2)["model.norm.weight"].to(torch.bfloat16))


def test_a_corrupted_chunk_is_detected(publisher):
    manifest = publisher.publish(1, state_dict())
    publisher._versions[1].buf[manifest.chunks[2].offset + 5] ^= 0xFF  # memory corruption after checksumming
    with pytest.raises(ChecksumMismatch, match="chunk 2"):
        pull_weights_blocking(publisher.endpoint, manifest, timeout_s=5, max_retries=2)


class FlakyPublisher(WeightPublisher):
    """Serves one corrupted copy of chunk 1, then the real thing."""

    corrupted = 0

    def _answer(self, frames):
        body = frames[2:]
        req = codec.decode(body, expect=WeightChunkRequest)
        if req.index <= 1 < req.index + req.count and not self.corrupted:  # a run with chunk 1 in it
            self.corrupted += 1
            ver = self._versions[req.version]
            end = min(req.index + req.count, len(ver.manifest.chunks))
            out = chunk_reply_frames(ver.manifest, ver.buf, req.index, end)
            k = 2 * (1 - req.index) + 1  # chunk 1's data frame
            out[k] = bytes(out[k])
            out[k] = bytes([out[k][0] ^ 0x01]) + out[k][1:]
            self._sock.send_multipart([frames[0].bytes, frames[1].bytes, *out])
            return
        super()._answer(frames)


def test_a_chunk_corrupted_in_transit_is_fetched_again():
    pub = FlakyPublisher("tcp://127.0.0.1:0", chunk_mb=0.004, dtype="float32")
    try:
        sd = state_dict()
        manifest = pub.publish(4, sd)
        got = pull_weights_blocking(pub.endpoint, manifest, timeout_s=5, max_retries=2)
        assert pub.corrupted == 1
        assert all(torch.equal(got[k], sd[k]) for k in sd)
    finally:
        pub.close()


def test_publisher_keeps_the_latest_two_versions(publisher):
    manifests = [publisher.publish(v, state_dict(v)) for v in (1, 2, 3)]
    assert publisher.versions() == [2, 3]
    with pytest.raises(RemoteError) as err:
        pull_weights_blocking(publisher.endpoint, manifests[0], timeout_s=5)
    assert err.value.code == "unknown_version"
    got = pull_weights_blocking(publisher.endpoint, manifests[1], timeout_s=5)
    assert torch.equal(got["model.norm.weight"], state_dict(2)["model.norm.weight"].to(torch.bfloat16))


def test_bad_requests_get_error_replies_and_serving_continues(publisher):
    manifest = publisher.publish(1, state_dict())
    ctx = zmq.Context.instance()
    s = configure(ctx.socket(zmq.DEALER))
    s.connect(publisher.endpoint)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        s.send_multipart([b"r1", b"\xc1 not msgpack"])
        rid, *body = s.recv_multipart()
        assert rid == b"r1" and codec.decode(body, expect=ErrorReply).code == "bad_message"
        s.send_multipart([b"r2", *codec.encode(WeightChunkRequest(version=1, index=10_000))])
        rid, *body = s.recv_multipart()
        assert rid == b"r2" and codec.decode(body, expect=ErrorReply).code == "unknown_chunk"
    finally:
        s.close(linger=0)
    assert pull_weights_blocking(publisher.endpoint, manifest, timeout_s=5)["scalar"] == 3.25


def test_pull_from_a_silent_endpoint_fails_within_its_bounds():
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=1, dtype="float32")
    manifest = pub.publish(1, state_dict())
    pub.close()  # nobody answers any more
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="no reply"):
        pull_weights_blocking(f"tcp://127.0.0.1:{free_port()}", manifest, timeout_s=0.2, max_retries=1)
    assert time.monotonic() - t0 < 5


def test_trained_weights_published_and_pulled_give_the_same_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from turnscale.conf.schema import Config
    from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
    from turnscale.learner.trainer import Trainer

    path = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=256, intermediate=64)
    cfg = Config()
    cfg.algo.lr = 1e-2
    trainer = Trainer(cfg, path)
    trainer.train_step(synthetic_groups(2, 4, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4))
    pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.01, dtype="float32")
    try:
        manifest = pub.publish(trainer.step, trainer.state_dict_for_publish("float32"))
        tensors = pull_weights_blocking(pub.endpoint, manifest, timeout_s=5)
    finally:
        pub.close()
    actor_model = AutoModelForCausalLM.from_pretrained(path)  # the actor starts from the initial weights
    actor_model.load_state_dict(tensors, strict=True)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(actor_model(input_ids=ids).logits, trainer.hf_model(input_ids=ids).logits)


def test_publisher_reuses_the_retired_versions_buffer(publisher):
    publisher.publish(1, state_dict(1))
    first = publisher._versions[1].buf.ctypes.data
    pull_weights_blocking(publisher.endpoint, publisher._versions[1].manifest, timeout_s=5)  # zero-copy sends from it
    publisher.publish(2, state_dict(2))
    publisher.publish(3, state_dict(3))  # retires 1 first, then writes into its buffer
    assert publisher.versions() == [2, 3]
    assert publisher._versions[3].buf.ctypes.data == first
