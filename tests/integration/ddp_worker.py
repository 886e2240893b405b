"""One rank of the two-rank CPU DDP test (started by torchrun from test_trainer_ddp.py):
trains on its share of the groups and rank 0 saves the published state dict."""

from __future__ import annotations

import sys

import torch

torch.set_num_threads(1)

from turnscale.conf.schema import Config  # noqa: E402
from turnscale.benchmarks.synthetic import synthetic_groups  # noqa: E402
from turnscale.learner.trainer import Trainer  # noqa: E402


def batches(steps: int):
    return [synthetic_groups(4, 4, vocab=256, prompt_len=8, turns=2, tokens_per_turn=6, obs_len=4, seed=i) for i in range(steps)]


def config() -> Config:
    cfg = Config()
    cfg.algo.lr = 1e-3
    cfg.algo.micro_batch_tokens = 100_000
    return cfg


def main(model_dir: str, out: str) -> None:
    tr = Trainer(config(), model_dir)
    rank, world = tr.accelerator.process_index, tr.accelerator.num_processes
    assert world == 2, world
    for groups in batches(2):
        tr.train_step(groups[rank::world])
    sd = tr.state_dict_for_publish("float32")
    if rank == 0:
        torch.save(sd, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
