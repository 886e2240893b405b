"""``turnscale bench envgames``: in-process throughput of TextCraft, SearchQA and SciWorld.

Figures (each beside a baseline measured in the same run):

* ``sciworld_step_per_s``: our step (simulator step + score, no valid-action listing) on one
  JVM over the gold path of task 0, vs the ``scienceworld`` package's own ``step()`` on the
  same path (lists every valid action each step, as AgentGym's server does).
* ``sciworld_pool<N>_steps_per_s``: gold-path steps/s, resets included, over
  ``--sciworld-episodes`` episodes run by ``N`` threads on one family with ``N`` pooled JVMs.
* ``bm25_batched_queries_per_s`` vs single queries, on the shipped SearchQA corpus.
* ``textcraft_steps_per_s``: solver actions stepped in-process (reported only).
"""

from __future__ import annotations

import argparse
import threading
import time

from benchmarks.common import Result, result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sciworld-pool", type=int, default=2, help="JVMs in the SciWorld pool")
    parser.add_argument("--sciworld-episodes", type=int, default=4, help="gold-path episodes per measurement")


def _textcraft() -> list[Result]:
    from envhub.textcraft import TextCraftEnv, RecipeBook, solve

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
    from conf.schema import EnvConfig
    from envhub.searchqa import make_family

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
    from envhub.sciworld import SciWorldFamily

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


def run(args: argparse.Namespace) -> list[Result]:
    out = _textcraft() + _bm25()
    out += _sciworld(getattr(args, "sciworld_pool", 2), getattr(args, "sciworld_episodes", 4))
    return out
