"""Full weight states for vLLM swaps, as safetensors files in shared memory.

Why files: vLLM's workers may live in other processes (its default multiprocess mode), and
nothing pickled may cross a process boundary.  Every swap therefore writes the *full* state
once into a safetensors file in memory (``StateStore``) and tells each worker its path
(``actors.vllm_worker``); a worker maps the file and streams it into its model.  The same
path serves vLLM's in-process mode, so there is one swap mechanism.

Invariants:

- ``write`` copies every tensor's bytes into the file and keeps no reference to the caller's
  tensors (the actor reuses its receive buffer for the next pull);
- a file is complete before its path is handed out (written under a temporary name, then
  renamed);
- ``StateStore`` keeps exactly one *restore source*: the state the engine last loaded
  successfully (at first, the model folder's own safetensors files).  A failed swap reloads
  it; the files of a failed swap are deleted at once.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import tempfile
from typing import Any, Iterator, Mapping, Sequence

from turnscale.actors.engine import EngineError

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
_FLOAT_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def clean_name(name: str) -> str:
    """A state-dict name without wrapper prefixes (DDP ``module.``, ``torch.compile``'s
    ``_orig_mod.``, FSDP / activation-checkpoint wrappers), wherever they appear."""
    clean, changed = name, True
    while changed:
        changed = False
        for pre in _WRAPPER_PREFIXES:
            if clean.startswith(pre):
                clean, changed = clean[len(pre):], True
            if "." + pre in clean:
                clean, changed = clean.replace("." + pre, "."), True
    return clean


def vllm_names(tensors: Mapping[str, Any], *, tie_word_embeddings: bool) -> dict[str, str]:
    """``{vLLM name: caller's name}`` for the tensors vLLM loads: HF names without wrapper
    prefixes, without rotary ``inv_freq`` buffers and, for tied embeddings, without
    ``lm_head.weight`` (vLLM shares it with ``embed_tokens``)."""
    out: dict[str, str] = {}
    for name in tensors:
        clean = clean_name(name)
        if clean.endswith(_SKIPPED_SUFFIXES) or (tie_word_embeddings and clean == "lm_head.weight"):
            continue
        if clean in out:
            raise EngineError(f"load_weights: {out[clean]!r} and {name!r} map to the same vLLM name {clean!r} after stripping wrapper prefixes")
        out[clean] = name
    return out


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of an HF model folder (sorted); empty when it has none."""
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def read_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from a safetensors file's header (no tensor data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}


def expected_shapes(files: Sequence[str], *, tie_word_embeddings: bool) -> dict[str, tuple[int, ...]]:
    """``{vLLM name: shape}`` of the full state, from a checkpoint's safetensors headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        for name, (_, shape) in read_header(f).items():
            shapes[name] = shape
    names = vllm_names(shapes, tie_word_embeddings=tie_word_embeddings)
    return {clean: shapes[orig] for clean, orig in names.items()}


def check_full_state(tensors: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]], *, tie_word_embeddings: bool) -> dict[str, str]:
    """Raise ``EngineError`` unless ``tensors`` is the model's full state (every expected
    name, no other, the right shapes, floating-point dtypes).  vLLM's loaders fuse
    projections (``qkv_proj``, ``gate_up_proj``): a partial state leaves fused layers
    half-written (NaN log-probs), so only full states are accepted.  Returns
    ``vllm_names(tensors)``."""
    names = vllm_names(tensors, tie_word_embeddings=tie_word_embeddings)
    missing = sorted(set(expected) - set(names))
    unknown = sorted(set(names) - set(expected))
    if missing or unknown:
        raise EngineError(
            f"load_weights: engine=vllm takes the model's full state ({len(expected)} tensors); "
            f"missing {missing[:3]}{'...' if len(missing) > 3 else ''} ({len(missing)}), "
            f"unknown {unknown[:3]}{'...' if len(unknown) > 3 else ''} ({len(unknown)})"
        )
    for clean, orig in names.items():
        t = tensors[orig]
        if tuple(t.shape) != tuple(expected[clean]):
            raise EngineError(f"load_weights: {orig} has shape {tuple(t.shape)}, the model needs {tuple(expected[clean])}")
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _FLOAT_DTYPES:
            raise EngineError(f"load_weights: {orig} has dtype {dtype}; weights must be one of {sorted(_FLOAT_DTYPES)}")
    return names


def write_state(path: str, tensors: Mapping[str, Any], names: Mapping[str, str]) -> int:
    """Write ``{vLLM name: tensors[caller's name]}`` as one safetensors file at ``path``
    (through ``path + '.tmp'`` and a rename).  Tensors may share storage (views of one
    receive buffer).  Returns the bytes written."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        n = write_state_to(f, tensors, names)
    os.replace(tmp, path)
    return n


def write_state_to(f: Any, tensors: Mapping[str, Any], names: Mapping[str, str]) -> int:
    """``write_state`` into an open binary file ``f``."""
    import torch

    header: dict[str, Any] = {}
    offset = 0
    order = sorted(names)
    for clean in order:
        t = tensors[names[clean]]
        nbytes = t.numel() * t.element_size()
        header[clean] = {"dtype": _FLOAT_DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for clean in order:
        t = tensors[names[clean]].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        f.write(memoryview(flat.numpy()))
    return 8 + len(blob) + offset


def iter_state(files: Sequence[str]) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every tensor of ``files`` (memory-mapped, read one at a time)."""
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def shm_dir() -> str | None:
    """``/dev/shm`` when it is a writable directory (a tmpfs on Linux), else None (the
    system temp dir is used)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class StateStore:
    """The state files of one engine, in shared memory.

    By default each state is an anonymous in-memory file (``memfd_create``) that workers open
    as ``/proc/<engine pid>/fd/<fd>``: the kernel frees it when the engine closes it *or
    dies*, so a killed actor never leaks a model-sized file.  Where that is unavailable, or
    when ``directory`` is given, states are files in a private directory (``/dev/shm`` when
    writable), removed by ``discard`` / ``close``.

    ``restore`` is the state the engine last loaded successfully.  Not thread-safe: used
    only by the engine thread (and ``close`` after that thread ended).
    """

    def __init__(self, initial: Sequence[str], directory: str | None = None) -> None:
        self.restore: list[str] = list(initial)
        self._fds: dict[str, int] = {}
        self._count = 0
        use_memfd = directory is None and hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")
        self.dir = None if use_memfd else tempfile.mkdtemp(prefix="turnscale-vllm-", dir=directory if directory is not None else shm_dir())

    def write(self, tensors: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
        """A new state file (complete before its path is returned; not yet the restore source)."""
        self._count += 1
        if self.dir is None:
            fd = os.memfd_create(f"turnscale-vllm-state-{self._count}", os.MFD_CLOEXEC)
            path = f"/proc/{os.getpid()}/fd/{fd}"
            self._fds[path] = fd
            try:
                with os.fdopen(os.dup(fd), "wb") as f:
                    write_state_to(f, tensors, names)
            except BaseException:
                self.discard([path])
                raise
            return [path]
        path = os.path.join(self.dir, f"state-{self._count}.safetensors")
        try:
            write_state(path, tensors, names)
        except BaseException:
            self.discard([path, path + ".tmp"])
            raise
        return [path]

    def commit(self, files: list[str]) -> None:
        """``files`` were loaded: they become the restore source (our previous one is freed)."""
        old, self.restore = self.restore, list(files)
        self.discard([f for f in old if f not in files])

    def discard(self, files: Sequence[str]) -> None:
        """Free ``files`` that are ours (never the model folder's)."""
        for f in files:
            fd = self._fds.pop(f, None)
            if fd is not None:
                os.close(fd)
            elif self.dir is not None and os.path.dirname(f) == self.dir:
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass

    def close(self) -> None:
        self.discard(list(self._fds))
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
