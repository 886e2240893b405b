"""Checkpoints: one folder per step, written atomically, the last N kept.

Layout of ``<root>/step-<8 digits>/``::

    model/                    HF format (save_pretrained, safetensors) + tokenizer files   } the trainer's
    modules.safetensors       extra trained modules (e.g. the PPO value head), "<module>.<param>"  } part
    trainer_state.pt          optimizer, LR scheduler, RNG states and the trainer's own       } (``Trainer.
                              optimizer-step counter "step" (torch.save; loaded weights_only) } state_writer``)
    meta.json                 the run's state: {"format", "step", "schedule", "extra"} — written last

Two writers, one folder: ``save`` creates the temp folder, has the trainer write its part
into it (``write_trainer(dir)``: model, optimizer and RNG state only), then writes the run's
state itself as ``meta.json``.  ``extra`` is the run's state, opaque here
(``learner.runstate.RunState.state``: step, version, run id, trained groups; plus the task
cursor and leases); ``schedule`` is the turn schedule's state; both must be
JSON-serialisable.  The trainer's ``step`` and ``meta.json``'s ``step`` must agree on load
(``learner.main.TrainerCheckpointer``).

Ordering: everything is written into ``<root>/.tmp-step-...`` and the folder is renamed
to its final name only when complete (``os.rename`` is atomic on one filesystem), so a
crash never leaves a half-written ``step-*`` folder; ``latest`` ignores temp folders and
folders without ``meta.json``, which is written (and fsynced) last.  Older checkpoints
beyond ``keep`` are removed after the rename.

Sharded (``learner.strategy=fsdp``, ``save_sharded``): the trainer's part is instead::

    sharded/                  torch.distributed.checkpoint: model (policy, value head) and
                              optimizer state, each rank's shards, plus ``.metadata``
    rng-<rank>.pt             each rank's RNG states
    trainer_state.pt          scheduler, ``step``, ``strategy``, ``world_size`` (rank 0)
    model/                    config.json + tokenizer files only (``export_hf`` adds weights)

Every rank writes its files into rank 0's temp folder (storage every rank sees); the
checkpoint's own collective (``dcp.save``) returns on rank 0 only after every rank's shards
are written, and each rank writes its RNG file before it, so the rename that follows never
publishes a folder with a rank's files missing.  Resuming reshards on load (DCP), so a
checkpoint loads onto any number of ranks; each rank restores its own RNG file when there
is one (rank 0's otherwise).

Format 1 (before the trainer's part and the run's state were split) had the same files,
but ``trainer_state.pt`` had no ``step``: ``load_trainer_state`` takes it from ``meta.json``
then, so such checkpoints still resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

FORMAT = 2
READS = (1, 2)
"""Formats ``load_meta`` accepts (1: no ``step`` in ``trainer_state.pt``)."""
_STEP_RE = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not fit the model."""


@dataclass
class Loaded:
    """A checkpoint's run state (``meta.json``), what ``load_meta`` returns."""

    path: str
    step: int
    schedule: dict[str, Any] | None
    extra: dict[str, Any]
    format: int = FORMAT


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, "meta.json")):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(root: str) -> str | None:
    """Path of the newest complete checkpoint under ``root``, or None."""
    cps = list_checkpoints(root)
    return cps[-1][1] if cps else None


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA when present) RNG states, weights_only-loadable."""
    py = random.getstate()
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    root: str,
    *,
    step: int,
    write_trainer: Callable[[str], Any],
    schedule: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> str:
    """Write a checkpoint for ``step`` atomically; returns its final path.

    ``write_trainer(dir)`` writes the trainer's part (model, modules, ``trainer_state.pt``:
    ``Trainer.state_writer``) into the temp folder; the run's state (``schedule``, ``extra``)
    goes into ``meta.json``, written last.
    """
    meta = {"format": FORMAT, "step": step, "schedule": dict(schedule) if schedule else None, "extra": dict(extra or {})}
    meta_json = json.dumps(meta)  # a non-JSON extra fails here, before anything is written
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".tmp-step-{step:08d}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        write_trainer(tmp)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            f.write(meta_json)
            f.flush()
            os.fsync(f.fileno())
        final = step_dir(root, step)
        if os.path.exists(final):  # re-saving a step: move the old one aside first
            old = final + f".old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def write_trainer_part(
    path: str,
    *,
    model: Any,
    model_state: Mapping[str, torch.Tensor] | None = None,
    tokenizer: Any = None,
    modules: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
    trainer_state: Mapping[str, Any],
) -> None:
    """The trainer's files in ``path`` (a temp folder of ``save``): ``model/`` (``model`` is an
    unwrapped HF ``PreTrainedModel``; ``model_state`` the full state dict to save, under FSDP
    ``accelerator.get_state_dict``, default its own), ``modules.safetensors`` and
    ``trainer_state.pt`` (optimizer, scheduler, RNG, ``step``)."""
    from safetensors.torch import save_file

    model.save_pretrained(os.path.join(path, "model"), state_dict=dict(model_state) if model_state is not None else None)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(path, "model"))
    if modules:
        flat = {f"{m}.{k}": v.detach().to("cpu").contiguous() for m, sd in modules.items() for k, v in sd.items()}
        save_file(flat, os.path.join(path, "modules.safetensors"))
    torch.save(dict(trainer_state), os.path.join(path, "trainer_state.pt"))


def prune(root: str, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints (and stale temp folders)."""
    cps = list_checkpoints(root)
    for _, path in cps[: max(len(cps) - max(keep, 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def load_meta(path: str) -> Loaded:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json); use checkpoint.latest(root)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") not in READS:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this code reads {list(READS)}")
    return Loaded(path=path, step=int(meta["step"]), schedule=meta.get("schedule"), extra=meta.get("extra") or {},
                  format=int(meta["format"]))


def load_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.pt`` of a complete checkpoint (``CheckpointError`` otherwise), with its
    ``step``: format 1 did not store it there, so it comes from ``meta.json`` then."""
    meta = load_meta(path)
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    if "step" not in state:
        if meta.format != 1:
            raise CheckpointError(f"{path}: trainer_state.pt has no step")
        state["step"] = meta.step
    return state


def load_model_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``<path>/model/*.safetensors`` (sharded or not)."""
    from safetensors.torch import load_file

    model_dir = os.path.join(path, "model")
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors")) if os.path.isdir(model_dir) else []
    if not files:
        raise CheckpointError(f"{model_dir} holds no .safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(model_dir, f)))
    return out


def is_sharded(path: str) -> bool:
    """Whether the checkpoint at ``path`` was written by ``save_sharded``."""
    return os.path.isdir(os.path.join(path, "sharded"))


def _container(modules: Mapping[str, Any]) -> Any:
    from torch import nn

    return nn.ModuleDict(dict(modules))


def save_sharded(path: str, *, modules: Mapping[str, Any], optimizer: Any, trainer_state: Mapping[str, Any],
                 model: Any = None, tokenizer: Any = None) -> None:
    """This rank's part of a sharded checkpoint in ``path`` (see the module docstring); every
    rank calls it with the same ``path``.  ``modules`` (name -> FSDP-sharded module) and
    ``optimizer`` go through ``torch.distributed.checkpoint``; ``trainer_state`` (rank 0's:
    scheduler, step), ``model``'s config and ``tokenizer`` are written by rank 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(capture_rng(), os.path.join(path, f"rng-{rank}.pt"))
    if rank == 0:
        torch.save({**trainer_state, "rng": capture_rng(), "strategy": "fsdp", "world_size": world},
                   os.path.join(path, "trainer_state.pt"))
        if model is not None:
            model.config.save_pretrained(os.path.join(path, "model"))
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(path, "model"))
    model_sd, optim_sd = get_state_dict(_container(modules), optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=os.path.join(path, "sharded"))


def load_sharded(path: str, *, modules: Mapping[str, Any], optimizer: Any) -> dict[str, Any]:
    """Load a sharded checkpoint into ``modules`` and ``optimizer`` on every rank (a
    collective; any number of ranks, sharded or not: DCP reshards; one process without
    torch.distributed too), restore this rank's RNG; returns ``trainer_state.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state = load_trainer_state(path)
    container = _container(modules)
    model_sd, optim_sd = get_state_dict(container, optimizer)
    both = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(both, checkpoint_id=os.path.join(path, "sharded"))
    except Exception as exc:  # DCP raises CheckpointException / RuntimeError naming the key
        raise CheckpointError(f"{path}: the sharded checkpoint does not fit this model and optimizer "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})") from exc
    set_state_dict(container, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    own = os.path.join(path, f"rng-{rank}.pt")
    rng = torch.load(own, map_location="cpu", weights_only=True) if os.path.isfile(own) else state["rng"]
    restore_rng(rng)
    return state


def export_hf(path: str, out: str, *, dtype: str = "float32") -> str:
    """The policy of the checkpoint at ``path`` as an HF model folder ``out`` (safetensors,
    config, tokenizer), in one process without torch.distributed: a sharded checkpoint is
    gathered from its shards (DCP resharding onto one full copy), a replicated one copied
    from ``model/``.  Returns ``out``."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from turnscale.protocol.dtypes import float_torch_dtype

    load_meta(path)  # complete checkpoints only
    model_dir = os.path.join(path, "model")
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if is_sharded(path):
        sd = {f"policy.{k}": v for k, v in model.state_dict().items()}
        dcp.load({"model": sd}, checkpoint_id=os.path.join(path, "sharded"), no_dist=True)
    else:
        model.load_state_dict(load_model_state(path), strict=False)
    model.to(float_torch_dtype(dtype, "export dtype")).save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    except (OSError, ValueError, TypeError):
        pass  # a bare model (tests) has no tokenizer
    return out


def load_modules(path: str) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    p = os.path.join(path, "modules.safetensors")
    if not os.path.isfile(p):
        return {}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in load_file(p).items():
        mod, _, name = k.partition(".")
        out.setdefault(mod, {})[name] = v
    return out
