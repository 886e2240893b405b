"""One rank of the two-rank CPU DDP tests (started by torchrun from test_trainer_ddp.py):
trains on its share of the groups and rank 0 saves the published state dict.

``even``: each rank gets half of every batch.  ``uneven``: rank 0 gets three groups of four
and then both of a two-group batch, rank 1 one group and then none, with small
micro-batches, the extra proximal pass and ``seq_mean_token_mean`` -- the ranks plan
different numbers of micro-batches (rank 1 none at all in the second step), which hangs
DDP unless the trainer pads with zero-weight micro-batches."""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from turnscale.conf.schema import Config  # noqa: E402
from turnscale.benchmarks.synthetic import synthetic_groups  # noqa: E402
from turnscale.learner.trainer import Trainer  # noqa: E402


def batches(steps: int, mode: str = "even"):
    sizes = [4] * steps if mode == "even" else [4, 2][:steps]
    return [synthetic_groups(n, 4, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4, seed=i)
            for i, n in enumerate(sizes)]


def share(groups, rank: int, world: int, mode: str):
    if mode == "even":
        return groups[rank::world]
    cut = 3 if len(groups) == 4 else len(groups)
    return groups[:cut] if rank == 0 else groups[cut:]


def config(mode: str = "even") -> Config:
    cfg = Config()
    cfg.algo.lr = 1e-3
    cfg.algo.micro_batch_tokens = 100_000
    if mode == "uneven":
        cfg.algo.micro_batch_tokens = 60
        cfg.algo.prox_forward = "extra"
        cfg.algo.loss_agg = "seq_mean_token_mean"
    return cfg


def main(model_dir: str, out: str, mode: str = "even") -> None:
    tr = Trainer(config(mode), model_dir)
    rank, world = tr.accelerator.process_index, tr.accelerator.num_processes
    assert world == 2, world
    for groups in batches(2, mode):
        m = tr.train_step(share(groups, rank, world, mode))
        print(f"rank {rank} micro_batches {m.get('perf/micro_batches')}", flush=True)
    sd = tr.state_dict_for_publish("float32")
    if rank == 0:
        torch.save(sd, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
