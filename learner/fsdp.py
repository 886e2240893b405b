"""The sharded learner (``learner.strategy=fsdp``): torch FSDP2 around the trainer's modules.

``shard(model, mp)`` applies ``torch.distributed.fsdp.fully_shard`` to every decoder layer
(the classes HF names in ``model._no_split_modules``), then to the root (embeddings, final
norm and a tied LM head share the root's unit).  Each rank then holds 1/world of every
parameter as a ``DTensor`` (``Shard(0)``), and so of the gradients and of the AdamW state
built over them; a forward all-gathers one unit at a time (in ``mp.param_dtype``) and frees
it after, a backward reduce-scatters each unit's gradients (in ``mp.reduce_dtype``, averaged
over ranks as DDP's all-reduce is, so the trainer's loss normaliser is the same).

Every function here that touches a sharded tensor is a collective: every rank calls it, in
the same order (the trainer's invariant of equal forwards and backwards per step covers the
step; ``learner.ranks`` starts publication and checkpoints on the followers with
``RankCollective``).

Memory per rank (parameters, gradients, optimizer state): ``local_bytes``; the test compares
it with a replica's.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from turnscale.protocol.dtypes import float_torch_dtype


def param_dtype(name: str, device: str) -> torch.dtype:
    """``learner.fsdp.param_dtype`` as a torch dtype (``auto``: bfloat16 on cuda/npu, float32 on cpu)."""
    if name == "auto":
        return torch.float32 if device.partition(":")[0] == "cpu" else torch.bfloat16
    return float_torch_dtype(name, "learner.fsdp.param_dtype")


def mixed_precision(fsdp_cfg: Any, device: str) -> Any:
    """The ``MixedPrecisionPolicy`` of ``learner.fsdp``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype(fsdp_cfg.param_dtype, device),
                                reduce_dtype=float_torch_dtype(fsdp_cfg.reduce_dtype, "learner.fsdp.reduce_dtype"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (HF ``_no_split_modules``: ``Qwen2DecoderLayer`` ...; also
    once sharded, when FSDP2 has made their class ``FSDPQwen2DecoderLayer``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def offload(fsdp_cfg: Any, device: str) -> Any:
    """The ``OffloadPolicy`` of ``learner.fsdp.cpu_offload`` (pinned host memory off CPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not fsdp_cfg.cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device.partition(":")[0] != "cpu")


def device_mesh(device: torch.device) -> Any:
    """The 1-D mesh of every rank on ``device``'s type (``cpu``: gloo, ``cuda``: NCCL, ``npu``:
    HCCL; the default process group), named explicitly so FSDP never guesses the type."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard(module: nn.Module, mp: Any, *, mesh: Any = None, offload_policy: Any = None, per_layer: bool = True) -> nn.Module:
    """``fully_shard`` each decoder layer (``per_layer``), then ``module`` itself, over ``mesh``
    (None: FSDP's default); returns it (FSDP2 shards in place: names and the HF class stay,
    the parameters become DTensors)."""
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload_policy or OffloadPolicy()}
    if per_layer:
        for layer in decoder_layers(module):
            fully_shard(layer, **kw)
    fully_shard(module, **kw)
    return module


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (an all-gather: every rank calls it), or ``t`` itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_state(model: nn.Module, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model.state_dict()`` in its order (HF names, tied weights under
    each of their names, as a replica's ``state_dict`` has them), each gathered whole on its
    own (``full``: a collective per tensor; peak extra memory is one tensor) and cast to
    ``dtype`` (floating ones) on CPU, contiguous.  Every rank iterates it to the end."""
    target = float_torch_dtype(dtype, "transfer dtype")
    for name, t in model.state_dict().items():
        v = full(t.detach())
        want = target if v.is_floating_point() else v.dtype
        yield name, v.to(device="cpu", dtype=want).contiguous()


def state_shapes(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of ``model.state_dict()`` without gathering: a sharded entry is its
    ``DTensor``, whose ``shape``, ``dtype`` and ``numel`` are the whole tensor's (enough for
    ``protocol.weights.layout``)."""
    return [(k, v.detach()) for k, v in model.state_dict().items()]


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the gradients of sharded ``params`` to ``max_norm`` (total 2-norm over all ranks:
    a collective); returns the total norm (a plain tensor, the same on every rank)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, error_if_nonfinite=False)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank holds of ``t`` (its shard for a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def local_bytes(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for ``params`` (``parameters``), their gradients (``gradients``:
    one per parameter, as after a backward, whether or not one is held now) and the
    optimizer's state (``optimizer``), counted from the local tensors."""
    from torch.distributed.tensor import DTensor

    def nbytes(t: torch.Tensor) -> int:
        return local_numel(t) * t.element_size()

    params = list(params)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, (torch.Tensor, DTensor))]
    return {"parameters": sum(nbytes(p) for p in params), "gradients": sum(nbytes(p) for p in params),
            "optimizer": sum(nbytes(v) for v in state)}
