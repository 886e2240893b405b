"""turnscale.protocol.router: the shared ROUTER serving loop keeps serving after a failing request, answers
a malformed one with bad_message, and stops when told."""

import logging
import threading

import zmq

from turnscale.protocol import codec
from turnscale.protocol.messages import ErrorReply, WeightChunkRequest
from turnscale.protocol.router import read_request, serve_router


def test_loop_survives_a_failing_answer_replies_bad_message_and_stops(caplog):
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    client.setsockopt(zmq.RCVTIMEO, 10_000)
    stop = threading.Event()
    seen: list = []

    def answer(frames: list) -> None:
        got = read_request(server, frames, WeightChunkRequest)
        if got is None:
            return
        prefix, req = got
        seen.append(req.index)
        if req.index == 0:
            raise RuntimeError("boom")  # logged; the loop goes on
        server.send_multipart([*prefix, *codec.encode(ErrorReply(code="ok", message=str(req.index)))])

    t = threading.Thread(target=serve_router, args=(server, stop, answer),
                         kwargs=dict(poll_ms=50, log=logging.getLogger("test.router"), name="test"), daemon=True)
    t.start()
    try:
        client.send_multipart([b"r1", *codec.encode(WeightChunkRequest(version=1, index=0))])
        client.send_multipart([b"r2", b"not msgpack"])
        rid, *body = client.recv_multipart()
        assert rid == b"r2"
        err = codec.decode(body, expect=ErrorReply)
        assert err.code == "bad_message" and "expected a WeightChunkRequest" in err.message
        client.send_multipart([b"r3", *codec.encode(WeightChunkRequest(version=1, index=7))])
        rid, *body = client.recv_multipart()
        assert rid == b"r3" and codec.decode(body, expect=ErrorReply).message == "7"
        assert seen == [0, 7]
        assert "unexpected error answering a request" in caplog.text
    finally:
        stop.set()
        t.join(10)
        assert not t.is_alive()
        client.close(0)
        server.close(0)
        ctx.term()
