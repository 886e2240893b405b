"""``turnscale bench fanout``'s CPU accounting: CPU seconds per version of the pullers and
the publisher against what the machine had over the same wall time."""

from __future__ import annotations

import pytest

from turnscale.benchmarks.cpuprobe import CpuSample
from turnscale.benchmarks.fanout import round_cpu


def test_round_cpu_is_the_difference_of_two_samples_against_cores_times_wall():
    before = CpuSample(100.0, {"pullers": 3.0, "publisher": 1.0}, 50.0)
    after = CpuSample(100.5, {"pullers": 4.1, "publisher": 1.05}, 51.2)
    got = round_cpu(before, after, cores=2)
    assert got == pytest.approx({"pullers": 1.1, "publisher": 0.05, "machine": 1.2, "wall": 0.5, "available": 1.0})
    assert got["pullers"] > got["available"]  # CPU-bound: the pullers wanted more than two cores gave


def test_round_cpu_never_goes_negative():
    before = CpuSample(10.0, {"pullers": 2.0, "publisher": 1.0}, 5.0)
    after = CpuSample(9.0, {"pullers": 1.0}, 4.0)  # a process gone (reads 0), clocks out of order
    assert round_cpu(before, after, cores=2) == {"pullers": 0.0, "publisher": 0.0, "machine": 0.0, "wall": 0.0,
                                                 "available": 0.0}
