"""One rank of the two-rank CPU FSDP test (started by torchrun from test_trainer_fsdp.py).

Runs the multi-rank learner's own share protocol (``learner.ranks``: rank 0 is a
``RankedTrainer`` that splits each batch into shares, the follower runs ``ranks.follow``)
under ``learner.strategy=fsdp``, for 3 optimizer steps on the batches of ``batches()``:

- after step 2 a sharded checkpoint through the learner's own checkpointer (every rank
  writes its shards: ``RankCollective(kind="checkpoint")``);
- after step 3: the local parameter/gradient/optimizer bytes rank 0 holds, the weights
  published through a real ``WeightPublisher`` (gathered a tensor at a time:
  ``RankCollective(kind="publish")``), and the whole fp32 state;
- then every rank resumes from the step-2 checkpoint and takes step 3 again.

Rank 0 saves it all to ``out`` (torch.save) for the test to compare with one process."""

from __future__ import annotations

import math
import os
import sys

import torch

torch.set_num_threads(1)

from turnscale.benchmarks.synthetic import synthetic_groups  # noqa: E402
from turnscale.conf.schema import Config  # noqa: E402

TRANSFER = "bfloat16"
VOCAB = 251
"""Odd: the embedding's rows split unevenly over 2 ranks (126 + 125), as real vocabularies may."""


def batches(steps: int = 3):
    sizes = [4, 3, 2][:steps]  # 3 groups on 2 ranks: uneven shares, padded micro-batches
    return [synthetic_groups(n, 4, vocab=VOCAB, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4, seed=10 + i)
            for i, n in enumerate(sizes)]


def config(mode: str) -> Config:
    cfg = Config()
    cfg.algo.name = mode
    cfg.algo.lr = 1e-3
    cfg.algo.micro_batch_tokens = 80  # several packed micro-batches per rank
    cfg.algo.packing = "varlen"
    if mode == "grpo":
        cfg.algo.kl_coef = 0.05  # a sharded reference model too
        cfg.algo.loss_agg = "seq_mean_token_mean"
        cfg.learner.fsdp.cpu_offload = True  # the offload policy's code path (on CPU the same memory)
    if mode == "ppo":
        cfg.learner.activation_checkpointing = True  # recomputed in the backward: the same step
    cfg.learner.strategy = "fsdp"
    cfg.learner.fsdp.param_dtype = "float32"
    cfg.learner.fsdp.reduce_dtype = "float32"
    cfg.learner.transfer_dtype = TRANSFER
    cfg.learner.rank_timeout_s = 120.0
    return cfg


def rank0(cfg: Config, channel, model_dir: str, out: str) -> None:
    from turnscale.learner import fsdp, ranks
    from turnscale.learner.main import TrainerCheckpointer
    from turnscale.learner.trainer import Trainer
    from turnscale.learner.weights import WeightPublisher
    from turnscale.protocol.messages import RankStart

    channel.broadcast(RankStart(model_path=model_dir, world_size=channel.world))
    tr = Trainer(cfg, model_dir)
    ranked = ranks.RankedTrainer(tr, channel, cfg.learner.rank_timeout_s)
    ckpt = TrainerCheckpointer(ranked, os.path.join(os.path.dirname(out), "ckpt"), None, keep=2)
    norms, ckpt_path = [], None
    try:
        for i, groups in enumerate(batches()):
            m = ranked.train_step(groups)
            assert "train/nonfinite" not in m, m
            norms.append(m["loss/grad_norm"])
            if i == 1:
                ckpt_path = ckpt.save(ranked.step, {"note": "step 2"})
        memory = fsdp.local_bytes(tr.params, tr.optimizer)
        with WeightPublisher("tcp://127.0.0.1:0", chunk_mb=0.01, dtype=TRANSFER, shm=False) as pub:
            manifest = pub.publish(1, ranked.state_dict_for_publish(TRANSFER))
            published = bytes(pub._versions[1].buf[:manifest.total_bytes])
        gs = ranked.state_dict_for_publish("float32")
        state = dict(zip(list(gs.keys()), gs.values()))
        resumed_at = ranked.load_state(ckpt_path)
        m = ranked.train_step(batches()[2])
        gs = ranked.state_dict_for_publish("float32")
        resumed = dict(zip(list(gs.keys()), gs.values()))
        torch.save({"norms": norms, "memory": memory, "published": torch.frombuffer(bytearray(published), dtype=torch.uint8),
                    "checksums": [c.checksum for c in manifest.chunks], "state": state, "resumed": resumed,
                    "resumed_at": resumed_at, "resumed_norm": m["loss/grad_norm"], "checkpoint": ckpt_path,
                    "layers_sharded": len(fsdp.decoder_layers(tr.hf_model)),
                    "checkpointing": bool(tr.hf_model.is_gradient_checkpointing)}, out)
    except BaseException:
        ranked.stop("error")
        raise
    ranked.stop("done")


def memory_batch():
    """One small GRPO group per rank of a 4-rank job (enough for one optimizer step)."""
    return synthetic_groups(4, 2, vocab=1000, prompt_len=8, turns=1, tokens_per_turn=6, obs_len=2, seed=3)


def memory(model_dir: str, out: str) -> None:
    """Each rank of a 4-rank FSDP trainer takes one step on its group and writes the bytes it
    holds for parameters, gradients and optimizer state to ``<out>.<rank>.json``."""
    import json

    from turnscale.learner import fsdp
    from turnscale.learner.trainer import Trainer

    cfg = config("grpo")
    cfg.algo.kl_coef = 0.0
    cfg.learner.fsdp.meta_init = False  # whole model on every rank, then sharded (the other loading path)
    cfg.learner.fsdp.param_dtype = "bfloat16"  # the GPU default: bf16 compute over float32 shards
    tr = Trainer(cfg, model_dir)
    rank, world = tr.accelerator.process_index, tr.accelerator.num_processes
    m = tr.train_step(memory_batch()[rank::world])
    assert tr.sharded and tr.step == 1 and math.isfinite(m["loss/grad_norm"]), m
    assert all(p.dtype == torch.float32 for p in tr.params)  # the shards the optimizer steps stay float32
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(fsdp.local_bytes(tr.params, tr.optimizer), f)


def main(model_dir: str, out: str, mode: str) -> None:
    from turnscale.learner import ranks

    if mode == "memory":
        return memory(model_dir, out)
    cfg = config(mode)
    channel = ranks.connect(cfg)
    assert channel is not None and channel.world == 2
    if channel.rank == 0:
        rank0(cfg, channel, model_dir, out)
    else:
        ranks.follow(cfg, channel)


if __name__ == "__main__":
    main(*sys.argv[1:])
