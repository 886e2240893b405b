"""``turnscale bench transport``: trajectory groups through the real codec + ZeroMQ,
against raw ZeroMQ bytes of the same size, in one run.

System: an actor-shaped sender (``DEALER`` as ``AsyncSocket`` under trio) encodes a
``TrajectoryGroup`` with ``protocol.codec`` and sends it; a learner-shaped receiver
(``ROUTER`` as ``AsyncSocket`` under trio, in another process) receives with
``copy=False``, decodes and validates it fully and answers a ``GroupAck`` that the sender
decodes.  Baseline: plain blocking pyzmq, one frame of the same number of bytes sent with
``copy=False``, received with ``copy=False``, answered with one byte.  Both keep the same
window of unacknowledged messages (``--transport-window``) over tcp on 127.0.0.1, so the
ratio isolates what the codec and the trio helpers cost.

Groups are GRPO-shaped: 8 episodes, each with ``[T]`` token ids / loss mask / log-probs /
versions and a ``Turn`` record per turn; ``T`` is chosen so the encoded group is about the
requested size.  Their arrays are carved from one ``protocol.arena.Arena``, as the actor
builds a group (so a large group is a few frames).  Figures: ``transport_<size>_mb_s`` (MB/s, target ratio 0.8 at 4 MB, 0.5 at 64 KB),
``transport_<size>_groups_s`` (groups/s, reported) and, with a receiver process,
``transport_<size>_cpu_us`` (CPU time per group of sender + receiver, all threads; ratio
raw / system, reported): on a shared machine the wall-clock figures move with other
processes' load, the CPU figure much less.  Ceiling (``--transport-ceiling``, on by
default): the same bytes as ``[tag, payload]`` through the system's trio ``AsyncSocket`` on
both sides with a one-byte ack and no codec, ``transport_<size>_trio_bytes_mb_s`` and
``_cpu_us`` against raw: the most any codec could reach over this socket path.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from turnscale.benchmarks.common import Result, result

SIZES = {"64KB": 64 << 10, "4MB": 4 << 20}
TARGETS = {"4MB": 0.8, "64KB": 0.5}
ENV_MAX_LIFETIME_S = 120.0


def add_arguments(parser: Any) -> None:
    parser.add_argument("--transport-sizes", default="64KB,4MB", help=f"group sizes, from {list(SIZES)} or e.g. 1MB")
    parser.add_argument("--transport-seconds", type=float, default=2.5, help="seconds per measurement")
    parser.add_argument("--transport-window", type=int, default=8, help="unacknowledged messages in flight")
    parser.add_argument("--transport-receiver", choices=["process", "thread", "both"], default="process",
                        help="receiver in another process (realistic), in a thread of this one, or both")
    parser.add_argument("--transport-ceiling", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure the trio socket path with raw bytes, no codec (the ceiling for the codec)")
    parser.add_argument("--transport-repeats", type=int, default=2,
                        help="alternate system/baseline this many times per size; the best of each is reported")


def _parse_size(text: str) -> int:
    if text in SIZES:
        return SIZES[text]
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for u, mult in units.items():
        if text.upper().endswith(u):
            return int(float(text[: -len(u)]) * mult)
    return int(text)


# ----------------------------------------------------------------------------- workload


def make_group(target_bytes: int, *, n_episodes: int = 8, turns: int = 8, seed: int = 0, arena: bool = True):
    """A valid GRPO-shaped ``TrajectoryGroup`` whose encoding is about ``target_bytes``;
    with ``arena`` its arrays are carved from one ``protocol.arena.Arena`` sized by a
    ``BlockSizer`` that saw a group like it, as an actor in steady state builds a group
    (``actors/episode.py``), else each array is its own."""
    from turnscale.protocol import codec
    from turnscale.protocol import messages as m
    from turnscale.protocol.arena import BlockSizer

    sizer = BlockSizer()

    def build(tokens: int):
        rng = np.random.default_rng(seed)
        blocks = sizer.arena()
        place = blocks.array if arena else (lambda values, dtype: np.asarray(values, dtype=dtype))
        eps = []
        for e in range(n_episodes):
            prompt = max(1, tokens // 8)
            mask = np.zeros(tokens, np.uint8)
            span = max(1, (tokens - prompt) // (2 * turns))
            turn_recs = []
            for t in range(turns):
                start = prompt + 2 * t * span
                end = min(tokens, start + span)
                if start >= tokens:
                    break
                mask[start:end] = 1
                turn_recs.append(m.Turn(index=t, token_start=start, token_end=end, output_text=f"I think I should go to room {t}. <action>go to room {t}</action>",
                                        action=f"go to room {t}", parse_error=False, observation=f"You are in room {t}. You see a red ball and a door.",
                                        reward=0.0, done=False, policy_version=7, gen_latency_s=0.05, env_latency_s=0.001))
            logprobs = np.where(mask == 1, -rng.random(tokens, dtype=np.float32), 0).astype(np.float32)
            eps.append(m.Episode(token_ids=place(rng.integers(0, 150_000, tokens, dtype=np.int32), np.int32),
                                 loss_mask=place(mask, np.uint8), logprobs=place(logprobs, np.float32),
                                 versions=place(np.where(mask == 1, 7, -1), np.int32), prompt_len=prompt, turns=turn_recs,
                                 finish_reason="done", reward=1.0, success=True, turn_limit=turns))
        sizer.observe(blocks)
        return m.TrajectoryGroup(lease_id="l-123", actor_id="bench-actor", task=m.Task(env="babyai", data_idx=123), turn_limit=turns, episodes=eps)

    def size(g) -> int:
        return sum(len(memoryview(f).cast("B")) for f in codec.encode(g))

    # the encoded size is affine in the tokens per episode: fit it on two points
    t1, t2 = 4 * turns, 4 * turns + 1000
    s1, s2 = size(build(t1)), size(build(t2))
    per_token = (s2 - s1) / (t2 - t1)
    tokens = max(t1, int(t1 + (target_bytes - s1) / per_token))
    build(tokens)  # an actor's earlier groups, which size its arena's first block
    group = build(tokens)
    return group, size(group)


# ----------------------------------------------------------------------------- receivers


def serve_system(endpoint_file: str | None, ready: Any = None) -> None:
    """Learner-shaped receiver: trio ROUTER, full decode, GroupAck; stops on ``Shutdown``."""
    import trio
    import zmq

    from turnscale.protocol import codec
    from turnscale.protocol import messages as m
    from turnscale.protocol.transport import AsyncSocket, SocketLimits, configure, split_router_frames

    async def main() -> None:
        ctx = zmq.Context()
        router = configure(ctx.socket(zmq.ROUTER), SocketLimits())
        port = router.bind_to_random_port("tcp://127.0.0.1")
        _announce(port, endpoint_file, ready)
        sock = AsyncSocket(router)
        limits = codec.Limits()
        n, cpu0 = 0, None
        with trio.move_on_after(ENV_MAX_LIFETIME_S):
            while True:
                frames = await sock.recv_multipart(copy=False)
                prefix, body = split_router_frames(frames)
                timed = prefix[1] not in (b"w", b"s")  # not warm-up, not stop
                if timed and cpu0 is None:
                    cpu0 = _cpu_s()
                msg = codec.decode(body, limits)
                if isinstance(msg, m.Shutdown):
                    cpu = _cpu_s() - cpu0 if cpu0 is not None else 0.0
                    await sock.send_msg(m.GroupAck(lease_id="", accepted=True, reason=f"{cpu} {n}"), prefix=prefix)
                    break
                await sock.send_msg(m.GroupAck(lease_id=msg.lease_id, accepted=True), prefix=prefix)
                n += timed
        sock.close()
        ctx.term()

    trio.run(main)


def serve_raw(endpoint_file: str | None, ready: Any = None) -> None:
    """Baseline receiver: blocking pyzmq ROUTER, ``copy=False``, one-byte ack; stops on an empty frame."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    _announce(port, endpoint_file, ready)
    deadline = time.monotonic() + ENV_MAX_LIFETIME_S
    n, cpu0 = 0, None
    while time.monotonic() < deadline:
        if not router.poll(1000):
            continue
        ident, *parts = router.recv_multipart(copy=False)
        if len(parts) == 2:  # [b"w", payload]: warm-up, untimed
            router.send_multipart([ident, b"k"])
            continue
        if len(parts[0]) == 0:  # stop: answer with the CPU seconds spent on timed messages
            cpu = _cpu_s() - cpu0 if cpu0 is not None else 0.0
            router.send_multipart([ident, f"{cpu} {n}".encode()])
            break
        if cpu0 is None:
            cpu0 = _cpu_s()
        router.send_multipart([ident, b"k"])
        n += 1
    router.close(0)
    ctx.term()


def serve_trio_bytes(endpoint_file: str | None, ready: Any = None) -> None:
    """Ceiling receiver: the system's trio ROUTER (``AsyncSocket``) with no codec: takes
    ``[tag, payload]`` and answers ``[tag, b"k"]``; stops on tag ``b"s"``."""
    import trio
    import zmq

    from turnscale.protocol.transport import AsyncSocket, SocketLimits, configure

    async def main() -> None:
        ctx = zmq.Context()
        router = configure(ctx.socket(zmq.ROUTER), SocketLimits())
        _announce(router.bind_to_random_port("tcp://127.0.0.1"), endpoint_file, ready)
        sock = AsyncSocket(router)
        n, cpu0 = 0, None
        with trio.move_on_after(ENV_MAX_LIFETIME_S):
            while True:
                ident, tag, *_ = await sock.recv_multipart(copy=False)
                tag = tag.bytes
                if tag == b"s":
                    cpu = _cpu_s() - cpu0 if cpu0 is not None else 0.0
                    await sock.send_multipart([ident, tag, f"{cpu} {n}".encode()])
                    break
                if tag != b"w" and cpu0 is None:
                    cpu0 = _cpu_s()
                await sock.send_multipart([ident, tag, b"k"])
                n += tag != b"w"
        sock.close()
        ctx.term()

    trio.run(main)


SERVERS = {"system": serve_system, "raw": serve_raw, "trio": serve_trio_bytes}


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (ZeroMQ's I/O thread included)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _announce(port: int, endpoint_file: str | None, ready: Any) -> None:
    if ready is not None:
        ready(port)
    else:
        print(f"READY {port}", flush=True)


class _Receiver:
    """A receiver in a child process (started with ``sys.executable``, ended by pid) or a thread."""

    def __init__(self, kind: str, where: str) -> None:
        self.where = where
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        if where == "process":
            env = dict(os.environ)
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
            self.proc = subprocess.Popen([sys.executable, "-m", "turnscale.benchmarks.transport", "--serve", kind], stdout=subprocess.PIPE, env=env)
            line = self.proc.stdout.readline().split()
            if not line or line[0] != b"READY":
                self.close()
                raise RuntimeError(f"transport receiver did not start: {line!r}")
            self.port = int(line[1])
        else:
            got: list[int] = []
            event = threading.Event()

            def ready(port: int) -> None:
                got.append(port)
                event.set()

            target = SERVERS[kind]
            self.thread = threading.Thread(target=target, args=(None, ready), daemon=True)
            self.thread.start()
            if not event.wait(30):
                raise RuntimeError("transport receiver thread did not start")
            self.port = got[0]

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            if self.proc.stdout:
                self.proc.stdout.close()
        if self.thread is not None:
            self.thread.join(10)


# ----------------------------------------------------------------------------- senders


async def _trio_window(sock: Any, message: Any, ack: Any, seconds: float, window: int) -> tuple[int, float, float]:
    """The trio senders' loop: ``window`` warm-up round trips (tag ``w``), then for
    ``seconds`` keep ``window`` messages ``[tag, *message()]`` unacknowledged; returns
    (messages sent, seconds, CPU seconds of this process)."""
    for _ in range(window):  # warm-up: connection, allocator, caches
        await sock.send_multipart([b"w", *message()])
        await ack()
    outstanding = sent = 0
    t0, cpu0 = time.perf_counter(), _cpu_s()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        if outstanding == window:
            await ack()
            outstanding -= 1
        await sock.send_multipart([sent.to_bytes(8, "little"), *message()])
        outstanding += 1
        sent += 1
    while outstanding:
        await ack()
        outstanding -= 1
    return sent, time.perf_counter() - t0, _cpu_s() - cpu0


def send_system(port: int, group: Any, seconds: float, window: int) -> tuple[int, float, float, float]:
    """Actor-shaped sender: trio DEALER, encode per group, decode each GroupAck."""
    import trio
    import zmq

    from turnscale.protocol import codec
    from turnscale.protocol import messages as m
    from turnscale.protocol.transport import AsyncSocket, SocketLimits, configure

    async def main() -> tuple[int, float, float, float]:
        ctx = zmq.Context()
        dealer = configure(ctx.socket(zmq.DEALER), SocketLimits())
        dealer.connect(f"tcp://127.0.0.1:{port}")
        sock = AsyncSocket(dealer)

        async def ack() -> None:
            frames = await sock.recv_multipart(copy=False)
            reply = codec.decode(frames[1:], expect=m.GroupAck)
            assert reply.accepted

        sent, elapsed, cpu = await _trio_window(sock, lambda: codec.encode(group), ack, seconds, window)
        await sock.send_multipart([b"s", *codec.encode(m.Shutdown(reason="bench done"))])
        frames = await sock.recv_multipart(copy=False)
        rx_cpu, rx_n = codec.decode(frames[1:], expect=m.GroupAck).reason.split()
        sock.close()
        ctx.term()
        return sent, elapsed, cpu, float(rx_cpu) * sent / max(1, int(rx_n))

    return trio.run(main)


def send_trio_bytes(port: int, nbytes: int, seconds: float, window: int) -> tuple[int, float, float, float]:
    """Ceiling sender: the system's trio DEALER (``AsyncSocket``) sending ``[tag, payload]``
    of ``nbytes`` with ``copy=False``, no codec: what the socket path alone allows."""
    import trio
    import zmq

    from turnscale.protocol.transport import AsyncSocket, SocketLimits, configure

    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)

    async def main() -> tuple[int, float, float, float]:
        ctx = zmq.Context()
        dealer = configure(ctx.socket(zmq.DEALER), SocketLimits())
        dealer.connect(f"tcp://127.0.0.1:{port}")
        sock = AsyncSocket(dealer)

        async def ack() -> None:
            await sock.recv_multipart(copy=False)

        sent, elapsed, cpu = await _trio_window(sock, lambda: (payload,), ack, seconds, window)
        await sock.send_multipart([b"s"])
        rx_cpu, rx_n = (await sock.recv_multipart())[1].bytes.split()
        sock.close()
        ctx.term()
        return sent, elapsed, cpu, float(rx_cpu) * sent / max(1, int(rx_n))

    return trio.run(main)


def send_raw(port: int, nbytes: int, seconds: float, window: int) -> tuple[int, float, float, float]:
    """Baseline sender: blocking pyzmq DEALER, one frame of ``nbytes`` with ``copy=False``."""
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    for _ in range(window):
        dealer.send_multipart([b"w", payload], copy=False)
        dealer.recv(copy=False)
    outstanding = sent = 0
    t0, cpu0 = time.perf_counter(), _cpu_s()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        if outstanding == window:
            dealer.recv(copy=False)
            outstanding -= 1
        dealer.send(payload, copy=False)
        outstanding += 1
        sent += 1
    while outstanding:
        dealer.recv(copy=False)
        outstanding -= 1
    elapsed, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    dealer.send(b"")
    rx_cpu, rx_n = dealer.recv().split()
    dealer.close(0)
    ctx.term()
    return sent, elapsed, cpu, float(rx_cpu) * sent / max(1, int(rx_n))


# ----------------------------------------------------------------------------- run


def measure(kind: str, where: str, group: Any, nbytes: int, seconds: float, window: int) -> tuple[float, float, float]:
    """(MB/s, messages/s, CPU microseconds per message on both sides) of one configuration.

    The CPU figure counts every thread of the sender and the receiver process (ZeroMQ's
    I/O threads included), so it holds still while the shared machine's load moves the
    wall-clock figures; with a receiver thread it is not separable and is reported as 0."""
    rx = _Receiver(kind, where)
    try:
        if kind == "system":
            n, elapsed, tx_cpu, rx_cpu = send_system(rx.port, group, seconds, window)
        elif kind == "trio":
            n, elapsed, tx_cpu, rx_cpu = send_trio_bytes(rx.port, nbytes, seconds, window)
        else:
            n, elapsed, tx_cpu, rx_cpu = send_raw(rx.port, nbytes, seconds, window)
    finally:
        rx.close()
    cpu_us = (tx_cpu + rx_cpu) / max(1, n) * 1e6 if where == "process" else 0.0
    return n * nbytes / elapsed / 1e6, n / elapsed, cpu_us


def run(args: argparse.Namespace) -> list[Result]:
    sizes = [s.strip() for s in getattr(args, "transport_sizes", "64KB,4MB").split(",") if s.strip()]
    seconds = float(getattr(args, "transport_seconds", 2.5))
    window = int(getattr(args, "transport_window", 8))
    receiver = getattr(args, "transport_receiver", "process")
    repeats = max(1, int(getattr(args, "transport_repeats", 2)))
    wheres = ["process", "thread"] if receiver == "both" else [receiver]
    ceiling = bool(getattr(args, "transport_ceiling", True))
    results: list[Result] = []
    for label in sizes:
        group, nbytes = make_group(_parse_size(label))
        for where in wheres:
            sys_runs, raw_runs, trio_runs = [], [], []
            for _ in range(repeats):  # alternate, so drift on a shared machine hits all
                sys_runs.append(measure("system", where, group, nbytes, seconds / repeats, window))
                raw_runs.append(measure("raw", where, group, nbytes, seconds / repeats, window))
                if ceiling and where == "process":
                    trio_runs.append(measure("trio", where, group, nbytes, seconds / repeats, window))
            sys_best, raw_best = max(sys_runs), max(raw_runs)
            suffix = "" if where == "process" else "_thread"
            base = f"raw zmq bytes ({nbytes / 1e6:.3f} MB, copy=False, receiver {where})"
            results.append(result(f"transport_{label}_mb_s{suffix}", sys_best[0], "MB/s", base, raw_best[0], target=TARGETS.get(label)))
            results.append(result(f"transport_{label}_groups_s{suffix}", sys_best[1], "groups/s", base, raw_best[1]))
            if where == "process":
                sys_cpu, raw_cpu = min(r[2] for r in sys_runs), min(r[2] for r in raw_runs)
                results.append(result(f"transport_{label}_cpu_us", sys_cpu, "CPU us/group (both sides)", base, raw_cpu, lower_is_better=True))
            if trio_runs:  # the socket path alone: the most the codec could ever reach
                trio_best = max(trio_runs)
                results.append(result(f"transport_{label}_trio_bytes_mb_s", trio_best[0], "MB/s", base, raw_best[0]))
                results.append(result(f"transport_{label}_trio_bytes_cpu_us", min(r[2] for r in trio_runs), "CPU us/message (both sides)",
                                      base, raw_cpu, lower_is_better=True))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        SERVERS[sys.argv[2]](None)
        sys.exit(0)
    from turnscale.benchmarks.main import main

    sys.exit(main(["transport", *sys.argv[1:]]))
