"""``benchmarks.cpuprobe``: CPU seconds from /proc and cores used between two samples."""

from __future__ import annotations

import os
import time

import pytest

from turnscale.benchmarks.cpuprobe import CpuSample, cores_between, machine_busy_s, proc_cpu_s, sample, tree_cpu_s


def test_cores_between_uses_the_samples_around_the_window():
    samples = [CpuSample(0.0, {"a": 0.0, "b": 1.0}, 10.0), CpuSample(5.0, {"a": 2.0, "b": 1.0}, 15.0),
               CpuSample(10.0, {"a": 6.0, "b": 3.0}, 25.0), CpuSample(20.0, {"a": 9.0, "b": 3.0}, 30.0)]
    got = cores_between(samples, 5.0, 10.0)
    assert got == pytest.approx({"a": 0.8, "b": 0.4, "machine": 2.0})
    assert cores_between(samples, 6.0, 9.0) == got  # the nearest samples outside the window
    assert cores_between(samples, -5.0, 50.0) == pytest.approx({"a": 0.45, "b": 0.1, "machine": 1.0})
    assert cores_between(samples[:1], 0.0, 1.0) == {}


def test_a_busy_process_accumulates_cpu_time_and_a_missing_one_counts_zero():
    before = proc_cpu_s(os.getpid())
    deadline = time.monotonic() + 60
    while proc_cpu_s(os.getpid()) <= before and time.monotonic() < deadline:  # CPU time advances while this spins
        sum(range(10_000))
    assert proc_cpu_s(os.getpid()) > before
    assert proc_cpu_s(2**22 + 12345) == 0.0
    s = sample({"me": [os.getpid()], "gone": [2**22 + 12345]})
    assert s.roles["me"] > 0 and s.roles["gone"] == 0 and 0 < s.machine <= machine_busy_s()


def test_a_process_tree_counts_its_descendants():
    fake = {1: [2, 3], 3: [4]}
    assert tree_cpu_s([os.getpid()], {os.getpid(): [os.getppid()]}) >= proc_cpu_s(os.getppid())
    assert tree_cpu_s([2**22 + 1], fake) == 0.0  # gone processes and their (fake) children read 0


def test_a_childs_cpu_stays_counted_after_it_exits_and_is_waited_for():
    import subprocess
    import sys

    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\ninput()\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while proc_cpu_s(child.pid) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        during = tree_cpu_s([os.getpid()])
        assert during >= proc_cpu_s(child.pid) >= 0.3
    finally:
        child.communicate(b"\n", timeout=60)
    assert tree_cpu_s([os.getpid()]) >= during
