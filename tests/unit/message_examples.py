"""One valid example of every record in ``protocol.messages.REGISTRY`` and a deep field
comparison, shared by the codec round-trip and fuzz tests."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from turnscale.protocol import messages as m


def episode(n_tokens: int = 40, *, seed: int = 0, turn_limit: int = 5, finish_reason: str = "done", big: bool = False) -> m.Episode:
    """A consistent episode: prompt, then alternating sampled output / observation spans."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, 50_000, n_tokens, dtype=np.int32)
    loss_mask = np.zeros(n_tokens, np.uint8)
    prompt_len = n_tokens // 4
    turns = []
    pos, i = prompt_len, 0
    step = max(1, (n_tokens - prompt_len) // 4)
    while pos + step <= n_tokens and i < 2:
        loss_mask[pos : pos + step] = 1
        turns.append(
            m.Turn(index=i, token_start=pos, token_end=pos + step, output_text=f"think {i} <action>go</action>", action="go",
                   parse_error=False, observation=f"you see room {i}", reward=0.5 * i, done=i == 1, policy_version=3,
                   gen_latency_s=0.01, env_latency_s=0.002)
        )
        pos += 2 * step
        i += 1
    logprobs = np.where(loss_mask == 1, -rng.random(n_tokens, dtype=np.float32), 0).astype(np.float32)
    versions = np.where(loss_mask == 1, 3, -1).astype(np.int32)
    return m.Episode(token_ids=token_ids, loss_mask=loss_mask, logprobs=logprobs, versions=versions, prompt_len=prompt_len,
                     turns=turns, finish_reason=finish_reason, reward=1.0, success=True, turn_limit=turn_limit,
                     error="" if finish_reason in m.TRAINABLE_FINISH_REASONS else "boom")


def group(n_episodes: int = 2, n_tokens: int = 40) -> m.TrajectoryGroup:
    return m.TrajectoryGroup(lease_id="l-1", actor_id="a-1", task=m.Task(env="babyai", data_idx=7, split="train", task_id="babyai_7"),
                             turn_limit=5, episodes=[episode(n_tokens, seed=s) for s in range(n_episodes)])


def manifest(version: int = 3) -> m.WeightManifest:
    return m.WeightManifest(
        version=version, dtype="bfloat16", total_bytes=300, checksum_algo="crc32",
        tensors=[m.TensorInfo(name="w", dtype="bfloat16", shape=[10, 10], offset=0, nbytes=200),
                 m.TensorInfo(name="b", dtype="bfloat16", shape=[50], offset=200, nbytes=100)],
        chunks=[m.ChunkInfo(index=0, offset=0, nbytes=256, checksum=123), m.ChunkInfo(index=1, offset=256, nbytes=44, checksum=456)],
    )


def announcement() -> m.PolicyAnnouncement:
    return m.PolicyAnnouncement(version=3, step=120, manifest=manifest())


def examples() -> dict[str, Any]:
    """Record name -> a valid instance; covers every name in REGISTRY (checked by a test)."""
    task = m.Task(env="textcraft", data_idx=3)
    sampling = m.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64, max_context_tokens=2048)
    lease = m.Lease(lease_id="l-17", task=task, group_size=8, turn_limit=10, policy_version=3, ttl_s=120.0, seed=17)
    out = [
        task,
        sampling,
        m.EnvEndpoint(name="babyai", url="http://127.0.0.1:8301"),
        m.TensorInfo(name="lm_head.weight", dtype="float32", shape=[4, 8], offset=0, nbytes=128),
        m.ChunkInfo(index=0, offset=0, nbytes=128, checksum=99),
        manifest(),
        announcement(),
        m.PolicyAnnouncement(version=4, step=200, manifest=None),
        m.WeightChunkRequest(version=3, index=1),
        m.WeightChunk(version=3, index=1, checksum=456, data=np.arange(44, dtype=np.uint8)),
        m.Hello(actor_id="h-1-x", host="h", pid=123, engine="hf", device="cpu", max_groups=2, pool="cpu",
                relay_endpoint="tcp://10.0.0.2:5600", relay_public_key="rq>t0]gM=&jvy]{7Zsy8)1xUU^}1aK}u/aC2^tv@"),
        m.Welcome(run_id="r", actor_id="h-1-x", model_path="/models/tiny", renderer="chatml", sampling=sampling,
                  envs=[m.EnvEndpoint(name="babyai", url="http://127.0.0.1:8301")], transfer_dtype="bfloat16",
                  pub_endpoint="tcp://127.0.0.1:5001", weights_endpoint="tcp://127.0.0.1:5002", heartbeat_interval_s=5.0,
                  policy=announcement(), weight_sources=["tcp://10.0.0.3:5600"], weight_source_keys=["rq>t0]gM=&jvy]{7Zsy8)1xUU^}1aK}u/aC2^tv@"],
                  relay_clients=["Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"]),
        m.LeaseRequest(actor_id="h-1-x", max_leases=2),
        lease,
        m.LeaseGrant(leases=[lease], retry_after_s=0.0),
        episode().turns[0],
        episode(),
        group(),
        m.TrajectoryGroup(lease_id="l-2", actor_id="a", task=task, turn_limit=5, failed=True, error="env died",
                          episodes=[episode(seed=1), episode(seed=2, finish_reason="env_error")]),
        m.GroupAck(lease_id="l-17", accepted=False, reason="stale"),
        m.Heartbeat(actor_id="h-1-x", lease_ids=["l-17", "l-18"], policy_version=3, stats={"engine_busy": 0.5, "tokens": 1e6}),
        m.HeartbeatAck(unknown_lease_ids=["l-18"], weight_sources=["tcp://10.0.0.3:5600", "tcp://10.0.0.4:5600"],
                       weight_source_keys=["rq>t0]gM=&jvy]{7Zsy8)1xUU^}1aK}u/aC2^tv@", ""],
                       relay_clients=["Yne@$w-vo<fVvi]a<NY6T1ed:M$fCG*[IaLV{hID"]),
        m.Goodbye(actor_id="h-1-x", reason="sigterm"),
        m.ControlRequest(drain=["h-1-x"], max_leases_per_actor=1),
        m.ActorStatus(actor_id="h-2-y", pool="ascend", host="h2", leases=0, draining=False),
        m.LearnerStatus(step=12, version=6, uptime_s=80.5, idle_s=20.25, ready_groups=3, live_leases=5, groups_received=40,
                        groups_stale=2, groups_trained=24, staleness_sum=9, max_leases_per_actor=2,
                        actors=[m.ActorStatus(actor_id="h-1-x", pool="cpu", host="h", leases=1, draining=True,
                                              tokens_generated=1.5e5)]),
        m.Shutdown(reason="done"),
        m.RankStart(model_path="/runs/r1/cache/tiny-64", world_size=2),
        m.RankResume(path="/runs/r1/checkpoints/step-4"),
        m.RankShare(step=3, total_groups=4, indices=[1, 2], groups=[group(), group()]),
        m.RankPing(step=3),
        m.RankCollective(kind="checkpoint", step=4, path="/runs/r1/checkpoints/.tmp-step-4"),
        m.RankStop(reason="done"),
        m.ErrorReply(code="bad_message", message="TrajectoryGroup.episodes[0].loss_mask: too long", retryable=False),
    ]
    by_name: dict[str, Any] = {}
    for rec in out:
        by_name.setdefault(type(rec).__name__, rec)
    return by_name


def all_examples() -> list[Any]:
    """Every example, including the second variant of a type (failed group, announcement without manifest)."""
    ex = list(examples().values())
    ex.append(m.PolicyAnnouncement(version=4, step=200, manifest=None))
    ex.append(m.TrajectoryGroup(lease_id="l-2", actor_id="a", task=m.Task(env="x", data_idx=0), turn_limit=5, failed=True,
                                error="env died", episodes=[episode(seed=2, finish_reason="env_error")]))
    return ex


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Field-by-field equality; arrays compared with dtype, shape and ``np.array_equal``."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), (path, type(a), type(b))
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)
