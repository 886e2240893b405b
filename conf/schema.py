"""Typed configuration: the schema every Hydra config in ``conf/`` is merged over.

Entry points call ``conf.load(overrides)`` once; it composes the Hydra groups, merges
them over ``Config`` (a misspelled key raises naming the key), converts to these
dataclasses (running every ``__post_init__`` check) and returns a ``Config``.  Below
``main()`` nothing sees a ``DictConfig``.

Groups mirror the packages: ``env`` (envhub), ``engine`` (actors), ``algo`` and
``schedule`` (learner), ``model``, ``logger``, and ``experiment`` bundles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from turnscale.conf.envs import ENVS
from turnscale.protocol.dtypes import FLOAT_DTYPES


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"config key '{key}': {msg}")


@dataclass(kw_only=True)
class TasksConfig:
    """Which ``data_idx`` values make each split.  Each is a range ``"start:stop"``, a comma
    list ``"3,5,9"`` or the path of a JSON file (AgentGym-RL's ``[{"item_id": "babyai_17"}, ...]``
    or a list of ints); ``conf.tasks`` parses them."""

    train: str = "0:1000"
    """Tasks the learner leases for training."""
    test: str = "1000:1100"
    """Held-out tasks (evaluations; never trained on)."""
    warmup: str = ""
    """Tasks for the SFT warm start (defaults to ``train``)."""


@dataclass(kw_only=True)
class ServerLimits:
    """What one envhub server bounds, so that no client (buggy or hostile) can stall it,
    exhaust its memory or act for another client (docs/security.md)."""

    call_timeout_s: float = 60.0
    """Deadline of every env call (create, reset, step, observation, expert, hint, close).
    A call past it answers 504 and its instance is broken and disposed of."""
    max_overrun_calls: int = 16
    """Env calls past their deadline that may still hold a worker thread, all clients
    together; at this many, ``/health`` answers 503 and every new env call is refused with
    503 until some return.  Keep it >= ``max_overrun_calls_per_address`` +
    ``env.options.server_threads`` (16 >= 4 + 8): one address can then never reach it."""
    max_overrun_calls_per_address: int = 4
    """Env calls started by one peer address that overran their deadline and still hold a
    worker thread; at this many, that address's new env calls are refused (429
    ``overrun_quota``, ``Retry-After``) while other addresses are served."""
    max_instances_per_address: int = 0
    """Instances one peer IP address may hold, all its ``X-Envhub-Client`` tokens together
    (a token labels instances, it never adds quota).  0: seven eighths of
    ``env.max_instances``, rounded up (448 of 512): actors behind one host share it, and
    other addresses keep the rest."""
    max_connections_per_address: int = 0
    """Open HTTP connections from one peer IP address; one beyond it is closed at once.
    0: seven eighths of ``max_connections``, rounded up (896 of 1024)."""
    max_json_values: int = 4096
    """JSON values (array items, object members, scalars) one request body may hold (422
    ``too_many_values`` beyond, counted before the body is decoded).  The largest body a
    route takes, a 256-step ``/v1/step_batch``, holds about 1,300."""
    max_body_bytes: int = 1 << 20
    """Request body limit: a larger ``Content-Length`` is refused before reading (413),
    a body without one is counted while it streams."""
    max_json_depth: int = 32
    """Deepest nesting of arrays/objects a request body may have (422 beyond)."""
    header_timeout_s: float = 10.0
    """A request's line and headers must arrive within this (else the connection closes)."""
    body_timeout_s: float = 30.0
    """A request's body must arrive within this once its headers did (else 408)."""
    keepalive_timeout_s: float = 15.0
    """An idle keep-alive connection is closed after this."""
    max_connections: int = 1024
    """Open HTTP connections; a connection beyond it is closed at once."""
    shutdown_timeout_s: float = 10.0
    """Bound on the graceful part of shutdown (open requests, closing instances)."""

    def __post_init__(self) -> None:
        for key in ("call_timeout_s", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s", "shutdown_timeout_s"):
            _require(getattr(self, key) > 0, f"env.limits.{key}", "must be > 0 seconds")
        for key in ("max_overrun_calls", "max_overrun_calls_per_address", "max_body_bytes", "max_json_depth", "max_connections", "max_json_values"):
            _require(getattr(self, key) > 0, f"env.limits.{key}", "must be > 0")
        for key in ("max_instances_per_address", "max_connections_per_address"):
            _require(getattr(self, key) >= 0, f"env.limits.{key}", "must be >= 0 (0: seven eighths of the server-wide limit)")


@dataclass(kw_only=True)
class EnvConfig:
    """One env family: the envhub server's settings and where clients find it."""

    name: str = "babyai"
    """An env registered in ``conf.envs`` (``babyai``, ``textcraft``, ...)."""
    host: str = "127.0.0.1"
    """Interface the server binds (clients connect here unless ``url`` is set)."""
    port: int = 8301
    """TCP port the server listens on (each env family has its own default,
    ``conf/env/*.yaml``)."""
    url: str = ""
    """Base URL clients use; empty means ``http://{host}:{port}``."""
    max_instances: int = 512
    """Instance limit; ``/create`` beyond it answers 429."""
    idle_timeout_s: float = 900.0
    """Instances untouched this long are closed."""
    max_env_steps: int = 0
    """Per-episode env step cap enforced by the server (0: the env's own)."""
    exit_after_idle_s: float = 0.0
    """The server exits by itself (its instances closed, exit code 4 as an actor that gave up
    on its learner) once no env request has arrived for this long, counted from the first
    one (a server nobody has used yet waits for its clients) and not while a request runs;
    ``/health`` and ``/metrics`` do not count.  A run whose learner died leaves no actors to
    call it.  0: never (a server run by hand serving many runs); ``turnscale slurm`` sets
    ``slurm.envhub_idle_exit_s``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Env-specific options (BabyAI's text and level mix, corpus paths, JVM pool size, ...)."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)
    """Deadlines, sizes, quotas and connection limits of the server."""

    def __post_init__(self) -> None:
        _require(self.name in ENVS, "env.name", f"unknown env {self.name!r}; choose one of {sorted(ENVS)}")
        _require(0 < self.port < 65536, "env.port", f"{self.port} is not a TCP port")
        _require(self.max_instances > 0, "env.max_instances", "must be > 0")
        _require(self.exit_after_idle_s >= 0, "env.exit_after_idle_s", f"must be >= 0 seconds (0: never), got {self.exit_after_idle_s}")

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.host}:{self.port}"

    @property
    def client_flavor(self) -> str:
        """What the env server speaks, for env clients: ``env.options.flavor`` (default
        ``turnscale``; ``agentgym`` etc. for AgentGym's own servers, see ``common.envclient``)."""
        return str(self.options.get("flavor") or "turnscale")


@dataclass(kw_only=True)
class TinyModelConfig:
    """The model ``turnscale run`` builds itself when ``model.path=tiny`` (no downloads here)."""

    architecture: str = "qwen2"
    """Model family of the built model (a transformers config type, e.g. ``qwen2``)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads (head_dim = ``hidden_size / num_heads``; vLLM's CPU attention needs
    >= 32)."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 384
    """Width of each MLP."""
    vocab_size: int = 2048
    """Size of the byte-level BPE tokenizer trained for it (and of the embedding)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model takes (bounds the context a fitted recipe may use)."""
    seed: int = 0
    """Seed of the weight initialisation."""


@dataclass(kw_only=True)
class ModelConfig:
    path: str = "tiny"
    """HF model name or local folder; ``tiny`` builds (once, cached) a small model and tokenizer."""
    cache_dir: str = ""
    """Where the tiny model is built; empty: ``~/.cache/turnscale``."""
    dtype: str = "float32"
    """Learner compute dtype (``float32``, ``bfloat16``, ``float16``)."""
    renderer: str = "auto"
    """Chat renderer: ``auto`` picks from the tokenizer's template (``chatml``, ``llama3``)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in FLOAT_DTYPES, "model.dtype", f"{self.dtype!r} not supported")


@dataclass(kw_only=True)
class SamplingConfig:
    """Sent to every actor in ``Welcome``; see ``protocol.messages.SamplingParams``."""

    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches this (1:
    off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    max_new_tokens: int = 64
    """Longest reply of one turn, in tokens."""
    max_context_tokens: int = 2048
    """Longest episode (prompt, every turn and observation), in tokens; an episode that runs
    out ends unsolved (``rollout/finish/context_limit``); groups longer than this are
    refused by the learner."""

    def __post_init__(self) -> None:
        _require(self.temperature > 0, "sampling.temperature", "must be > 0")
        _require(0 < self.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
        _require(self.max_new_tokens > 0, "sampling.max_new_tokens", "must be > 0")


@dataclass(kw_only=True)
class SimEngineConfig:
    """``engine=sim``: tokens after a delay from a cost model (benchmarks only)."""

    prefill_s_per_token: float = 2e-5
    """Seconds per prompt token of the requests joining a decoding step."""
    decode_s_per_step: float = 5e-3
    """Seconds per decoding step of the whole batch."""
    mean_new_tokens: int = 24
    """Mean length of a short turn (geometric), in tokens."""
    long_tail: float = 0.2
    """Probability a turn is long (``max_new_tokens``)."""
    seed: int = 0
    """Seed of the sampled lengths."""


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """``engine=vllm`` only (see ``actors.vllm_engine.platform_settings``)."""

    multiprocess: bool = True
    """vLLM's EngineCore in its own process (vLLM's default), else in the actor's process
    (starts in seconds instead of tens of seconds on CPU)."""
    kv_cache_gib: int = 1
    """KV cache size on ``device=cpu`` in whole GiB (``VLLM_CPU_KVCACHE_SPACE``)."""
    enforce_eager: bool = False
    """No CUDA graphs / torch.compile on ``cuda``/``npu`` (always eager on ``cpu``)."""
    max_model_len: int = 0
    """Longest sequence vLLM plans for; 0: the model's own limit."""

    def __post_init__(self) -> None:
        _require(self.kv_cache_gib >= 1, "engine.vllm.kv_cache_gib", "must be >= 1 (whole GiB)")
        _require(self.max_model_len >= 0, "engine.vllm.max_model_len", "must be >= 0 (0: the model's limit)")


@dataclass(kw_only=True)
class EngineConfig:
    """An actor's inference engine (local to each actor)."""

    name: str = "hf"
    """``hf`` (transformers, any device), ``vllm`` (CUDA / Ascend / CPU) or ``sim``."""
    device: str = "cpu"
    """Where the engine runs: ``cpu``, ``cuda``, ``npu`` (Ascend)."""
    dtype: str = "float32"
    """Engine compute dtype (``float32``, ``bfloat16``, ``float16``)."""
    max_batch: int = 32
    """Most sequences decoded together."""
    update_mode: str = "between_turns"
    """``between_turns`` or ``inflight`` weight swaps."""
    gpu_memory_utilization: float = 0.85
    """vLLM on cuda/npu only."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    sim: SimEngineConfig = field(default_factory=SimEngineConfig)

    def __post_init__(self) -> None:
        _require(self.name in ("hf", "vllm", "sim"), "engine.name", f"{self.name!r}; choose hf, vllm or sim")
        _require(self.update_mode in ("between_turns", "inflight"), "engine.update_mode", f"{self.update_mode!r}; choose between_turns or inflight")
        _require(self.max_batch > 0, "engine.max_batch", "must be > 0")


@dataclass(kw_only=True)
class PPOLossConfig:
    """The decoupled-PPO loss's own knobs (``learner.loss.ppo_loss`` takes this); declared
    once here, and ``AlgoConfig`` inherits them, so they are ``algo.clip_low`` etc. in the
    config."""

    clip_low: float = 0.2
    """eps_low: the ratio is clipped below at ``1 - clip_low``."""
    clip_high: float = 0.2
    """eps_high: the ratio is clipped above at ``1 + clip_high``."""
    behaviour_cap: float = 2.0
    """C: the behaviour weight ``pi_prox / mu`` is truncated at C (token level)."""
    seq_mask: bool = False
    """Drop whole sequences whose geometric-mean behaviour weight leaves [seq_mask_low, seq_mask_high]."""
    seq_mask_low: float = 0.5
    """Lower bound of the kept range for ``seq_mask``."""
    seq_mask_high: float = 2.0
    """Upper bound of the kept range for ``seq_mask``."""
    kl_coef: float = 0.0
    """Weight of KL to the frozen reference (``low_var_kl``; needs ``ref_logprobs_BT``); 0 loads no reference."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (needs ``entropy_BT``)."""


@dataclass(kw_only=True)
class AlgoConfig(PPOLossConfig):
    """Advantage estimator and loss.  See ``learner.algorithms`` and ``learner.loss``; the
    loss's own fields (``clip_low`` ... ``entropy_coef``) come from ``PPOLossConfig``."""

    name: str = "grpo"
    """``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``ppo`` (GAE + value head) or ``sft``."""
    group_size: int = 8
    """Episodes per task in a group (a lease asks for one group; GRPO's G)."""
    lr: float = 1e-6
    """Adam learning rate (``turnscale run``'s recipe: 1e-4)."""
    lr_schedule: str = "constant"
    """``constant`` or ``cosine`` (after warm-up)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's (beta1, beta2)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0: none)."""
    gamma: float = 1.0
    """Discount of per-turn rewards (``reinforce_pp``'s returns, ``ppo``'s GAE)."""
    lam: float = 1.0
    """GAE lambda (``ppo``)."""
    value_coef: float = 0.5
    """Weight of the value head's loss (``ppo``)."""
    micro_batch_tokens: int = 8192
    """Token budget per micro-batch: real tokens with ``packing=varlen``, padded positions
    (rows x longest) with ``padded``."""
    packing: str = "varlen"
    """``varlen``: each micro-batch's episodes packed end to end in one row, attention kept
    per episode (``learner.packing``; no padding is computed); ``padded``: sorted by length
    and right-padded (the forward computes the pads too).  Same losses and gradients."""
    loss_agg: str = "token_mean"
    """``token_mean`` (every loss token weighs the same) or ``seq_mean_token_mean`` (every
    episode weighs the same; not applied to ``ppo``)."""
    prox_forward: str = "auto"
    """How the trainer gets ``pi_prox``: ``auto`` reuses the step's own forward (exact, as
    every batch gets one optimizer step), ``extra`` runs a separate no-grad forward first
    (the same numbers at ~1.5x the compute; a cross-check, and the hook for several updates
    per batch)."""

    def __post_init__(self) -> None:
        _require(self.name in ALGOS, "algo.name", f"{self.name!r}; choose one of {sorted(ALGOS)}")
        _require(self.group_size >= 1, "algo.group_size", "must be >= 1")
        _require(self.lr >= 0, "algo.lr", "must be >= 0")
        _require(self.lr_schedule in ("constant", "cosine"), "algo.lr_schedule", "constant or cosine")
        _require(self.behaviour_cap >= 1, "algo.behaviour_cap", "must be >= 1")
        _require(self.micro_batch_tokens > 0, "algo.micro_batch_tokens", "must be > 0")
        _require(self.packing in ("varlen", "padded"), "algo.packing", f"{self.packing!r}; choose varlen or padded")
        _require(self.loss_agg in ("token_mean", "seq_mean_token_mean"), "algo.loss_agg", f"{self.loss_agg!r}; choose token_mean or seq_mean_token_mean")
        _require(self.prox_forward in ("auto", "extra"), "algo.prox_forward", f"{self.prox_forward!r}; choose auto or extra")

    def loss_config(self) -> PPOLossConfig:
        """The loss's own config, copied out of this one."""
        return PPOLossConfig(**{f.name: getattr(self, f.name) for f in fields(PPOLossConfig)})


ALGOS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo", "sft"})


@dataclass(kw_only=True)
class ScheduleConfig:
    """ScalingInter-RL: ``turns[i]`` is in force from step ``i * every``; one entry = fixed."""

    turns: list[int] = field(default_factory=lambda: [10])
    """Turn limits of the stages (``[10]``: one fixed limit; ``[3, 5, 8]``: ScalingInter-
    RL)."""
    every: int = 100
    """Steps per stage: ``turns[i]`` applies from step ``i * every``."""

    def __post_init__(self) -> None:
        _require(len(self.turns) > 0 and all(t > 0 for t in self.turns), "schedule.turns", "a non-empty list of positive turn limits")
        _require(self.every > 0, "schedule.every", "must be > 0")


@dataclass(kw_only=True)
class LoggerConfig:
    jsonl: bool = True
    """Write ``metrics.jsonl`` in the learner's ``dir``."""
    tensorboard: bool = True
    """Write TensorBoard logs under ``<learner.dir>/tb``."""
    wandb: bool = False
    """Log to Weights & Biases (needs the ``wandb`` package and a login)."""
    wandb_project: str = "turnscale"
    """The W&B project name."""
    console_every_s: float = 5.0
    """Seconds between progress lines."""


CURVE_MODES = ("auto", "true", "false")


def _curve_mode(value: object, key: str) -> str:
    """``auto`` / ``true`` / ``false`` (YAML booleans and on/off/yes/no/1/0 accepted)."""
    v = str(value).strip().lower()
    v = {"on": "true", "yes": "true", "1": "true", "off": "false", "no": "false", "0": "false"}.get(v, v)
    _require(v in CURVE_MODES, key, f"{value!r} is not one of auto, true, false")
    return v


@dataclass(kw_only=True)
class LearnerCurveConfig:
    """ZeroMQ CURVE (authentication + encryption) on the learner's three sockets.
    Keys: ``turnscale keys DIR`` (docs/cluster.md, "CURVE between actors and the learner")."""

    enabled: str = "auto"
    """``auto``: on when ``learner.host`` is not a loopback address (127.0.0.0/8, ::1,
    localhost), off on loopback; ``true``; ``false`` (on a non-loopback address an explicit,
    logged, insecure choice)."""
    secret_key: str = ""
    """The learner's secret certificate (``DIR/learner.key_secret``)."""
    authorized: str = ""
    """Folder of the public certificates (``*.key``) of the actors allowed in
    (``DIR/authorized``).  Required when CURVE is on: a client whose key is not there is
    refused, even if it knows the learner's public key."""

    def __post_init__(self) -> None:
        self.enabled = _curve_mode(self.enabled, "learner.curve.enabled")


@dataclass(kw_only=True)
class ActorCurveConfig:
    """CURVE on the actor's sockets to the learner (control, announcements, weights)."""

    enabled: str = "auto"
    """``auto``: on when ``actor.learner_host`` is not a loopback address; ``true``; ``false``."""
    server_key: str = ""
    """The learner's public certificate (``DIR/learner.key``)."""
    secret_key: str = ""
    """This actor's secret certificate (``DIR/actor-N.key_secret``); its public key must be
    in the learner's ``learner.curve.authorized`` folder."""
    max_handshake_failures: int = 3
    """Failed CURVE handshakes with the learner (wrong server key, or a learner without
    CURVE) after which the actor exits with code 3.  A refused key (not authorized) exits at once."""

    def __post_init__(self) -> None:
        self.enabled = _curve_mode(self.enabled, "actor.curve.enabled")
        _require(self.max_handshake_failures >= 1, "actor.curve.max_handshake_failures", "must be >= 1")


@dataclass(kw_only=True)
class RelayConfig:
    """Weight fan-out through actor relays (docs/architecture.md, "Weight fan-out")."""

    enabled: bool = True
    """Actors that advertise a relay endpoint (``Hello.relay_endpoint``) are placed in a
    tree in registration order and told their sources (``Welcome``/``HeartbeatAck.
    weight_sources``); off: every actor pulls from the learner (the star)."""
    fanout: int = 1
    """Children per node: the learner serves ``fanout`` copies of each version and every
    relay uploads ``fanout`` copies.  1 (a chain) measured fastest on per-host capped links:
    chunk-level pipelining makes depth cheap, and each host's uplink carries one copy
    (benchmarks/README.md, "fanout")."""
    fallback_hops: int = 2
    """Ancestors an actor is told to ask (nearest first) before the learner: a dead parent
    costs a hop up the tree, not the learner's egress."""

    def __post_init__(self) -> None:
        _require(self.fanout >= 1, "learner.relay.fanout", "must be >= 1")
        _require(self.fallback_hops >= 1, "learner.relay.fallback_hops", "must be >= 1")


@dataclass(kw_only=True)
class FsdpConfig:
    """Mixed precision of the sharded learner (``learner.strategy=fsdp``; torch FSDP2's
    ``MixedPrecisionPolicy``).  The sharded parameters and the optimizer state stay float32."""

    param_dtype: str = "auto"
    """Dtype of the gathered parameters the forward and backward compute in: ``auto`` is
    ``bfloat16`` on cuda/npu and ``float32`` on cpu; or ``float32``, ``bfloat16``, ``float16``."""
    reduce_dtype: str = "float32"
    """Dtype of the gradient reduce-scatter across ranks."""
    meta_init: bool = True
    """Build the model on the meta device and have each rank read only its shards of the
    model folder's safetensors, so no rank ever holds the whole model; false: every rank
    loads the whole model, then shards it (for checkpoints whose tensor names transformers
    converts on load)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory (FSDP2's
    ``CPUOffloadPolicy``): each unit is copied to the device for its forward and backward,
    and the optimizer steps on the CPU.  Less device memory, slower steps."""

    def __post_init__(self) -> None:
        _require(self.param_dtype == "auto" or self.param_dtype in FLOAT_DTYPES, "learner.fsdp.param_dtype",
                 f"{self.param_dtype!r}: choose auto, {', '.join(FLOAT_DTYPES)}")
        _require(self.reduce_dtype in FLOAT_DTYPES, "learner.fsdp.reduce_dtype",
                 f"{self.reduce_dtype!r}: choose one of {', '.join(FLOAT_DTYPES)}")


LEARNER_STRATEGIES = ("ddp", "fsdp")


@dataclass(kw_only=True)
class LearnerConfig:
    host: str = "127.0.0.1"
    """Interface the learner binds; actors connect to it."""
    port: int = 5555
    """ROUTER for control messages."""
    pub_port: int = 5556
    """PUB for announcements."""
    weights_port: int = 5557
    """ROUTER for weight chunks (own thread)."""
    device: str = "cpu"
    """Where the learner trains: ``cpu``, ``cuda``, ``npu``."""
    groups_per_step: int = 4
    """Groups (of ``algo.group_size`` episodes) per optimizer step."""
    max_staleness: int = 1
    """0: synchronous on-policy training through the same code."""
    publish_every: int = 1
    """Publish new weights every this many steps (one policy version covers that many
    steps)."""
    transfer_dtype: str = "float32"
    """Dtype of published weights on the wire and in shared memory (``float32``,
    ``bfloat16``, ``float16``)."""
    chunk_mb: float = 32.0
    """Size of one weight chunk (each is checksummed and pulled on its own), in MiB."""
    weights_shm: bool = True
    """Keep published weights in shared-memory segments (memfds, ``protocol/shmweights.py``)
    and announce them: actors on this host copy them from there instead of pulling over
    TCP (``actor.weights_shm``).  Costs nothing extra: the buffers the TCP path serves
    from are the segments."""
    lease_ttl_s: float = 120.0
    """A lease expires this long after the last heartbeat naming it (its actor died or lost
    it); its task is re-issued."""
    heartbeat_interval_s: float = 5.0
    """How often actors heartbeat (sent in ``Welcome``); an actor silent for 3 intervals
    (and ``lease_ttl_s``) is forgotten."""
    steps: int = 100
    """Optimizer steps to train; the learner exits after the last (and its checkpoint)."""
    seed: int = 0
    """Seed of the task order and of the trainer."""
    dir: str = "runs/learner"
    """Checkpoints, metrics and trajectories go here."""
    checkpoint_every: int = 50
    """Write a checkpoint every this many steps (and after the last)."""
    keep_checkpoints: int = 2
    """Checkpoints kept; older ones are deleted."""
    resume: bool = False
    """Continue from the newest checkpoint in ``dir`` (step, version, task cursor,
    leases)."""
    init_from: str = ""
    """Start from this checkpoint/model folder instead of ``model.path`` weights (e.g. after SFT)."""
    save_trajectories: bool = True
    """Write every trained group's episodes to ``trajectories.jsonl`` (``turnscale view``
    reads it)."""
    sft_data: str = ""
    """``algo=sft``: conversations JSONL to train on offline (``learner/sft_data.py``); no actors."""
    max_actors: int = 4096
    """Registered actors at most (more Hellos are refused, retryable)."""
    max_leases_per_actor: int = 64
    """Leases one actor may hold at once (also capped by its ``Hello.max_groups`` and, while
    other actors want leases, by its fair share of the admission window: ``learner/control.py``)."""
    max_actor_ids_per_connection: int = 1
    """Live actor ids one connection may register (each id gets its own share of leases); a
    ``Hello`` for more is refused ``too_many_actor_ids``.  An actor uses one."""
    max_actor_ids_per_key: int = 8
    """With CURVE: live actor ids one client key may register, over all its connections
    (e.g. the actors of one host sharing one key); raise it for more actors per key."""
    lease_progress_timeout_s: float = 120.0
    """A lease expires (its task re-issued) when its actor has made no progress for this long:
    returned no group and reported no growth of ``tokens_generated`` or ``decode_steps`` in
    its heartbeats.  Heartbeats alone do not extend it, so an actor whose engine hangs while
    its heartbeat runs loses its leases (``lease_ttl_s`` still ends them sooner if its
    heartbeats stop)."""
    max_message_mb: float = 64.0
    """Largest control message (a trajectory group; frames added up) the learner reads."""
    max_abs_reward: float = 1e6
    """Largest magnitude of an episode's reward and of each turn's reward in a received
    group; a group past it is dropped as ``invalid`` at intake (its task re-issued).  Env
    rewards are in [0, 1] per step (SciWorld's native score, through AgentGym's own server,
    within +-100 per step), so 1e6 refuses no legal reward while keeping the advantage
    statistics (squares, sums over a batch) far inside float32.  0: no bound (non-finite
    rewards are refused anyway)."""
    max_header_mb: float = 0.0
    """Largest msgpack header (frame 0) of a control message.  0: what a legal group
    needs, with room: 64 bytes per token of ``algo.group_size * sampling.max_context_tokens``,
    at least 1 MiB (1 MiB with the defaults; a default group's header is ~0.3 MB).  A header
    decodes into Python objects (up to ~60x its size), so this bounds a decode's time and memory."""
    max_frames: int = 1024
    """Frames of one control message (a group is a header and a few data frames; at most
    4 per episode without an arena).  Frames past it are dropped as they arrive and the
    message is refused, never decoded."""
    decode_queue: int = 8
    """Large control messages (64 KiB and up: trajectory groups) waiting to be decoded off
    the control loop, besides the one being decoded; one per connection.  Past either bound
    a message is answered at once with a retryable ``ErrorReply(code="busy")``."""
    debug_step_delay_s: float = 0.0
    """Tests and benchmarks only: sleep this long before every optimizer step (a slow learner,
    to exercise admission control and backpressure).  0 in real runs."""
    rank_timeout_s: float = 300.0
    """Several learner ranks (``torchrun``; ``learner/ranks.py``): longest wait of rank 0 for a
    follower rank to take its share of a step; past it rank 0 fails with ``RankError``."""
    strategy: str = "ddp"
    """Several learner ranks: ``ddp`` (every rank holds the whole model, its gradients and
    optimizer state) or ``fsdp`` (torch FSDP2: parameters, gradients and optimizer state
    sharded across ranks, per decoder layer; ``learner/fsdp.py``).  One rank: no sharding."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them
    (less memory, about a third more compute); either strategy."""
    curve: LearnerCurveConfig = field(default_factory=LearnerCurveConfig)
    """CURVE on the learner's sockets (on by default off loopback)."""
    relay: RelayConfig = field(default_factory=RelayConfig)

    def __post_init__(self) -> None:
        _require(self.max_staleness >= 0, "learner.max_staleness", "must be >= 0")
        _require(self.groups_per_step > 0, "learner.groups_per_step", "must be > 0")
        _require(self.publish_every > 0, "learner.publish_every", "must be > 0")
        _require(self.debug_step_delay_s >= 0, "learner.debug_step_delay_s", "must be >= 0")
        _require(self.max_actors >= 1, "learner.max_actors", "must be >= 1")
        _require(self.max_leases_per_actor >= 1, "learner.max_leases_per_actor", "must be >= 1")
        _require(self.max_actor_ids_per_connection >= 1, "learner.max_actor_ids_per_connection", "must be >= 1")
        _require(self.max_actor_ids_per_key >= 1, "learner.max_actor_ids_per_key", "must be >= 1")
        _require(self.lease_progress_timeout_s > 0, "learner.lease_progress_timeout_s", "must be > 0")
        _require(self.max_message_mb > 0, "learner.max_message_mb", "must be > 0")
        _require(self.max_abs_reward >= 0, "learner.max_abs_reward", "must be >= 0 (0: no bound)")
        _require(self.max_header_mb >= 0, "learner.max_header_mb", "must be >= 0 (0: derived from the group size and context)")
        _require(self.max_frames >= 2, "learner.max_frames", "must be >= 2 (a header and a data frame)")
        _require(self.decode_queue >= 0, "learner.decode_queue", "must be >= 0")
        _require(self.rank_timeout_s > 0, "learner.rank_timeout_s", "must be > 0")
        _require(self.strategy in LEARNER_STRATEGIES, "learner.strategy",
                 f"{self.strategy!r}: choose one of {', '.join(LEARNER_STRATEGIES)}")
        _require(self.transfer_dtype in FLOAT_DTYPES, "learner.transfer_dtype", f"{self.transfer_dtype!r} not supported")


@dataclass(kw_only=True)
class ActorConfig:
    learner_host: str = "127.0.0.1"
    """Address of the learner (its ``learner.host``, as this actor reaches it)."""
    learner_port: int = 5555
    """The learner's control port (``learner.port``); the announcement and weight ports come
    in ``Welcome``."""
    max_groups: int = 2
    """Leases run at once."""
    actor_id: str = ""
    """Empty: ``host-pid-random``."""
    pool: str = "default"
    """The pool this actor belongs to (``Hello.pool``): a named kind of hardware with its own
    engine settings (``nvidia``, ``ascend``, ``cpu``); metrics and scaling are split by it."""
    request_timeout_s: float = 30.0
    """Longest wait for the learner's answer to one request; past it the actor treats the
    learner as lost and reconnects."""
    reconnect_max_backoff_s: float = 10.0
    """Cap of the exponential backoff between ``Hello`` attempts while the learner is
    unreachable."""
    learner_lost_timeout_s: float = 1800.0
    """Give up after this long without a learner (from the start, or since the last session
    was lost: a learner killed without a goodbye, a node lost): the actor exits with code 4
    saying so, instead of reconnecting until its job's time limit.  0: never give up.  Long
    enough by default for a requeued learner job to come back (Slurm holds a requeued job
    about 2 minutes) and resume from its checkpoint."""
    shutdown_grace_s: float = 10.0
    """On SIGTERM, finish running groups for at most this long, then abandon them."""
    stop_timeout_s: float = 3.0
    """Once stopping, every request to the learner (the last groups, ``Goodbye``, a pending
    ``Hello``), including one already waiting when the stop began, gets at most this long,
    and so does closing the env instances: an actor whose learner and env server are gone
    exits within ``shutdown_grace_s + 2 * stop_timeout_s`` (Slurm SIGKILLs ``KillWait``,
    30 s, after SIGTERM)."""
    env_url: str = ""
    """Override the env server URL the learner announces (e.g. a host-local envhub)."""
    env_batch_steps: bool = False
    """Coalesce the concurrent env steps of this actor's episodes into ``POST
    /v1/step_batch`` requests (envhub servers only; ``common.envclient``).  Worth it for fast,
    CPU-bound envs (BabyAI, TextCraft: ~2x the steps per CPU second of one request per
    step); leave off for envs whose steps wait on something else (SciWorld's JVMs), which a
    batch would run one after another."""
    verify_weights: bool = True
    """After every swap, checksum the engine's weights against the pulled bytes (engines
    that can: ``hf``); a mismatch (torn or corrupted weights) is counted as
    ``torn_weights``, logged, and the version pulled again.  Costs one checksum pass over
    the model per version (crc32c runs at memory-copy speed)."""
    curve: ActorCurveConfig = field(default_factory=ActorCurveConfig)
    """CURVE on the sockets to the learner (on by default when the learner is not on loopback)."""
    relay: bool = True
    """Serve the weight chunks this actor holds to other actors (``actors/relay.py``) when
    it has an address they can reach (``relay_host``)."""
    relay_host: str = ""
    """Address other actors reach this actor's relay at.  Empty: the local address of the
    route to the learner, unless ``learner_host`` is a loopback address (an actor on the
    learner's host keeps its direct local pull and serves no relay)."""
    relay_port: int = 0
    """Port of the relay; 0 picks a free one."""
    weights_shm: str = "auto"
    """Same-host weights: ``auto`` reads an announced shared-memory segment when it opens
    from here with the announced token (the actor shares the learner's host), else pulls
    over TCP; ``false`` always pulls over TCP; ``true`` is ``auto`` plus a warning each
    time the segment cannot be used."""

    def __post_init__(self) -> None:
        self.weights_shm = str(self.weights_shm).lower()  # a command-line ``true`` arrives as a bool
        _require(self.weights_shm in ("auto", "true", "false"), "actor.weights_shm",
                 f"must be auto, true or false, got {self.weights_shm!r}")
        _require(bool(self.pool) and self.pool.isprintable() and len(self.pool) <= 256, "actor.pool",
                 "must be a non-empty printable name (at most 256 characters)")
        _require(self.stop_timeout_s > 0, "actor.stop_timeout_s", "must be > 0 seconds")
        _require(self.learner_lost_timeout_s >= 0, "actor.learner_lost_timeout_s", "must be >= 0 seconds (0: never give up)")


@dataclass(kw_only=True)
class WarmStartConfig:
    """``turnscale run``'s supervised warm start on oracle episodes (``algo=sft``)."""

    episodes: int = 300
    """Oracle conversations to play (from ``run.warmup_seeds``); unsolved ones are skipped."""
    max_turns: int = 8
    """Oracle episodes longer than this are skipped."""
    steps: int = 40
    """SFT steps (0 skips the warm start); stopped early on purpose, so RL has room."""
    lr: float = 3e-3
    """Learning rate of the SFT warm start."""
    batch_episodes: int = 16
    """Conversations per SFT step."""
    rounds: int = 1
    """With ``run.adapt``: up to this many SFT rounds, round k training ``steps * 2**(k-1)``
    more steps (``recipe.round_steps``), stopping once a probe
    on training tasks predicts at least ``min_mixed`` of GRPO groups with mixed rewards
    (``turnscale/recipe.py``)."""
    min_mixed: float = 0.3
    """Predicted share of groups with both a success and a failure that counts as signal."""
    probe_tasks_per_level: int = 8
    """Training tasks per level in the probe after each round (held-out tasks are never used)."""
    action_noise: float = 0.0
    """BabyAI: the share of demonstration turns where the demonstrator takes a uniformly random
    available action instead of the oracle's, the oracle replanning from there (a fumbling
    demonstrator, as a base model is, rather than an optimal planner).  Seeded per task.
    The turn-limit fit (``run.adapt``) still surveys the oracle's own play."""

    def __post_init__(self) -> None:
        _require(self.rounds >= 1, "run.warm_start.rounds", "must be >= 1")
        _require(0.0 <= self.action_noise < 1.0, "run.warm_start.action_noise", "a fraction in [0, 1)")
        _require(0.0 <= self.min_mixed <= 1.0, "run.warm_start.min_mixed", "a fraction in [0, 1]")
        _require(self.probe_tasks_per_level >= 1, "run.warm_start.probe_tasks_per_level", "must be >= 1")


@dataclass(kw_only=True)
class PoolConfig:
    """One actor pool of ``turnscale slurm``: a named kind of actor hardware, its Slurm
    placement and its engine settings; one job array per pool."""

    name: str = "cpu"
    """Pool name (``actor.pool``; metrics and scaling are split by it)."""
    count: int = 1
    """Actors (array tasks) submitted at start."""
    min_actors: int = 0
    """Fewest actors the scaling controller keeps in this pool."""
    max_actors: int = 8
    """Bounds for the scaling controller."""
    cost: float = 1.0
    """Relative price of one actor (scale-up prefers tokens/s per cost)."""
    constraint: str = ""
    """``sbatch -C`` (node features, e.g. ``nvidia``, ``ascend``)."""
    partition: str = ""
    """``sbatch -p`` (empty: ``slurm.partition``)."""
    cpus_per_task: int = 2
    """``sbatch --cpus-per-task`` of each actor."""
    gres: str = ""
    """``sbatch --gres`` (e.g. ``gpu:1``, ``npu:1``); empty with an ``accelerator``: generated."""
    accelerator: str = ""
    """``nvidia`` or ``ascend``: each actor gets ``devices`` of them: ``--gres=gpu:<devices>`` /
    ``--gres=npu:<devices>`` (unless ``gres`` is set), its own devices (Slurm's allocation to
    the task) in ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES`` unless already set, and
    ``engine.device=cuda`` / ``npu`` (before ``overrides``).  Empty: CPU actors."""
    devices: int = 1
    """Accelerator devices per actor (with ``accelerator``)."""
    overrides: list[str] = field(default_factory=list)
    """Hydra overrides for this pool's actors (``engine=vllm``, ``engine.dtype=bfloat16``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables of this pool's actors (set before the device variable, so one
    named here wins)."""

    def __post_init__(self) -> None:
        _require(bool(self.name) and self.name.isascii() and self.name.replace("_", "").isalnum(), "slurm.pools[].name",
                 f"{self.name!r}: letters, digits and '_' only (it names files and jobs, and actor ids are "
                 "'<pool>-<job>_<task>': a '-' would make them ambiguous)")
        _require(0 <= self.min_actors <= self.max_actors, f"slurm.pools[{self.name}]", "needs 0 <= min_actors <= max_actors")
        _require(self.count >= 0 and self.cpus_per_task >= 1 and self.cost > 0, f"slurm.pools[{self.name}]",
                 "needs count >= 0, cpus_per_task >= 1, cost > 0")
        _require(self.accelerator in ("", "nvidia", "ascend"), f"slurm.pools[{self.name}].accelerator",
                 f"{self.accelerator!r} is not one of nvidia, ascend (empty: CPU actors)")
        _require(self.devices >= 1, f"slurm.pools[{self.name}].devices", "must be >= 1")


@dataclass(kw_only=True)
class SlurmConfig:
    """``turnscale slurm``: sbatch scripts for one learner job, one envhub job (or an
    external env URL) and one actor job array per pool (``turnscale/slurm.py``)."""

    dir: str = "slurm-run"
    """Run folder on storage every node sees: scripts, logs, the learner's address file,
    the learner's run dir (``learner.dir`` is set to ``<dir>/learner``)."""
    python: str = "python"
    """Interpreter on the nodes (with turnscale installed)."""
    workdir: str = ""
    """``cd`` here before starting (empty: the folder ``turnscale slurm`` ran in)."""
    partition: str = ""
    """``sbatch -p`` for every job (empty: the cluster's default)."""
    account: str = ""
    """``sbatch -A`` for every job (empty: none)."""
    time: str = ""
    """``sbatch --time`` for every job (empty: the partition's default)."""
    learner_constraint: str = ""
    """``sbatch -C`` of the learner job (node features)."""
    learner_gres: str = ""
    """``sbatch --gres`` of the learner job (e.g. ``gpu:1``)."""
    learner_cpus: int = 4
    """``sbatch --cpus-per-task`` of the learner job."""
    learner_ranks: int = 1
    """Ranks of the learner job (one node): above 1 the job runs ``torchrun --standalone
    --nproc_per_node=<ranks> -m turnscale learner`` (``learner/ranks.py``: rank 0 serves,
    every rank trains its share of each step under DDP); give it as many devices
    (``learner_gres``, e.g. ``gpu:4``) and cpus."""
    env_url: str = ""
    """An external env server (e.g. AgentGym's); empty: an envhub job is submitted."""
    envhub_cpus: int = 2
    """``sbatch --cpus-per-task`` of the envhub job."""
    envhub_idle_exit_s: float = 1800.0
    """The envhub job's ``env.exit_after_idle_s``: its server exits once no actor has called it
    for this long, so it ends even where ``squeue`` cannot say that the learner job is gone
    (0: never)."""
    wait_s: int = 600
    """How long an actor job waits for the learner's (or envhub's) address file when it does not
    know that job's id (``learner.job`` / ``envhub.job``, written by ``turnscale slurm``): with
    the id it waits for as long as that job is queued or running (``slurm.poll_s``)."""
    poll_s: int = 30
    """How often (seconds) each envhub and actor job asks ``squeue`` whether the learner job
    (and, while waiting for its URL, the envhub job) is still queued or running: one that has
    left the queue without ``learner.done`` (cancelled, killed, out of memory, node lost) ends
    them within about this long.  Every job asks once per period: keep it long on big clusters."""
    resubmit_backoff_s: float = 30.0
    """``turnscale autoscale``: a pool whose resubmitted actors are lost again before registering
    (they keep failing) waits this long before the next resubmission, doubling each time."""
    resubmit_backoff_max_s: float = 600.0
    """Longest wait between resubmissions of a failing pool."""
    free_ports: bool = True
    """The learner and envhub jobs pick ports no socket on their node uses when they start
    (``learner.port``/``pub_port``/``weights_port``, ``env.port`` are then ignored) and publish
    them in ``learner.addr`` / ``envhub.url``; false: the configured ports (two runs on one
    node clash)."""
    interface: str = ""
    """Network interface whose IPv4 address the learner and envhub jobs bind and publish
    (e.g. ``ib0``, a separate fast network); empty: the node's first address (``hostname -I``),
    every interface bound."""
    pools: list[PoolConfig] = field(default_factory=lambda: [PoolConfig()])
    """Actor pools, one job array each (``PoolConfig``); on the command line
    ``'slurm.pools=[{name:cpu,count:4}]'``."""

    def __post_init__(self) -> None:
        _require(self.interface == "" or (len(self.interface) < 16 and self.interface.isascii() and all(
            ch.isalnum() or ch in "._:-" for ch in self.interface)), "slurm.interface",
            f"{self.interface!r} is not a network interface name (e.g. ib0, eth1)")
        names = [p.name for p in self.pools]
        _require(bool(names) and len(set(names)) == len(names), "slurm.pools", f"needs unique pool names, got {names}")
        _require(self.learner_cpus >= 1 and self.envhub_cpus >= 1 and self.wait_s >= 1, "slurm", "cpus and wait_s must be >= 1")
        _require(self.learner_ranks >= 1, "slurm.learner_ranks", f"must be >= 1, got {self.learner_ranks}")
        _require(self.poll_s >= 1, "slurm.poll_s", f"must be >= 1 second, got {self.poll_s}")
        _require(self.envhub_idle_exit_s >= 0, "slurm.envhub_idle_exit_s", f"must be >= 0 seconds (0: never), got {self.envhub_idle_exit_s}")
        _require(0 < self.resubmit_backoff_s <= self.resubmit_backoff_max_s, "slurm.resubmit_backoff_s",
                 "needs 0 < resubmit_backoff_s <= resubmit_backoff_max_s")


@dataclass(kw_only=True)
class RunConfig:
    """``turnscale run``: every process on one machine (``turnscale/launch.py``)."""

    dir: str = "runs/default"
    """The run's folder: task lists, warm start, learner (checkpoints, metrics),
    evaluations, ``summary.json`` and plots."""
    actors: int = 2
    """Actor processes started on this machine."""
    warmup_seeds: str = "0:30"
    """Seeds (``a:b``) whose tasks the oracle plays for the warm start."""
    train_seeds: str = "30:1000"
    """Seeds of the RL training tasks."""
    test_seeds: str = "1000:1006"
    """Seeds of the held-out tasks (before/after success rates)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval_turns: int = 6
    """Turn limit of the held-out evaluations."""
    eval_samples: int = 1
    """Episodes per held-out task."""
    adapt: bool = True
    """Fit the recipe to the level mix (BabyAI): survey the oracle, stretch the turn limits to
    what the levels need, warm-start in rounds until RL has signal (``turnscale/recipe.py``)."""
    adapt_max_turns: int = 32
    """Cap on the oracle's turns in the survey (and on the fitted turn limits)."""
    adapt_loss_agg: str = "seq_mean_token_mean"
    """``algo.loss_agg`` when the fit stretches the turn limits (empty: keep ``algo.loss_agg``).
    Long multi-turn failures outweigh short successes under a plain token mean; on a
    KeyInBox mix stretched to 16 turns, token_mean collapsed (docs/results.md, "Other level mixes")."""
    timeout_s: float = 0.0
    """Wall-clock limit of one ``turnscale run`` invocation, in seconds; 0 (default): none.
    When it passes, training stops gracefully (the learner checkpoints), the newest
    checkpoint is still evaluated held out, and ``summary.json`` says
    ``stopped: time limit after step N of M``; ``run.resume=true`` continues from there."""
    resume: bool = False
    """Continue a stopped run in ``run.dir`` from its checkpoint: the phases already done
    (task files, recipe fit, warm start, its evaluation) are skipped, and the stopped run's
    own configuration (``<run.dir>/run_config.yaml``) is used, except ``run.timeout_s`` and
    ``logger.console_every_s`` from this command line."""
    actor_python: str = ""
    """Python interpreter of the processes that run the engine (actors and evaluations);
    empty: the launcher's own.  ``engine=vllm`` on CPU: ``.venv-vllm/bin/python``
    (``scripts/setup_vllm.sh``)."""

    def __post_init__(self) -> None:
        _require(self.actors >= 1, "run.actors", "must be >= 1")
        _require(self.adapt_max_turns >= 1, "run.adapt_max_turns", "must be >= 1")
        _require(self.timeout_s >= 0, "run.timeout_s", "must be >= 0 seconds (0: no time limit)")
        _require(self.adapt_loss_agg in ("", "token_mean", "seq_mean_token_mean"), "run.adapt_loss_agg",
                 f"{self.adapt_loss_agg!r}; choose '', token_mean or seq_mean_token_mean")
        for key in ("warmup_seeds", "train_seeds", "test_seeds"):
            a, sep, b = getattr(self, key).partition(":")
            _require(sep == ":" and a.isdigit() and b.isdigit() and int(a) < int(b), f"run.{key}", "a seed range 'a:b' with a < b")


@dataclass(kw_only=True)
class Config:
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    run: RunConfig = field(default_factory=RunConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
