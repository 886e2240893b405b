"""Before/after probe of issue 21's memory and descriptor cases against one envhub server.

    python benchmarks/envhub_limits_probe.py REPO_DIR

starts ``turnscale envhub env=babyai`` (default limits) from ``REPO_DIR`` (this checkout,
or an export of an older commit, to compare) on 127.0.0.1, ends it by pid, and prints:
peak RSS while eight clients send 50 MB bodies with ``Content-Length``; ``GET /expert`` on
BabyAI task 1948 (minigrid's bot loops there) with a 12 s client timeout and the RSS change;
``POST /close`` of that instance; server fds with 2000 half-open requests, and 15 s later;
the SIGTERM exit time.  Not a ``turnscale bench`` figure: it compares code versions, not a
baseline in the same run.
"""
import os, socket, subprocess, sys, threading, time, json, http.client
repo = sys.argv[1]
sys.path.insert(0, repo)
from turnscale.benchmarks.envhub_launch import free_port, wait_healthy, stop
port = free_port()
proc = subprocess.Popen([sys.executable, "-m", "turnscale", "envhub", "env=babyai", "host=127.0.0.1", f"port={port}"], cwd=repo,
                        env={**os.environ, "PYTHONPATH": repo}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"
wait_healthy(url, proc, 90)
def status(key):
    for line in open(f"/proc/{proc.pid}/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
def fds(): return len(os.listdir(f"/proc/{proc.pid}/fd"))
def req(method, path, body=None, timeout=10):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request(method, path, body=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    r = c.getresponse(); d = r.read(); c.close(); return r.status, d
out = {}
try:
    # a. 8 x 50 MB bodies with Content-Length
    rss0 = status("VmRSS:")
    def big():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (50 << 20))
                piece = b"x" * (1 << 20)
                for _ in range(50):
                    s.sendall(piece)
                s.recv(100)
        except OSError:
            pass
    ts = [threading.Thread(target=big) for _ in range(8)]
    [t.start() for t in ts]; [t.join(120) for t in ts]
    out["8x50MB_bodies"] = f"RSS {rss0:.0f} MB -> peak {status('VmHWM:'):.0f} MB"
    # b. expert on 1948 for up to 12 s
    s, d = req("POST", "/create", {}); i = json.loads(d)["id"]
    req("POST", "/reset", {"id": i, "data_idx": 1948})
    rss0 = status("VmRSS:"); t0 = time.monotonic()
    try:
        s, d = req("GET", f"/expert?id={i}", timeout=12)
        res = f"{s} in {time.monotonic() - t0:.2f} s"
    except OSError:
        res = f"no answer in {time.monotonic() - t0:.0f} s"
    out["expert_1948"] = f"{res}; RSS {rss0:.0f} -> {status('VmRSS:'):.0f} MB"
    t0 = time.monotonic()
    try:
        s, d = req("POST", "/close", {"id": i}, timeout=5); out["close_after_expert"] = f"{s} in {time.monotonic()-t0:.2f} s"
    except OSError:
        out["close_after_expert"] = "no answer in 5 s"
    # c. 2000 half-open connections, fds after 15 s
    f0 = fds(); socks = []
    for _ in range(2000):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5); s.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\n"); socks.append(s)
        except OSError:
            break
    peak = fds(); time.sleep(15)
    out["2000_half_open"] = f"fds {f0} -> {peak} -> after 15 s {fds()}"
    [s.close() for s in socks]
    t0 = time.monotonic(); os.kill(proc.pid, 15)
    try:
        proc.wait(20); out["sigterm_exit"] = f"{time.monotonic()-t0:.1f} s rc {proc.returncode}"
    except subprocess.TimeoutExpired:
        out["sigterm_exit"] = "not within 20 s"
finally:
    if proc.poll() is None:
        proc.kill(); proc.wait()
print(repo, json.dumps(out, indent=1))
