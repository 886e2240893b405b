"""``turnscale bench fanout``: seconds from the publication of a weight version until all N
pullers hold it (every chunk checksum-verified), on the network-namespace test cluster
(``cluster/netns.py``: one fake host per process, every host link capped at
``--fanout-rate`` Mbit/s both ways), for the star (everyone pulls from the learner, as
without relays) beside the relay tree (``learner/relaytree.py``: fan-out k, chunk-level
pipelining through ``actors/relay.py``), N = 1, 2, 4, 8, 16.

What runs: the learner host runs the real ``WeightPublisher`` (one float32 tensor of
``--fanout-mb``, chunks of ``--fanout-chunk-kb``); each other host runs a *pull-only
client* (``python -m turnscale.benchmarks.fanout puller``): the actor's real ``pull_stream`` (the
checked puller of ``actors/weight_sync.py``) into two alternating ``ReceiveBuffer``s, and
in relay mode the actor's real ``RelayServer`` fed by ``on_chunk``, exactly as
``actors/weight_path.py`` wires them.  Not the full actor (engine, env pool, leases): sixteen of
those do not fit the 2 CPU cores of this box, and none of it is on the weight path.
Processes meet through files in a scratch folder (the cluster's bridge has no address in
the root namespace); publication time is written by the publisher right after
``publish()`` returns (when the learner would announce), completion by each puller after
its last chunk verified.  ``--fanout-rounds`` versions per configuration; the first is a
warm-up (connections), the median of the others is reported.

Figures (ratios higher-is-better, as every benchmark here):
- ``fanout_star_nN`` / ``fanout_relay_kK_nN``: time at N against the same mode at N=1
  (ideal: star ~N, relay ~1; target: relay at N=16 within 1.5x of N=1);
- ``fanout_relay_kK_vs_star_nN``: relay time against the star's at the same N;
- ``fanout_egress_kK_nN``: learner egress per version, in copies of the weights, against
  the bound of 2 copies (target); the star's is N.
- ``fanout_cpu_kK_nN`` / ``fanout_cpu_star_nN``: CPU seconds per version used by all N
  pullers together (``/proc/<pid>/stat`` user + system, every thread, ``benchmarks/cpuprobe.py``)
  against the CPU seconds the machine had over the same wall time (cores x seconds, from the
  end of the previous version to the end of this one): a ratio near 1 (or below) means
  the pullers are CPU-bound, not link-bound.  The printed line also gives the publisher's
  CPU and the whole machine's (other sessions' included).

Skips (no figures, the reason printed) when the cluster is unavailable (not root, no ``ip``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from turnscale.benchmarks.common import Result, result

LEARNER_PORT = 5700
RELAY_PORT = 5701
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fanout-n", default="1,2,4,8,16", help="puller counts (default 1,2,4,8,16)")
    parser.add_argument("--fanout-k", default="1,2", help="relay tree fan-outs to measure (default 1,2; 1 is a chain)")
    parser.add_argument("--fanout-mb", type=float, default=8.0, help="weights payload in MB (default 8)")
    parser.add_argument("--fanout-chunk-kb", type=int, default=128, help="chunk size in KB (default 128)")
    parser.add_argument("--fanout-rate", type=float, default=200.0, help="per-host link cap, Mbit/s (default 200)")
    parser.add_argument("--fanout-rounds", type=int, default=3, help="versions per configuration, first is warm-up (default 3)")
    parser.add_argument("--fanout-run-kb", type=int, default=1024,
                        help="bytes of chunks one request asks for, KB (default 1024: the actor's default; at most the "
                             "chunk size: one chunk per request, as before runs)")
    parser.add_argument("--fanout-switch-ms", type=float, default=0.0,
                        help="pullers' sys.setswitchinterval in ms (default: Python's 5 ms; 0.5 cuts the GIL hand-off "
                             "between a relay's serving thread and its pull, ~10%% at N=16)")


# ---------------------------------------------------------------------------------- files

def _write(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _wait_file(path: str, timeout_s: float, poll_s: float = 0.002) -> dict:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(poll_s)
    with open(path) as f:
        return json.load(f)


def _encode_manifest(m: Any) -> list[str]:
    import base64

    from turnscale.protocol import codec

    return [base64.b64encode(bytes(f)).decode() for f in codec.encode(m)]


def _decode_manifest(frames: list[str]) -> Any:
    import base64

    from turnscale.protocol import codec
    from turnscale.protocol.messages import WeightManifest

    return codec.decode([base64.b64decode(f) for f in frames], expect=WeightManifest)


# ---------------------------------------------------------------------------------- roles

def publisher(a: argparse.Namespace) -> int:
    import torch

    from turnscale.learner.weights import WeightPublisher

    torch.set_num_threads(1)
    n_floats = int(a.mb * 1e6) // 4
    pub = WeightPublisher(a.bind, chunk_mb=a.chunk_kb / 1024, dtype="float32", keep=2)
    try:
        for i in range(a.n):
            _wait_file(os.path.join(a.dir, f"ready-{i}"), 120, poll_s=0.02)
        for v in range(1, a.rounds + 1):
            sd = {"w": torch.full((n_floats,), float(v))}
            mark = pub.served_bytes
            m = pub.publish(v, sd)
            t_pub = time.time()
            _write(os.path.join(a.dir, f"pub-{v}"), {"t": t_pub, "manifest": _encode_manifest(m)})
            done = [_wait_file(os.path.join(a.dir, f"done-{v}-{i}"), 120) for i in range(a.n)]
            _write(os.path.join(a.dir, f"round-{v}"), {
                "t_pub": t_pub, "t_all": max(d["t"] for d in done), "egress_bytes": pub.served_bytes - mark,
                "total_bytes": m.total_bytes, "pullers": done})
        _write(os.path.join(a.dir, "end"), {})
        time.sleep(0.2)
    finally:
        pub.close()
    return 0


def puller(a: argparse.Namespace) -> int:
    import trio

    if a.switch_ms > 0:  # the relay thread and the pull share the GIL: hand it over sooner (default 5 ms)
        sys.setswitchinterval(a.switch_ms / 1000)
    import zmq

    from turnscale.actors.weight_sync import PullReport, ReceiveBuffer, pull_stream
    from turnscale.protocol.transport import AsyncSocket, configure

    relay = None
    if a.relay_bind:
        from turnscale.actors.relay import RelayServer

        relay = RelayServer(a.relay_bind, curve=None)
    bufs = [ReceiveBuffer(), ReceiveBuffer()]
    _write(os.path.join(a.dir, f"ready-{a.index}"), {})

    async def main() -> None:
        ctx = zmq.Context.instance()
        learner = AsyncSocket(configure(ctx.socket(zmq.DEALER), curve=None))
        learner.sock.connect(a.learner)
        relays = []
        for ep in filter(None, a.relays.split(",")):
            s = AsyncSocket(configure(ctx.socket(zmq.DEALER), curve=None))
            s.sock.connect(ep)
            relays.append(s)
        for v in range(1, a.rounds + 1):
            pub = await trio.to_thread.run_sync(_wait_file, os.path.join(a.dir, f"pub-{v}"), 120)
            m = _decode_manifest(pub["manifest"])
            key, buf = v % 2, bufs[v % 2]
            on_chunk = None
            if relay is not None:  # as actors/weight_path.py: registered before any byte lands, served once verified
                relay.begin(key, m, buf.take(m.total_bytes))
                on_chunk = (lambda k: (lambda i: relay.mark(k, i)))(key)
            rep = PullReport()
            await pull_stream(learner, m, timeout_s=30, buffer=buf, relays=relays, on_chunk=on_chunk, report=rep,
                              run_bytes=a.run_kb * 1024)
            _write(os.path.join(a.dir, f"done-{v}-{a.index}"), {
                "t": time.time(), "from_relays": rep.from_relays, "from_learner": rep.from_learner,
                "fallbacks": rep.fallbacks})
        await trio.to_thread.run_sync(_wait_file, os.path.join(a.dir, "end"), 300, 0.02)
        for s in (learner, *relays):
            s.close()

    try:
        trio.run(main)
    finally:
        if relay is not None:
            relay.close()
    return 0


# ---------------------------------------------------------------------------------- driver

def round_cpu(before: Any, after: Any, cores: int) -> dict:
    """CPU of one version between two ``cpuprobe.CpuSample``s (roles ``pullers`` and
    ``publisher``): seconds used by each, by the whole machine, and ``available`` (cores x
    wall seconds between the samples)."""
    wall = max(after.t - before.t, 0.0)
    used = {r: max(after.roles.get(r, 0.0) - before.roles.get(r, 0.0), 0.0) for r in ("pullers", "publisher")}
    return {**used, "machine": max(after.machine - before.machine, 0.0), "wall": wall, "available": cores * wall}


def _watch_rounds(d: str, procs: list, rounds: int, deadline: float, what: str) -> list[dict]:
    """Wait for every round of the run in ``d``, sampling the pullers' and publisher's CPU at
    each round's end (the first sample when every puller is ready); per-round ``round_cpu``."""
    from turnscale.benchmarks import cpuprobe

    roles = {"publisher": [procs[0].pid], "pullers": [p.pid for p in procs[1:]]}
    cores = len(os.sched_getaffinity(0))
    marks = [os.path.join(d, f"ready-{i}") for i in range(len(procs) - 1)]
    marks = [marks] + [[os.path.join(d, f"round-{v}")] for v in range(1, rounds + 1)]
    samples = []
    for paths in marks:
        while not all(os.path.exists(p) for p in paths):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done in time; see {d}/log")
            if any(p.poll() not in (None, 0) for p in procs):
                break  # a process failed: the caller reports it
            time.sleep(0.002)
        samples.append(cpuprobe.sample(roles, descendants=False))  # nsenter execs: the pids are the pullers
    return [round_cpu(a, b, cores) for a, b in zip(samples, samples[1:])]


def measure(c: Any, n: int, k: int | None, a: argparse.Namespace, log_dir: str) -> dict:
    """One configuration: a publisher on host L and n pullers; k None is the star.  Returns
    median time (s) over the rounds after the first, egress per version (copies), details."""
    from turnscale.learner import relaytree

    d = tempfile.mkdtemp(prefix=f"fanout-n{n}-k{k}-", dir=log_dir)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "turnscale.benchmarks.fanout"]
    learner_ep = f"tcp://{c.addr('L')}:{LEARNER_PORT}"
    relay_eps = [f"tcp://{c.addr(f'h{i}')}:{RELAY_PORT}" for i in range(n)]
    procs = []
    logf = open(os.path.join(d, "log"), "w")
    pub = c.spawn("L", [*base, "publisher", "--bind", learner_ep, "--dir", d, "--n", str(n), "--rounds", str(a.fanout_rounds),
                        "--mb", str(a.fanout_mb), "--chunk-kb", str(a.fanout_chunk_kb)],
                  env=env, stdout=logf, stderr=logf, cwd=ROOT)
    procs.append(pub)
    for i in range(n):
        argv = [*base, "puller", "--index", str(i), "--learner", learner_ep, "--dir", d, "--rounds", str(a.fanout_rounds),
                "--switch-ms", str(a.fanout_switch_ms), "--run-kb", str(a.fanout_run_kb)]
        if k is not None:
            argv += ["--relay-bind", relay_eps[i], "--relays", ",".join(relaytree.sources(relay_eps, i, k, 2))]
        procs.append(c.spawn(f"h{i}", argv, env=env, stdout=logf, stderr=logf, cwd=ROOT))
    try:
        deadline = time.monotonic() + 60 + 30 * a.fanout_rounds * max(1, n * a.fanout_mb / 8)
        cpu = _watch_rounds(d, procs, a.fanout_rounds, deadline, f"fanout n={n} k={k}")
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"fanout n={n} k={k}: not done in time; see {d}/log")
            time.sleep(0.1)
        bad = [p.returncode for p in procs if p.returncode != 0]
        if bad:
            raise RuntimeError(f"fanout n={n} k={k}: processes failed ({bad}); see {d}/log")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        logf.close()
    rounds = [_wait_file(os.path.join(d, f"round-{v}"), 1) for v in range(1, a.fanout_rounds + 1)]
    timed = rounds[1:] or rounds
    cpu_timed = cpu[1:] or cpu
    return {"s": statistics.median(r["t_all"] - r["t_pub"] for r in timed),
            **{f"cpu_{f}": statistics.median(c[f] for c in cpu_timed) for f in cpu_timed[0]},
            "egress": statistics.median(r["egress_bytes"] / r["total_bytes"] for r in timed),
            "from_relays": sum(p["from_relays"] for r in timed for p in r["pullers"]),
            "from_learner": sum(p["from_learner"] for r in timed for p in r["pullers"]),
            "fallbacks": sum(p["fallbacks"] for r in timed for p in r["pullers"])}


def run(args: argparse.Namespace) -> list[Result]:
    from turnscale.cluster.netns import Cluster, available

    ok, why = available()
    if not ok:
        print(f"fanout: skipped: the namespace cluster is unavailable ({why})", flush=True)
        return []
    ns = [int(x) for x in str(args.fanout_n).split(",") if x]
    ks = [int(x) for x in str(args.fanout_k).split(",") if x]
    print(f"fanout: {args.fanout_mb:g} MB float32 in {args.fanout_chunk_kb} KB chunks, runs of up to {args.fanout_run_kb} KB "
          f"per request, every host link capped at "
          f"{args.fanout_rate:g} Mbit/s; pullers are pull-only clients (the actor's pull_stream + RelayServer), "
          f"not full actors (16 of those do not fit 2 cores)", flush=True)
    log_dir = tempfile.mkdtemp(prefix="turnscale-fanout-")  # removed after a clean run, kept (and named) after a failure
    got: dict[tuple[int | None, int], dict] = {}
    clean = False
    try:
        with Cluster(["L", *[f"h{i}" for i in range(max(ns))]], rate_mbit=args.fanout_rate) as c:
            for n in ns:
                for k in [None, *ks]:
                    got[(k, n)] = m = measure(c, n, k, args, log_dir)
                    name = "star" if k is None else f"relay k={k}"
                    print(f"  {name:<11} N={n:<3} {m['s']:.3f}s  egress {m['egress']:.2f} copies  chunks from relays "
                          f"{m['from_relays']}, from learner {m['from_learner']}, fallbacks {m['fallbacks']}; CPU s/version: "
                          f"pullers {m['cpu_pullers']:.2f}, publisher {m['cpu_publisher']:.2f}, machine {m['cpu_machine']:.2f} "
                          f"of {m['cpu_available']:.2f} available", flush=True)
        clean = True
    finally:
        if clean:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"fanout: the processes' logs are in {log_dir}", flush=True)
    n0, results = ns[0], []
    one = args.fanout_mb * 8 / args.fanout_rate
    print(f"fanout: ideal one pull = {one:.3f}s at the link cap; star ideal ~N x that, relay ~1x", flush=True)
    for n in ns:
        star = got[(None, n)]
        results.append(result(f"fanout_star_n{n}", star["s"], "s", f"star at N={n0}", got[(None, n0)]["s"],
                              lower_is_better=True))
        for k in ks:
            rel = got[(k, n)]
            target = 1 / 1.5 if n == 16 else None
            results.append(result(f"fanout_relay_k{k}_n{n}", rel["s"], "s", f"relay k={k} at N={n0}", got[(k, n0)]["s"],
                                  target=target, lower_is_better=True))
            results.append(result(f"fanout_relay_k{k}_vs_star_n{n}", rel["s"], "s", f"star at N={n}", star["s"],
                                  lower_is_better=True))
            results.append(result(f"fanout_egress_k{k}_n{n}", rel["egress"], "copies/version", "bound: 2 copies", 2.0,
                                  target=1.0, lower_is_better=True))
        results.append(result(f"fanout_egress_star_n{n}", star["egress"], "copies/version", "bound: 2 copies", 2.0,
                              lower_is_better=True))
        for k in [None, *ks]:
            m = got[(k, n)]
            results.append(result(f"fanout_cpu_{'star' if k is None else f'k{k}'}_n{n}", m["cpu_pullers"], "CPU s/version",
                                  "CPU s available over the same wall time", m["cpu_available"], lower_is_better=True))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m turnscale.benchmarks.fanout")
    sub = p.add_subparsers(dest="role", required=True)
    pp = sub.add_parser("publisher")
    pp.add_argument("--bind", required=True)
    pp.add_argument("--dir", required=True)
    pp.add_argument("--n", type=int, required=True)
    pp.add_argument("--rounds", type=int, default=3)
    pp.add_argument("--mb", type=float, default=8.0)
    pp.add_argument("--chunk-kb", type=int, default=128)
    pu = sub.add_parser("puller")
    pu.add_argument("--index", type=int, required=True)
    pu.add_argument("--learner", required=True)
    pu.add_argument("--dir", required=True)
    pu.add_argument("--rounds", type=int, default=3)
    pu.add_argument("--relay-bind", default="")
    pu.add_argument("--relays", default="")
    pu.add_argument("--switch-ms", type=float, default=0.0)
    pu.add_argument("--run-kb", type=int, default=1024)
    a = p.parse_args(argv)
    return publisher(a) if a.role == "publisher" else puller(a)


if __name__ == "__main__":
    sys.exit(main())
