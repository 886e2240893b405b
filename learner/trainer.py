"""The learner's model, optimizer and one optimizer step on a batch of trajectory groups.

``Trainer`` holds an HF causal LM (plus a value head for PPO and a frozen reference when
``algo.kl_coef > 0``) on ``learner.device`` through ``accelerate`` (single process here;
DDP when started with ``torchrun`` / ``accelerate launch``), AdamW, a warm-up +
constant/cosine LR schedule and grad-norm clipping.  With ``learner.strategy=fsdp`` on
several ranks, all three modules are sharded with torch FSDP2 instead (``learner.fsdp``:
per decoder layer, then the root; mixed precision from ``learner.fsdp``; no accelerate
wrapper, autocast or loss scaler) and AdamW runs over the shards (``sharded``).  With
``learner.fsdp.meta_init`` (default) the policy and the reference are built on the meta
device and each rank reads only its shards from the safetensors.
``learner.activation_checkpointing`` recomputes each decoder layer in the backward (HF's
gradient checkpointing, non-reentrant), under either strategy.

One ``train_step(groups)`` is ONE optimizer step, in this order:

1. rows: every episode of every group (a ``failed`` group is an error: the service drops
   those); trailing non-trainable tokens are trimmed (kept for PPO: the critic's value
   after the stream bootstraps truncated episodes); rows without trainable tokens skip;
2. advantages (``learner.advantages``): group estimators per group, REINFORCE++ over the
   batch, PPO's GAE per row from the critic's values before the step;
3. micro-batches by token budget: with ``algo.packing=varlen`` (default) the episodes of a
   micro-batch are packed end to end in one row with per-episode attention
   (``learner.packing``: no padding is computed, per-token outputs come back in the padded
   ``[B, T]`` layout); with ``padded``, sorted by length and right-padded
   (``learner.batching``).  For each: forward, log-probs
   (``learner.logprobs`` convention, ``sampling.temperature``), decoupled-PPO loss
   normalised by the whole batch's loss-token count (``learner.loss``), backward;
4. clip grad norm, optimizer step, LR step, ``step += 1`` — unless the gradient norm is
   not finite (a NaN/inf loss or gradient): then the gradients are discarded, the weights,
   optimizer state and LR schedule stay as they were, ``step`` does not advance and the
   metrics say ``train/nonfinite = 1``.  No NaN ever reaches the published weights.

One group cannot cost the others their step.  Before any forward, a group whose rewards are
not finite or too large for float32 statistics, whose group advantages are not finite, or
whose behaviour log-probs (loss tokens) are not finite is dropped (``group_problem``).  In
each micro-batch, before its backward, every row's new log-probs, ``pi_prox``, advantages,
values, reference log-probs and entropies on its loss tokens are checked, and the loss too
(row by row when the micro-batch's is not finite); a row that fails marks its group.  If
any group was marked (on any rank: one all-reduce of the count), the gradients are
discarded and the step runs again, once, without those groups.  ``last_dropped`` maps each
dropped group's index to what was wrong (the service re-issues their tasks and logs them in
the ledger); when every group is dropped, the step is refused as ``train/nonfinite``.  The
whole-step refusal above stays the last resort: a non-finite gradient with no row to blame,
or marked rows again on the second try.  Log-probs off the loss mask are never read (set to
0 when rows are built).

``pi_prox`` is the policy before the step.  With ``algo.prox_forward=extra`` it is computed by
one extra no-grad forward over the batch at the start of the step (needed whenever a
batch gets more than one optimizer update).  Since a step here is exactly one update,
every micro-batch's forward runs on the pre-step weights, so the detached log-probs of
that same forward ARE ``pi_prox``, bit for bit: ``algo.prox_forward=auto`` (default) reuses
them and saves a third of the step's compute.  Both give the same step (tested).

Several ranks (``torchrun`` / ``accelerate launch``; ``learner.ranks``): each rank calls
``train_step`` with its share of the groups (whole groups).  Invariant: **every rank runs
the same sequence of collectives and the same number of forwards and backwards per step**
— DDP all-reduces gradients on the last micro-batch's backward and broadcasts buffers on
every forward, so a rank with one micro-batch fewer hangs the others.  ``train_step``
enforces it: one all-reduce of ``[loss tokens, rows]`` (sum) and one of the micro-batch
count (max) start every step, one of the count of groups marked non-finite (sum) ends its
backward passes; a rank with fewer micro-batches pads its plan with
zero-weight micro-batches (``pad_plan``; a one-token forward whose loss is multiplied by
0, so it adds nothing to the summed gradients), in the proximal pass as in the update,
running the modules a real micro-batch runs there (the critic in both passes, the
reference in the update: under FSDP each forward of a sharded module is an all-gather); a
rank with no trainable row takes part with pads only, and the step is skipped on every
rank alike when no rank has one.  Loss normalisation and ``algo.loss_agg``'s mean
episode length use the global counts, so K ranks on a split batch take the same step as
one process on the whole batch (tested to float tolerance; under FSDP the reduce-scatter
averages over ranks as DDP's all-reduce does, so the normaliser is the same, and every
micro-batch's gradients are reduced into the shards: no unsharded gradient is kept between
micro-batches).  Group estimators need whole groups on a rank; REINFORCE++'s batch
statistics are per rank.  Under DDP ``state_dict_for_publish`` and ``state_writer`` need no
collective (``learner.ranks`` calls them on rank 0 only).  Sharded, they are collectives
that every rank runs: ``state_dict_for_publish`` gathers one tensor at a time
(``fsdp.gathered_state``), ``state_writer`` returns a writer on every rank that saves this
rank's shards (``checkpoint.save_sharded``: torch.distributed.checkpoint), and
``load_state`` loads them on every rank, resharding onto the ranks of the resuming run.

Per-group diagnostics: after a policy step ``last_group_gaps[i]`` holds the token sums of
``|mu - pi_prox|`` and ``exp(pi_prox - mu)`` over group ``i``'s loss tokens
(``learner.poolgap.GroupGap``; the learner aggregates them by actor pool).  They are read
off the same ``[B, T]`` tensors the loss gets, on the padded and the packed path alike, and
change nothing in the loss.  Empty groups (no trainable row) get zero sums; ``algo=sft``
reports none (an empty list).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Container, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from turnscale.learner import advantages as adv_mod
from turnscale.learner import checkpoint as ckpt
from turnscale.learner.batching import accumulation_normaliser, pad_BT, plan_micro_batches
from turnscale.learner.packing import Pack, pack_sequences, plan_packs, use_varlen_attention
from turnscale.learner.logprobs import logprobs_and_entropy_BT, token_logprobs_BT
from turnscale.learner.loss import LossMetrics, behaviour_gap_sums_B, ppo_loss, sft_loss, value_loss
from turnscale.learner.poolgap import GroupGap
from turnscale.protocol.dtypes import float_torch_dtype


@dataclass
class _Row:
    """One episode prepared for training (numpy, unpadded)."""

    ids: np.ndarray
    mask: np.ndarray
    mu: np.ndarray
    reward: float
    truncated: bool
    group: int
    """Index of the row's group in the step's groups."""
    index: int
    """Index of the episode within its group."""
    adv: np.ndarray | None = None
    prox: np.ndarray | None = None
    old_values: np.ndarray | None = None
    bootstrap: float = 0.0


@dataclass
class _Micro:
    """One micro-batch's tensors: the padded ``[B, T]`` layout the losses use, plus the
    packed row the model runs on when ``algo.packing=varlen`` (``pack`` is None when padded)."""

    ids: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor
    mu: torch.Tensor
    pack: Pack | None


def lr_factor(step: int, *, warmup: int, total: int, kind: str) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warm-up over ``warmup``
    steps, then 1 (``constant``) or a cosine decay to 0 at ``total`` (``cosine``)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(max((step - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_accelerator(device: str, dtype: str):
    """An ``accelerate.Accelerator`` for ``device`` (``cpu``, ``cuda[:i]``, ``npu[:i]``) with
    mixed precision for ``dtype`` where the device supports it (fp16 needs cuda/npu)."""
    from accelerate import Accelerator

    kind, _, index = device.partition(":")
    if kind == "npu":
        import torch_npu  # noqa: F401  (lazy: only for Ascend)
    if kind not in ("cpu", "cuda", "npu"):
        raise ValueError(f"learner.device {device!r}: choose cpu, cuda[:i] or npu[:i]")
    if index and kind == "cuda":
        torch.cuda.set_device(int(index))
    elif index and kind == "npu":
        torch.npu.set_device(int(index))  # type: ignore[attr-defined]
    mp = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    if mp == "fp16" and kind == "cpu":
        mp = "no"  # CPU autocast has no fp16; train in fp32
    _reset_accelerate_if_changed(kind == "cpu", mp)
    return Accelerator(cpu=kind == "cpu", mixed_precision=mp)


def _reset_accelerate_if_changed(cpu: bool, mp: str) -> None:
    """accelerate keeps one process-wide state and refuses (or silently ignores) another
    device / precision.  In a single-process run a Trainer with different settings resets
    it (earlier Trainers of this process must not be used afterwards); under a
    multi-process launch the settings come from the launcher and are never reset."""
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return
    state = AcceleratorState()
    if state.num_processes > 1:
        return
    if str(state.mixed_precision) != mp or (state.device.type == "cpu") != cpu:
        AcceleratorState._reset_state(reset_partial_state=True)


class Trainer:
    """See the module docstring.  ``step`` counts completed optimizer steps."""

    def __init__(self, cfg: Any, model_path: str, *, total_steps: int | None = None) -> None:
        from accelerate.utils import set_seed

        self.cfg = cfg
        self.algo = cfg.algo
        self.prox_forward = cfg.algo.prox_forward
        self.temperature = float(cfg.sampling.temperature)
        self.total_steps = int(total_steps if total_steps is not None else cfg.learner.steps)
        self.step = 0
        shard = cfg.learner.strategy == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) > 1
        self.accelerator = make_accelerator(cfg.learner.device, "float32" if shard else cfg.model.dtype)  # FSDP: its own policy
        self.device = self.accelerator.device
        self.sharded = shard and self.accelerator.num_processes > 1
        """FSDP2 (``learner.fsdp``): parameters, gradients and optimizer state sharded over ranks."""
        self._mesh: Any = None
        """The ranks' device mesh (sharded only; made with the first sharded module)."""
        set_seed(cfg.learner.seed)

        self.packing = cfg.algo.packing
        self.tokenizer = _load_tokenizer(model_path)
        self.model = self._load_lm(model_path, self._prepare_policy)
        self.value_head: nn.Module | None = None
        if self.algo.name == "ppo":
            hidden = self.hf_model.config.get_text_config().hidden_size
            head = nn.Linear(hidden, 1)
            nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden + 1))
            nn.init.zeros_(head.bias)
            self.value_head = self._wrap(head)
        self.ref_model = None
        if self.algo.kl_coef > 0:
            self.ref_model = self._load_lm(model_path, self._prepare_reference, evaluation_mode=True)

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.value_head is not None:
            self.params += list(self.value_head.parameters())
        opt = torch.optim.AdamW(self.params, lr=self.algo.lr, betas=tuple(self.algo.betas), weight_decay=self.algo.weight_decay)
        self.optimizer = opt if self.sharded else self.accelerator.prepare_optimizer(opt)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, warmup=self.algo.warmup_steps, total=self.total_steps, kind=self.algo.lr_schedule)
        )
        self.loss_cfg = self.algo.loss_config()
        self.last_group_gaps: list[GroupGap] = []
        """Per group of the last ``train_step``, in batch order (see the module docstring)."""
        self.last_dropped: dict[int, str] = {}
        """Groups of the last ``train_step`` dropped for a non-finite value: index in the
        step's groups -> what was wrong (see the module docstring); none were trained."""

    def _prepare_policy(self, model: nn.Module) -> None:
        model.config.use_cache = False
        if self.packing == "varlen":
            use_varlen_attention(model)
        model.train()
        if self.cfg.learner.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _prepare_reference(self, model: nn.Module) -> None:
        model.config.use_cache = False
        model.requires_grad_(False).eval()
        if self.packing == "varlen":
            use_varlen_attention(model)

    def _load_lm(self, model_path: str, prepare: Callable[[nn.Module], None], *, evaluation_mode: bool = False) -> nn.Module:
        """The HF causal LM of ``model_path`` in float32, ``prepare``d and wrapped (``_wrap``).
        Sharded with ``learner.fsdp.meta_init``: built on the meta device and each rank reads
        only its shards (``fsdp.load_pretrained_sharded``), so no rank holds the whole model."""
        if self.sharded and self.cfg.learner.fsdp.meta_init:
            from turnscale.learner import fsdp

            return fsdp.load_pretrained_sharded(model_path, self.device, prepare=prepare, shard_fn=self._shard)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        prepare(model)
        return self._wrap(model, evaluation_mode=evaluation_mode)

    def _wrap(self, module: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        """``module`` on the device, sharded (``learner.fsdp``: per decoder layer, then the
        root) or replicated by accelerate (DDP when there are several ranks)."""
        if not self.sharded:
            return self.accelerator.prepare_model(module, evaluation_mode=evaluation_mode)
        return self._shard(module.to(self.device))

    def _shard(self, module: nn.Module) -> nn.Module:
        """``module`` sharded over the ranks (``learner.fsdp``), in place."""
        from turnscale.learner import fsdp

        lc = self.cfg.learner
        if self._mesh is None:
            self._mesh = fsdp.device_mesh(self.device)
        return fsdp.shard(module, fsdp.mixed_precision(lc.fsdp, lc.device), mesh=self._mesh,
                          offload_policy=fsdp.offload(lc.fsdp, lc.device))

    # ------------------------------------------------------------------ public API

    @property
    def hf_model(self) -> Any:
        """The unwrapped HF model."""
        return self.accelerator.unwrap_model(self.model)

    def train_step(self, groups: Sequence[Any]) -> dict[str, float]:
        """One optimizer step on ``groups`` (``protocol.messages.TrajectoryGroup``); returns
        metrics namespaced ``loss/...`` and ``perf/...``.  ``algo=sft`` trains masked NLL on
        every episode of the groups instead."""
        for g in groups:
            if g.failed:
                raise ValueError(f"group of lease {g.lease_id!r} is marked failed ({g.error}); failed groups are never trained on")
        self.last_group_gaps = []
        self.last_dropped = {}
        if self.algo.name == "sft":
            return self.sft_step([ep for g in groups for ep in g.episodes])
        t0 = time.perf_counter()
        for gi, g in enumerate(groups):
            problem = group_problem(g, self.algo.name)
            if problem:
                self.last_dropped[gi] = problem
        out = self._policy_step(groups, t0)
        if out is None:  # groups marked in the forward: once more without them
            out = self._policy_step(groups, t0)
        if out is None:  # marked again: the last resort, as for a non-finite gradient
            out = {"train/nonfinite": 1.0, "loss/lr": float(self.scheduler.get_last_lr()[0])}
        return out

    def _policy_step(self, groups: Sequence[Any], t0: float) -> dict[str, float] | None:
        """One try at the step on the groups not in ``last_dropped``: its metrics, or None
        when a row's values were not finite (its group added to ``last_dropped``, every
        rank's gradients discarded, nothing stepped)."""
        self.last_group_gaps = [GroupGap()] * len(groups)
        dropped = self.last_dropped
        rows, skipped = self._rows(groups, trim=self.algo.name != "ppo", skip=dropped)
        degenerate = adv_mod.count_degenerate([np.array([ep.reward for ep in g.episodes])
                                               for gi, g in enumerate(groups) if gi not in dropped])
        tokens, n_rows = self._global_counts(rows)
        if not n_rows:
            out = self._finish_empty(t0, skipped, degenerate)
            if dropped and len(dropped) == len(groups):
                out["train/nonfinite"] = 1.0  # every group dropped: refused as non-finite
            return out
        self._advantages(groups, rows, mean_len=tokens / n_rows)
        plan = self._plan(rows)
        num_tokens = accumulation_normaliser(int(tokens), self.accelerator.num_processes)
        if self.prox_forward == "extra":
            self._proximal_pass(rows, plan)

        metrics = LossMetrics()
        value_sum = 0.0
        marked: dict[int, str] = {}
        for i, mb in enumerate(plan):
            sync = i == len(plan) - 1
            with self._no_sync(sync):
                if not mb:
                    self._pad_micro_batch()
                    continue
                m, v, bad = self._policy_micro_batch([rows[j] for j in mb], num_tokens)
            marked.update(bad)
            metrics = metrics.merge(m)
            value_sum += v
        if self._global_sum(len(marked)):
            self.optimizer.zero_grad(set_to_none=True)
            dropped.update(marked)
            return None
        out = self._optimizer_step()
        out.update({f"loss/{k}": v for k, v in metrics.means().items() if k != "tokens"})
        if self.value_head is not None:
            out["loss/value"] = value_sum
        out["loss/degenerate_groups"] = float(degenerate)
        out.update(self._perf(t0, rows, plan, skipped))
        return out

    def sft_step(self, episodes: Sequence[Any]) -> dict[str, float]:
        """One optimizer step of masked NLL on the episodes' loss-mask (assistant) tokens."""
        t0 = time.perf_counter()
        rows, skipped = self._rows_from_episodes(episodes, trim=True)
        tokens, n_rows = self._global_counts(rows)
        if not n_rows:
            return self._finish_empty(t0, skipped, 0)
        plan = self._plan(rows)
        num_tokens = accumulation_normaliser(int(tokens), self.accelerator.num_processes)
        nll = 0.0
        for i, mb in enumerate(plan):
            sync = i == len(plan) - 1
            with self._no_sync(sync):
                if not mb:
                    self._pad_micro_batch()
                    continue
                micro = self._collate([rows[j] for j in mb])
                loss = sft_loss(logprobs_BT=self._token_logprobs(self.model, micro), mask_BT=micro.mask, num_tokens=num_tokens)
                self._backward(loss)
                nll += float(loss.detach())
        out = self._optimizer_step()
        out["loss/sft_nll"] = nll
        out.update(self._perf(t0, rows, plan, skipped))
        return out

    def state_dict_for_publish(self, dtype: str, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Full model state dict with HF parameter names, floating tensors cast to ``dtype``,
        on CPU, contiguous.  Gathers under FSDP (``accelerator.get_state_dict``; every rank
        must call it).  ``copy=True`` guarantees the tensors do not alias live parameters;
        ``copy=False`` may alias them (publish at once, before the next step)."""
        if self.sharded:
            from turnscale.learner import fsdp

            return dict(fsdp.gathered_state(self.model, dtype))
        target = float_torch_dtype(dtype, "transfer dtype")
        sd = self.accelerator.get_state_dict(self.model)
        out = {}
        for k, v in sd.items():
            v = v.detach()
            want = target if v.is_floating_point() else v.dtype
            out[k] = v.to(device="cpu", dtype=want, copy=copy).contiguous()
        return out

    def state_writer(self) -> Callable[[str], None] | None:
        """The trainer's part of a checkpoint: model, value head, optimizer, LR schedule, RNG
        and its optimizer-step counter ``step`` (no run state: ``learner.checkpoint.save``
        writes that beside it).  Gathers the full model, so call it on every rank; returns
        ``write(dir)`` on the main rank, None on the others.  The writer references the live
        weights and optimizer state (no copies): run it before the next step.  Sharded
        (``learner.fsdp``): ``write(dir)`` on every rank, which every rank must run
        (``ckpt.save_sharded``)."""
        if self.sharded:
            return self._write_sharded
        model_state = self.accelerator.get_state_dict(self.model)
        modules = {}
        if self.value_head is not None:
            modules["value_head"] = self.accelerator.get_state_dict(self.value_head)
        if not self.accelerator.is_main_process:
            return None
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "rng": ckpt.capture_rng(),
                 "step": self.step}
        model, tokenizer = self.hf_model, self.tokenizer
        return lambda path: ckpt.write_trainer_part(path, model=model, model_state=model_state, tokenizer=tokenizer,
                                                    modules=modules, trainer_state=state)

    def load_state(self, path: str) -> int:
        """Restore model, value head, optimizer, LR schedule, RNG and ``step`` from the complete
        checkpoint at ``path`` (``CheckpointError`` for an incomplete one); returns ``step``.
        The run's state in the same folder is the checkpointer's to read.  A sharded checkpoint
        (``ckpt.save_sharded``) loads on every rank at once (a collective)."""
        if ckpt.is_sharded(path):
            return self._load_sharded(path)
        state = ckpt.load_trainer_state(path)
        self._load_model_state(ckpt.load_model_state(path))
        modules = ckpt.load_modules(path)
        if self.value_head is not None:
            if "value_head" not in modules:
                raise ckpt.CheckpointError(f"{path} has no value head; it was not written by a PPO run")
            self.accelerator.unwrap_model(self.value_head).load_state_dict(modules["value_head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.restore_rng(state["rng"])
        self.step = int(state["step"])
        return self.step

    def _checkpoint_modules(self) -> dict[str, nn.Module]:
        """The trained modules of a sharded checkpoint, by name (``policy``, ``value_head``)."""
        mods = {"policy": self.model}
        if self.value_head is not None:
            mods["value_head"] = self.value_head
        return mods

    def _write_sharded(self, path: str) -> None:
        ckpt.save_sharded(path, modules=self._checkpoint_modules(), optimizer=self.optimizer,
                          trainer_state={"scheduler": self.scheduler.state_dict(), "step": self.step},
                          model=self.hf_model, tokenizer=self.tokenizer)

    def _load_sharded(self, path: str) -> int:
        """A sharded checkpoint into this trainer, sharded or not: DCP reshards it onto the
        ranks (or the one process) of this run."""
        state = ckpt.load_sharded(path, modules=self._checkpoint_modules(), optimizer=self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        return self.step

    # ------------------------------------------------------------------ internals

    def _load_model_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        model = self.hf_model
        missing, unexpected = model.load_state_dict(dict(sd), strict=False)
        tied = set()
        out_emb = model.get_output_embeddings()
        if out_emb is not None and out_emb.weight is model.get_input_embeddings().weight:
            tied = {k for k, p in model.named_parameters(remove_duplicate=False) if p is out_emb.weight}
        bad = [k for k in missing if k not in tied]
        if bad or unexpected:
            raise ckpt.CheckpointError(f"checkpoint does not fit the model: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")

    def _rows(self, groups: Sequence[Any], *, trim: bool, skip: Container[int] = ()) -> tuple[list[_Row], int]:
        """Rows of every group whose index is not in ``skip``."""
        rows: list[_Row] = []
        skipped = 0
        for gi, g in enumerate(groups):
            if gi in skip:
                continue
            r, s = self._rows_from_episodes(g.episodes, trim=trim, group=gi)
            rows += r
            skipped += s
        return rows, skipped

    def _rows_from_episodes(self, episodes: Sequence[Any], *, trim: bool, group: int = 0) -> tuple[list[_Row], int]:
        rows, skipped = [], 0
        for k, ep in enumerate(episodes):
            mask = np.asarray(ep.loss_mask, dtype=np.float32)
            if not mask.any():
                skipped += 1
                continue
            end = int(np.nonzero(mask)[0][-1]) + 1 if trim else len(mask)
            mu = np.asarray(ep.logprobs[:end], dtype=np.float32)
            rows.append(_Row(
                ids=np.asarray(ep.token_ids[:end], dtype=np.int64), mask=mask[:end],
                mu=np.where(mask[:end] > 0, mu, np.float32(0.0)), reward=float(ep.reward),  # off the mask: never read
                truncated=ep.finish_reason != "done", group=group, index=k,
            ))
        return rows, skipped

    def _advantages(self, groups: Sequence[Any], rows: list[_Row], *, mean_len: float) -> None:
        """Fill ``row.adv`` ([T] float64) for every estimator but PPO (done per micro-batch);
        ``mean_len``: loss tokens per trainable episode over the whole step (all ranks)."""
        name = self.algo.name
        if name == "ppo" or not rows:
            return
        if name in adv_mod.GROUP_ESTIMATORS:
            adv_G = {gi: adv_mod.group_advantages_G(name, np.array([ep.reward for ep in groups[gi].episodes]))
                     for gi in {r.group for r in rows}}
            for r in rows:
                r.adv = adv_G[r.group][r.index] * (r.mask > 0)
            self._aggregate(rows, mean_len)
            return
        if name == "reinforce_pp":
            mask_BT = pad_BT([r.mask for r in rows]).numpy()
            rewards_BT = adv_mod.outcome_rewards_BT(np.array([r.reward for r in rows]), mask_BT)
            keep_B = np.array([not adv_mod.is_degenerate_G(np.array([ep.reward for ep in groups[r.group].episodes])) for r in rows])
            adv_BT = adv_mod.reinforce_pp_BT(rewards_BT, mask_BT, self.algo.gamma, keep_B=keep_B)
            for b, r in enumerate(rows):
                r.adv = adv_BT[b, : len(r.ids)]
            self._aggregate(rows, mean_len)
            return
        raise ValueError(f"algo {name!r} has no advantage estimator")

    def _aggregate(self, rows: list[_Row], mean_len: float) -> None:
        """``algo.loss_agg=seq_mean_token_mean``: scale each episode's advantages by
        ``mean_len / len_i`` (loss tokens), so the token-mean loss over the batch equals the
        mean over episodes of each episode's token-mean -- every episode weighs the same
        whatever its length.  Multi-turn failures are long; under a plain token mean they
        outweigh the short successes and push down the format tokens both share.  The mean
        length ``mean_len`` is the whole step's (all ranks), so a split batch weighs its
        episodes as the whole batch does."""
        if self.algo.loss_agg != "seq_mean_token_mean" or not rows:
            return
        for r in rows:
            r.adv = r.adv * (mean_len / float(r.mask.sum()))

    def _global_counts(self, rows: Sequence[_Row]) -> tuple[float, int]:
        """(loss tokens, trainable rows) of the step over all ranks: the step's first
        collective (module docstring, Several ranks)."""
        tokens, n = sum(float(r.mask.sum()) for r in rows), len(rows)
        if self.accelerator.num_processes > 1:
            t = torch.tensor([tokens, float(n)], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t)
            tokens, n = float(t[0]), int(t[1])
        return tokens, n

    def _global_sum(self, x: float) -> float:
        """``x`` summed over all ranks (a collective when there are several)."""
        if self.accelerator.num_processes > 1:
            t = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
            torch.distributed.all_reduce(t)
            return float(t[0])
        return float(x)

    def _plan(self, rows: Sequence[_Row]) -> list[list[int]]:
        """Micro-batches of row indices, padded with empty ones (zero-weight micro-batches)
        to the largest count of any rank: the step's second collective."""
        lengths = [len(r.ids) for r in rows]
        if not rows:
            plan = []
        elif self.packing == "varlen":
            plan = plan_packs(lengths, self.algo.micro_batch_tokens)
        else:
            plan = plan_micro_batches(lengths, self.algo.micro_batch_tokens)
        if self.accelerator.num_processes > 1:
            t = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            plan = pad_plan(plan, int(t[0]))
        return plan

    def _pad_micro_batch(self) -> None:
        """A zero-weight micro-batch: a one-token forward through the policy (and value head)
        whose loss is multiplied by 0, then backward (no-grad: the forward only).  It keeps
        the forward/backward count equal on every rank and adds nothing to any gradient."""
        micro = self._collate([_Row(ids=np.zeros(1, dtype=np.int64), mask=np.zeros(1, dtype=np.float32),
                                    mu=np.zeros(1, dtype=np.float32), reward=0.0, truncated=False, group=0, index=0)])
        want_hidden = self.value_head is not None
        out, _, _ = self._run(self.model, micro, output_hidden_states=want_hidden)
        if not torch.is_grad_enabled():  # the proximal pass: the forwards a real micro-batch runs there
            if want_hidden:
                self.value_head(out.hidden_states[-1].float())
            return
        loss = out.logits.float().sum() * 0.0
        if want_hidden:
            loss = loss + self.value_head(out.hidden_states[-1].float()).sum() * 0.0
        if self.ref_model is not None:
            with torch.no_grad():
                self._run(self.ref_model, micro)
        self._backward(loss)

    def _no_sync(self, sync: bool) -> Any:
        """Gradient accumulation across micro-batches: DDP all-reduces only on the last one
        (``sync``); FSDP reduce-scatters every micro-batch's gradients into the shards (no
        unsharded gradient is kept between micro-batches)."""
        if sync or self.sharded:
            return nullcontext()
        return self.accelerator.no_sync(self.model)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.sharded:
            loss.backward()  # mixed precision is FSDP's (learner.fsdp); no loss scaling
        else:
            self.accelerator.backward(loss)

    def _collate(self, rows: Sequence[_Row]) -> _Micro:
        d = self.device
        ids = pad_BT([r.ids for r in rows]).to(d)
        attn = pad_BT([np.ones(len(r.ids), dtype=np.int64) for r in rows]).to(d)
        mask = pad_BT([r.mask for r in rows]).to(d)
        mu = pad_BT([r.mu for r in rows]).to(d)
        pack = pack_sequences([r.ids for r in rows], d) if self.packing == "varlen" else None
        return _Micro(ids, attn, mask, mu, pack)

    def _run(self, model: Any, micro: _Micro, **kw: Any) -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
        """``model``'s forward on the micro-batch: (output, the ids it saw, a function taking
        its per-token tensors to the padded ``[B, T]`` layout)."""
        if micro.pack is None:
            return model(input_ids=micro.ids, attention_mask=micro.attn, **kw), micro.ids, lambda x, shifted=False: x
        return model(**micro.pack.model_inputs(), **kw), micro.pack.input_ids_1N, micro.pack.unpack_BT

    def _token_logprobs(self, model: Any, micro: _Micro) -> torch.Tensor:
        out, ids, unpack = self._run(model, micro)
        return unpack(token_logprobs_BT(out.logits, ids, self.temperature), shifted=True)

    def _forward(self, rows: Sequence[_Row], micro: _Micro, *, grad_entropy: bool):
        """Forward through the policy: (logprobs_BT, entropy_BT on mask tokens, values_BT | None, bootstrap_B | None)."""
        want_hidden = self.value_head is not None
        out, ids, unpack = self._run(self.model, micro, output_hidden_states=want_hidden)
        ent_mask = micro.mask if micro.pack is None else micro.pack.pack_1N([r.mask for r in rows])
        logp, ent = logprobs_and_entropy_BT(out.logits, ids, self.temperature, entropy_mask_BT=ent_mask, entropy_grad=grad_entropy)
        logp, ent = unpack(logp, shifted=True), unpack(ent, shifted=True)
        values = boot = None
        if want_hidden:
            v_all = unpack(self.value_head(out.hidden_states[-1].float()).squeeze(-1))
            values = torch.nn.functional.pad(v_all[:, :-1], (1, 0), value=0.0)
            lengths = torch.tensor([len(r.ids) for r in rows], device=v_all.device)
            boot = v_all[torch.arange(len(rows), device=v_all.device), lengths - 1]
        return logp, ent, values, boot

    @torch.no_grad()
    def _proximal_pass(self, rows: list[_Row], plan: list[list[int]]) -> None:
        """The extra no-grad forward: pi_prox (and the critic's values) before the step."""
        for mb in plan:
            if not mb:
                self._pad_micro_batch()
                continue
            sub = [rows[j] for j in mb]
            logp, _, values, boot = self._forward(sub, self._collate(sub), grad_entropy=False)
            for b, r in enumerate(sub):
                n = len(r.ids)
                r.prox = logp[b, :n].float().cpu().numpy()
                if values is not None:
                    r.old_values = values[b, :n].float().cpu().numpy()
                    r.bootstrap = float(boot[b]) if r.truncated else 0.0

    def _policy_micro_batch(self, rows: list[_Row], num_tokens: float) -> tuple[LossMetrics, float, dict[int, str]]:
        """Forward, loss and backward of one micro-batch: (loss metrics, value loss, the groups
        of rows with a non-finite value on their loss tokens -> what; checked before backward)."""
        micro = self._collate(rows)
        mask, mu = micro.mask, micro.mu
        logp, ent, values, boot = self._forward(rows, micro, grad_entropy=self.loss_cfg.entropy_coef != 0)
        if self.prox_forward == "extra":
            prox = pad_BT([r.prox for r in rows]).to(self.device)
        else:
            prox = logp.detach()
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._token_logprobs(self.ref_model, micro)
        vloss = None
        if values is not None:
            if self.prox_forward == "extra":
                old_v = pad_BT([r.old_values for r in rows]).numpy()
                boot_B = np.array([r.bootstrap for r in rows])
            else:
                old_v = values.detach().float().cpu().numpy()
                boot_B = np.where([r.truncated for r in rows], boot.detach().float().cpu().numpy(), 0.0)
            mask_np = mask.cpu().numpy()
            rewards_BT = adv_mod.outcome_rewards_BT(np.array([r.reward for r in rows]), mask_np)
            adv_np, ret_np = adv_mod.gae_BT(rewards_BT, old_v, mask_np, self.algo.gamma, self.algo.lam, boot_B)
            adv = torch.from_numpy(adv_np).to(self.device, torch.float32)
            vloss = value_loss(values_BT=values, returns_BT=torch.from_numpy(ret_np).to(self.device), mask_BT=mask, num_tokens=num_tokens)
        else:
            adv = pad_BT([r.adv for r in rows]).to(self.device, torch.float32)
        inputs = dict(logprobs_BT=logp, prox_logprobs_BT=prox, behaviour_logprobs_BT=mu, advantages_BT=adv, mask_BT=mask,
                      num_tokens=num_tokens, cfg=self.loss_cfg, ref_logprobs_BT=ref, entropy_BT=ent)
        loss, metrics = ppo_loss(**inputs)
        self._record_gaps(rows, prox, mu, mask)
        v = 0.0
        if vloss is not None:
            loss = loss + self.algo.value_coef * vloss
            v = float(vloss.detach())
        bad_B = nonfinite_rows_B(mask, {"new log-probs": logp, "pi_prox": prox, "advantages": adv, "values": values,
                                        "reference log-probs": ref, "entropy": ent})
        if not bad_B and not torch.isfinite(loss.detach()):
            bad_B = _nonfinite_loss_rows_B(inputs, len(rows))
        self._backward(loss)  # also when marked: every rank runs the same backwards
        return metrics, v, {rows[b].group: what for b, what in bad_B.items()}

    def _record_gaps(self, rows: Sequence[_Row], prox: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> None:
        """Add each row's behaviour-gap sums to its group's ``last_group_gaps`` entry."""
        sums = behaviour_gap_sums_B(prox_logprobs_BT=prox, behaviour_logprobs_BT=mu, mask_BT=mask)
        tokens_B, gap_B, weight_B = (t.tolist() for t in sums)
        for b, r in enumerate(rows):
            self.last_group_gaps[r.group] += GroupGap(tokens_B[b], gap_B[b], weight_B[b])

    def _optimizer_step(self) -> dict[str, float]:
        lr = self.scheduler.get_last_lr()[0]
        max_norm = self.algo.grad_clip if self.algo.grad_clip > 0 else float("inf")
        if self.sharded:
            from turnscale.learner import fsdp

            grad_norm = fsdp.clip_grad_norm_(self.params, max_norm)
        else:
            grad_norm = self.accelerator.clip_grad_norm_(self.params, max_norm)
        if not math.isfinite(float(grad_norm)):  # every rank sees the same (synchronised) norm
            self.optimizer.zero_grad(set_to_none=True)
            return {"train/nonfinite": 1.0, "loss/lr": float(lr)}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss/grad_norm": float(grad_norm), "loss/lr": float(lr)}

    def _padded_tokens(self, lengths: Sequence[int]) -> int:
        """Token positions the forward computes for one micro-batch of these lengths."""
        return sum(lengths) if self.packing == "varlen" else len(lengths) * max(lengths)

    def _finish_empty(self, t0: float, skipped: int, degenerate: int) -> dict[str, float]:
        """Nothing trainable: no optimizer step, so ``step`` does not advance."""
        return {"loss/degenerate_groups": float(degenerate), "perf/skipped_episodes": float(skipped),
                "perf/tokens": 0.0, "perf/step_s": time.perf_counter() - t0}

    def _perf(self, t0: float, rows: list[_Row], plan: list[list[int]], skipped: int) -> dict[str, float]:
        dt = time.perf_counter() - t0
        tokens = float(sum(len(r.ids) for r in rows))
        padded = float(sum(self._padded_tokens([len(rows[j].ids) for j in mb]) for mb in plan if mb))
        return {
            "perf/step_s": dt,
            "perf/tokens": tokens,
            "perf/loss_tokens": float(sum(r.mask.sum() for r in rows)),
            "perf/tokens_per_s": tokens / dt if dt > 0 else 0.0,
            "perf/episodes": float(len(rows)),
            "perf/skipped_episodes": float(skipped),
            "perf/micro_batches": float(len(plan)),
            "perf/padded_tokens": padded,
            "perf/padding_ratio": padded / tokens if tokens else 0.0,
        }


FLOAT32_SQRT_MAX = float(np.sqrt(np.finfo(np.float32).max))
"""About 1.8e19: a reward above it has no float32 square (group and batch statistics)."""


def group_problem(group: Any, estimator: str) -> str:
    """Why ``group`` cannot enter a step's arithmetic, or "" (pure; before any forward):
    rewards not finite or beyond ``FLOAT32_SQRT_MAX``, group advantages (``estimator``'s, for
    group estimators) not finite in float32, or a loss token's behaviour log-prob not finite."""
    rewards = np.array([float(ep.reward) for ep in group.episodes], dtype=np.float64)
    if not np.isfinite(rewards).all() or (np.abs(rewards) > FLOAT32_SQRT_MAX).any():
        bad = rewards[~np.isfinite(rewards) | (np.abs(rewards) > FLOAT32_SQRT_MAX)][0]
        return f"rewards ({bad:.3g}: beyond float32 statistics)"
    if estimator in adv_mod.GROUP_ESTIMATORS:
        with np.errstate(all="ignore"):
            adv = adv_mod.group_advantages_G(estimator, rewards).astype(np.float32)
        if not np.isfinite(adv).all():
            return "advantages"
    for k, ep in enumerate(group.episodes):
        mask = np.asarray(ep.loss_mask) > 0
        if not np.isfinite(np.asarray(ep.logprobs, dtype=np.float64)[mask]).all():
            return f"episodes[{k}] behaviour log-probs"
    return ""


def nonfinite_rows_B(mask_BT: torch.Tensor, tensors_BT: Mapping[str, torch.Tensor | None]) -> dict[int, str]:
    """Rows with a non-finite value of any of ``tensors_BT`` (None: absent) on their loss
    tokens (``mask_BT > 0``) -> the name of the first such tensor."""
    keep = mask_BT > 0
    named = [(name, t.detach()) for name, t in tensors_BT.items() if t is not None]
    if not named:
        return {}
    ok_KB = torch.stack([torch.where(keep, torch.isfinite(t), torch.ones_like(keep)).all(-1) for _, t in named])
    out: dict[int, str] = {}
    for (name, _), ok_B in zip(named, ok_KB.tolist()):  # one device-to-host copy per micro-batch
        for b, ok in enumerate(ok_B):
            if not ok:
                out.setdefault(b, name)
    return out


@torch.no_grad()
def _nonfinite_loss_rows_B(inputs: Mapping[str, Any], n_rows: int) -> dict[int, str]:
    """The micro-batch's loss is not finite although every input is: the rows whose own loss
    (``ppo_loss`` on that row alone) is not finite."""
    out = {}
    for b in range(n_rows):
        one = {k: (v[b:b + 1] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        loss, _ = ppo_loss(**one)
        if not torch.isfinite(loss):
            out[b] = "loss"
    return out


def pad_plan(plan: list[list[int]], count: int) -> list[list[int]]:
    """``plan`` followed by empty micro-batches (zero-weight: ``Trainer._pad_micro_batch``)
    up to ``count`` entries, so every rank runs ``count`` forwards and backwards."""
    if count < len(plan):
        raise ValueError(f"cannot pad a plan of {len(plan)} micro-batches to {count}")
    return plan + [[] for _ in range(count - len(plan))]


def _load_tokenizer(model_path: str) -> Any:
    """The model folder's tokenizer, or None when it has none (tests build bare models)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError):
        return None
