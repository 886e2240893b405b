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

Loading (``learner.fsdp.meta_init``, default): ``load_pretrained_sharded`` builds the model on
the meta device, shards it, and each rank reads only its rows of each tensor from the
folder's safetensors, so no rank ever holds the whole model.  ``learner.fsdp.cpu_offload``
keeps the shards, gradients and optimizer state in host memory (``offload``).

Memory per rank (parameters, gradients, optimizer state): ``local_bytes`` counts it from the
local tensors; ``planned_state_bytes`` predicts it from ``config.json`` alone (equal on the
tested models).
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


def load_pretrained_sharded(model_path: str, device: torch.device, *, prepare: Any, shard_fn: Any) -> nn.Module:
    """The HF causal LM of ``model_path``, sharded, without any rank holding the whole model:
    built on the meta device (buffers such as rotary frequencies computed for real),
    ``prepare(model)`` (attention, caching, checkpointing: settings that must precede
    sharding), ``shard_fn(model)``, then each rank allocates only its shards on ``device`` and
    reads only its rows of each tensor from the folder's safetensors (``load_local_shards``).
    Collective-free: every rank does it on its own."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # from_config leaves meta weights untied (transformers 5)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    prepare(model)
    shard_fn(model)
    model.to_empty(device=device)
    for name, b in buffers.items():  # to_empty left them uninitialised
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = b.to(device)
    load_local_shards(model, model_path)
    return model


def safetensors_index(model_path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file of ``model_path`` that holds it."""
    import json
    import os

    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(model_path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(model_path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{model_path} holds neither model.safetensors nor model.safetensors.index.json "
                                f"(learner.strategy=fsdp loads shards from safetensors)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_local_shards(model: nn.Module, model_path: str) -> None:
    """Copy this rank's rows of every parameter of the sharded ``model`` (and every persistent
    buffer, whole) from ``model_path``'s safetensors, reading only those rows (safetensors
    slices).  A tied weight stored once is loaded once; a tensor the files lack is an error."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    where = safetensors_index(model_path)
    loaded: set[int] = set()
    handles: dict[str, Any] = {}
    missing = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in loaded:
            continue  # a tied weight under its second name
        if name not in where:
            missing.append(name)
            continue
        f = handles.get(where[name]) or handles.setdefault(where[name], safe_open(where[name], framework="pt"))
        if isinstance(t, DTensor):
            local = t.to_local()
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if local.numel():
                start = offset[0] if len(shape) else 0
                data = f.get_slice(name)[start:start + shape[0]] if len(shape) else f.get_tensor(name)
                local.copy_(data.reshape(local.shape).to(local.dtype))
        else:
            t.copy_(f.get_tensor(name).to(t.dtype))
        loaded.add(id(t))
    tied_later = [n for n in missing if id(model.state_dict(keep_vars=True)[n]) in loaded]
    missing = [n for n in missing if n not in tied_later]
    if missing:
        raise KeyError(f"{model_path}: no tensor for {missing[:5]} in its safetensors (a checkpoint of another "
                       f"architecture, or names transformers converts on load); set learner.fsdp.meta_init=false")


def planned_state_bytes(model_path: str, world: int, *, strategy: str = "fsdp", value_head: bool = False) -> dict[str, int]:
    """Bytes the most loaded rank holds for the policy's training state, predicted from the
    model folder's ``config.json`` alone (the model is built on the meta device to count its
    tensors; no weights are read): float32 ``parameters``, ``gradients`` (one per parameter)
    and AdamW's two float32 moments plus a step counter per parameter (``optimizer``).
    ``fsdp`` shards every tensor by rows over ``world`` ranks (``torch.chunk``: the first
    ranks get ``ceil(rows / world)``); ``ddp`` holds everything on every rank.  Tied weights
    count once.  Not included: activations, the gathered (unsharded) layer in flight, the
    reference model, the publication buffer: the memory plan's other terms."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    shapes = [tuple(p.shape) for p in model.parameters()]  # parameters() yields a tied weight once
    if value_head:
        hidden = config.get_text_config().hidden_size
        shapes += [(1, hidden), (1,)]
    ways = world if strategy == "fsdp" else 1

    def held(shape: tuple[int, ...]) -> int:
        if not shape:
            return 1
        rows = -(-shape[0] // ways)
        rest = 1
        for d in shape[1:]:
            rest *= d
        return rows * rest

    n = sum(held(s) for s in shapes)
    return {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * len(shapes)}
