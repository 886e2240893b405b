"""``turnscale bench weights``: seconds from ``publish`` to an actor-side copy of a bf16
state dict (default 0.5 GB), same host (shared memory) and over TCP loopback, against
safetensors through /dev/shm and against bare ZeroMQ.

All figures move the same bytes and end with them in another process's memory (except
the ceiling):

- **ours, same host**: ``WeightPublisher(shm=True).publish`` (lay out + checksum, into its
  shared-memory segment) in this process, then a child process — a real actor-side
  ``pull_weights`` with the announced segment (``shm``) into its reused receive buffer,
  every chunk copied and checksum-verified — told the manifest over a pipe.  Timed from
  before ``publish`` to the child's "done".
- **ours, TCP**: the same with the child pulling every chunk over TCP (what an actor on
  another host does), against **raw**: a bare ROUTER answering chunk requests with a
  fixed buffer, received with ``recv_into`` (no layout, no checksums, no codec).
- **baseline**: ``safetensors.torch.save_file`` to /dev/shm, then the child loads it with
  ``safetensors.torch.load_file``.  Timed the same way.
- **ceiling**: one memory copy of the same bytes into a preallocated, touched buffer.

Each is repeated (``--weights-repeats``, after one warm-up) and the best time kept.
Memory: the state dict, the publisher's buffer and the child's buffer (3x the size; with
``keep=1`` the publisher retires the previous version when the next publication starts
and reuses its buffer), or the state dict, the /dev/shm file and the child's loaded copy.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

from turnscale.benchmarks.common import Result, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--weights-gb", type=float, default=0.5, help="state dict size in GB (default 0.5; uses ~3x this in RAM)")
    parser.add_argument("--weights-chunk-mb", type=float, default=32.0, help="chunk size (default 32)")
    parser.add_argument("--weights-repeats", type=int, default=5, help="timed repeats per figure (default 5; best kept)")


def _state_dict(gb: float):
    import torch

    per = 4096 * 4096  # 32 MB bf16 tensors, like a 7B model's projections
    total = int(gb * 1e9) // 2
    sd, i = {}, 0
    while total > 0:
        n = min(per, total)
        t = torch.empty(n // 4096 if n >= 4096 else 1, 4096 if n >= 4096 else n, dtype=torch.bfloat16)
        t.view(torch.int16).random_(-16000, 16000)
        sd[f"model.layers.{i}.weight"] = t
        total -= t.numel()
        i += 1
    return sd


class _Child:
    """The actor-side process: JSON lines in on stdin, JSON lines out on stdout; every
    request waits at most ``timeout_s`` for its answer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "turnscale.benchmarks.weights", "child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=os.environ.copy())
        self._pending = b""

    def ask(self, msg: dict, timeout_s: float = 300.0) -> dict:
        import select

        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"benchmark child gave no answer to {msg['op']!r} within {timeout_s:.0f}s")
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError(f"benchmark child exited (rc={self.proc.poll()})")
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"benchmark child failed: {reply.get('error')}")
        return reply

    def close(self) -> None:
        try:
            self.ask({"op": "exit"}, timeout_s=10)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


class _RawServer:
    """The transport's own ceiling: a bare ROUTER thread answering every request with one
    chunk-sized frame of a fixed buffer (no layout, no checksums, no codec)."""

    def __init__(self, chunk_bytes: int) -> None:
        import threading

        import numpy as np
        import zmq

        self.data = np.ones(chunk_bytes, dtype=np.uint8)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import zmq

        while not self.stop.is_set():
            if self.sock.poll(100):
                ident, rid, _ = self.sock.recv_multipart()
                self.sock.send_multipart([ident, rid, memoryview(self.data)], copy=False)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)


def run(args: argparse.Namespace) -> list[Result]:
    import torch
    from safetensors.torch import save_file

    from turnscale.learner.weights import WeightPublisher
    from turnscale.protocol import codec

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    gb = getattr(args, "weights_gb", 0.5)
    repeats = max(getattr(args, "weights_repeats", 5), 1)
    sd = _state_dict(gb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())

    # ceiling: one copy of the same bytes into a touched buffer
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    best_copy = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        off = 0
        for t in sd.values():
            n = t.numel() * 2
            dst[off:off + n].copy_(t.view(-1).view(torch.uint8))
            off += n
        best_copy = min(best_copy, time.perf_counter() - t0)
    del dst

    child = _Child()
    path = f"/dev/shm/turnscale-bench-weights-{os.getpid()}.safetensors"
    try:
        best_st = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            save_file(sd, path)
            child.ask({"op": "load", "path": path})
            best_st = min(best_st, time.perf_counter() - t0)
            os.remove(path)

        chunk_bytes = int(getattr(args, "weights_chunk_mb", 32.0) * (1 << 20))
        raw = _RawServer(chunk_bytes)
        try:
            best_raw = float("inf")
            for _ in range(repeats + 1):
                reply = child.ask({"op": "raw", "endpoint": raw.endpoint, "nbytes": nbytes, "chunk_bytes": chunk_bytes})
                best_raw = min(best_raw, reply["s"])  # timed in the child, like the pull it is compared with
        finally:
            raw.close()

        best_ours, best_tcp, pulls = float("inf"), float("inf"), {}
        pub = WeightPublisher("tcp://127.0.0.1:0", chunk_mb=getattr(args, "weights_chunk_mb", 32.0), dtype="bfloat16", keep=1,
                              shm=True)
        try:
            for v in range(2 * (repeats + 1)):  # alternate same host / TCP, so drift hits both
                shm = v % 2 == 0
                t0 = time.perf_counter()
                manifest = pub.publish(v, sd)
                ref = pub.segment_ref(v) if shm else None
                frames = codec.encode(manifest)
                reply = child.ask({"op": "pull", "endpoint": pub.endpoint, "manifest": base64.b64encode(bytes(frames[0])).decode(),
                                   "shm": [ref.path, ref.token] if ref else None})
                took = time.perf_counter() - t0
                if shm:
                    best_ours = min(best_ours, took)
                    if reply["from_shm"] != len(manifest.chunks):
                        raise RuntimeError(f"same-host pull took {reply['from_shm']} of {len(manifest.chunks)} chunks "
                                           f"from shared memory: {reply['shm_error']}")
                else:
                    best_tcp = min(best_tcp, took)
                pulls["shm" if shm else "tcp"] = min(pulls.get("shm" if shm else "tcp", float("inf")), reply["s"])
        finally:
            pub.close()
    finally:
        child.close()
        if os.path.exists(path):
            os.remove(path)

    size = f"{nbytes / 1e9:.2f} GB bf16"
    rate = lambda s: nbytes / s / 1e9  # noqa: E731
    st = f"safetensors via /dev/shm + load in another process, {size}"
    return [
        result("weights_publish_to_actor_gbps", rate(best_ours), "GB/s", f"{st} (ours: same host, shared memory)",
               rate(best_st), target=1.0),
        result("weights_publish_to_actor_s", best_ours, "s", f"{st} (ours: same host, shared memory)",
               best_st, target=1.0, lower_is_better=True),
        result("weights_tcp_publish_to_actor_gbps", rate(best_tcp), "GB/s", f"{st} (ours: TCP loopback, as across hosts)",
               rate(best_st)),
        result("weights_tcp_pull_vs_raw_zmq_gbps", rate(pulls["tcp"]), "GB/s",
               f"bare ZeroMQ request/reply of the same bytes over tcp, recv_into (pull only), {size}", rate(best_raw), target=0.9),
        result("weights_vs_memcpy_gbps", rate(best_ours), "GB/s", f"one memory copy of the same bytes (ceiling), {size}",
               rate(best_copy)),
    ]


def _raw_pull(endpoint: str, nbytes: int, chunk_bytes: int, rbuf) -> int:
    """Request chunks (window 4) from a ``_RawServer`` and ``recv_into`` them in place."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    sock.connect(endpoint)
    buf = rbuf.take(nbytes)
    n_chunks = -(-nbytes // chunk_bytes)
    sent = got = 0
    try:
        while got < n_chunks:
            while sent < n_chunks and sent - got < 4:
                sock.send_multipart([sent.to_bytes(4, "little"), b"r"])
                sent += 1
            i = int.from_bytes(sock.recv(), "little")
            off = i * chunk_bytes
            view = buf[off:off + chunk_bytes]
            scratch = view if view.nbytes == chunk_bytes else bytearray(chunk_bytes)
            sock.recv_into(scratch)
            got += 1
    finally:
        sock.close(linger=0)
    return nbytes


def _child_main() -> int:
    """Actor side: pull or load on request; report when the bytes are in this process."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from safetensors.torch import load_file

    from turnscale.actors.weight_sync import PullReport, ReceiveBuffer, pull_weights_blocking
    from turnscale.protocol.shmweights import SegmentRef
    from turnscale.protocol import codec
    from turnscale.protocol.messages import WeightManifest

    buf = ReceiveBuffer()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "exit":
                print(json.dumps({"ok": True}), flush=True)
                return 0
            if msg["op"] == "load":
                tensors = load_file(msg["path"])
                n = sum(t.numel() for t in tensors.values())
                del tensors
            elif msg["op"] == "pull":
                manifest = codec.decode([base64.b64decode(msg["manifest"])], expect=WeightManifest)
                report = PullReport()
                shm = SegmentRef(*msg["shm"]) if msg.get("shm") else None
                t0 = time.perf_counter()
                tensors = pull_weights_blocking(msg["endpoint"], manifest, timeout_s=60, buffer=buf, shm=shm, report=report)
                pull_s = time.perf_counter() - t0
                n = sum(t.numel() for t in tensors.values())
                del tensors
                buf.release()  # as the actor does once its engine let go of the tensors (same-host hold)
            elif msg["op"] == "raw":
                t0 = time.perf_counter()
                n = _raw_pull(msg["endpoint"], msg["nbytes"], msg["chunk_bytes"], buf)
                raw_s = time.perf_counter() - t0
            else:
                raise ValueError(f"unknown op {msg['op']!r}")
            extra = {"s": pull_s, "from_shm": report.from_shm, "shm_error": report.shm_error} if msg["op"] == "pull" else {}
            if msg["op"] == "raw":
                extra = {"s": raw_s}
            print(json.dumps({"ok": True, "elements": n, **extra}), flush=True)
        except Exception as exc:  # reported to the parent, which raises
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    sys.exit(_child_main())
