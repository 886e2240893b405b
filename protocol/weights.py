"""The weight-transfer protocol: how a state dict becomes one byte stream, its chunks and
its ``WeightManifest``, and how the stream becomes tensors again.  Both ends use it: the
learner's publisher (``learner/weights.py``) lays out and chunks, the actor's puller
(``actors/weight_sync.py``) verifies chunks against the manifest and views the tensors.

Layout: tensors end to end in the order given, each at an offset aligned to its element
size; floating tensors travel as the manifest's ``dtype``, others as they are (one of
``protocol.dtypes.WIRE_DTYPES``).  Chunks of ``chunk_bytes`` tile ``[0, total_bytes)``,
each with its ``checksum_algo`` checksum (``protocol.checksums``).  The message classes
themselves (``WeightManifest``, ``TensorInfo``, ``ChunkInfo``, ``WeightChunkRequest``,
``WeightChunk``) live in ``protocol.messages``.

Torch is imported only by the functions that take or return tensors.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

import numpy as np

from turnscale.protocol import checksums
from turnscale.protocol.dtypes import torch_dtype, wire_name
from turnscale.protocol.errors import ProtocolError
from turnscale.protocol.messages import ChunkInfo, TensorInfo, WeightManifest


def layout(state_dict: Mapping[str, Any], dtype: str) -> tuple[list[TensorInfo], int]:
    """Offsets of every tensor in the stream: floating tensors as ``dtype``, others as they
    are; each offset aligned to the element size.  Returns (tensor infos, total bytes)."""
    target = torch_dtype(dtype)
    infos, pos = [], 0
    for name, t in state_dict.items():
        dt = target if t.is_floating_point() else t.dtype
        dt_name = wire_name(dt)
        if dt_name is None:
            raise ValueError(f"tensor {name!r} has dtype {dt}, which cannot travel as weights")
        item = dt.itemsize
        pos = (pos + item - 1) // item * item
        nbytes = t.numel() * item
        infos.append(TensorInfo(name=name, dtype=dt_name, shape=list(t.shape), offset=pos, nbytes=nbytes))
        pos += nbytes
    return infos, pos


def chunk_table(buf: np.ndarray, total: int, chunk_bytes: int, algo: str) -> list[ChunkInfo]:
    """The chunks tiling ``buf[:total]``, ``chunk_bytes`` each (the last may be shorter), checksummed."""
    chunks = []
    for i, off in enumerate(range(0, max(total, 1), chunk_bytes)):
        n = min(chunk_bytes, total - off)
        chunks.append(ChunkInfo(index=i, offset=off, nbytes=n, checksum=checksums.checksum(algo, buf[off:off + n])))
    return chunks if total else []


def build_manifest(version: int, dtype: str, buf: np.ndarray, infos: list[TensorInfo], total: int, *,
                   chunk_bytes: int, checksum_algo: str, chunks: list[ChunkInfo] | None = None) -> WeightManifest:
    """The checked manifest of the stream ``buf[:total]`` laid out as ``infos`` (``chunks``:
    already computed by ``write_and_chunk``)."""
    if chunks is None:
        chunks = chunk_table(buf, total, chunk_bytes, checksum_algo)
    manifest = WeightManifest(version=version, dtype=dtype, total_bytes=total, checksum_algo=checksum_algo,
                              tensors=infos, chunks=chunks)
    manifest.check()
    return manifest


def write_tensors(buf: np.ndarray, infos: list[TensorInfo], tensors: Any) -> None:
    """Copy ``tensors`` (in ``infos`` order, any device) into their places in ``buf``, cast to their wire dtypes."""
    import torch

    flat = torch.from_numpy(buf)
    for info, t in zip(infos, tensors):
        if not info.nbytes:
            continue
        dt = torch_dtype(info.dtype)
        if t.dtype == dt and t.device.type == "cpu" and t.is_contiguous():  # a plain byte copy: numpy's memcpy
            buf[info.offset: info.offset + info.nbytes] = t.detach().reshape(-1).view(torch.uint8).numpy()
        else:
            flat[info.offset: info.offset + info.nbytes].view(dt).view(t.shape).copy_(t.detach())


_PIECE = 256 << 10
"""Bytes copied, then checksummed while still in cache, by ``write_and_chunk``."""


def write_and_chunk(buf: np.ndarray, infos: list[TensorInfo], tensors: Any, total: int, chunk_bytes: int,
                    algo: str) -> list[ChunkInfo]:
    """``write_tensors`` and ``chunk_table`` in one pass over the stream: each piece is
    checksummed right after it is written (one trip through memory instead of two).  The
    result equals ``chunk_table(buf, total, chunk_bytes, algo)`` after ``write_tensors``
    (alignment gaps are checksummed as they lie in ``buf``).  ``infos`` must be in stream
    order, as ``layout`` makes them."""
    import torch

    flat = torch.from_numpy(buf)
    sums: list[int] = []
    pos, crc = 0, 0

    def advance(upto: int) -> None:  # checksum buf[pos:upto], closing chunks at their ends
        nonlocal pos, crc
        while pos < upto:
            end = min(upto, (pos // chunk_bytes + 1) * chunk_bytes)
            crc = checksums.update(algo, crc, buf[pos:end])
            pos = end
            if pos % chunk_bytes == 0:
                sums.append(crc)
                crc = 0

    for info, t in zip(infos, tensors):
        if not info.nbytes:
            continue
        dt = torch_dtype(info.dtype)
        if t.dtype == dt and t.device.type == "cpu" and t.is_contiguous():
            src = t.detach().reshape(-1).view(torch.uint8).numpy()
            for p in range(0, info.nbytes, _PIECE):
                n = min(_PIECE, info.nbytes - p)
                buf[info.offset + p: info.offset + p + n] = src[p:p + n]
                advance(info.offset + p + n)
        else:
            flat[info.offset: info.offset + info.nbytes].view(dt).view(t.shape).copy_(t.detach())
            advance(info.offset + info.nbytes)
    advance(total)
    if total % chunk_bytes:
        sums.append(crc)
    return [ChunkInfo(index=i, offset=i * chunk_bytes, nbytes=min(chunk_bytes, total - i * chunk_bytes), checksum=c)
            for i, c in enumerate(sums)]


def tensors_from_buffer(buf: np.ndarray, manifest: WeightManifest, *, copy: bool = False) -> dict[str, Any]:
    """Tensors of ``manifest`` viewing (or copied out of) the stream bytes in ``buf``;
    ``ProtocolError`` when the manifest does not fit ``buf``."""
    import torch

    out: dict[str, Any] = {}
    for t in manifest.tensors:
        try:
            dtype = torch_dtype(t.dtype)
        except ValueError:
            raise ProtocolError(f"tensor {t.name}: dtype {t.dtype!r} unknown to this actor") from None
        numel = math.prod(t.shape)
        if numel == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
            continue
        if t.offset < 0 or t.offset + numel * dtype.itemsize > len(buf):
            raise ProtocolError(f"tensor {t.name}: {numel} x {t.dtype} at offset {t.offset} lies outside the "
                                f"{len(buf)}-byte stream; the manifest is inconsistent")
        with warnings.catch_warnings():  # a same-host segment is mapped read-only: nobody writes through these views
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            x = torch.frombuffer(buf, dtype=dtype, count=numel, offset=t.offset).view(t.shape)
        out[t.name] = x.clone() if copy else x
    return out


def chunk_reply_frames(manifest: WeightManifest, buf: np.ndarray, first: int, end: int, *, corrupt: bool = False) -> list:
    """The frames of a reply carrying chunks ``first .. end - 1`` of ``manifest`` from the
    stream ``buf`` (``WeightChunkRequest``): per chunk a ``WeightChunk`` header frame, then its
    data frame (a view of ``buf``: send with ``copy=False`` only while ``buf`` cannot change).
    ``corrupt`` flips the first byte of every chunk (tests: a relay serving wrong bytes)."""
    from turnscale.protocol import codec
    from turnscale.protocol.messages import WeightChunk

    frames: list = []
    for c in manifest.chunks[first:end]:
        data = buf[c.offset:c.offset + c.nbytes]
        if corrupt and c.nbytes:
            data = data.copy()
            data[0] ^= 0xFF
        frames += codec.encode(WeightChunk(version=manifest.version, index=c.index, checksum=c.checksum, data=data),
                               out_of_band_bytes=0)  # data always its own frame: the asker recv_into's it
    return frames
