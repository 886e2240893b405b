"""``turnscale slurm [--dry-run] [hydra overrides]``: a run on a Slurm cluster.

Writes readable sbatch scripts into ``slurm.dir`` (storage every node sees) and submits
them, the learner's first and the others with ``--dependency=after:<learner job>`` (they
start once it has started); ``--dry-run`` prints them and submits nothing:

- ``learner.sbatch``: the learner (under ``torchrun --standalone
  --nproc_per_node=<slurm.learner_ranks>`` when that is above 1), with ``learner.resume=true``
  when ``<dir>/learner/checkpoints`` holds a checkpoint (a requeued or resubmitted job
  continues the run from the newest one); once started it publishes its address as
  ``<dir>/learner.addr`` (``host port``, written to a temp file and renamed, so a reader
  never sees half of it) and its job id as ``<dir>/learner.job``.  When the learner ends by
  itself (its steps done, or an error) the job writes ``<dir>/learner.done``: the run is
  over.  A signalled job (scancel, requeue, time limit: the learner checkpoints) writes none,
  so the actors of a requeued learner stay and follow it;
- ``envhub.sbatch`` (unless ``slurm.env_url`` names an external env server): the env
  server, publishing ``<dir>/envhub.url`` and ``<dir>/envhub.job`` the same way;
- ``actors-<pool>.sbatch``: one job array per pool (``slurm.pools``; ``--array=0-(count-1)``,
  the pool's ``-C``/``-p``/``--gres``, its engine overrides and environment; an
  ``accelerator: nvidia|ascend`` pool gets ``--gres=gpu|npu:<devices>``, ``engine.device=cuda|npu``
  and each task its own devices in ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``
  from Slurm's allocation, ``_device_env``); each task waits for the address files for as
  long as the job publishing each is queued or running (``_job_lib``: ``squeue`` every
  ``slurm.poll_s``; ``slurm.wait_s`` only when the job id is unknown), then runs
  ``turnscale actor`` with ``actor.pool=<pool>`` and ``actor.actor_id=<pool>-<array job>_<task>``,
  and restarts it against the new address when ``learner.addr`` changes (a requeued learner).

The envhub and actor jobs stop their process (SIGTERM) and end once ``learner.done`` appears,
or once the learner job has left the queue without writing it (cancelled, killed, out of
memory, node lost: ``_supervise`` asks ``squeue`` every ``slurm.poll_s``), so no job is left
running until its time limit.

Addresses: each server job publishes ``slurm.interface``'s IPv4 address (and binds it), or
without one the node's first address (``hostname -I``, binding every interface); with
``slurm.free_ports`` (default) it picks ports no socket on its node uses when it starts
(the learner's three, the envhub's one) and publishes them, so runs sharing a node do not
clash; actors learn the learner's other two ports from its ``Welcome``.

Before anything is written, the run's config and every pool's actor config (the run's
overrides, then the pool's ``overrides``) are loaded through the schema (``pool_configs``):
a key or value it refuses stops ``turnscale slurm`` (also ``--dry-run``) with exit 2, naming
``slurm.pools[<pool>].overrides`` and the key.

CURVE: the learner job binds off loopback, so CURVE is on (``learner.curve.enabled: auto``).
When the command line names no key file, the run uses its own keys in ``<dir>/keys``
(``RunKeys``: made by ``turnscale slurm`` when missing, kept when present; secret files
mode 0600): the learner's pair and authorized folder go to the learner job, one pair per
pool to that pool's actors, and a ``control`` pair to ``turnscale autoscale``.  The dry run
says which.  With the user's keys, the files are loaded at generation as the jobs will
(a missing one stops it naming the key and ``turnscale keys``).

Each script forwards the job's SIGTERM (``scancel``) to its process and waits for it.

Every job gets the Hydra overrides given on the command line (minus ``slurm.*``), so
``env=``, ``model=``, ``algo=`` ... are the same everywhere.  ``SlurmBackend`` is the
``turnscale.scaling.ScalingBackend`` on Slurm: ``scale_to(pool, n)`` submits more array
tasks of the pool's script (``sbatch --array=a-b``); ``drain(actor_id)`` needs nothing
more than the learner's drain (the actor exits by itself and its array task ends), and
``cancel(actor_id)`` is ``scancel <job>_<task>`` for an actor that must go now (SIGTERM:
it stops within seconds, docs/architecture.md "Graceful stop").
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from turnscale.conf.schema import Config, PoolConfig, SlurmConfig


def _q(args: Iterable[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def _sbatch_header(name: str, log: str, *, partition: str, account: str, time: str, cpus: int,
                   constraint: str = "", gres: str = "", array: str = "") -> list[str]:
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --output={log}", "#SBATCH --ntasks=1",
             f"#SBATCH --cpus-per-task={cpus}"]
    for flag, value in (("--partition", partition), ("--account", account), ("--time", time),
                        ("--constraint", constraint), ("--gres", gres), ("--array", array)):
        if value:
            lines.append(f"#SBATCH {flag}={value}")
    return lines


_GONE_STATES = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED")
"""Slurm job states after which a job no longer runs (``CANCELLED by ...`` included); a
requeued job goes back to ``PENDING`` and is not gone."""


def _job_lib(run: str, poll_s: int, wait_s: int) -> list[str]:
    """Shell functions of the envhub and actor jobs:

    - ``job_gone ID``: true once Slurm holds job ``ID`` neither pending nor running (ended,
      cancelled, failed, its node lost; a requeued job is pending again, so not gone).  A
      failing ``squeue`` (controller busy) counts as not gone; an empty ``ID`` never is.
    - ``wait_published FILE JOBFILE WHAT``: wait for ``FILE`` for as long as the job named in
      ``JOBFILE`` (``learner.job``, ``envhub.job``: written by ``turnscale slurm`` and by the
      job itself) is pending or running, asking ``squeue`` every ``slurm.poll_s``; exit 1
      saying why once it has ended.  Without a job id, at most ``slurm.wait_s``.
    - ``learner_gone``: ``job_gone`` of the learner job (every ``slurm.poll_s``)."""
    states = "|".join(f"{st}*" if st == "CANCELLED" else st for st in _GONE_STATES)
    return [f"POLL={poll_s}; LEARNER_JOB_FILE={shlex.quote(run + '/learner.job')}",
            "job_gone() {",
            '  local out rc=0; [ -n "$1" ] || return 1',
            '  out=$(squeue -h -j "$1" -o %T 2>&1) || rc=$?',
            '  if [ "$rc" -ne 0 ]; then [[ $out == *"Invalid job id"* ]]; return; fi',
            f'  case "${{out%%[[:space:]]*}}" in ""|{states}) return 0;; esac',
            "  return 1",
            "}",
            'learner_gone() { job_gone "$(cat "$LEARNER_JOB_FILE" 2>/dev/null || true)"; }',
            "wait_published() {",
            "  local t=0 job",
            '  until [ -s "$1" ]; do',
            '    job=$(cat "$2" 2>/dev/null || true)',
            f'    if [ -z "$job" ] && [ "$t" -ge {wait_s} ]; then echo "no $1 after {wait_s}s and no job id in $2: '
            'is the $3 job running?" >&2; exit 1; fi',
            '    if [ -n "$job" ] && [ $((t % POLL)) -eq 0 ] && job_gone "$job"; then '
            f'echo "no $1: the $3 job $job has ended (its log: {run}/logs/)" >&2; exit 1; fi',
            "    sleep 1; t=$((t + 1))",
            "  done",
            "}"]


def _supervise(done: str, follow: str = "") -> list[str]:
    """Shell lines supervising the role ``start`` (a shell function) launches in the background
    (``$PID``) until it exits, ``done`` appears (the run is over), or the learner job has left
    the queue without writing it (cancelled, killed, node lost: ``learner_gone`` every
    ``slurm.poll_s``); then SIGTERM (a role stops within seconds).  The job's SIGTERM is
    forwarded.  ``follow`` (actors): the learner's address file; when its content changes (a
    requeued learner job publishes its new node and ports) the actor is stopped and started
    again with it.  The script exits with the role's status."""
    restart = []
    if follow:
        restart = [f'  NEW=$(cat {follow} 2>/dev/null || true)',
                   '  if [ "$STOP" -eq 0 ] && [ -n "$NEW" ] && [ "$NEW" != "$ADDR" ]; then',
                   '    echo "the learner moved to $NEW (a new incarnation): restarting the actor"',
                   "    kill -TERM $PID 2>/dev/null || true; while kill -0 $PID 2>/dev/null; do wait $PID || true; done",
                   "    start",
                   "  fi"]
    return ["STOP=0; start", "trap 'STOP=1; kill -TERM $PID 2>/dev/null' TERM INT", "T=0",
            f"while kill -0 $PID 2>/dev/null && [ ! -e {done} ]; do",
            "  sleep 1; T=$((T + 1))",
            '  if [ $((T % POLL)) -eq 0 ] && learner_gone; then',
            '    echo "the learner job $(cat "$LEARNER_JOB_FILE") has ended without learner.done '
            '(cancelled, killed, its node lost): stopping"; break',
            "  fi",
            *restart,
            "done",
            "kill -TERM $PID 2>/dev/null || true",
            *_reap()]


def _reap() -> list[str]:
    """Wait for ``$PID`` (again after a trapped signal interrupted ``wait``); exit with its status."""
    return ["rc=0; wait $PID || rc=$?", "while kill -0 $PID 2>/dev/null; do rc=0; wait $PID || rc=$?; done", "exit $rc"]


_PICK_PORTS_AWK = r"""
function hex(s,  i, v) { v = 0; for (i = 1; i <= length(s); i++) v = v * 16 + index("0123456789ABCDEF", toupper(substr(s, i, 1))) - 1; return v }
FNR > 1 { split($2, a, ":"); used[hex(a[2])] = 1 }
END {
  srand(seed); got = 0; lo0 = 10000
  for (tries = 0; got < n && tries < 100000; tries++) {
    if (lo > lo0 + 1000) p = lo0 + int(rand() * (lo - lo0)); else p = hi + 1 + int(rand() * (65535 - hi))
    if (p < 1024 || p > 65535 || (p >= lo && p <= hi) || (p in used)) continue
    used[p] = 1; printf "%s%d", (got++ ? " " : ""), p
  }
  print ""
}"""


def _host_lines(interface: str) -> list[str]:
    """Shell lines setting ``$HOST`` (the address this job publishes) and ``$BIND`` (what its
    server binds): ``slurm.interface``'s IPv4 address for both, or without one the node's first
    address (``hostname -I``) published and every interface bound."""
    if not interface:
        return ['HOST=$(hostname -I 2>/dev/null | awk \'{print $1}\'); HOST=${HOST:-$(hostname)}', "BIND=0.0.0.0"]
    i = shlex.quote(interface)
    return [f"HOST=$(ip -o -4 addr show dev {i} 2>/dev/null | awk '{{split($4, a, \"/\"); print a[1]; exit}}' || true)",
            f'[ -n "$HOST" ] || {{ echo "slurm.interface={interface}: no IPv4 address on $(hostname) '
            f'(ip -4 addr show dev {interface}); name an interface this node has" >&2; exit 1; }}',
            'BIND=$HOST']


def _pick_ports(names: Sequence[str], fixed: Sequence[int], free: bool) -> list[str]:
    """Shell lines setting the variables ``names`` to TCP ports: with ``free`` (``slurm.free_ports``)
    ports that no socket of this node uses now (``/proc/net/tcp*``, any state), outside the
    kernel's ephemeral range (which outgoing connections draw from) and distinct; else ``fixed``.
    The seed stays below 2**30 (awk clamps a larger one: every job on a node drew the same ports).
    The pick happens when the job starts, on its node, so two runs sharing a node do not
    clash (a port taken between the pick and the bind makes the role fail to bind: rare)."""
    if not free:
        return [f"{n}={p}" for n, p in zip(names, fixed)]
    return ["read -r LO HI < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || { LO=32768; HI=60999; }",
            f"PORTS=$(awk -v n={len(names)} -v lo=\"$LO\" -v hi=\"$HI\" -v seed=\"$(( (RANDOM << 15 | RANDOM) ^ $$ ))\" "
            f"{shlex.quote(_PICK_PORTS_AWK)} /proc/net/tcp /proc/net/tcp6 2>/dev/null || true)",
            f"read -r {' '.join(names)} <<< \"$PORTS\"",
            f'[ -n "${{{names[-1]}:-}}" ] || {{ echo "no free TCP ports on $(hostname) (/proc/net/tcp)" >&2; exit 1; }}']


def _resume_if_checkpointed(checkpoints: str) -> list[str]:
    """Shell lines setting ``$RESUME`` to ``learner.resume=true`` when ``checkpoints`` holds a
    complete checkpoint (``step-*/meta.json``, ``learner/checkpoint.py``), else empty: a
    requeued or resubmitted learner job continues the run from its newest checkpoint."""
    pattern = f"{shlex.quote(checkpoints)}/step-*/meta.json"
    return ["RESUME=''",
            f"if compgen -G {pattern} >/dev/null; then",
            f"  RESUME=learner.resume=true; echo \"resuming from the newest checkpoint in {checkpoints}\"",
            "fi"]


def _publish(path: str, value: str) -> list[str]:
    """Shell lines writing ``value`` to ``path`` atomically (temp file + rename)."""
    return [f'printf "%s\\n" {value} > {shlex.quote(path)}.tmp.$$', f"mv -f {shlex.quote(path)}.tmp.$$ {shlex.quote(path)}"]


@dataclass(frozen=True)
class Scripts:
    """The generated scripts, by file name, in submission order."""

    files: dict[str, str]

    def write(self, folder: Path) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "logs").mkdir(exist_ok=True)
        out = []
        for name, text in self.files.items():
            p = folder / name
            p.write_text(text)
            p.chmod(0o755)
            out.append(p)
        return out


def run_tag(run: str) -> str:
    """Eight hex digits naming the run (its folder) in job names (``ts-actors-<pool>-<tag>``), so
    ``squeue --name`` counts this run's tasks, never another run's pool of the same name."""
    return hashlib.sha1(os.path.abspath(run).encode()).hexdigest()[:8]


def job_name(script: Path, default: str) -> str:
    """The job name a script declares (``#SBATCH --job-name=X`` or ``-J X``), else ``default``."""
    try:
        text = script.read_text()
    except OSError:
        return default
    m = re.search(r"^#SBATCH\s+(?:--job-name=|-J\s*)(\S+)", text, re.M)
    return m.group(1) if m else default


def _job_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's Hydra overrides every job gets: all but ``slurm.*``."""
    return [o for o in overrides if not o.startswith(("slurm.", "slurm=", "+slurm"))]


def pool_configs(cfg: Config, overrides: Sequence[str]) -> dict[str, Config]:
    """Each pool's actors' config, loaded through the schema as the actor will load it (the
    run's overrides, then the pool's ``overrides``, then ``actor.pool``): a key or value the
    schema refuses raises ``conf.ConfigError`` naming ``slurm.pools[<pool>].overrides`` and the
    key, here at generation rather than on the nodes once the actors start."""
    from turnscale import conf

    out = {}
    for pool in cfg.slurm.pools:
        try:
            out[pool.name] = conf.load([*_job_overrides(overrides), *_pool_overrides(pool), f"actor.pool={pool.name}"])
        except conf.ConfigError as exc:
            raise conf.ConfigError(f"slurm.pools[{pool.name}].overrides {list(pool.overrides)}: {exc}") from None
    return out


def render(cfg: Config, overrides: Sequence[str], cwd: str = "") -> Scripts:
    """Every sbatch script of the run (pure: no file written, nothing submitted)."""
    s: SlurmConfig = cfg.slurm
    run = os.path.abspath(s.dir)
    workdir = s.workdir or cwd or os.getcwd()
    common = _job_overrides(overrides)
    common.append(f"learner.dir={run}/learner")
    keys = run_keys(cfg)
    py = [s.python, "-m", "turnscale"]
    files: dict[str, str] = {}
    lc = cfg.learner

    learner_cmd = py
    if s.learner_ranks > 1:  # one job, K ranks on its node: rank 0 serves, all train (learner/ranks.py)
        learner_cmd = [s.python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.learner_ranks}",
                       "-m", "turnscale"]
    learner = _sbatch_header(f"ts-learner-{run_tag(run)}", f"{run}/logs/learner-%j.log", partition=s.partition, account=s.account,
                             time=s.time, cpus=s.learner_cpus, constraint=s.learner_constraint, gres=s.learner_gres)
    done = shlex.quote(f"{run}/learner.done")
    learner += ["# turnscale learner: trains, leases work, publishes weights; its address goes to learner.addr",
                "set -euo pipefail", f"cd {shlex.quote(workdir)}", f"rm -f {done}",
                'if [ -n "${SLURM_JOB_ID:-}" ]; then', *_publish(f"{run}/learner.job", '"$SLURM_JOB_ID"'), "fi",
                *_host_lines(s.interface),
                *_pick_ports(("PORT", "PUB_PORT", "WEIGHTS_PORT"), (lc.port, lc.pub_port, lc.weights_port), s.free_ports),
                *_publish(f"{run}/learner.addr", '"$HOST $PORT"'),
                *_resume_if_checkpointed(f"{run}/learner/checkpoints"),
                f"{_q(learner_cmd)} learner {_q(common)} {_q(keys.learner_overrides(pool_ids_per_key(cfg, overrides)) if keys else [])} "
                '"learner.host=$BIND" "learner.port=$PORT" "learner.pub_port=$PUB_PORT" "learner.weights_port=$WEIGHTS_PORT" '
                "$RESUME &",
                "PID=$!", "STOP=0",
                "trap 'STOP=1; kill -TERM $PID 2>/dev/null' TERM INT  # scancel, requeue, time limit: it checkpoints and exits",
                *_reap()[:2],
                'if [ "$STOP" -eq 0 ]; then',
                f"  touch {done}  # it ended by itself (its steps done, or an error): the run is over, every job stops",
                "else",
                '  echo "stopped by a signal (scancel, requeue, time limit): no learner.done; the envhub and actor jobs '
                'stop once this job has left the queue, and stay for a requeued one (it resumes)"',
                "fi",
                "exit $rc"]
    files["learner.sbatch"] = "\n".join(learner) + "\n"

    if not s.env_url:
        env = _sbatch_header(f"ts-envhub-{run_tag(run)}", f"{run}/logs/envhub-%j.log", partition=s.partition, account=s.account,
                             time=s.time, cpus=s.envhub_cpus)
        env += ["# turnscale envhub: the env server the actors play on; its URL goes to envhub.url",
                "set -euo pipefail", f"cd {shlex.quote(workdir)}",
                'if [ -n "${SLURM_JOB_ID:-}" ]; then', *_publish(f"{run}/envhub.job", '"$SLURM_JOB_ID"'), "fi",
                *_job_lib(run, s.poll_s, s.wait_s),
                *_host_lines(s.interface),
                *_pick_ports(("PORT",), (cfg.env.port,), s.free_ports),
                *_publish(f"{run}/envhub.url", '"http://$HOST:$PORT"'),
                f'start() {{ {_q(py)} envhub {_q(common)} "host=$BIND" "port=$PORT" "env.exit_after_idle_s={s.envhub_idle_exit_s:g}" '
                '& PID=$!; }  # it also ends by itself once no actor has called it for that long (no squeue needed)',
                *_supervise(done)]
        files["envhub.sbatch"] = "\n".join(env) + "\n"

    for pool in s.pools:
        files[f"actors-{pool.name}.sbatch"] = _actor_script(cfg, pool, run, workdir, py,
                                                           [*common, *(keys.actor_overrides(pool.name) if keys else [])])
    return Scripts(files)


ACCELERATORS = {"nvidia": ("gpu", "CUDA_VISIBLE_DEVICES", "cuda"), "ascend": ("npu", "ASCEND_RT_VISIBLE_DEVICES", "npu")}
"""``PoolConfig.accelerator`` -> (Slurm gres name, the device variable, ``engine.device``)."""


def pool_gres(pool: PoolConfig) -> str:
    """``--gres`` of the pool's tasks: ``gres`` as given, else ``<gpu|npu>:<devices>`` for an accelerator pool."""
    if pool.gres or not pool.accelerator:
        return pool.gres
    return f"{ACCELERATORS[pool.accelerator][0]}:{pool.devices}"


def _pool_overrides(pool: PoolConfig) -> list[str]:
    """The pool's actor overrides: ``engine.device`` of its accelerator, then its own ``overrides``."""
    device = [f"engine.device={ACCELERATORS[pool.accelerator][2]}"] if pool.accelerator else []
    return [*device, *pool.overrides]


def _device_env(pool: PoolConfig) -> list[str]:
    """Shell lines exporting the task's own devices (``CUDA_VISIBLE_DEVICES`` /
    ``ASCEND_RT_VISIBLE_DEVICES``) from Slurm's allocation to this task (``scontrol show job -d``:
    ``GRES=npu:2(IDX:2-3)`` -> ``2,3``), unless set already (by Slurm's gres plugin, or the
    pool's ``env``); a task without such devices stops saying so."""
    if not pool.accelerator:
        return []
    kind, var, _ = ACCELERATORS[pool.accelerator]
    return [f'if [ -z "${{{var}:-}}" ]; then  # this task\'s {kind} devices, from its allocation',
            f'  IDX=$(scontrol show job -d "${{SLURM_JOB_ID:-0}}" 2>/dev/null | grep -o "{kind}[^(, ]*(IDX:[^)]*)" '
            "| head -n 1 | sed 's/.*IDX:\\([^)]*\\))/\\1/' || true)",
            '  DEVS=""; IFS=, read -ra PARTS <<< "$IDX"',
            '  for p in "${PARTS[@]}"; do if [[ $p =~ ^([0-9]+)-([0-9]+)$ ]]; then '
            'for ((i=${BASH_REMATCH[1]}; i<=${BASH_REMATCH[2]}; i++)); do DEVS+="${DEVS:+,}$i"; done; '
            'elif [[ $p =~ ^[0-9]+$ ]]; then DEVS+="${DEVS:+,}$p"; fi; done',
            f'  [ -n "$DEVS" ] || {{ echo "pool {pool.name}: no {kind} in this task\'s allocation (scontrol show job -d '
            f'${{SLURM_JOB_ID:-?}}); check the pool\'s gres ({pool_gres(pool)}) and the nodes\' gres.conf, or set {var} '
            'in the pool\'s env" >&2; exit 1; }',
            f"  export {var}=$DEVS",
            "fi",
            f'echo "{var}=${{{var}}}"']


def _actor_script(cfg: Config, pool: PoolConfig, run: str, workdir: str, py: list[str], common: list[str]) -> str:
    s = cfg.slurm
    array = f"0-{pool.count - 1}" if pool.count > 0 else ""
    lines = _sbatch_header(f"ts-actors-{pool.name}-{run_tag(run)}", f"{run}/logs/actors-{pool.name}-%A_%a.log",
                           partition=pool.partition or s.partition, account=s.account, time=s.time,
                           cpus=pool.cpus_per_task, constraint=pool.constraint, gres=pool_gres(pool), array=array)
    lines.append("#SBATCH --no-requeue  # a task lost with its node is replaced by SlurmBackend under a new actor id")
    lines += [f"# turnscale actors of pool {pool.name!r}: one actor per array task",
              "set -euo pipefail", f"cd {shlex.quote(workdir)}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(pool.env.items())]
    lines += _device_env(pool)
    addr = shlex.quote(f"{run}/learner.addr")
    lines += [*_job_lib(run, s.poll_s, s.wait_s),
              f'wait_published {addr} "$LEARNER_JOB_FILE" learner']
    if not s.env_url:
        lines.append(f"wait_published {shlex.quote(run + '/envhub.url')} {shlex.quote(run + '/envhub.job')} envhub")
    env_url = shlex.quote(s.env_url) if s.env_url else f"$(cat {shlex.quote(run + '/envhub.url')})"
    lines += [f"ENV_URL={env_url}",
              f'ACTOR_ID={pool.name}-${{SLURM_ARRAY_JOB_ID:-${{SLURM_JOB_ID:-0}}}}_${{SLURM_ARRAY_TASK_ID:-0}}',
              "start() {",
              f"  ADDR=$(cat {addr}); read -r LEARNER_HOST LEARNER_PORT <<< \"$ADDR\"",
              f"  {_q(py)} actor {_q(common)} {_q(_pool_overrides(pool))} actor.pool={pool.name} "
              '"actor.learner_host=$LEARNER_HOST" "actor.learner_port=$LEARNER_PORT" "actor.env_url=$ENV_URL" '
              '"actor.actor_id=$ACTOR_ID" &',
              "  PID=$!",
              "}",
              *_supervise(shlex.quote(f"{run}/learner.done"), follow=addr)]
    return "\n".join(lines) + "\n"


_ACTOR_ID = re.compile(r"^([A-Za-z0-9_]+)-([0-9]+_[0-9]+)$")


def parse_actor_id(actor_id: str) -> tuple[str, str]:
    """``(pool, "<job>_<task>")`` of an actor id this launcher made (``<pool>-<job>_<task>``);
    ``ValueError`` for anything else.  Unambiguous because a pool name has no ``-``
    (``PoolConfig`` refuses one), so the only ``-`` separates the pool from the Slurm ids."""
    m = _ACTOR_ID.match(actor_id)
    if m is None:
        raise ValueError(f"{actor_id!r} is not an actor id of turnscale slurm ('<pool>-<job>_<task>', "
                         "pool: letters, digits, '_')")
    return m.group(1), m.group(2)


KEYS = "keys"
"""Folder of the run's own CURVE keys, inside ``slurm.dir``."""


@dataclass(frozen=True)
class RunKeys:
    """The run's own CURVE key files in ``<slurm.dir>/keys`` (``ensure``, mode 0700; secret
    files 0600): the learner's pair, one pair per pool (``actor-<pool>``; the pool's actors
    share it, and the learner job lets it register the whole pool: ``pool_ids_per_key``), one for
    ``turnscale autoscale`` (``control``), and ``authorized/`` with the pools' and the
    control's public keys.  ``*_overrides`` wire them into each role's command line."""

    folder: str

    def _p(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def learner_overrides(self, ids_per_key: int = 0) -> list[str]:
        """The learner's key files and, with ``ids_per_key`` > 0, ``learner.max_actor_ids_per_key``
        raised to it (``pool_ids_per_key``)."""
        extra = [f"learner.max_actor_ids_per_key={ids_per_key}"] if ids_per_key > 0 else []
        return [f"learner.curve.secret_key={self._p('learner.key_secret')}",
                f"learner.curve.authorized={self._p('authorized')}", *extra]

    def actor_overrides(self, pool: str) -> list[str]:
        return [f"actor.curve.server_key={self._p('learner.key')}",
                f"actor.curve.secret_key={self._p(f'actor-{pool}.key_secret')}"]

    def control_overrides(self) -> list[str]:
        """For ``turnscale autoscale`` (its ``LearnerControl`` connects as an authorized client)."""
        return [f"actor.curve.server_key={self._p('learner.key')}",
                f"actor.curve.secret_key={self._p('control.key_secret')}"]

    def exists(self) -> bool:
        return os.path.isfile(self._p("learner.key_secret"))

    def ensure(self, pools: Iterable[str]) -> list[str]:
        """Create the key pairs that are missing (an existing pair is kept: a resubmitted run
        keeps its keys, and actors still running keep matching); the names created."""
        from turnscale.protocol.curve import create_pair

        os.makedirs(self._p("authorized"), exist_ok=True)
        os.chmod(self.folder, 0o700)
        made = []
        for name in ("learner", *(f"actor-{p}" for p in pools), "control"):
            if os.path.isfile(self._p(f"{name}.key_secret")):
                continue
            public, _ = create_pair(self.folder, name)
            if name != "learner":
                shutil.copyfile(public, self._p(f"authorized/{name}.key"))
            made.append(name)
        return made


def run_keys(cfg: Config) -> RunKeys | None:
    """The run's own keys when the learner serves CURVE (``learner.curve.enabled`` is ``true``,
    or ``auto``: the learner job binds off loopback) and the command line gives no key file
    (``learner.curve.*``, ``actor.curve.*``); None when CURVE is off or the user's keys are used."""
    lc, ac = cfg.learner.curve, cfg.actor.curve
    if lc.enabled == "false" or any((lc.secret_key, lc.authorized, ac.secret_key, ac.server_key)):
        return None
    return RunKeys(os.path.join(os.path.abspath(cfg.slurm.dir), KEYS))


def _explicit(overrides: Sequence[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def pool_ids_per_key(cfg: Config, overrides: Sequence[str]) -> int:
    """With the run's own keys, the actors of a pool share its key: the learner then lets one
    key register as many actor ids as the largest pool may have (``max(count, max_actors)``),
    when that is above ``learner.max_actor_ids_per_key`` and the command line does not set the
    key itself (then ``check_curve`` holds the user to it).  0: nothing to raise.  The bound
    still holds against any other key: these keys are made by the run and only its jobs read
    them."""
    if run_keys(cfg) is None or not cfg.slurm.pools or _explicit(overrides, "learner.max_actor_ids_per_key"):
        return 0
    largest = max(max(p.count, p.max_actors) for p in cfg.slurm.pools)
    return largest if largest > cfg.learner.max_actor_ids_per_key else 0


def check_curve(cfg: Config, pools: dict[str, Config], overrides: Sequence[str] = ()) -> None:
    """At generation: with the run's own keys, every pool fits under ``learner.max_actor_ids_per_key``
    (its actors share one key; raised to the largest pool unless the command line sets it:
    ``pool_ids_per_key``); with the user's keys, the files load as the jobs will load them
    (``CurveConfigError`` names the key and the ``turnscale keys`` command)."""
    import dataclasses

    from turnscale import conf
    from turnscale.common.curve import actor_curve, learner_curve

    if run_keys(cfg) is not None:
        if pool_ids_per_key(cfg, overrides):
            return
        limit = cfg.learner.max_actor_ids_per_key
        for p in cfg.slurm.pools:
            if max(p.count, p.max_actors) > limit:
                raise conf.ConfigError(
                    f"slurm.pools[{p.name}]: up to {max(p.count, p.max_actors)} actors share the pool's CURVE key, "
                    f"but learner.max_actor_ids_per_key is {limit}: pass learner.max_actor_ids_per_key="
                    f"{max(p.count, p.max_actors)}, or split the pool")
        return
    learner_curve(dataclasses.replace(cfg.learner, host="0.0.0.0"), warn=False)
    for pc in pools.values():  # any address off loopback: what the published one is
        actor_curve(dataclasses.replace(pc.actor, learner_host="learner.invalid"), warn=False)


Runner = Callable[[Sequence[str]], str]


def _run(cmd: Sequence[str]) -> str:
    return subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=60).stdout


def submit(folder: Path, scripts: Scripts, runner: Runner = _run) -> dict[str, str]:
    """``sbatch --parsable`` every script in order; script name -> job id.  The jobs after the
    first (the learner's) get ``--dependency=after:<learner job>``: they start once the learner
    job has started, so no envhub or actor holds a node while the learner waits for one (and
    actors then wait for the address files only while those jobs are queued or running)."""
    out: dict[str, str] = {}
    for name in scripts.files:
        dep = [f"--dependency=after:{next(iter(out.values()))}"] if out else []
        out[name] = runner(["sbatch", "--parsable", *dep, str(folder / name)]).strip().split(";")[0]
    return out


@dataclass
class SlurmBackend:
    """``ScalingBackend`` on Slurm (see the module docstring).  ``submitted``: array tasks
    submitted so far per pool (the next task index)."""

    folder: Path
    pools: dict[str, int]
    runner: Runner = _run
    submitted: dict[str, int] = field(default_factory=dict)
    drained: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for pool, n in self.pools.items():
            self.submitted.setdefault(pool, n)

    def scale_to(self, pool: str, n: int) -> None:
        """Submit array tasks so that ``n`` actors of ``pool`` run (counting those running
        now, ``self.pools``, which the caller keeps current); never cancels."""
        have = self.pools.get(pool, 0)
        if n <= have:
            return
        first = self.submitted.get(pool, 0)
        last = first + (n - have) - 1
        self.runner(["sbatch", "--parsable", f"--array={first}-{last}", str(self.folder / f"actors-{pool}.sbatch")])
        self.submitted[pool] = last + 1
        self.pools[pool] = n

    def live(self, pool: str) -> int:
        """Array tasks of ``pool`` that Slurm still holds (pending or running), from
        ``squeue``: a task whose node died (or that crashed) is no longer counted, unlike
        "submitted minus drained".  Matched by the job name the pool's script declares
        (``ts-actors-<pool>-<run tag>``: this run's tasks only)."""
        name = job_name(self.folder / f"actors-{pool}.sbatch", f"ts-actors-{pool}")
        out = self.runner(["squeue", "--noheader", "--array", "--states=PENDING,CONFIGURING,RUNNING",
                           f"--name={name}", "--format=%i"])
        return sum(1 for line in out.splitlines() if line.strip())

    def refresh(self) -> dict[str, int]:
        """Set ``self.pools`` from ``squeue`` (``live``) so that ``scale_to`` replaces lost actors."""
        for pool in list(self.pools):
            self.pools[pool] = self.live(pool)
        return dict(self.pools)

    def job_gone(self, job: str) -> bool:
        """True once Slurm holds ``job`` neither pending nor running (the scripts' ``job_gone``):
        ``squeue`` no longer knows it or shows an end state; a failing ``squeue`` is not gone."""
        try:
            out = self.runner(["squeue", "-h", "-j", job, "-o", "%T"])
        except subprocess.CalledProcessError as exc:
            return "Invalid job id" in f"{exc.stdout or ''}{exc.stderr or ''}"
        except (OSError, subprocess.SubprocessError):
            return False
        words = out.split()
        return not words or words[0].startswith(_GONE_STATES)

    def drain(self, actor_id: str) -> None:
        """The learner drains it; the actor exits by itself and its array task ends."""
        pool, _ = parse_actor_id(actor_id)
        self.drained.append(actor_id)
        if self.pools.get(pool, 0) > 0:
            self.pools[pool] -= 1

    def cancel(self, actor_id: str) -> None:
        """``scancel`` the array task of ``actor_id`` (``<pool>-<job>_<task>``): SIGTERM, then Slurm's KillWait."""
        self.runner(["scancel", parse_actor_id(actor_id)[1]])


def main(argv: Iterable[str] | None = None, runner: Runner = _run) -> int:
    from turnscale import conf
    args = list(sys.argv[1:] if argv is None else argv)
    dry = "--dry-run" in args
    overrides = [a for a in args if a != "--dry-run"]
    try:
        cfg = conf.load(overrides)
        check_curve(cfg, pool_configs(cfg, overrides), overrides)
    except conf.ConfigError as exc:
        print(f"turnscale slurm: {exc}", file=sys.stderr)
        return 2
    scripts = render(cfg, overrides)
    keys = run_keys(cfg)
    if dry:
        if keys is not None:
            print(f"# CURVE is on (the learner binds off loopback) and no key is given: "
                  + (f"the run's keys in {keys.folder} are used" if keys.exists() else
                     f"turnscale slurm (without --dry-run) creates them in {keys.folder} (secret files mode 0600)")
                  + "; every job below is wired to them\n")
        for name, text in scripts.files.items():
            print(f"# ===== {cfg.slurm.dir}/{name}\n{text}")
        return 0
    folder = Path(cfg.slurm.dir)
    for stale in ("learner.addr", "envhub.url", "learner.done", "learner.job", "envhub.job"):  # a previous run's
        (folder / stale).unlink(missing_ok=True)
    scripts.write(folder)
    if keys is not None:
        made = keys.ensure(p.name for p in cfg.slurm.pools)
        print(f"CURVE keys: {keys.folder} ({'made ' + ', '.join(made) if made else 'kept from before'}; "
              f"turnscale autoscale finds them there)")
    try:
        jobs = submit(folder, scripts, runner)
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"turnscale slurm: sbatch failed ({exc}); the scripts are in {folder}/ to inspect and submit by hand",
              file=sys.stderr)
        return 1
    for name, job in jobs.items():
        print(f"{name}: job {job}")
    for name, file in (("learner.sbatch", "learner.job"), ("envhub.sbatch", "envhub.job")):
        if name in jobs:  # the other jobs wait while it is queued, and end once it has left the queue
            (folder / file).write_text(jobs[name] + "\n")
    print(f"to stop the run: scancel {' '.join(jobs.values())}")
    from turnscale.learner.checkpoint import latest
    if (ck := latest(str(folder.resolve() / "learner" / "checkpoints"))) is not None:
        print(f"the learner resumes from {ck} (and from the newest checkpoint whenever its job is requeued); "
              "a fresh run needs a new slurm.dir")
    print(f"learner address: {folder}/learner.addr (written when the learner job starts); logs: {folder}/logs/")
    return 0
