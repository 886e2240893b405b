"""Synthetic inputs for learner tests and benchmarks: a tiny randomly initialised HF model
(built locally, no downloads) and multi-turn trajectory groups of random tokens.

The groups are real ``protocol.messages.TrajectoryGroup`` records (they pass the codec's
checks): per episode a prompt, then ``turns`` x (sampled assistant tokens, loss mask 1,
then observation tokens, loss mask 0).
"""

from __future__ import annotations

import numpy as np

from turnscale.protocol.messages import Episode, Task, TrajectoryGroup, Turn


def build_tiny_model(path: str, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 192, vocab: int = 1024, arch: str = "qwen2", seed: int = 0) -> str:
    """Save a randomly initialised causal LM (no tokenizer) under ``path``; returns ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def synthetic_episode(rng: np.random.Generator, *, vocab: int, prompt_len: int, turns: int, tokens_per_turn: int,
                      obs_len: int, reward: float, turn_limit: int, finish_reason: str = "done",
                      version: int = 0) -> Episode:
    ids = [rng.integers(0, vocab, prompt_len)]
    mask = [np.zeros(prompt_len, np.uint8)]
    turn_recs = []
    pos = prompt_len
    for k in range(turns):
        n = int(max(1, tokens_per_turn + rng.integers(-tokens_per_turn // 4, tokens_per_turn // 4 + 1)))
        ids.append(rng.integers(0, vocab, n))
        mask.append(np.ones(n, np.uint8))
        turn_recs.append(Turn(index=k, token_start=pos, token_end=pos + n, output_text="", action="", parse_error=False,
                              observation="", reward=reward if k == turns - 1 else 0.0, done=k == turns - 1,
                              policy_version=version, gen_latency_s=0.0, env_latency_s=0.0))
        pos += n
        if obs_len and k < turns - 1:
            ids.append(rng.integers(0, vocab, obs_len))
            mask.append(np.zeros(obs_len, np.uint8))
            pos += obs_len
    token_ids = np.concatenate(ids).astype(np.int32)
    loss_mask = np.concatenate(mask)
    logprobs = np.where(loss_mask > 0, -rng.uniform(4.0, 9.0, len(token_ids)), 0.0).astype(np.float32)
    versions = np.where(loss_mask > 0, version, -1).astype(np.int32)
    return Episode(token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs, versions=versions, prompt_len=prompt_len,
                   turns=turn_recs, finish_reason=finish_reason, reward=float(reward), success=reward > 0,
                   turn_limit=turn_limit)


def synthetic_groups(n_groups: int, group_size: int, *, vocab: int = 1024, prompt_len: int = 32, turns: int = 3,
                     tokens_per_turn: int = 16, obs_len: int = 12, seed: int = 0, turn_limit: int = 10,
                     max_turns: int = 0) -> list[TrajectoryGroup]:
    """``n_groups`` groups of random multi-turn episodes with 0/1 rewards (never all equal
    within a group when ``group_size > 1``: the first two episodes get 1 and 0).  With
    ``max_turns`` > 0 each episode plays a uniform 1..max_turns turns instead of ``turns``
    (uneven lengths, as multi-turn runs produce)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        rewards = rng.integers(0, 2, group_size).astype(float)
        if group_size > 1:
            rewards[0], rewards[1] = 1.0, 0.0
        eps = [synthetic_episode(rng, vocab=vocab, prompt_len=prompt_len,
                                 turns=int(rng.integers(1, max_turns + 1)) if max_turns > 0 else turns, tokens_per_turn=tokens_per_turn,
                                 obs_len=obs_len, reward=float(r), turn_limit=turn_limit,
                                 finish_reason="done" if r > 0 else "turn_limit") for r in rewards]
        groups.append(TrajectoryGroup(lease_id=f"l-{g}", actor_id="synthetic", task=Task(env="babyai", data_idx=g),
                                      turn_limit=turn_limit, episodes=eps))
    return groups
