"""Two CPU ranks (torchrun + gloo on 127.0.0.1), each training on its share of every batch,
end with the same weights as one process training on whole batches: the loss normaliser
is the all-reduced token count, so accumulated, rank-averaged gradients equal one batch's.
Also when the shares are uneven (different micro-batch counts, one rank with nothing):
the trainer pads with zero-weight micro-batches instead of hanging DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from turnscale.benchmarks.synthetic import build_tiny_model
from turnscale.learner.trainer import Trainer
from turnscale.protocol.transport import free_port
from tests.integration import ddp_worker


@pytest.mark.parametrize("mode", ["even", "uneven"])
def test_two_ranks_on_shares_of_batches_equal_one_process_on_whole_batches(tmp_path, mode):
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden=32, layers=2, vocab=256, intermediate=64)
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "TMPDIR": str(tmp_path)}  # torchelastic_*
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(os.path.dirname(__file__), "ddp_worker.py"), model_dir, str(out), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if mode == "uneven":  # planned 6 and 2, then 4 and 0 micro-batches: rank 1 was padded to rank 0's count
        assert "rank 1 micro_batches 6.0" in proc.stdout and "rank 1 micro_batches 4.0" in proc.stdout, proc.stdout

    single = Trainer(ddp_worker.config(mode), model_dir)
    for groups in ddp_worker.batches(2, mode):
        single.train_step(groups)
    want = single.state_dict_for_publish("float32")
    got = torch.load(out, weights_only=True)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
