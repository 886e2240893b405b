"""The server's limits in process, with fakes: call deadlines and abandoned calls
(``envhub.workers`` via ``InstanceTable``), body parsing rules (``envhub.bodies``), quotas.
The same against real server processes: ``tests/integration/test_envhub_hostile.py``."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from turnscale.conf.schema import ServerLimits
from turnscale.envhub.base import ResetResult, StepResult
from turnscale.envhub.bodies import encode_json, json_shape, parse_json_object
from turnscale.envhub.instances import CALLER, ApiError, InstanceTable, per_address_limit


class HangingEnv:
    """``step("hang")`` blocks until ``release`` is set (a simulator that stopped answering)."""

    def __init__(self, release: threading.Event, closed: list) -> None:
        self.release, self.closed = release, closed

    def reset(self, data_idx):
        return ResetResult(f"task {data_idx}")

    def step(self, action):
        if action == "hang":
            self.release.wait(30)
        return StepResult("ok", 0.0, False)

    def observation(self):
        return "obs"

    def close(self):
        self.closed.append(self)


class HangingFamily:
    name = "hanging"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed: list = []

    def create(self):
        return HangingEnv(self.release, self.closed)

    def num_tasks(self):
        return 1

    def close(self):
        pass


def _table(family, **limits) -> InstanceTable:
    return InstanceTable(family, max_instances=8, idle_timeout_s=60, threads=2, limits=ServerLimits(**limits))


async def _wait_for(cond, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


def test_a_call_past_its_deadline_answers_504_and_frees_the_instance_at_once():
    async def main():
        family = HangingFamily()
        table = _table(family, call_timeout_s=0.2, max_overrun_calls=1)
        a, b = await table.create(), await table.create()
        await table.reset(a, 0)
        await table.reset(b, 0)
        with pytest.raises(ApiError) as err:
            await table.step(a, "hang")
        assert err.value.status == 504 and err.value.code == "deadline_exceeded"
        with pytest.raises(ApiError) as err:  # no lock left held: answered at once
            await table.observation(a)
        assert err.value.status == 410
        await table.close(a)  # idempotent
        assert family.closed == []  # the env is still inside its call: not closed under it
        assert "overran" in table.health()  # 1 abandoned call = max_overrun_calls
        with pytest.raises(ApiError) as err:
            await table.step(b, "x")
        assert err.value.status == 503 and err.value.code == "workers_exhausted" and err.value.retry_after_s
        family.release.set()
        await _wait_for(lambda: len(family.closed) == 1)  # closed when the call returned
        assert table.health() == "" and (await table.step(b, "x")).observation == "ok"
        assert table.metrics()["timed_out"] == 1
        await table.close_all()

    asyncio.run(main())


def test_shutdown_does_not_wait_for_an_abandoned_call():
    async def main():
        family = HangingFamily()
        table = _table(family, call_timeout_s=0.2, shutdown_timeout_s=1)
        a = await table.create()
        await table.reset(a, 0)
        with pytest.raises(ApiError):
            await table.step(a, "hang")
        async with asyncio.timeout(5):
            await table.close_all()
        family.release.set()

    asyncio.run(main())


def test_quota_is_per_address_and_tokens_never_extend_it():
    async def main():
        table = InstanceTable(HangingFamily(), max_instances=8, idle_timeout_s=60, limits=ServerLimits(max_instances_per_address=2))
        mine = [await table.create("10.0.0.1", "actor-1"), await table.create("10.0.0.1", "actor-2")]
        for token in ("", "actor-3", "actor-1"):  # another token behind the same address gains nothing
            with pytest.raises(ApiError) as err:
                await table.create("10.0.0.1", token)
            assert (err.value.status, err.value.code) == (429, "client_quota") and err.value.retry_after_s
            assert "10.0.0.1" in err.value.message and "max_instances_per_address" in err.value.message
        await table.create("10.0.0.2")  # another address has its own quota
        await table.close(mine[0])
        await table.create("10.0.0.1", "actor-9")  # closing freed the address's quota
        assert table.errors == {}  # counted once, by the error handler, not here
        await table.close_all()

    asyncio.run(main())


def test_default_address_quota_is_seven_eighths_of_the_server_rounded_up():
    assert per_address_limit(0, 512) == 448 and per_address_limit(0, 80) == 70 and per_address_limit(0, 2) == 2
    assert per_address_limit(0, 1) == 1 and per_address_limit(5, 512) == 5

    async def main():
        table = InstanceTable(HangingFamily(), max_instances=8, idle_timeout_s=60)
        for _ in range(7):
            await table.create("10.0.0.1", f"t{_}")
        with pytest.raises(ApiError) as err:
            await table.create("10.0.0.1", "t7")
        assert err.value.code == "client_quota"
        await table.create("10.0.0.2")  # the eighth is another address's
        await table.close_all()

    asyncio.run(main())


def test_an_address_at_its_overrun_cap_is_refused_while_others_are_served():
    async def main():
        family = HangingFamily()
        table = _table(family, call_timeout_s=0.2, max_overrun_calls=4, max_overrun_calls_per_address=2)
        ids = {}
        for who in ("10.0.0.1", "10.0.0.1", "10.0.0.1", "10.0.0.2"):
            CALLER.set(who)
            i = await table.create(who)
            await table.reset(i, 0)
            ids.setdefault(who, []).append(i)
        CALLER.set("10.0.0.1")
        for i in ids["10.0.0.1"][:2]:
            with pytest.raises(ApiError) as err:
                await table.step(i, "hang")
            assert err.value.status == 504
        with pytest.raises(ApiError) as err:  # its third call is refused before it starts
            await table.step(ids["10.0.0.1"][2], "x")
        assert (err.value.status, err.value.code) == (429, "overrun_quota") and err.value.retry_after_s
        assert "10.0.0.1" in err.value.message and "max_overrun_calls_per_address" in err.value.message
        assert table.health() == ""  # 2 of 4 abandoned: the server is healthy
        CALLER.set("10.0.0.2")
        assert (await table.step(ids["10.0.0.2"][0], "x")).observation == "ok"
        assert table.metrics()["overrun_addresses"] == 1
        family.release.set()
        await _wait_for(lambda: table.workers.overrun == 0)
        CALLER.set("10.0.0.1")
        assert (await table.step(ids["10.0.0.1"][2], "x")).observation == "ok"  # its calls returned: served again
        assert table.metrics()["overrun_addresses"] == 0
        await table.close_all()

    asyncio.run(main())


def test_reclaim_closes_an_instance_nobody_holds_and_frees_the_quota():
    async def main():
        family = HangingFamily()
        table = InstanceTable(family, max_instances=8, idle_timeout_s=60, limits=ServerLimits(max_instances_per_address=1))
        i = await table.create("10.0.0.1")
        await table.reclaim(i)
        assert family.closed and table.metrics()["reclaimed"] == 1
        with pytest.raises(ApiError) as err:
            await table.reset(i, 0)
        assert err.value.status == 404 and "hung up" in err.value.message
        await table.create("10.0.0.1")
        await table.close_all()

    asyncio.run(main())


LIMITS = ServerLimits(max_json_depth=4)


@pytest.mark.parametrize("raw, code", [
    (b"[" * 100_000 + b"]" * 100_000, "too_deep"),
    (b'{"a": [[[[1]]]]}', "too_deep"),
    (b'{"a": "\\ud800"}', "invalid_text"),
    (b'{"\\udfff": 1}', "invalid_text"),
    (b'{"a": 1', "invalid_json"),
    (b"\xff\xfe", "invalid_json"),
    (b"[1]", "invalid_body"),
])
def test_malformed_bodies_get_a_typed_422(raw, code):
    with pytest.raises(ApiError) as err:
        parse_json_object(raw, LIMITS)
    assert err.value.status == 422 and err.value.code == code, err.value.message


def test_valid_bodies_pass_and_paired_surrogates_are_text():
    assert parse_json_object(b'{"a": [[1]], "b": "\\ud83d\\ude00 \xc3\xa9"}', LIMITS) == {"a": [[1]], "b": "\U0001F600 \u00e9"}
    assert parse_json_object(b"  ", LIMITS, required=False) == {}


def test_any_string_the_server_holds_can_be_encoded():
    assert json.loads(encode_json({"o": "caf\u00e9"})) == {"o": "caf\u00e9"}
    assert json.loads(encode_json({"o": "bad \ud800"})) == {"o": "bad \ud800"}


@pytest.mark.parametrize("raw, values", [
    (b'{"id": 1, "action": "go, [left], {now}"}', 3),  # brackets and commas inside strings are text
    (b'{"id": 1, "action": "say \\"[[,\\" \\\\"}', 3),  # escaped quotes and backslashes
    (b'{"steps": [{"id": 1, "action": "a"}, {"id": 2, "action": "b"}]}', 8),
])
def test_json_shape_counts_structure_outside_strings(raw, values):
    depth, n = json_shape(raw, 4096)
    assert n == values and n >= _count_values(json.loads(raw)) and depth <= 3


def _count_values(v) -> int:
    if isinstance(v, dict):
        return 1 + sum(_count_values(x) for x in v.values())
    if isinstance(v, list):
        return 1 + sum(_count_values(x) for x in v)
    return 1


@pytest.mark.parametrize("raw", [
    b'{"id": 1, "action": [' + b",".join([b"0"] * 520_000) + b"]}",  # 1 MiB: once 0.9 s of the event loop
    b'{"id": 1, "action": [' + b",".join([b'""'] * 300_000) + b"]}",
    b'{"id": 1, "action": {' + b",".join(b'"k%d": 0' % k for k in range(5000)) + b"}}",
])
def test_a_body_with_more_values_than_the_limit_is_refused_before_decoding(raw):
    with pytest.raises(ApiError) as err:
        parse_json_object(raw, ServerLimits())
    assert (err.value.status, err.value.code) == (422, "too_many_values") and "max_json_values" in err.value.message


def test_the_largest_step_batch_fits_the_default_value_limit():
    body = json.dumps({"steps": [{"id": 2**52 + k, "action": "move forward"} for k in range(256)]}).encode()
    assert len(parse_json_object(body, ServerLimits())["steps"]) == 256
