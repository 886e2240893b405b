"""``turnscale bench learner``: trained tokens/s of ``Trainer.train_step`` against a plain
hand-written loop over the same tokens.

Both train a fresh copy of the same tiny model (built locally, random init) on the same
synthetic multi-turn groups.  The baseline is the least one can do per step: the whole
batch pre-padded into tensors (outside the timing), forward, float32 log-softmax of the
sampled tokens, advantage-weighted masked mean, backward, grad-norm clip, AdamW step.
The learner's step additionally collates, computes advantages, the behaviour weights,
clipping, metrics and entropy.  Steps alternate between the variants, in a rotating
order, so machine noise hits all; the figure is the fastest step of each (noise on a
shared machine only ever adds time).  ``learner_step_extra_prox`` reports the cost of the
optional extra proximal forward (``prox_forward="extra"``).

Packing (``learner_packed_vs_padded``): the learner's step with ``algo.packing=varlen``
(episodes packed end to end, per-episode attention) against the same step with
``padded`` (sorted by length, right-padded), on groups of uneven episodes (1 to
``--learner-max-turns`` turns each, as multi-turn runs produce) at the default
micro-batch budget; trained (real) tokens/s, same alternating fastest-step method.
``learner_padded_tokens_per_real`` is the learner's own ``perf/padding_ratio`` metric
(positions the forward computes per real token) of the packed step, target <= 1.05;
``..._padded`` reports the padded step's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from turnscale.benchmarks.common import Result, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--learner-groups", type=int, default=2, help="groups per step (default 2)")
    parser.add_argument("--learner-group-size", type=int, default=8, help="episodes per group (default 8)")
    parser.add_argument("--learner-steps", type=int, default=8, help="timed steps per variant (default 8)")
    parser.add_argument("--learner-hidden", type=int, default=128, help="tiny model hidden size (default 128)")
    parser.add_argument("--learner-layers", type=int, default=2, help="tiny model layers (default 2)")
    parser.add_argument("--learner-vocab", type=int, default=2048, help="tiny model vocabulary (default 2048)")
    parser.add_argument("--learner-max-turns", type=int, default=8,
                        help="packing figures: episodes play 1..N turns (default 8)")


def _baseline(model_path: str, groups, lr: float):
    """A plain forward/backward/AdamW step over the groups' tokens; returns step()."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from turnscale.learner.advantages import grpo_G

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    eps = [ep for g in groups for ep in g.episodes]
    adv_ep = np.concatenate([grpo_G(np.array([e.reward for e in g.episodes])) for g in groups])
    T = max(len(e.token_ids) for e in eps)
    ids = torch.zeros(len(eps), T, dtype=torch.long)
    attn = torch.zeros(len(eps), T, dtype=torch.long)
    mask = torch.zeros(len(eps), T)
    for b, e in enumerate(eps):
        n = len(e.token_ids)
        ids[b, :n] = torch.from_numpy(e.token_ids.astype(np.int64))
        attn[b, :n] = 1
        mask[b, :n] = torch.from_numpy(e.loss_mask.astype(np.float32))
    adv = torch.from_numpy(adv_ep).float()[:, None].expand(-1, T - 1)
    m = mask[:, 1:]

    def step() -> None:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(adv * logp * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run(args: argparse.Namespace) -> list[Result]:
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from turnscale.conf.schema import Config
    from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
    from turnscale.learner.trainer import Trainer

    g_n = getattr(args, "learner_groups", 2)
    g_size = getattr(args, "learner_group_size", 8)
    steps = getattr(args, "learner_steps", 8)
    vocab = getattr(args, "learner_vocab", 2048)
    with tempfile.TemporaryDirectory(prefix="turnscale-bench-learner-") as tmp:
        path = build_tiny_model(os.path.join(tmp, "model"), hidden=getattr(args, "learner_hidden", 128),
                                layers=getattr(args, "learner_layers", 2), heads=4, kv_heads=2,
                                intermediate=3 * getattr(args, "learner_hidden", 128), vocab=vocab)
        groups = synthetic_groups(g_n, g_size, vocab=vocab, prompt_len=64, turns=3, tokens_per_turn=32, obs_len=24, seed=0)
        tokens = float(sum(len(ep.token_ids) for g in groups for ep in g.episodes))
        cfg = Config()
        cfg.algo.lr = 1e-4
        cfg.algo.micro_batch_tokens = 1 << 20  # the whole batch in one micro-batch, as the baseline
        variants = {
            "auto": Trainer(cfg, path).train_step,
            "extra": Trainer(_with_prox(cfg, "extra"), path).train_step,
        }
        base = _baseline(path, groups, cfg.algo.lr)
        times: dict[str, list[float]] = {"auto": [], "extra": [], "base": []}
        order = [("base", base), ("auto", variants["auto"]), ("extra", variants["extra"])]
        for i in range(steps + 1):  # step 0 warms up every variant
            for name, fn in order[i % 3:] + order[:i % 3]:
                t0 = time.perf_counter()
                fn() if name == "base" else fn(groups)
                if i:
                    times[name].append(time.perf_counter() - t0)
        packing = _packing(path, cfg, synthetic_groups(g_n, g_size, vocab=vocab, prompt_len=64, tokens_per_turn=32, obs_len=24,
                                                       seed=1, max_turns=getattr(args, "learner_max_turns", 8)), steps)
    if os.environ.get("TURNSCALE_BENCH_DEBUG"):
        print({k: [round(x, 3) for x in v] for k, v in times.items()})
    tps = {k: tokens / min(v) for k, v in times.items()}
    desc = f"plain fwd/bwd/AdamW loop, same {int(tokens)} tokens"
    return [
        result("learner_step_tokens_per_s", tps["auto"], "tokens/s", desc, tps["base"], target=0.9),
        result("learner_step_extra_prox", tps["extra"], "tokens/s", desc + " (extra proximal forward)", tps["base"]),
        *packing,
    ]


def _packing(path: str, cfg, groups, steps: int) -> list[Result]:
    """Packed (varlen) against padded learner steps on uneven episodes; see the module docstring."""
    import copy
    import time

    from turnscale.learner.trainer import Trainer

    base = copy.deepcopy(cfg)
    base.algo.micro_batch_tokens = type(cfg.algo)().micro_batch_tokens  # the default budget, as a run uses
    trainers = {mode: Trainer(_with_packing(base, mode), path) for mode in ("varlen", "padded")}
    times: dict[str, list[float]] = {m: [] for m in trainers}
    ratio: dict[str, float] = {}
    tokens = 0.0
    order = list(trainers)
    for i in range(steps + 1):  # step 0 warms up
        for mode in order[i % 2:] + order[:i % 2]:
            t0 = time.perf_counter()
            m = trainers[mode].train_step(groups)
            if i:
                times[mode].append(time.perf_counter() - t0)
            ratio[mode] = m["perf/padding_ratio"]
            tokens = m["perf/tokens"]  # trained tokens (trailing non-trainable tokens trimmed)
    tps = {k: tokens / min(v) for k, v in times.items()}
    desc = f"{int(tokens)} tokens of {sum(len(g.episodes) for g in groups)} uneven episodes"
    return [
        result("learner_packed_vs_padded", tps["varlen"], "tokens/s", f"padded learner step, {desc}", tps["padded"], target=1.0),
        result("learner_padded_tokens_per_real", ratio["varlen"], "positions/token", "no padding (1.0); target <= 1.05",
               1.0, target=round(1 / 1.05, 4), lower_is_better=True),
        result("learner_padded_tokens_per_real_padded", ratio["padded"], "positions/token", "no padding (1.0), padded step",
               1.0, lower_is_better=True),
    ]


def _with_packing(cfg, mode: str):
    """A copy of ``cfg`` with ``algo.packing = mode``."""
    import copy

    out = copy.deepcopy(cfg)
    out.algo.packing = mode
    return out


def _with_prox(cfg, mode: str):
    """A copy of ``cfg`` with ``algo.prox_forward = mode``."""
    import copy

    out = copy.deepcopy(cfg)
    out.algo.prox_forward = mode
    return out
