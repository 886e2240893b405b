"""``engine=vllm``: the engine interface over vLLM (CUDA; Ascend through vllm-ascend).

vLLM is imported lazily, only here.  The decoding thread drives vLLM's own continuous
batching through the documented ``LLM.llm_engine`` calls: ``add_request`` with a
``TokensPrompt`` (token ids in, never text), ``step()`` returning ``RequestOutput``
deltas (``RequestOutputKind.DELTA``), ``abort_request`` for cancelled requests.

Log-prob convention.  vLLM's engine option ``logprobs_mode`` decides what
``SamplingParams(logprobs=0)`` returns for the sampled token:

- ``raw_logprobs`` (vLLM's default): ``log_softmax(logits)``, *before* temperature;
- ``processed_logprobs``: after temperature (and penalties) **and after top-k/top-p
  truncation** (renormalised over the kept tokens).

turnscale's convention is ``log_softmax(logits / temperature)`` before truncation
(``turnscale.logprobs``).  We start vLLM with ``processed_logprobs`` and accept only
requests where that equals our convention: ``top_k == 0`` and ``top_p == 1`` (any
temperature; no penalties are ever set).  Other requests raise ``EngineError`` — use
the ``hf`` engine for truncated sampling.  ``ignore_eos=True`` plus explicit
``stop_token_ids`` make vLLM stop exactly where the ``hf`` engine stops; the stop token
is part of the output ids.

Weights.  Our decoding thread is the only caller of ``step()``, so not stepping *is*
the pause: ``_apply_weights`` runs between steps (``inflight``) or with no request
running (``between_turns``), calls ``model.load_weights`` in every worker through
``LLM.collective_rpc`` (the worker-side callable ``load_weights_in_worker``), then
``reset_prefix_cache()`` so no KV block computed by old weights is reused by a new
request.  Names are the HF state-dict names (``vllm_weight_items`` strips wrapper
prefixes and drops what vLLM does not load); vLLM's loader maps them onto its fused
layers (``qkv_proj``, ``gate_up_proj``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from actors.engine import FINISH_ABORTED, FINISH_LENGTH, FINISH_STOP, EngineError, GenerateRequest, GenerateResult, Pending, ThreadedEngine
from protocol.messages import SamplingParams

LOGPROBS_MODE = "processed_logprobs"

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)


# ----------------------------------------------------------------------------- pure logic


def check_logprob_convention(sp: SamplingParams, logprobs_mode: str = LOGPROBS_MODE) -> None:
    """Raise ``EngineError`` unless vLLM's returned log-prob equals turnscale's convention."""
    if logprobs_mode == "processed_logprobs":
        if sp.top_k not in (0, -1) or sp.top_p < 1.0:
            raise EngineError(
                f"engine=vllm reports log-probs after top-k/top-p truncation (processed_logprobs); turnscale's "
                f"convention is before truncation. Use sampling.top_k=0 and sampling.top_p=1 with vllm "
                f"(got top_k={sp.top_k}, top_p={sp.top_p}), or engine=hf"
            )
    elif logprobs_mode == "raw_logprobs":
        if sp.temperature != 1.0 or sp.top_k not in (0, -1) or sp.top_p < 1.0:
            raise EngineError("engine=vllm with raw_logprobs matches the convention only at temperature 1 without truncation")
    else:
        raise EngineError(f"logprobs_mode {logprobs_mode!r} cannot give turnscale's log-prob convention")


def sampling_kwargs(req: GenerateRequest) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one request (output kind set by the caller)."""
    sp = req.sampling
    check_logprob_convention(sp)
    return {
        "n": 1,
        "temperature": float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": -1 if sp.top_k == 0 else int(sp.top_k),
        "max_tokens": int(sp.max_new_tokens),
        "stop_token_ids": [int(t) for t in req.stop_token_ids],
        "ignore_eos": True,
        "seed": req.seed,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORTED}


def finish_reason(vllm_reason: str | None) -> str:
    """vLLM's ``CompletionOutput.finish_reason`` -> ours (``stop``/``length``/``aborted``)."""
    try:
        return FINISH_REASONS[vllm_reason or "abort"]
    except KeyError:
        raise EngineError(f"unknown vLLM finish reason {vllm_reason!r}") from None


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position logprobs.

    ``logprobs`` is a list (one entry per new token) of ``{token_id: Logprob}`` dicts, or
    vLLM's ``FlatLogprobs`` (indexable the same way).  With ``logprobs=0`` each entry
    holds exactly the sampled token.
    """
    if logprobs is None:
        raise EngineError("vLLM returned no log-probs; the request must set logprobs=0")
    if len(logprobs) != len(token_ids):
        raise EngineError(f"vLLM returned {len(logprobs)} log-prob entries for {len(token_ids)} tokens")
    out = []
    for tok, entry in zip(token_ids, logprobs):
        lp = entry[tok]
        out.append(float(getattr(lp, "logprob", lp)))
    return out


def vllm_weight_items(tensors: Mapping[str, Any], *, tie_word_embeddings: bool) -> list[tuple[str, Any]]:
    """HF state-dict tensors -> the ``(name, tensor)`` items vLLM's ``load_weights`` takes.

    Strips wrapper prefixes (DDP ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP /
    activation-checkpoint wrappers), drops rotary ``inv_freq`` buffers and, for tied
    embeddings, ``lm_head.weight`` (vLLM shares it with ``embed_tokens``).
    """
    items = []
    for name, t in tensors.items():
        clean = name
        changed = True
        while changed:
            changed = False
            for pre in _WRAPPER_PREFIXES:
                if clean.startswith(pre):
                    clean, changed = clean[len(pre):], True
                clean = clean.replace("." + pre, ".")
        if clean.endswith(_SKIPPED_SUFFIXES):
            continue
        if tie_word_embeddings and clean == "lm_head.weight":
            continue
        items.append((clean, t))
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise EngineError("load_weights: two tensors map to the same vLLM name after stripping wrapper prefixes")
    return items


def load_weights_in_worker(worker: Any, items: list[tuple[str, Any]]) -> int:
    """Runs inside each vLLM worker (via ``collective_rpc``): load ``items`` into its model."""
    model = worker.model_runner.model
    loaded = model.load_weights(weights=iter(items))
    return len(loaded) if loaded is not None else len(items)


# ----------------------------------------------------------------------------- engine


@dataclass(eq=False)
class _VRow:
    p: Pending
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class VLLMEngine(ThreadedEngine):
    """See the module docstring.  ``llm`` / ``vllm_api`` may be injected (tests use fakes)."""

    def __init__(self, cfg: Any, model_path: str, *, version: int = 0, llm: Any = None, vllm_api: Any = None) -> None:
        super().__init__(max_batch=cfg.max_batch, update_mode=cfg.update_mode, version=version, name="vllm")
        self.api = vllm_api or _import_vllm()
        if llm is None:
            llm = self.api.LLM(
                model=model_path,
                dtype=cfg.dtype,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_num_seqs=cfg.max_batch,
                logprobs_mode=LOGPROBS_MODE,
                enable_prefix_caching=True,
            )
        self.llm = llm
        self.core = llm.llm_engine
        hf_config = getattr(getattr(self.core, "model_config", None), "hf_config", None)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._rows: dict[str, _VRow] = {}
        self._start()

    def _validate(self, req: GenerateRequest) -> None:
        super()._validate(req)
        check_logprob_convention(req.sampling)

    def _active(self) -> list[Pending]:
        return [r.p for r in list(self._rows.values())]

    def _admit(self, joiners: list[Pending]) -> list[tuple[Pending, GenerateResult]]:
        for p in joiners:
            kw = sampling_kwargs(p.req)
            params = self.api.SamplingParams(output_kind=self.api.RequestOutputKind.DELTA, **kw)
            prompt = self.api.TokensPrompt(prompt_token_ids=[int(t) for t in p.req.prompt_ids])
            rid = str(p.rid)
            self._rows[rid] = _VRow(p=p)
            self.core.add_request(rid, prompt, params)
        return []

    def _step(self) -> list[tuple[Pending, GenerateResult]]:
        done = []
        version = self._version
        for out in self.core.step():
            row = self._rows.get(out.request_id)
            if row is None:
                continue
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            row.logprobs += sampled_logprobs(ids, comp.logprobs) if ids else []
            row.ids += ids
            row.versions += [version] * len(ids)
            if out.finished:
                del self._rows[out.request_id]
                done.append((row.p, self._result(row, finish_reason(comp.finish_reason))))
        return done

    def _result(self, row: _VRow, reason: str) -> GenerateResult:
        v = np.asarray(row.versions, dtype=np.int32)
        return GenerateResult(
            token_ids=np.asarray(row.ids, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            finish_reason=reason,
            policy_version=int(v.min()) if len(v) else self._version,
            latency_s=time.monotonic() - row.p.submitted,
            token_versions=v,
        )

    def _drop(self, gone: list[Pending]) -> None:
        ids = [str(p.rid) for p in gone if str(p.rid) in self._rows]
        for rid in ids:
            del self._rows[rid]
        if ids:
            self.core.abort_request(ids)

    def _reset_batch(self) -> None:
        if self._rows:
            try:
                self.core.abort_request(list(self._rows))
            finally:
                self._rows = {}

    def _partial_result(self, p: Pending, reason: str) -> GenerateResult:
        row = self._rows.get(str(p.rid))
        return self._result(row, reason) if row is not None else self._aborted_result(p)

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        vllm_weight_items(tensors, tie_word_embeddings=self.tie_word_embeddings)

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        items = vllm_weight_items(tensors, tie_word_embeddings=self.tie_word_embeddings)
        self.llm.collective_rpc(load_weights_in_worker, args=(items,))
        self.llm.reset_prefix_cache()


def _import_vllm() -> Any:
    try:
        import vllm
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except ImportError as exc:
        raise EngineError(f"engine=vllm needs vLLM (pip install 'turnscale[vllm]', CUDA or Ascend): {exc}") from None

    class Api:
        LLM = vllm.LLM
        SamplingParams = vllm.SamplingParams

    Api.TokensPrompt = TokensPrompt
    Api.RequestOutputKind = RequestOutputKind
    return Api

