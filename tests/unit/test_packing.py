"""Padding-free (varlen) micro-batches give the padded path's log-probs, losses and steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from turnscale.benchmarks.synthetic import build_tiny_model, synthetic_groups
from turnscale.conf.schema import AlgoConfig
from turnscale.learner.batching import pad_BT
from turnscale.learner.logprobs import token_logprobs_BT
from turnscale.learner.packing import pack_sequences, plan_packs, use_varlen_attention
from turnscale.learner.trainer import Trainer
from tests.unit.test_trainer import assert_same, make_cfg, params

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), hidden=32, layers=2, vocab=256, intermediate=64)


def uneven_groups(seed=0):
    """Two groups whose episodes differ a lot in length (1 to 4 turns), so padding is real."""
    out = []
    for turns in (1, 4):
        out += synthetic_groups(1, 4, vocab=256, prompt_len=8, turns=turns, tokens_per_turn=8, obs_len=5, seed=seed + turns)
    return out


def test_plan_packs_puts_every_sequence_once_within_the_budget():
    lengths = [50, 7, 30, 30, 200, 1, 64, 12]
    plan = plan_packs(lengths, 64)
    assert sorted(i for p in plan for i in p) == list(range(len(lengths)))
    assert [p for p in plan if sum(lengths[i] for i in p) > 64] == [[4]]  # over-long goes alone
    assert len(plan) == 5  # 200 | 64 | 50+12+1 | 30+30 | 7 ... first-fit decreasing
    assert plan == plan_packs(lengths, 64)
    with pytest.raises(ValueError, match="token_budget"):
        plan_packs(lengths, 0)


def test_pack_maps_tokens_back_to_the_padded_layout():
    pk = pack_sequences([np.array([5, 6, 7]), np.array([8, 9])])
    assert pk.input_ids_1N.tolist() == [[5, 6, 7, 8, 9]]
    assert pk.position_ids_1N.tolist() == [[0, 1, 2, 0, 1]]
    assert pk.cu_seq_lens.tolist() == [0, 3, 5]
    assert pk.unpack_BT(pk.input_ids_1N).tolist() == [[5, 6, 7], [8, 9, 0]]
    assert pk.unpack_BT(pk.input_ids_1N, shifted=True).tolist() == [[0, 6, 7], [0, 9, 0]]
    with pytest.raises(ValueError, match="empty"):
        pack_sequences([np.array([1]), np.array([], dtype=np.int64)])


def test_packed_forward_gives_the_padded_logprobs_and_gradients(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 256, n) for n in (40, 3, 17, 1, 29)]
    ids = pad_BT(rows)
    attn = pad_BT([np.ones(len(r), dtype=np.int64) for r in rows])
    lp_pad = token_logprobs_BT(model(input_ids=ids, attention_mask=attn).logits, ids)
    (lp_pad * attn).sum().backward()
    g_pad = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    use_varlen_attention(model)
    pk = pack_sequences(rows)
    lp_pk = pk.unpack_BT(token_logprobs_BT(model(**pk.model_inputs()).logits, pk.input_ids_1N), shifted=True)
    lp_pk.sum().backward()
    valid = attn.bool()
    torch.testing.assert_close(lp_pk[valid], lp_pad[valid], rtol=0, atol=1e-5)
    assert (lp_pk[~valid] == 0).all()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_pad[k], rtol=1e-4, atol=1e-5, msg=k)
    # the same model still answers padded calls as before
    torch.testing.assert_close(token_logprobs_BT(model(input_ids=ids, attention_mask=attn).logits, ids), lp_pad.detach())


@pytest.mark.parametrize("algo, extra", [
    ("grpo", {}), ("ppo", {}), ("reinforce_pp", {}), ("grpo", {"kl_coef": 0.1, "entropy_coef": 0.01}),
    ("grpo", {"prox_forward": "extra"}), ("sft", {}),
])
def test_varlen_steps_equal_padded_steps(model_dir, algo, extra):
    data = [uneven_groups(0), uneven_groups(10)]
    # padded: the whole batch in one micro-batch (as much padding as it gets); varlen: several packs
    padded = Trainer(make_cfg(algo, packing="padded", micro_batch_tokens=100_000, **extra), model_dir)
    varlen = Trainer(make_cfg(algo, packing="varlen", micro_batch_tokens=120, **extra), model_dir)
    for groups in data:
        mp, mv = padded.train_step(groups), varlen.train_step(groups)
        for k in mp:
            if k.startswith("loss/"):
                assert mv[k] == pytest.approx(mp[k], rel=1e-4, abs=1e-6), k
    assert mp["perf/padding_ratio"] > 1.2
    assert mv["perf/micro_batches"] > 1 and mv["perf/padding_ratio"] == 1.0 and mv["perf/padded_tokens"] == mv["perf/tokens"]
    assert_same(params(padded), params(varlen), atol=5e-5)


def test_unknown_packing_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match="algo.packing"):
        AlgoConfig(packing="bucketed")
