"""Actors: stateless workers that play episodes with an inference engine.

- ``engine``: the ``Engine`` interface (token ids in; ids, behaviour log-probs, finish
  reason out; ``load_weights``), the trio <-> thread bridge and ``make_engine``.
- ``hf_engine`` / ``vllm_engine`` / ``sim_engine``: continuous-batching implementations
  (transformers on cpu/cuda/npu; vLLM on CUDA/Ascend, imported lazily; a cost-model sim).
- ``renderer``: the chat template as an incrementally growing token stream, checked.
- ``parsing`` / ``prompts``: per-env action formats and instruction prompts.
- ``episode``: ``run_episode`` / ``run_group`` -> ``protocol.messages`` records.

The log-prob convention both sides use lives in ``turnscale.logprobs``.
"""
