"""``turnscale bench envgames``: in-process throughput of TextCraft, SearchQA and SciWorld.

Figures (each beside a baseline measured in the same run):

* ``sciworld_step_per_s``: our step (simulator step + score, no valid-action listing) on one
  JVM over the gold path of task 0, vs the ``scienceworld`` package's own ``step()`` on the
  same path (lists every valid action each step, as AgentGym's server does).
* ``sciworld_pool<N>_steps_per_s``: gold-path steps/s, resets included, over
  ``--sciworld-episodes`` episodes run by ``N`` threads on one family with ``N`` pooled JVMs.
* ``bm25_batched_queries_per_s`` vs single queries, on the shipped SearchQA corpus.
* ``textcraft_steps_per_s``: solver actions stepped in-process (reported only).
* ``web_steps_per_s_<N>_instances`` (``env=web``: real chromium, local sites): oracle steps/s,
  resets included, of ``--web-instances`` instances played by as many threads on one family,
  vs one instance alone (same family, same tasks); ``web_pss_mib_per_instance``: the browser's
  PSS (every chromium process) divided by the open instances, vs AgentGym's reported ~1 GB per
  WebArena instance (lower is better).  Skipped when ``/usr/bin/chromium`` is missing.
"""

from __future__ import annotations

import argparse
import threading
import time

from turnscale.benchmarks.common import Result, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sciworld-pool", type=int, default=2, help="JVMs in the SciWorld pool")
    parser.add_argument("--sciworld-episodes", type=int, default=4, help="gold-path episodes per measurement")
    parser.add_argument("--web-instances", type=int, default=4, help="concurrent env=web instances")
    parser.add_argument("--web-tasks", type=int, default=8, help="oracle episodes per env=web instance")
    parser.add_argument("--only", default="", help="comma-separated subset: textcraft,bm25,sciworld,web")


def _textcraft() -> list[Result]:
    from turnscale.envhub.textcraft import TextCraftEnv, RecipeBook, solve

    book = RecipeBook()
    env = TextCraftEnv(book)
    plans = [(i, solve(book, g)) for i, (g, _) in enumerate(book.goals)]
    t0, steps = time.perf_counter(), 0
    for i, plan in plans:
        env.reset(i)
        for a in plan:
            env.step(a)
        steps += len(plan) + 1
    dt = time.perf_counter() - t0
    return [result("textcraft_steps_per_s", steps / dt, "steps/s", "none (reported only)", steps / dt)]


def _bm25() -> list[Result]:
    from turnscale.conf.schema import EnvConfig
    from turnscale.envhub.searchqa import make_family

    fam = make_family(EnvConfig(name="searchqa"))
    qs = [it.question for it in fam.items]
    t0 = time.perf_counter()
    for q in qs[:300]:
        fam.retriever.search([q], 3)
    single = 300 / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    fam.retriever.search(qs, 3)
    batched = len(qs) / (time.perf_counter() - t0)
    return [result("bm25_batched_queries_per_s", batched, "queries/s", "single queries", single)]


def _sciworld(pool: int, episodes: int) -> list[Result]:
    from turnscale.envhub.sciworld import SciWorldFamily

    fam = SciWorldFamily(jvm_pool=pool)
    try:
        env = fam.create()
        env.reset(0)
        gold = env.gold_actions()
        env.close()
        # baseline: the package's step() (lists valid actions every step) on one JVM
        jvm = fam.pool.acquire(60)
        jvm.load("boil", 0, "")
        t0 = time.perf_counter()
        for a in gold:
            jvm.step(a)
        base = len(gold) / (time.perf_counter() - t0)
        fam.pool.release(jvm)
        env = fam.create()
        env.reset(0)
        t0, k = time.perf_counter(), 0
        for a in gold:
            k += 1
            if env.step(a).done:
                break
        fast = k / (time.perf_counter() - t0)
        env.close()
        counts: list[int] = []
        lock = threading.Lock()

        def worker(n: int) -> None:
            e = fam.create()
            for _ in range(n):
                e.reset(0)
                k = 0
                for a in gold:
                    k += 1
                    if e.step(a).done:
                        break
                with lock:
                    counts.append(k)
            e.close()

        per = max(1, episodes // pool)
        threads = [threading.Thread(target=worker, args=(per,)) for _ in range(pool)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        ours = sum(counts) / (time.perf_counter() - t0)
        return [
            result("sciworld_step_per_s", fast, "steps/s", "package step(), same JVM", base, target=2.0),
            result(f"sciworld_pool{pool}_steps_per_s", ours, "steps/s incl. resets", "package step(), 1 JVM, no resets", base),
        ]
    finally:
        fam.close()


AGENTGYM_WEBARENA_MIB_PER_INSTANCE = 1024.0
"""AgentGym-RL's reported browser memory per WebArena env instance (~1 GB)."""


def _web(instances: int, tasks: int) -> list[Result]:
    import os

    if not os.path.exists("/usr/bin/chromium"):
        print("envgames: /usr/bin/chromium missing; web entry skipped (scripts/setup.sh installs it as root)")
        return []
    from turnscale.envhub.web import WebFamily
    from turnscale.envhub.web_tasks import TASKS_PER_SEED

    fam = WebFamily()
    try:
        envs = [fam.create() for _ in range(instances)]

        def play(env, first: int, n: int, counts: list[int]) -> None:
            for k in range(n):
                env.reset(first + k)
                for _ in range(40):
                    counts.append(1)
                    if env.step(env.expert_action()).done:
                        break

        base_counts: list[int] = []
        t0 = time.perf_counter()
        play(envs[0], 100 * TASKS_PER_SEED, tasks, base_counts)
        base = len(base_counts) / (time.perf_counter() - t0)
        counts: list[int] = []
        threads = [threading.Thread(target=play, args=(e, 100 * TASKS_PER_SEED, tasks, counts)) for e in envs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        par = len(counts) / (time.perf_counter() - t0)
        mib = fam.pool.memory_bytes() / instances / 2**20
        for e in envs:
            e.close()
        return [
            result(f"web_steps_per_s_{instances}_instances", par, "steps/s incl. resets", "1 instance alone", base),
            result("web_pss_mib_per_instance", mib, "MiB", "AgentGym WebArena (reported)", AGENTGYM_WEBARENA_MIB_PER_INSTANCE,
                   target=2.0, lower_is_better=True),
        ]
    finally:
        fam.close()


def run(args: argparse.Namespace) -> list[Result]:
    only = {x for x in getattr(args, "only", "").split(",") if x}
    want = lambda name: not only or name in only  # noqa: E731
    out: list[Result] = []
    if want("textcraft"):
        out += _textcraft()
    if want("bm25"):
        out += _bm25()
    if want("sciworld"):
        out += _sciworld(getattr(args, "sciworld_pool", 2), getattr(args, "sciworld_episodes", 4))
    if want("web"):
        out += _web(getattr(args, "web_instances", 4), getattr(args, "web_tasks", 8))
    return out
