"""``turnscale slurm``: the generated sbatch scripts (read as text and checked by ``bash -n``),
``--dry-run``, submission order, and ``SlurmBackend`` (with a recording runner instead of
``sbatch``; the real Slurm is not on this machine)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from turnscale import conf
from turnscale import slurm

POOLS = ('slurm.pools=[{name:cpu,count:2,constraint:cpu},'
         '{name:ascend,count:1,constraint:ascend,gres:"npu:1",overrides:["engine.dtype=bfloat16","engine.device=npu"],'
         'env:{ASCEND_RT_VISIBLE_DEVICES:"0"}}]')


def render(tmp_path: Path, *extra: str) -> slurm.Scripts:
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=/opt/ts/bin/python", "slurm.workdir=/src/ts",
                 "slurm.partition=batch", "env=babyai", "learner.steps=7", *extra]
    return slurm.render(conf.load(overrides), overrides)


def test_one_learner_one_envhub_and_one_actor_array_per_pool(tmp_path):
    s = render(tmp_path)
    assert list(s.files) == ["learner.sbatch", "envhub.sbatch", "actors-cpu.sbatch", "actors-ascend.sbatch"]
    cpu, asc = s.files["actors-cpu.sbatch"], s.files["actors-ascend.sbatch"]
    assert "#SBATCH --array=0-1" in cpu and "#SBATCH --constraint=cpu" in cpu and "#SBATCH --partition=batch" in cpu
    assert "#SBATCH --array=0-0" in asc and "#SBATCH --constraint=ascend" in asc and "#SBATCH --gres=npu:1" in asc
    assert "export ASCEND_RT_VISIBLE_DEVICES=0" in asc and "ASCEND" not in cpu
    assert "engine.dtype=bfloat16 engine.device=npu actor.pool=ascend" in asc
    assert "engine.dtype" not in cpu and "actor.pool=cpu" in cpu
    for text in s.files.values():  # the run's own overrides reach every job, slurm.* none
        assert "learner.steps=7" in text and f"learner.dir={tmp_path}/run/learner" in text
        assert "slurm.pools" not in text and "cd /src/ts" in text and "/opt/ts/bin/python -m turnscale" in text


def test_learner_and_envhub_publish_their_address_atomically_and_actors_wait_for_it(tmp_path):
    s = render(tmp_path)
    run = f"{tmp_path}/run"
    learner = s.files["learner.sbatch"]
    assert f"> {run}/learner.addr.tmp.$$" in learner and f"mv -f {run}/learner.addr.tmp.$$ {run}/learner.addr" in learner
    assert "BIND=0.0.0.0" in learner and "\"learner.host=$BIND\"" in learner
    assert f"mv -f {run}/envhub.url.tmp.$$ {run}/envhub.url" in s.files["envhub.sbatch"]
    cpu = s.files["actors-cpu.sbatch"]
    assert f"ADDR=$(cat {run}/learner.addr); read -r LEARNER_HOST LEARNER_PORT" in cpu and f"$(cat {run}/envhub.url)" in cpu
    assert '"actor.actor_id=$ACTOR_ID"' in cpu and "ACTOR_ID=cpu-${SLURM_ARRAY_JOB_ID" in cpu


def test_an_external_env_url_replaces_the_envhub_job(tmp_path):
    s = render(tmp_path, "slurm.env_url=http://envs.example:36005")
    assert "envhub.sbatch" not in s.files
    assert "ENV_URL=http://envs.example:36005" in s.files["actors-cpu.sbatch"]
    assert "envhub.url" not in s.files["actors-cpu.sbatch"]


def test_envhub_job_exits_after_slurm_envhub_idle_exit_s_without_env_requests(tmp_path):
    """Where ``squeue`` cannot tell the envhub job that the learner job is gone, the envhub
    itself ends once no actor has called it for ``slurm.envhub_idle_exit_s``
    (``env.exit_after_idle_s``, #32 item 4)."""
    assert '"env.exit_after_idle_s=1800"' in render(tmp_path).files["envhub.sbatch"]
    envhub = render(tmp_path, "slurm.envhub_idle_exit_s=90").files["envhub.sbatch"]
    start = next(line for line in envhub.splitlines() if line.startswith("start()"))
    assert start.index('"port=$PORT"') < start.index('"env.exit_after_idle_s=90"')
    assert "exit_after_idle_s" not in render(tmp_path).files["actors-cpu.sbatch"]


def test_every_generated_script_is_valid_bash(tmp_path):
    for name, text in render(tmp_path).files.items():
        p = tmp_path / name
        p.write_text(text)
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, (name, r.stderr)


def test_actor_script_starts_an_actor_with_the_published_address(tmp_path):
    """Run the cpu actor script with bash, ``python`` replaced by ``echo``: the command line
    it would exec carries the learner address and env URL read from the files."""
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=echo", f"slurm.workdir={tmp_path}", "slurm.wait_s=5"]
    s = slurm.render(conf.load(overrides), overrides)
    (tmp_path / "run").mkdir()
    (tmp_path / "run/learner.addr").write_text("10.1.2.3 5555\n")
    (tmp_path / "run/envhub.url").write_text("http://10.1.2.4:36001\n")
    p = tmp_path / "a.sh"
    p.write_text(s.files["actors-cpu.sbatch"])
    r = subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30,
                       env={"PATH": "/usr/bin:/bin", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "1"})
    assert r.returncode == 0, r.stderr
    out = r.stdout.split()
    assert out[:3] == ["-m", "turnscale", "actor"]
    assert {"actor.learner_host=10.1.2.3", "actor.learner_port=5555", "actor.env_url=http://10.1.2.4:36001",
            "actor.actor_id=cpu-77_1", "actor.pool=cpu"} <= set(out)


def test_actor_script_gives_up_with_a_clear_message_when_the_learner_never_starts(tmp_path):
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=echo", f"slurm.workdir={tmp_path}", "slurm.wait_s=1"]
    s = slurm.render(conf.load(overrides), overrides)
    p = tmp_path / "a.sh"
    p.write_text(s.files["actors-cpu.sbatch"])
    r = subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "learner.addr after 1s and no job id in" in r.stderr and "is the learner job running?" in r.stderr


def test_learner_with_several_ranks_runs_under_torchrun_in_one_job(tmp_path, capsys):
    rc = slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", "slurm.python=/opt/ts/bin/python", "slurm.learner_ranks=4",
                     "slurm.learner_gres=gpu:4", "learner.device=cuda", POOLS])
    out = capsys.readouterr().out
    assert rc == 0
    learner = out.split("# ===== ")[1]
    assert learner.startswith(f"{tmp_path}/run/learner.sbatch")
    assert ("/opt/ts/bin/python -m torch.distributed.run --standalone --nproc_per_node=4 -m turnscale learner "
            in learner) and "#SBATCH --gres=gpu:4" in learner
    assert "torch.distributed.run" not in out.split("# ===== ")[2]  # actors and envhub: one process per task
    one = render(tmp_path).files["learner.sbatch"]
    assert "torch.distributed.run" not in one and "/opt/ts/bin/python -m turnscale learner " in one  # default: 1 rank
    assert slurm.main(["--dry-run", "slurm.learner_ranks=0"]) == 2


def test_dry_run_prints_every_script_and_writes_nothing(tmp_path, capsys):
    rc = slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", POOLS])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("# ===== ") == 4 and "#SBATCH --array=0-1" in out
    assert not (tmp_path / "run").exists()


def test_bad_pool_config_is_a_clear_error(capsys):
    assert slurm.main(["--dry-run", "slurm.pools=[{name:cpu},{name:cpu}]"]) == 2
    assert "slurm.pools" in capsys.readouterr().err
    with pytest.raises(conf.ConfigError, match=r"slurm.pools\[\].name"):
        conf.load(["slurm.pools=[{name:'a b'}]"])


def test_submit_runs_sbatch_in_order_and_backend_adds_array_tasks(tmp_path):
    calls = []

    def runner(cmd):
        calls.append(list(cmd))
        return f"{100 + len(calls)};cluster\n"

    s = render(tmp_path)
    folder = tmp_path / "run"
    s.write(folder)
    jobs = slurm.submit(folder, s, runner)
    assert jobs == {"learner.sbatch": "101", "envhub.sbatch": "102", "actors-cpu.sbatch": "103", "actors-ascend.sbatch": "104"}
    assert all(c[:2] == ["sbatch", "--parsable"] for c in calls)
    calls.clear()
    b = slurm.SlurmBackend(folder, {"cpu": 2, "ascend": 1}, runner=runner)
    b.scale_to("cpu", 4)
    assert calls[-1] == ["sbatch", "--parsable", "--array=2-3", str(folder / "actors-cpu.sbatch")]
    b.scale_to("cpu", 3)  # fewer: never cancels (removal drains)
    assert len(calls) == 1
    b.drain("cpu-103_0")
    b.scale_to("cpu", 4)
    assert calls[-1][2] == "--array=4-4"
    b.cancel("ascend-104_0")
    assert calls[-1] == ["scancel", "104_0"]


def test_envhub_job_ends_once_the_learner_job_has_finished(tmp_path):
    """The learner job leaves ``learner.done`` behind whatever the learner's exit status;
    the envhub job stops its server and ends when it appears (else it would hold its node
    forever).  Both scripts run with ``python`` replaced by ``sleep``/``false``."""
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", f"slurm.workdir={tmp_path}"]
    (tmp_path / "run").mkdir()
    learner = slurm.render(conf.load([*overrides, "slurm.python=/bin/false"]), overrides).files["learner.sbatch"]
    p = tmp_path / "l.sh"
    p.write_text(learner)
    r = subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and (tmp_path / "run/learner.done").exists()  # the learner's status, and the marker
    (tmp_path / "run/learner.done").unlink()

    fake = tmp_path / "fakepy"  # exits 0 on SIGTERM, as envhub does
    fake.write_text(f"#!/bin/bash\ntrap 'exit 0' TERM\ntouch {tmp_path}/started\nwhile true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    envhub = slurm.render(conf.load([*overrides, f"slurm.python={fake}"]), overrides).files["envhub.sbatch"]
    p = tmp_path / "e.sh"
    p.write_text(envhub)
    proc = subprocess.Popen(["bash", str(p)], env={"PATH": "/usr/bin:/bin"})
    try:
        _wait_for(tmp_path / "started", proc)
        (tmp_path / "run/learner.done").touch()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_actor_job_stops_its_actor_when_the_learner_job_has_finished_and_forwards_sigterm(tmp_path):
    """A cancelled learner does not tell actors the run is over (it may be resumed): the
    actor job SIGTERMs its actor once ``learner.done`` appears; a SIGTERM to the job (scancel)
    reaches the actor too.  The stand-in actor exits 0 on SIGTERM, as the real one does."""
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!/bin/bash\ntrap 'echo got-term; exit 0' TERM\ntouch {tmp_path}/started\n"
                    "while true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", f"slurm.python={fake}", f"slurm.workdir={tmp_path}", "slurm.wait_s=5"]
    script = slurm.render(conf.load(overrides), overrides).files["actors-cpu.sbatch"]
    (tmp_path / "run").mkdir()
    (tmp_path / "run/learner.addr").write_text("10.1.2.3 5555\n")
    (tmp_path / "run/envhub.url").write_text("http://10.1.2.4:36001\n")
    p = tmp_path / "a.sh"
    p.write_text(script)
    for how in ("done", "sigterm"):
        (tmp_path / "run/learner.done").unlink(missing_ok=True)
        (tmp_path / "started").unlink(missing_ok=True)
        proc = subprocess.Popen(["bash", str(p)], env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, text=True)
        try:
            _wait_for(tmp_path / "started", proc)
            if how == "done":
                (tmp_path / "run/learner.done").touch()
            else:
                proc.send_signal(15)
            out, _ = proc.communicate(timeout=30)
            assert proc.returncode == 0 and "got-term" in out, (how, proc.returncode, out)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _wait_for(marker: Path, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Until the stand-in process has started (it touches ``marker``), the script still running."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert proc.poll() is None, "the script ended before its process started"
        assert time.monotonic() < deadline, f"{marker.name} not written within {timeout_s:.0f}s"
        time.sleep(0.05)
    assert proc.poll() is None


def test_slurm_backend_counts_live_array_tasks_from_squeue_and_replaces_lost_ones(tmp_path):
    """A crashed actor (its node died) vanishes from ``squeue``: ``refresh`` counts what Slurm
    still holds, and ``scale_to`` then submits replacements (unit test, recording runner)."""
    calls: list[list[str]] = []
    queue = {"cpu": "103_0\n103_1\n"}

    def runner(cmd):
        calls.append(list(cmd))
        if cmd[0] == "squeue":
            name = [a for a in cmd if a.startswith("--name=")][0].removeprefix("--name=ts-actors-")
            return queue.get(name, "")
        return "200;cluster\n"

    b = slurm.SlurmBackend(tmp_path, {"cpu": 3}, runner=runner)
    assert b.refresh() == {"cpu": 2}  # one of three lost
    assert "--name=ts-actors-cpu" in calls[0]
    b.scale_to("cpu", 3)
    assert calls[-1] == ["sbatch", "--parsable", "--array=3-3", str(tmp_path / "actors-cpu.sbatch")]


def test_autoscaler_resubmits_the_actors_a_backend_lost_and_leaves_draining_and_pending_alone():
    """``Autoscaler.replace_lost``: ``SlurmBackend.refresh`` (its squeue answers faked here; the
    real one: tests/integration/test_slurm_nodes.py) counts one of two wanted cpu actors: a task
    is submitted; once squeue shows it (pending) nothing more is; a backend without
    ``refresh`` is never asked."""
    from turnscale.control import Autoscaler
    from turnscale.scaling import PoolPolicy, ScalingController, ScalingPolicy
    from turnscale.slurm import SlurmBackend

    queue = ["7_0"]
    calls = []

    def runner(cmd):
        calls.append(list(cmd))
        if cmd[0] == "sbatch":
            queue.append("7_2")
            return "8\n"
        return "".join(f"{j}\n" for j in queue)

    policy = ScalingPolicy(pools=(PoolPolicy(name="cpu", min_actors=1, max_actors=4),))
    b = SlurmBackend(Path("/run"), {"cpu": 2}, runner=runner)
    auto = Autoscaler(control=None, controller=ScalingController(policy, wanted={"cpu": 2}), backend=b)  # type: ignore[arg-type]
    assert auto.replace_lost() == {"cpu": 2}
    assert [c for c in calls if c[0] == "sbatch"] == [["sbatch", "--parsable", "--array=2-2", "/run/actors-cpu.sbatch"]]
    assert auto.replace_lost() == {}
    assert len([c for c in calls if c[0] == "sbatch"]) == 1

    class NoRefresh:
        def scale_to(self, pool, n):
            raise AssertionError("must not be called")

        def drain(self, actor_id):
            pass

    assert Autoscaler(control=None, controller=ScalingController(policy, wanted={"cpu": 2}),  # type: ignore[arg-type]
                      backend=NoRefresh()).replace_lost() == {}


def test_a_pool_name_with_a_dash_is_refused_where_pools_are_defined(capsys):
    """Actor ids are ``<pool>-<job>_<task>``: a ``-`` in a pool name made ``cpu-big``'s actors
    parse as pool ``cpu`` (drain) and ``scancel big-123_4`` (cancel)."""
    with pytest.raises(conf.ConfigError, match=r"slurm.pools\[\].name.*'cpu-big'.*'_'"):
        conf.load(["slurm.pools=[{name:cpu-big}]"])
    assert slurm.main(["--dry-run", "slurm.pools=[{name:cpu-big}]"]) == 2
    assert "slurm.pools[].name" in capsys.readouterr().err
    from turnscale.scaling import PoolPolicy, ScalingConfigError
    with pytest.raises(ScalingConfigError, match="cpu-big"):
        PoolPolicy(name="cpu-big")


def test_actor_ids_parse_to_their_own_pool_and_array_task(tmp_path):
    calls = []
    b = slurm.SlurmBackend(tmp_path, {"cpu": 2, "cpu_big": 2}, runner=lambda cmd: calls.append(list(cmd)) or "")
    assert slurm.parse_actor_id("cpu_big-123_4") == ("cpu_big", "123_4")
    b.drain("cpu_big-123_4")
    assert b.pools == {"cpu": 2, "cpu_big": 1}
    b.cancel("cpu_big-123_4")
    assert calls[-1] == ["scancel", "123_4"]
    for bad in ("cpu", "cpu-", "-1_2", "cpu-12", "cpu-1_2; rm", "a-b-1_2"):
        with pytest.raises(ValueError, match="not an actor id of turnscale slurm"):
            slurm.parse_actor_id(bad)


def test_a_pool_override_the_schema_refuses_stops_generation_naming_the_pool_and_key(tmp_path, capsys):
    """``engine.devicee=npu`` used to be accepted by ``turnscale slurm`` and found only when
    the actors started on their nodes."""
    pools = 'slurm.pools=[{name:cpu,count:1},{name:ascend,count:1,overrides:["engine.devicee=npu"]}]'
    assert slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", pools]) == 2
    err = capsys.readouterr().err
    assert "slurm.pools[ascend].overrides" in err and "config key 'engine.devicee'" in err, err
    bad_value = 'slurm.pools=[{name:cpu,overrides:["engine.max_batch=0"]}]'
    assert slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", bad_value]) == 2
    assert "config key 'engine.max_batch'" in capsys.readouterr().err
    assert slurm.main([f"slurm.dir={tmp_path}/run", pools]) == 2 and not (tmp_path / "run").exists()  # nothing written
    cfgs = slurm.pool_configs(conf.load([POOLS]), [POOLS])  # every pool's actors' config, as they will load it
    assert cfgs["ascend"].engine.device == "npu" and cfgs["ascend"].actor.pool == "ascend" and cfgs["cpu"].engine.device == "cpu"


def test_without_keys_the_run_makes_its_own_curve_keys_private_and_wires_every_job(tmp_path, capsys):
    """The learner job binds off loopback, so CURVE is on; the quick start passes no key and
    used to stop with ``CurveConfigError`` in every job.  Now ``turnscale slurm`` makes the
    run's keys in ``slurm.dir/keys`` (secret files 0600, folder 0700), the dry run says so,
    and each role's command line loads them (checked with the roles' own loaders)."""
    import os
    import shlex

    from turnscale.common.curve import actor_curve, learner_curve

    run = tmp_path / "run"
    args = [f"slurm.dir={run}", "slurm.python=/opt/ts/bin/python", POOLS]
    assert slurm.main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert f"creates them in {run}/keys (secret files mode 0600)" in out and not run.exists()
    assert f"learner.curve.secret_key={run}/keys/learner.key_secret" in out

    calls = []
    assert slurm.main(args, runner=lambda cmd: calls.append(list(cmd)) or f"{len(calls)}\n") == 0
    assert len(calls) == 4 and f"CURVE keys: {run}/keys (made learner, actor-cpu, actor-ascend, control" in capsys.readouterr().out
    keys = run / "keys"
    assert os.stat(keys).st_mode & 0o777 == 0o700
    secrets = sorted(p.name for p in keys.glob("*.key_secret"))
    assert secrets == ["actor-ascend.key_secret", "actor-cpu.key_secret", "control.key_secret", "learner.key_secret"]
    assert all(os.stat(keys / n).st_mode & 0o777 == 0o600 for n in secrets)
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == ["actor-ascend.key", "actor-cpu.key", "control.key"]

    def role_overrides(script: str, role: str) -> list[str]:
        line = next(ln for ln in script.splitlines() if f" -m turnscale {role} " in ln)
        return [w for w in shlex.split(line.replace("&", "")) if "=" in w and "$" not in w and not w.startswith("slurm.")]

    assert "BIND=0.0.0.0" in (run / "learner.sbatch").read_text()  # "learner.host=$BIND"
    lcfg = conf.load([*role_overrides((run / "learner.sbatch").read_text(), "learner"), "learner.host=0.0.0.0"])
    ls = learner_curve(lcfg.learner)
    assert ls is not None
    for pool in ("cpu", "ascend"):
        acfg = conf.load([*role_overrides((run / f"actors-{pool}.sbatch").read_text(), "actor"), "actor.learner_host=10.0.0.1"])
        a = actor_curve(acfg.actor)
        assert a is not None and a.server_public == ls.public and acfg.actor.pool == pool
    learner_pub = (keys / "learner.key").read_bytes()
    assert slurm.main(args, runner=lambda cmd: "9\n") == 0  # resubmitted: the keys are kept
    assert (keys / "learner.key").read_bytes() == learner_pub and "kept from before" in capsys.readouterr().out


def test_curve_off_or_the_users_own_keys_make_no_run_keys(tmp_path, capsys):
    off = render(tmp_path, "learner.curve.enabled=false", "actor.curve.enabled=false")
    assert ".curve.secret_key" not in off.files["learner.sbatch"] and ".curve.s" not in off.files["actors-cpu.sbatch"]
    mine = [f"slurm.dir={tmp_path}/run", POOLS, f"learner.curve.secret_key={tmp_path}/k/learner.key_secret",
            f"learner.curve.authorized={tmp_path}/k/authorized", f"actor.curve.server_key={tmp_path}/k/learner.key",
            f"actor.curve.secret_key={tmp_path}/k/actor-1.key_secret"]
    assert slurm.main(["--dry-run", *mine]) == 2  # the files do not exist: the dry run says how to make them
    err = capsys.readouterr().err
    assert "learner.curve.secret_key" in err and "turnscale keys" in err
    from turnscale.protocol.curve import create_keys
    create_keys(str(tmp_path / "k"), 1)
    assert slurm.main(["--dry-run", *mine]) == 0
    out = capsys.readouterr().out
    assert f"{tmp_path}/run/keys" not in out and f"actor.curve.secret_key={tmp_path}/k/actor-1.key_secret" in out


def test_the_learner_lets_a_pools_shared_run_key_register_the_whole_pool(tmp_path, capsys):
    """The run's own keys are one per pool: the learner job raises max_actor_ids_per_key to the
    largest pool; a value the user sets below it is refused, naming the value that fits."""
    assert slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", "slurm.pools=[{name:cpu,count:2,max_actors:12}]"]) == 0
    learner = next(t for t in capsys.readouterr().out.split("# =====") if "learner.sbatch" in t.splitlines()[0])
    assert "learner.max_actor_ids_per_key=12" in learner
    assert slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", "slurm.pools=[{name:cpu,count:2,max_actors:12}]",
                       "learner.max_actor_ids_per_key=10"]) == 2
    assert "learner.max_actor_ids_per_key=12" in capsys.readouterr().err
    assert slurm.main(["--dry-run", f"slurm.dir={tmp_path}/run", "slurm.pools=[{name:cpu,count:2,max_actors:4}]"]) == 0
    assert "max_actor_ids_per_key" not in capsys.readouterr().out  # the default (8) holds a pool of 4


def test_learner_job_resumes_from_a_checkpoint_in_the_run_folder(tmp_path):
    """A requeued (or resubmitted) learner job used to start the run over; its script now adds
    ``learner.resume=true`` when ``<slurm.dir>/learner/checkpoints`` holds a complete checkpoint
    (a temp folder, or one without ``meta.json``, does not count).  Run with ``python``
    replaced by ``echo``."""
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=echo", f"slurm.workdir={tmp_path}"]
    p = tmp_path / "l.sh"
    p.write_text(slurm.render(conf.load(overrides), overrides).files["learner.sbatch"])
    ck = tmp_path / "run/learner/checkpoints"

    def learner_args() -> list[str]:
        r = subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        assert r.returncode == 0, r.stderr
        return next(ln for ln in r.stdout.splitlines() if " turnscale learner " in f" {ln} ").split()

    (ck / ".tmp-step-00000002-ab12").mkdir(parents=True)
    (ck / "step-00000001").mkdir()  # incomplete: no meta.json
    assert "learner.resume=true" not in learner_args()
    (ck / "step-00000001" / "meta.json").write_text("{}")
    assert learner_args()[-1] == "learner.resume=true"


def _run_learner_script(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the learner script with ``python`` replaced by ``echo``; (result, the learner's argv)."""
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=echo", f"slurm.workdir={tmp_path}", *extra]
    (tmp_path / "run").mkdir(exist_ok=True)
    p = tmp_path / "l.sh"
    p.write_text(slurm.render(conf.load(overrides), overrides).files["learner.sbatch"])
    r = subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"})
    line = next((ln for ln in r.stdout.splitlines() if " turnscale learner " in f" {ln} "), "")
    return r, line.split()


def _arg(argv: list[str], key: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{key}="))


def test_learner_and_envhub_pick_free_ports_on_their_node_and_publish_them(tmp_path):
    """Fixed ports (5555-5557, 8301) clashed between runs sharing a node: the jobs now pick
    ports that no socket on the node uses (``/proc/net/tcp*``), outside the ephemeral range,
    and publish them; ``slurm.free_ports=false`` keeps the configured ones."""
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    seen = set()
    for _ in range(5):
        r, argv = _run_learner_script(tmp_path)
        assert r.returncode == 0, r.stderr
        ports = [int(_arg(argv, f"learner.{k}")) for k in ("port", "pub_port", "weights_port")]
        assert len(set(ports)) == 3 and all(1024 <= p <= 65535 and not lo <= p <= hi for p in ports), ports
        assert busy.getsockname()[1] not in ports and 5555 not in ports
        assert (tmp_path / "run/learner.addr").read_text().split()[1] == str(ports[0])
        assert _arg(argv, "learner.host") == "0.0.0.0"
        seen.add(ports[0])
    busy.close()
    assert len(seen) == 5  # at random per job (a saturated awk seed gave every job on a node the same ports)
    r, argv = _run_learner_script(tmp_path, "slurm.free_ports=false", "learner.port=6001")
    assert _arg(argv, "learner.port") == "6001" and _arg(argv, "learner.pub_port") == "5556"
    assert (tmp_path / "run/learner.addr").read_text().split()[1] == "6001"

    overrides = [POOLS, f"slurm.dir={tmp_path}/run", "slurm.python=echo", f"slurm.workdir={tmp_path}"]
    env_script = tmp_path / "e.sh"
    env_script.write_text(slurm.render(conf.load(overrides), overrides).files["envhub.sbatch"])
    (tmp_path / "run/learner.done").unlink(missing_ok=True)  # the echo "server" exits by itself
    r = subprocess.run(["bash", str(env_script)], capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    port = _arg(r.stdout.split(), "port")
    assert (tmp_path / "run/envhub.url").read_text().strip().endswith(f":{port}") and port != "8301"


def test_slurm_interface_names_the_address_published_and_bound(tmp_path):
    """``slurm.interface=lo`` publishes and binds lo's address (a cluster's fast network:
    ``ib0``); an interface the node lacks stops the job saying so."""
    r, argv = _run_learner_script(tmp_path, "slurm.interface=lo")
    assert r.returncode == 0, r.stderr
    assert _arg(argv, "learner.host") == "127.0.0.1"
    assert (tmp_path / "run/learner.addr").read_text().split()[0] == "127.0.0.1"
    r, argv = _run_learner_script(tmp_path, "slurm.interface=nosuch0")
    assert r.returncode == 1 and not argv and "slurm.interface=nosuch0: no IPv4 address on" in r.stderr
    with pytest.raises(conf.ConfigError, match="slurm.interface"):
        conf.load(["slurm.interface=eth0; rm -rf /"])


ACCEL = ('slurm.pools=[{name:nvidia,count:2,accelerator:nvidia,devices:2,constraint:a100},'
         '{name:ascend,count:2,accelerator:ascend,constraint:910b,overrides:["engine.dtype=bfloat16"]}]')


def test_accelerator_pools_get_their_gres_device_and_each_task_its_own_devices(tmp_path):
    """An Ascend pool used to get a constraint only: now ``accelerator: ascend`` gives
    ``--gres=npu:<devices>``, ``engine.device=npu`` and each task ``ASCEND_RT_VISIBLE_DEVICES``
    from its allocation (``scontrol show job -d``, faked here: ``IDX:2-3``), like an NVIDIA
    pool's ``--gres=gpu:N`` and ``CUDA_VISIBLE_DEVICES``; a variable already set (by Slurm or
    the pool's ``env``) is kept, and a task without devices stops saying so."""
    run = tmp_path / "run"
    overrides = [ACCEL, f"slurm.dir={run}", "slurm.python=/opt/ts/bin/python", "slurm.workdir=/src"]
    cfg = conf.load(overrides)
    files = slurm.render(cfg, overrides).files
    nv, asc = files["actors-nvidia.sbatch"], files["actors-ascend.sbatch"]
    assert "#SBATCH --gres=gpu:2" in nv and "#SBATCH --gres=npu:1" in asc and "#SBATCH --constraint=910b" in asc
    assert "engine.device=cuda actor.pool=nvidia" in nv and "engine.device=npu engine.dtype=bfloat16 actor.pool=ascend" in asc
    cfgs = slurm.pool_configs(cfg, overrides)
    assert cfgs["ascend"].engine.device == "npu" and cfgs["ascend"].engine.dtype == "bfloat16"
    assert cfgs["nvidia"].engine.device == "cuda"

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text('#!/bin/bash\necho "JobId=$4 JobName=ts-actors"\n'
                                   'echo "   Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=${FAKE_GRES}"\n')
    fake = tmp_path / "fakepy"  # the stand-in actor prints its device variables and exits
    fake.write_text('#!/bin/bash\necho "cuda=${CUDA_VISIBLE_DEVICES:-} npu=${ASCEND_RT_VISIBLE_DEVICES:-}"\n')
    for f in (bin_ / "scontrol", fake):
        f.chmod(0o755)
    run.mkdir()
    (run / "learner.addr").write_text("10.1.2.3 5555\n")
    (run / "envhub.url").write_text("http://10.1.2.4:36001\n")

    def task(pool: str, gres: str, extra_pools: str = ACCEL) -> subprocess.CompletedProcess:
        o = [extra_pools, f"slurm.dir={run}", f"slurm.python={fake}", f"slurm.workdir={tmp_path}", "slurm.wait_s=2"]
        p = tmp_path / f"{pool}.sh"
        p.write_text(slurm.render(conf.load(o), o).files[f"actors-{pool}.sbatch"])
        return subprocess.run(["bash", str(p)], capture_output=True, text=True, timeout=30,
                              env={"PATH": f"{bin_}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "FAKE_GRES": gres})

    r = task("ascend", "npu:2(IDX:2-3)")
    assert r.returncode == 0 and "npu=2,3" in r.stdout, (r.stdout, r.stderr)
    r = task("nvidia", "gpu:a100:3(IDX:0,2,5-6),npu:1(IDX:4)")
    assert r.returncode == 0 and "cuda=0,2,5,6 npu=" in r.stdout, (r.stdout, r.stderr)
    r = task("ascend", "gpu:1(IDX:0)")
    assert r.returncode == 1 and "pool ascend: no npu in this task's allocation" in r.stderr, r.stderr
    mine = 'slurm.pools=[{name:ascend,accelerator:ascend,env:{ASCEND_RT_VISIBLE_DEVICES:"7"}}]'
    r = task("ascend", "npu:1(IDX:0)", mine)
    assert r.returncode == 0 and "npu=7" in r.stdout, (r.stdout, r.stderr)
    with pytest.raises(conf.ConfigError, match=r"slurm.pools\[x\].accelerator"):
        conf.load(["slurm.pools=[{name:x,accelerator:tpu}]"])


def _fake_slurm_tools(tmp_path: Path) -> Path:
    """A ``squeue`` answering ``-h -j ID -o %T`` from ``state-ID`` (default RUNNING; ``INVALID``:
    Slurm no longer knows the job; ``DOWN``: the controller does not answer)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "squeue").write_text(
        f'#!/bin/bash\nst=$(cat {tmp_path}/state-$3 2>/dev/null || echo RUNNING)\n'
        'case "$st" in INVALID) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1;;\n'
        '  DOWN) echo "slurm_load_jobs error: Unable to contact slurm controller" >&2; exit 1;; esac\necho "$st"\n')
    (bin_ / "squeue").chmod(0o755)
    return bin_


def _actor_job(tmp_path: Path, *extra: str) -> subprocess.Popen:
    fake = tmp_path / "fakepy"  # records each start, exits 0 on SIGTERM as the real actor does
    fake.write_text(f"#!/bin/bash\ntrap 'echo got-term; exit 0' TERM\necho \"$*\" >> {tmp_path}/starts\n"
                    "while true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", f"slurm.python={fake}", f"slurm.workdir={tmp_path}",
                 "slurm.wait_s=1", "slurm.poll_s=1", *extra]
    p = tmp_path / "a.sh"
    p.write_text(slurm.render(conf.load(overrides), overrides).files["actors-cpu.sbatch"])
    env = {"PATH": f"{_fake_slurm_tools(tmp_path)}:/usr/bin:/bin"}
    return subprocess.Popen(["bash", str(p)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _starts(tmp_path: Path) -> list[str]:
    f = tmp_path / "starts"
    return f.read_text().splitlines() if f.exists() else []


def _until(cond, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_job_is_gone_once_slurm_holds_it_neither_pending_nor_running(tmp_path):
    """The scripts' ``job_gone`` (run in bash against a stand-in ``squeue``): end states and a
    job Slurm no longer knows are gone; a requeued (PENDING) job or a controller that does not
    answer is not."""
    states = {"1": "RUNNING", "2": "PENDING", "3": "DOWN", "4": "INVALID", "5": "CANCELLED by 0", "6": "NODE_FAIL",
              "7": "OUT_OF_MEMORY", "8": "COMPLETED", "9": "TIMEOUT", "10": "COMPLETING"}
    for job, state in states.items():
        (tmp_path / f"state-{job}").write_text(state)
    lib = "\n".join(slurm._job_lib(str(tmp_path / "run"), 1, 1))
    script = f"{lib}\nfor j in {' '.join(states)}; do if job_gone $j; then echo $j gone; else echo $j here; fi; done\n"
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{_fake_slurm_tools(tmp_path)}:/usr/bin:/bin"})
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got == {"1": "here", "2": "here", "3": "here", "4": "gone", "5": "gone", "6": "gone", "7": "gone",
                   "8": "gone", "9": "gone", "10": "here"}, (got, r.stderr)


def test_actor_job_ends_when_the_learner_job_leaves_the_queue_without_learner_done(tmp_path):
    """A learner killed without writing ``learner.done`` (SIGKILL, out of memory, node lost,
    scancel) left actors reconnecting until their time limit: the job now asks ``squeue``
    every ``slurm.poll_s`` and stops its actor once the learner job is no longer queued or
    running."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "learner.addr").write_text("10.1.2.3 5555\n")
    (run / "envhub.url").write_text("http://10.1.2.4:36001\n")
    (run / "learner.job").write_text("77\n")
    (tmp_path / "state-77").write_text("RUNNING")
    proc = _actor_job(tmp_path)
    try:
        _until(lambda: _starts(tmp_path))
        time.sleep(1.5)
        assert proc.poll() is None  # running while the learner job runs
        (tmp_path / "state-77").write_text("INVALID")  # it has ended and Slurm has forgotten it
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 0 and "got-term" in out and "the learner job 77 has ended without learner.done" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_actor_follows_a_requeued_learner_to_its_new_address(tmp_path):
    """A requeued learner job resumes (``learner.resume``) on a node and ports of its own and
    publishes them: the actor job stops its actor and starts it again against the new address."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "learner.addr").write_text("10.1.2.3 5555\n")
    (run / "envhub.url").write_text("http://10.1.2.4:36001\n")
    proc = _actor_job(tmp_path)
    try:
        _until(lambda: len(_starts(tmp_path)) == 1)
        assert "actor.learner_host=10.1.2.3" in _starts(tmp_path)[0]
        (run / "learner.addr").write_text("10.9.9.9 23456\n")
        _until(lambda: len(_starts(tmp_path)) == 2)
        assert "actor.learner_host=10.9.9.9 actor.learner_port=23456" in _starts(tmp_path)[1]
        assert "actor.actor_id=cpu-0_0" in _starts(tmp_path)[1]
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0 and out.count("got-term") == 2 and "the learner moved to 10.9.9.9 23456" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_actor_waits_for_the_envhub_as_long_as_its_job_is_queued_and_not_a_fixed_time(tmp_path):
    """Actors waited ``slurm.wait_s`` for the address files, so a pending envhub (or learner)
    left none: with the job's id known they wait while it is queued (here well past
    ``wait_s=1``), and give up saying why once it has left the queue."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "learner.addr").write_text("10.1.2.3 5555\n")
    (run / "envhub.job").write_text("88\n")
    (tmp_path / "state-88").write_text("PENDING")
    proc = _actor_job(tmp_path)
    try:
        time.sleep(3)
        assert proc.poll() is None and not _starts(tmp_path)
        (run / "envhub.url").write_text("http://10.1.2.4:36001\n")
        _until(lambda: _starts(tmp_path))
        assert "actor.env_url=http://10.1.2.4:36001" in _starts(tmp_path)[0]
    finally:
        proc.terminate()
        proc.communicate(timeout=20)
    (run / "envhub.url").unlink()
    (tmp_path / "state-88").write_text("FAILED")
    proc = _actor_job(tmp_path)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1 and f"no {run}/envhub.url: the envhub job 88 has ended" in err


def test_learner_job_writes_learner_done_only_when_the_learner_ended_by_itself(tmp_path):
    """A signalled learner job (scancel, requeue, time limit) may be resumed: no ``learner.done``
    (which would end the actors a requeued learner needs); the learner's own end writes it."""
    fake = tmp_path / "fakepy"
    fake.write_text(f"#!/bin/bash\ntrap 'exit 0' TERM\ntouch {tmp_path}/started\nwhile true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    overrides = [POOLS, f"slurm.dir={tmp_path}/run", f"slurm.python={fake}", f"slurm.workdir={tmp_path}"]
    (tmp_path / "run").mkdir()
    p = tmp_path / "l.sh"
    p.write_text(slurm.render(conf.load(overrides), overrides).files["learner.sbatch"])
    proc = subprocess.Popen(["bash", str(p)], env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "55"}, stdout=subprocess.PIPE,
                            text=True)
    try:
        _wait_for(tmp_path / "started", proc)
        assert (tmp_path / "run/learner.job").read_text().strip() == "55"
        proc.send_signal(15)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and not (tmp_path / "run/learner.done").exists() and "stopped by a signal" in out


def test_jobs_after_the_learner_start_once_it_has_started(tmp_path):
    calls = []
    s = render(tmp_path)
    s.write(tmp_path / "run")
    slurm.submit(tmp_path / "run", s, lambda cmd: calls.append(list(cmd)) or f"{300 + len(calls)}\n")
    assert "--dependency" not in " ".join(calls[0])
    assert all(c[2] == "--dependency=after:301" for c in calls[1:]) and len(calls) == 4


def test_squeue_counts_only_this_runs_tasks_not_another_runs_pool_of_the_same_name(tmp_path):
    """``squeue`` was matched by the job name ``ts-actors-<pool>`` alone, so another run's pool
    ``cpu`` counted as this run's: the names now carry the run's tag (from its folder) and the
    backend asks for the name its pool's script declares."""
    names = {}
    for run in ("a", "b"):
        o = ["slurm.pools=[{name:cpu,count:2}]", f"slurm.dir={tmp_path}/{run}"]
        s = slurm.render(conf.load(o), o)
        s.write(tmp_path / run)
        names[run] = slurm.job_name(tmp_path / run / "actors-cpu.sbatch", "")
        assert f"#SBATCH --job-name=ts-learner-{slurm.run_tag(str(tmp_path / run))}" in s.files["learner.sbatch"]
    assert names["a"] != names["b"] and names["a"] == f"ts-actors-cpu-{slurm.run_tag(str(tmp_path / 'a'))}"
    queue = {names["a"]: "11_0\n11_1\n", names["b"]: "12_0\n12_1\n12_2\n"}

    def runner(cmd):
        return queue.get(next(a for a in cmd if a.startswith("--name=")).removeprefix("--name="), "")

    assert slurm.SlurmBackend(tmp_path / "a", {"cpu": 2}, runner=runner).refresh() == {"cpu": 2}
    assert slurm.SlurmBackend(tmp_path / "b", {"cpu": 2}, runner=runner).refresh() == {"cpu": 3}
