"""Chunk checksums: standard check values, views, and a clear error for unknown algorithms."""

from __future__ import annotations

import numpy as np
import pytest

from turnscale.protocol import checksums


def test_check_values_of_the_standard_algorithms():
    assert checksums.checksum("crc32", b"123456789") == 0xCBF43926
    if "crc32c" in checksums.ALGOS:
        assert checksums.checksum("crc32c", b"123456789") == 0xE3069283


@pytest.mark.parametrize("algo", checksums.ALGOS)
def test_a_writable_array_slice_checksums_like_its_bytes(algo):
    buf = np.arange(1000, dtype=np.uint8)
    assert checksums.checksum(algo, buf[10:500]) == checksums.checksum(algo, bytes(buf[10:500]))
    assert buf.flags.writeable  # the caller's array is left writable


def test_preferred_is_hardware_crc32c_when_available():
    assert checksums.preferred() == checksums.ALGOS[0]
    with pytest.raises(ValueError, match="unknown checksum"):
        checksums.checksum("md5", b"x")
