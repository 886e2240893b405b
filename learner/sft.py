"""``algo=sft`` on recorded conversations: the learner's offline supervised mode.

``turnscale learner algo=sft learner.sft_data=convs.jsonl learner.steps=40`` trains the
model on the loss-masked assistant tokens of ``convs.jsonl`` (``learner.sft_data``'s
format), ``learner.groups_per_step`` conversations per step, drawn without replacement
per epoch with ``learner.seed``, then writes a checkpoint whose ``model/`` folder is an
ordinary HF model (``learner.init_from`` of a later RL run).  No actors are involved:
the data is what an expert or an earlier run recorded.

Order per step: draw batch -> ``Trainer.train_step`` (dispatches to SFT) -> metrics.
Checkpoints every ``learner.checkpoint_every`` steps and at the end.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

from turnscale.conf.schema import Config

log = logging.getLogger("turnscale.learner.sft")


def run_sft(cfg: Config, trainer: Any, logger: Any) -> str:
    """Train ``cfg.learner.steps`` SFT steps; returns the final checkpoint's folder."""
    from turnscale.common.renderer import Renderer
    from turnscale.learner.main import TrainerCheckpointer
    from turnscale.learner.sft_data import load_sft_groups

    lc = cfg.learner
    if not lc.sft_data:
        raise ValueError("config key 'learner.sft_data': algo=sft needs a conversations JSONL file (see learner/sft_data.py)")
    renderer = Renderer.for_tokenizer(trainer.tokenizer, cfg.model.renderer)
    groups = load_sft_groups(lc.sft_data, renderer, max_tokens=cfg.sampling.max_context_tokens)
    if not groups:
        raise ValueError(f"config key 'learner.sft_data': {lc.sft_data} holds no usable conversation")
    log.info("sft: %d conversations from %s", len(groups), lc.sft_data)
    rng = random.Random(lc.seed)
    order: list[int] = []
    root = os.path.join(lc.dir, "checkpoints")
    path = ""
    t0 = time.monotonic()
    while trainer.step < lc.steps:
        batch = []
        while len(batch) < min(lc.groups_per_step, len(groups)):
            if not order:
                order = list(range(len(groups)))
                rng.shuffle(order)
            batch.append(groups[order.pop()])
        metrics = trainer.train_step(batch)
        metrics["perf/wall_s"] = time.monotonic() - t0
        logger.write(trainer.step, metrics)
        if trainer.step % lc.checkpoint_every == 0 or trainer.step >= lc.steps:
            path = TrainerCheckpointer(trainer, root, None, lc.keep_checkpoints).save(trainer.step, {"sft_data": lc.sft_data}) or ""
    return path
