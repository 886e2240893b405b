"""Every message that crosses a process boundary between actors and the learner.

Records are frozen, keyword-only dataclasses.  Each field carries a docstring; arrays
note their shape and dtype (``[T] int32``).  ``protocol.codec`` encodes them as
MessagePack with the schema version on every message and validates every field on
decode against the annotations here (plus each record's ``check``).

The conversation (actor ``DEALER`` <-> learner ``ROUTER``, one request, one reply):

    Hello            -> Welcome | ErrorReply
    LeaseRequest     -> LeaseGrant            (zero leases + retry_after_s when admission is closed)
    TrajectoryGroup  -> GroupAck              (accepted or dropped, with the reason)
    Heartbeat        -> HeartbeatAck          (names leases the learner no longer holds)
    Goodbye          -> GroupAck(lease_id="") (learner releases the actor's leases)

A scaling controller (its own ``DEALER`` to the same ``ROUTER``; no registration):

    ControlRequest   -> LearnerStatus         (drain actors, set the lease limit, read the signals)

A drained actor is answered ``Shutdown(reason="drained")`` on its next ``LeaseRequest``
once it holds no lease; it says ``Goodbye`` and exits.

Weights (actor ``DEALER`` <-> learner weights ``ROUTER``, its own socket and thread):

    WeightChunkRequest -> WeightChunk | ErrorReply

Announcements (learner ``PUB`` -> actor ``SUB``): ``PolicyAnnouncement``, ``Shutdown``.

Example::

    lease = Lease(lease_id="l-17", task=Task(env="babyai", data_idx=17),
                  group_size=8, turn_limit=10, policy_version=3, ttl_s=120.0, seed=17)
    frames = codec.encode(lease)
    assert codec.decode(frames) == lease
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from turnscale.protocol.dtypes import WIRE_DTYPES
from turnscale.protocol.errors import ProtocolError

SCHEMA_VERSION = 9
"""Bumped on every incompatible change; a message with another version is rejected.
(3: ``PolicyAnnouncement.turn_limit`` and ``HeartbeatAck.policy_version`` removed: no one
read them; a lease carries its turn limit and version.  4: weight fan-out through actor
relays: ``Hello.relay_endpoint``, ``Welcome.weight_sources``, ``HeartbeatAck.weight_sources``.  5: out-of-band arrays are
packed, several to a data frame: the array ext is ``[dtype, shape, frame, offset]``;
``PolicyAnnouncement.shm_path`` / ``shm_token``: same-host weights in shared memory.
6: relays authenticate their clients: ``Welcome``/``HeartbeatAck.relay_clients``.
7: actor pools and elastic scaling: ``Hello.pool``, ``ControlRequest``, ``LearnerStatus``.
8: ``WeightChunkRequest.count``: one request for a run of chunks, one reply with several.
9: a run is answered one message per chunk, by the learner as by relays, so a relay chain
pipelines chunk by chunk.)"""

MAX_CHUNKS_PER_REQUEST = 64
"""Most chunks one ``WeightChunkRequest`` may ask for."""

FINISH_REASONS = frozenset(
    {"done", "truncated", "turn_limit", "context_limit", "env_error", "aborted", "render_error"}
)
"""Why an episode ended.  Only ``done`` (terminal), ``truncated`` (the env's own time
limit), ``turn_limit`` and ``context_limit`` episodes are trainable; a group holding any
other is reported ``failed`` and never trained on.  Every trainable reason but ``done``
is a cut, not a terminal state (value bootstrapping)."""

TRAINABLE_FINISH_REASONS = frozenset({"done", "truncated", "turn_limit", "context_limit"})


def array_field(dtype: str, ndim: int = 1) -> Any:
    """A numpy array field: the codec enforces ``dtype`` exactly and ``ndim``."""
    return field(metadata={"dtype": np.dtype(dtype), "ndim": ndim})


def record(cls=None, /, *, eq: bool = True, slots: bool = True):
    """Decorator: a frozen, keyword-only dataclass registered with the codec; slotted
    unless ``slots=False``.  ``slots=False`` is for a record of scalar fields only that a
    message carries by the hundred (``Turn``): its ``__dict__`` holds exactly its fields
    in field order, so the codec writes that dict as the record's map and adopts the map
    it decoded as the new record's ``__dict__`` (a few times cheaper per record than
    reading and filling a dozen slots; ``protocol/codec.py``)."""

    def wrap(c):
        d = dataclass(frozen=True, slots=slots, kw_only=True, eq=eq)(c)
        REGISTRY[d.__name__] = d
        return d

    return wrap if cls is None else wrap(cls)


REGISTRY: dict[str, type] = {}
"""Type name -> record class; the codec decodes only names listed here."""


def _fail(where: str, what: str) -> None:
    raise ProtocolError(f"{where}: {what}")


# ----------------------------------------------------------------------------- shared


@record
class Task:
    """One task of one environment, as the envhub selects it."""

    env: str
    """Environment family name (``babyai``, ``textcraft``, ``sciworld``, ``searchqa``, ``webarena``)."""
    data_idx: int
    """Index the env server maps deterministically to a task (AgentGym's ``data_idx``)."""
    split: str = "train"
    """Which split the index was drawn from (``train``/``test``/``warmup``); informational."""
    task_id: str = ""
    """AgentGym-RL's item id (``babyai_17``) when the task came from such a file."""


@record
class SamplingParams:
    """How actors sample.  Log-prob convention: ``log_softmax(logits / temperature)`` over
    the full vocabulary, before any top-p/top-k truncation, in float32 — the learner
    computes the same quantity, so identical weights give identical log-probs."""

    temperature: float = 1.0
    """Softmax temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables."""
    max_new_tokens: int = 256
    """Maximum tokens generated per turn."""
    max_context_tokens: int = 4096
    """An episode whose prompt would exceed this ends with ``context_limit``."""

    def check(self) -> None:
        if not self.temperature > 0:
            _fail("SamplingParams.temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail("SamplingParams.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens <= 0 or self.max_context_tokens <= 0:
            _fail("SamplingParams", "top_k >= 0, max_new_tokens > 0 and max_context_tokens > 0")


@record
class EnvEndpoint:
    """Where actors reach one env family's server."""

    name: str
    """Env family name, as in ``Task.env``."""
    url: str
    """Base URL of the envhub server, e.g. ``http://127.0.0.1:8301``."""
    flavor: str = "turnscale"
    """What that server speaks (``common.envclient.FLAVORS``): ``turnscale`` for envhub,
    ``agentgym`` for AgentGym's own servers (``env.options.flavor``)."""


# ----------------------------------------------------------------------------- weights


DTYPE_SIZES = WIRE_DTYPES
"""Bytes per element of every dtype a weight tensor may travel in (``protocol.dtypes``)."""


@record
class TensorInfo:
    """Where one tensor lives in the concatenated, chunked weight bytes."""

    name: str
    """Parameter name in the HF state dict (``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str
    """Transfer dtype name (``bfloat16``, ``float16``, ``float32``)."""
    shape: list[int]
    """Tensor shape."""
    offset: int
    """Byte offset of the tensor in the concatenated stream."""
    nbytes: int
    """Size in bytes."""


@record
class ChunkInfo:
    """One chunk of the concatenated weight bytes."""

    index: int
    """Chunk number, from 0."""
    offset: int
    """Byte offset of the chunk in the concatenated stream."""
    nbytes: int
    """Chunk size in bytes."""
    checksum: int
    """``WeightManifest.checksum_algo`` of the chunk's bytes."""


@record
class WeightManifest:
    """What a policy version's weights look like on the wire.  Chunks are pulled on
    request (``WeightChunkRequest``), so a late joiner just pulls the latest version."""

    version: int
    """Policy version these weights are."""
    dtype: str
    """Transfer dtype of every floating tensor."""
    total_bytes: int
    """Sum of all tensors' bytes."""
    checksum_algo: str
    """Checksum used per chunk (``crc32``)."""
    tensors: list[TensorInfo]
    """Every tensor, in stream order."""
    chunks: list[ChunkInfo]
    """Every chunk, in stream order; they tile ``[0, total_bytes)``."""

    def check(self) -> None:
        pos = 0
        for i, c in enumerate(self.chunks):
            if c.index != i:
                _fail("WeightManifest.chunks", f"chunk at position {i} says index {c.index}")
            if c.offset != pos or c.nbytes < 0:
                _fail("WeightManifest.chunks", f"chunk {c.index} does not tile the stream")
            pos += c.nbytes
        if pos != self.total_bytes:
            _fail("WeightManifest", f"chunks cover {pos} bytes, total_bytes is {self.total_bytes}")
        for t in self.tensors:
            if t.offset < 0 or t.offset + t.nbytes > self.total_bytes:
                _fail("WeightManifest.tensors", f"{t.name} lies outside the stream")
            size = DTYPE_SIZES.get(t.dtype)
            if size is None:
                _fail("WeightManifest.tensors", f"{t.name}: unknown dtype {t.dtype!r} (one of {sorted(DTYPE_SIZES)})")
            numel = 1
            for d in t.shape:
                if d < 0:
                    _fail("WeightManifest.tensors", f"{t.name}: negative dimension in shape {t.shape}")
                numel *= d
            if numel * size != t.nbytes:
                _fail("WeightManifest.tensors", f"{t.name}: shape {t.shape} x {t.dtype} is {numel * size} bytes, "
                      f"nbytes says {t.nbytes}")


@record
class PolicyAnnouncement:
    """Published on PUB after every weight publication (and re-sent periodically)."""

    version: int
    """Policy version now current; actors tag sampled tokens with it after swapping."""
    step: int
    """Learner optimizer step at publication."""
    manifest: WeightManifest | None = None
    """How to pull the weights; ``None`` only before the first publication.  (The turn limit
    is not announced: every lease carries the limit it was issued under.)"""
    incarnation: str = ""
    """Identifies the learner *process* that published these weights: a fresh random id per
    start, also after a resume (``run_id`` survives resumes).  ``(incarnation, version)``
    names one set of weights; an actor whose weights carry another incarnation drops them
    and pulls (a resumed learner may reuse a version number for other weights)."""
    shm_path: str = ""
    """Where an actor on the learner's host can read this version's stream from shared memory
    (``/proc/<pid>/fd/<fd>`` of a ``protocol.shmweights`` segment); empty: TCP only.  Same
    manifest and checksums as the TCP path; an actor that cannot open it (another host) or
    finds another ``shm_token`` there pulls over TCP."""
    shm_token: str = ""
    """Hex token the segment's header must hold (same-host check)."""


@record
class WeightChunkRequest:
    """Ask the weights socket (learner or relay) for a run of chunks of one version.  The
    replies carry chunks ``index, index + 1, ...`` (cut at the last chunk) in order, one
    message per chunk, each a ``WeightChunk`` (its header frame, then its data frame): the
    learner sends them all at once, a relay those it has verified and the rest as it
    verifies them.  A message per chunk lets a relay forward a chunk before the run's next
    one has arrived (ZeroMQ hands a message over only whole).

    Example: ``WeightChunkRequest(version=3, index=8, count=4)`` asks for chunks 8..11."""

    version: int
    """Policy version wanted; the learner keeps only the latest few."""
    index: int
    """First chunk index in that version's manifest."""
    count: int = 1
    """Chunks in the run (1..``MAX_CHUNKS_PER_REQUEST``): one request for several chunks
    cuts the requests and keeps the pipe full without a deep window."""

    def check(self) -> None:
        if not 1 <= self.count <= MAX_CHUNKS_PER_REQUEST:
            _fail("WeightChunkRequest.count", f"must be in 1..{MAX_CHUNKS_PER_REQUEST}, got {self.count}")


@record(eq=False)
class WeightChunk:
    """One chunk of weight bytes."""

    version: int
    """Policy version it belongs to."""
    index: int
    """Chunk index."""
    checksum: int
    """Checksum of ``data`` (the manifest's algorithm)."""
    data: np.ndarray = array_field("uint8")
    """[nbytes] uint8 raw bytes of the chunk; sent out-of-band without a copy."""


# ----------------------------------------------------------------------------- session


@record
class Hello:
    """First message of an actor (and again after every reconnect)."""

    actor_id: str
    """Unique per actor process (e.g. ``host-pid-random``)."""
    host: str
    """Hostname, for metrics and logs."""
    pid: int
    """Process id."""
    engine: str
    """Inference engine (``hf``, ``vllm``, ``sim``)."""
    device: str
    """Device the engine runs on (``cpu``, ``cuda:0``, ``npu:0``)."""
    max_groups: int
    """How many leases the actor will run at once (the learner grants no more)."""
    token: str = ""
    """Random per actor *process*: a reconnecting process keeps its actor id by presenting
    the same token; another process cannot take a live actor's id."""
    relay_endpoint: str = ""
    """Where this actor serves the weight chunks it holds to other actors (its
    ``RelayServer``, ``tcp://host:port`` reachable by them); empty: it serves none."""
    relay_public_key: str = ""
    """The relay's CURVE public key (z85 text) when it serves CURVE (the actor's own key
    pair); empty: a plain relay."""
    pool: str = "default"
    """The actor's pool: the named kind of hardware and engine settings it runs on
    (``nvidia``, ``ascend``, ``cpu``); metrics and the scaling signals are split by it."""
    schema_version: int = SCHEMA_VERSION
    """The actor's protocol version (also checked on the envelope)."""


@record
class Welcome:
    """The run's settings, everything an actor needs to start working."""

    run_id: str
    """Identifies the learner run; changes when a new run starts (not on resume).
    ``policy.incarnation`` identifies the learner process (changes on every start)."""
    actor_id: str
    """Echo of ``Hello.actor_id``."""
    model_path: str
    """HF model reference or local folder the actor loads its architecture/tokenizer from."""
    renderer: str
    """Chat renderer name (``chatml``, ``llama3``, ``auto``)."""
    sampling: SamplingParams
    """Sampling settings for every turn."""
    envs: list[EnvEndpoint]
    """Env servers, one per family the learner trains on."""
    transfer_dtype: str
    """dtype weights travel in."""
    pub_endpoint: str
    """Where to SUB for ``PolicyAnnouncement``/``Shutdown`` (``tcp://host:port``)."""
    weights_endpoint: str
    """Where to DEALER for ``WeightChunkRequest``."""
    heartbeat_interval_s: float
    """How often to send ``Heartbeat``; a lease not heartbeated for its ttl is re-issued."""
    policy: PolicyAnnouncement
    """The current policy (pull its weights before the first lease)."""
    weight_sources: list[str] = field(default_factory=list)
    """Relays (other actors' ``relay_endpoint``) to ask for weight chunks before
    ``weights_endpoint``, nearest first; empty: pull from the learner only."""
    weight_source_keys: list[str] = field(default_factory=list)
    """The CURVE public key of each of ``weight_sources`` (same order; "" for a plain relay)."""
    relay_clients: list[str] = field(default_factory=list)
    """CURVE public keys of the actors allowed to pull from this actor's relay (the other
    registered actors with a CURVE relay; the learner authenticated them all).  The relay
    refuses every other CURVE client.  Empty when this actor serves no CURVE relay."""


@record
class LeaseRequest:
    """Ask for up to ``max_leases`` new leases."""

    actor_id: str
    """Who asks."""
    max_leases: int
    """How many more the actor can run now (>= 1)."""


@record
class Lease:
    """A unit of work: play ``group_size`` episodes of ``task`` and send them back as one group."""

    lease_id: str
    """Unique id; the group must carry it back."""
    task: Task
    """The task to play."""
    group_size: int
    """Episodes in the group (GRPO's n)."""
    turn_limit: int
    """Maximum turns per episode (the schedule stage at issue time)."""
    policy_version: int
    """Policy version current at issue time; the actor must hold at least this one."""
    ttl_s: float
    """Seconds the lease stays valid without a heartbeat naming it."""
    seed: int
    """Sampling seed for the group."""


@record
class LeaseGrant:
    """Reply to ``LeaseRequest``."""

    leases: list[Lease]
    """Granted leases; may be empty."""
    retry_after_s: float
    """When ``leases`` is short, ask again after this many seconds (admission control)."""


@record(slots=False)
class Turn:
    """One model turn of an episode (a dict-backed record: a group carries ~64 of them)."""

    index: int
    """Turn number from 0."""
    token_start: int
    """First token of the sampled assistant output in ``Episode.token_ids``."""
    token_end: int
    """One past the last sampled token."""
    output_text: str
    """The model's full decoded output for the turn."""
    action: str
    """Parsed action sent to the env; empty when the output did not parse."""
    parse_error: bool
    """True when the output did not follow the env's action format."""
    observation: str
    """The env's (or the format hint's) reply."""
    reward: float
    """Step reward from the env."""
    done: bool
    """Whether the env ended the episode at this step."""
    policy_version: int
    """Policy version that sampled this turn."""
    gen_latency_s: float
    """Seconds spent generating."""
    env_latency_s: float
    """Seconds spent in the env step."""


@record(eq=False)
class Episode:
    """One episode: the token-exact stream and what happened per turn."""

    token_ids: np.ndarray = array_field("int32")
    """[T] int32 the full token stream (prompt, sampled outputs, observation deltas)."""
    loss_mask: np.ndarray = array_field("uint8")
    """[T] uint8 1 exactly on tokens the engine sampled, else 0."""
    logprobs: np.ndarray = array_field("float32")
    """[T] float32 behaviour log-prob of each sampled token (0 where the mask is 0)."""
    versions: np.ndarray = array_field("int32")
    """[T] int32 policy version that sampled each token (-1 where the mask is 0)."""
    prompt_len: int
    """Tokens in the first prompt (system + task)."""
    turns: list[Turn]
    """Every model turn, in order."""
    finish_reason: str
    """One of ``FINISH_REASONS``."""
    reward: float
    """Episode return (sum of step rewards; outcome reward for the envs we ship)."""
    success: bool
    """Whether the task was solved (env's own flag)."""
    turn_limit: int
    """Turn limit in force."""
    error: str = ""
    """What went wrong, for ``env_error``/``render_error``/``aborted``."""
    category: str = ""
    """Sub-task from the env's reset info (``info["category"]``: level, depth, task type), for metrics."""

    def check(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                _fail(f"Episode.{name}", f"length {len(getattr(self, name))} != token_ids length {n}")
        if self.finish_reason not in FINISH_REASONS:
            _fail("Episode.finish_reason", f"{self.finish_reason!r} not in {sorted(FINISH_REASONS)}")
        if not 0 <= self.prompt_len <= n:
            _fail("Episode.prompt_len", f"{self.prompt_len} outside [0, {n}]")
        if n and int(self.loss_mask.max(initial=0)) > 1:
            _fail("Episode.loss_mask", "values must be 0 or 1")
        for t in self.turns:
            if not self.prompt_len <= t.token_start <= t.token_end <= n:
                _fail(f"Episode.turns[{t.index}]", f"token range [{t.token_start}, {t.token_end}) outside the stream")

    @property
    def trainable(self) -> bool:
        return self.finish_reason in TRAINABLE_FINISH_REASONS


@record(eq=False)
class TrajectoryGroup:
    """The finished group of one lease.  ``failed`` groups are counted, never trained on."""

    lease_id: str
    """The lease this group answers."""
    actor_id: str
    """Who played it."""
    task: Task
    """Echo of the lease's task."""
    turn_limit: int
    """Echo of the lease's turn limit (groups never mix limits)."""
    episodes: list[Episode]
    """The group's episodes (``group_size`` of them unless ``failed``)."""
    failed: bool = False
    """True when any episode ended in ``env_error``/``render_error``/``aborted``."""
    error: str = ""
    """Why it failed."""

    def check(self) -> None:
        for i, ep in enumerate(self.episodes):
            if ep.turn_limit != self.turn_limit:
                _fail(f"TrajectoryGroup.episodes[{i}].turn_limit", f"{ep.turn_limit} != group turn_limit {self.turn_limit}")
        if not self.failed and any(not ep.trainable for ep in self.episodes):
            _fail("TrajectoryGroup.failed", "a group holding untrainable episodes must be marked failed")


@record
class GroupAck:
    """Reply to ``TrajectoryGroup`` (and to ``Goodbye``)."""

    lease_id: str
    """The group's lease."""
    accepted: bool
    """True when the group entered the training buffer."""
    reason: str = ""
    """Why it was dropped (``unknown_lease``, ``expired``, ``stale``, ``failed``, ``duplicate``)."""


@record
class Heartbeat:
    """Liveness, lease renewal and actor statistics."""

    actor_id: str
    """Who is alive."""
    lease_ids: list[str]
    """Leases the actor is still working on; each one's deadline is renewed."""
    policy_version: int
    """Version the actor's engine currently holds."""
    stats: dict[str, float] = field(default_factory=dict)
    """Actor-side counters (``engine_busy``, ``tokens_generated``, ...)."""


@record
class HeartbeatAck:
    """Reply to ``Heartbeat``."""

    unknown_lease_ids: list[str]
    """Leases the learner no longer holds (expired and re-issued): abandon them."""
    weight_sources: list[str] = field(default_factory=list)
    """The actor's current relays (as ``Welcome.weight_sources``; they change when actors leave)."""
    weight_source_keys: list[str] = field(default_factory=list)
    """As ``Welcome.weight_source_keys``."""
    relay_clients: list[str] = field(default_factory=list)
    """As ``Welcome.relay_clients`` (they change as actors join and leave)."""


@record
class Goodbye:
    """An actor leaves; its leases are released for re-issue at once."""

    actor_id: str
    """Who leaves."""
    reason: str = ""
    """Why (``sigterm``, ``done``)."""


@record
class Shutdown:
    """Published when the learner ends the run; actors finish and exit."""

    reason: str
    """Why the run ended."""


@record
class ControlRequest:
    """From a scaling controller: drain actors and/or set the lease limit; answered with
    the learner's signals (``LearnerStatus``).  An empty request only reads them.

    Example: ``ControlRequest(drain=["node3-4411-ab12"], max_leases_per_actor=1)``."""

    drain: list[str] = field(default_factory=list)
    """Actor ids to drain: no new lease for them; once they hold none they are told
    ``Shutdown(reason="drained")`` and leave.  Unknown ids are ignored (named in the log)."""
    max_leases_per_actor: int = 0
    """New limit of leases one actor may hold (0: unchanged); capped by ``learner.max_leases_per_actor``."""


@record
class ActorStatus:
    """One registered actor, as ``LearnerStatus`` reports it."""

    actor_id: str
    """Its id."""
    pool: str
    """``Hello.pool``."""
    host: str
    """``Hello.host``."""
    leases: int
    """Leases it holds now."""
    draining: bool
    """Told to drain (it leaves once ``leases`` is 0)."""
    tokens_generated: float = 0.0
    """Tokens its engine generated since it started (its latest heartbeat)."""


@record
class LearnerStatus:
    """The learner's scaling signals.  Counters are cumulative since the learner started:
    a controller takes differences between two replies (``turnscale.scaling``)."""

    step: int
    """Optimizer steps taken."""
    version: int
    """Published policy version."""
    uptime_s: float
    """Seconds since the learner started serving."""
    idle_s: float
    """Seconds the training loop spent waiting for groups (learner idle)."""
    ready_groups: int
    """Accepted groups waiting for a batch now (ready-group depth)."""
    live_leases: int
    """Leases granted and not yet answered (lease backlog)."""
    groups_received: int
    """Groups that arrived."""
    groups_stale: int
    """Groups dropped as stale (on arrival or when a batch was formed)."""
    groups_trained: int
    """Groups trained."""
    staleness_sum: int
    """Sum over trained groups of versions between sampling and training (policy lag)."""
    max_leases_per_actor: int
    """The lease limit in force."""
    actors: list[ActorStatus] = field(default_factory=list)
    """Every registered actor."""


# ----------------------------------------------------------------------------- learner ranks
# Learner rank 0 -> each follower rank of a multi-rank learner (``learner.ranks``), as
# codec bytes over torch.distributed (gloo): RankStart first, then RankResume (resuming
# only), then one RankShare per optimizer step (RankPing while idle; RankCollective for an
# FSDP learner's publication or checkpoint), then RankStop.


@record
class RankStart:
    """What a follower rank builds before the first step.

    Example: ``RankStart(model_path="/runs/r1/cache/tiny-64", world_size=2)``."""

    model_path: str
    """The model folder every rank loads (rank 0 resolved, or built, it)."""
    world_size: int
    """Ranks of the learner job."""


@record
class RankResume:
    """Load the trainer state of this checkpoint (rank 0 resumes from it)."""

    path: str
    """A complete checkpoint folder (``learner.checkpoint``) on storage every rank sees."""


@record(eq=False)
class RankShare:
    """A follower's share of one optimizer step: whole groups, never split.

    Example: ``RankShare(step=3, total_groups=4, indices=[1, 2], groups=[g1, g2])``."""

    step: int
    """Optimizer steps taken before this one (rank 0's ``Trainer.step``)."""
    total_groups: int
    """Groups of the whole step, all ranks together."""
    indices: list[int]
    """Position of each of ``groups`` in the step's batch (for per-group metrics)."""
    groups: list[TrajectoryGroup]
    """This rank's groups, in batch order."""


@record
class RankPing:
    """Rank 0 is alive and waiting for groups (sent when the channel was quiet for a
    while, so a follower's wait does not time out); the follower waits on."""

    step: int
    """Rank 0's optimizer steps so far."""


@record
class RankCollective:
    """Take part in a collective that rank 0 starts outside a step (``learner.strategy=fsdp``,
    where every rank holds a shard): ``publish`` gathers the weights one tensor at a time,
    in state-dict order, for rank 0 to publish; ``checkpoint`` writes this rank's shards.

    Example: ``RankCollective(kind="checkpoint", step=4, path="/runs/r1/checkpoints/.tmp-step-4")``."""

    kind: str
    """``publish`` or ``checkpoint``."""
    step: int
    """Rank 0's optimizer steps so far (a follower at another step fails)."""
    path: str = ""
    """``checkpoint``: the folder the shards go into, on storage every rank sees."""
    dtype: str = ""
    """``publish``: the transfer dtype."""


@record
class RankStop:
    """The learner is done (or failed): the follower exits."""

    reason: str
    """Why (``done``, ``error``)."""


@record
class ErrorReply:
    """Typed error answer to any request."""

    code: str
    """Machine-readable (``bad_message``, ``not_registered``, ``unknown_version``, ``internal``)."""
    message: str
    """What was wrong and how to fix it."""
    retryable: bool = False
    """Whether the same request may succeed later."""


Message = (
    Hello | Welcome | LeaseRequest | LeaseGrant | TrajectoryGroup | GroupAck | Heartbeat
    | HeartbeatAck | Goodbye | Shutdown | ErrorReply | PolicyAnnouncement
    | WeightChunkRequest | WeightChunk | ControlRequest | LearnerStatus
    | RankStart | RankResume | RankShare | RankPing | RankCollective | RankStop
)
"""Every top-level message (nested records like ``Episode`` travel only inside them)."""
