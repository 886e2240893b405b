"""The weight-transfer protocol (``protocol/weights.py``) and the one dtype table."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from turnscale.protocol import dtypes
from turnscale.protocol.weights import build_manifest, layout, tensors_from_buffer, write_tensors


def test_dtype_table_matches_torch_element_sizes():
    for name, size in dtypes.WIRE_DTYPES.items():
        dt = dtypes.torch_dtype(name)
        assert torch.empty((), dtype=dt).element_size() == size
        assert dtypes.wire_name(dt) == name
    assert dtypes.wire_name(torch.float64) is None
    with pytest.raises(ValueError, match="cannot travel"):
        dtypes.torch_dtype("float64")
    with pytest.raises(ValueError, match="transfer dtype 'int8'"):
        dtypes.float_torch_dtype("int8", "transfer dtype")


def test_protocol_imports_no_torch():
    code = "import sys, protocol.dtypes, protocol.weights, protocol.messages, conf; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layout_round_trip_both_ends():
    sd = {"a": torch.randn(3, 5), "step": torch.tensor([7], dtype=torch.int64), "m": torch.ones(2, dtype=torch.bool),
          "b": torch.randn(4, dtype=torch.float64)}
    infos, total = layout(sd, "bfloat16")
    assert [(i.dtype, i.offset, i.nbytes) for i in infos] == [("bfloat16", 0, 30), ("int64", 32, 8), ("bool", 40, 2),
                                                               ("bfloat16", 42, 8)]
    buf = np.empty(total, dtype=np.uint8)
    write_tensors(buf, infos, sd.values())
    m = build_manifest(3, "bfloat16", buf, infos, total, chunk_bytes=16, checksum_algo="crc32")
    assert [c.nbytes for c in m.chunks] == [16, 16, 16, 2]
    out = tensors_from_buffer(buf, m, copy=True)
    assert torch.equal(out["a"], sd["a"].to(torch.bfloat16))
    assert torch.equal(out["step"], sd["step"]) and torch.equal(out["m"], sd["m"])
    assert torch.equal(out["b"], sd["b"].to(torch.bfloat16))


@pytest.mark.parametrize("algo", ["crc32", "crc32c"])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 16, 1000, 3 << 20])
def test_write_and_chunk_equals_write_then_checksum(algo, chunk_bytes):
    """The one-pass publisher path (copy a piece, checksum it while in cache) gives the
    same bytes and chunk table as writing first and checksumming after, also across
    alignment gaps, casts, pieces larger than ``_PIECE`` and a stream shorter than a chunk."""
    from turnscale.protocol import checksums
    from turnscale.protocol.weights import chunk_table, write_and_chunk

    if algo not in checksums.ALGOS:
        pytest.skip(f"{algo} not available here")
    sd = {"a": torch.randn(3, 5), "step": torch.tensor([7], dtype=torch.int64), "m": torch.ones(3, dtype=torch.bool),
          "big": torch.randn(700_000).to(torch.bfloat16), "b": torch.randn(4, dtype=torch.float64), "e": torch.empty(0)}
    infos, total = layout(sd, "bfloat16")
    ref = np.zeros(total, dtype=np.uint8)
    write_tensors(ref, infos, sd.values())
    buf = np.zeros(total, dtype=np.uint8)
    chunks = write_and_chunk(buf, infos, sd.values(), total, chunk_bytes, algo)
    assert np.array_equal(buf, ref)
    assert chunks == chunk_table(ref, total, chunk_bytes, algo)
    assert write_and_chunk(np.zeros(0, np.uint8), [], [], 0, chunk_bytes, algo) == []
