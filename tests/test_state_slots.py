"""Every call on the shared state keeps its keys in one Redis Cluster slot.

A Lua script on Redis Cluster may touch only keys of one slot (else CROSSSLOT), and a hash tag
is what puts a pool's keys together: `gw:{pool}:...`. Here every operation of RedisState runs
against a recording stand-in for the client (nothing is connected to), for any pool and tenant
name the policy allows and any key prefix `--state-prefix` allows, and the slot of each key of
each call is computed with redis-py's `key_slot` (CRC16 of the hash tag, as Redis does): one
slot per call. The scripts themselves name no key but their KEYS (a key built inside a script
is invisible to this test and to the cluster's routing). tests/test_state.py runs the same
operations on a real Redis Cluster.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.cluster import key_slot

from gateway.policy.model import NAME_RE
from gateway.state import Bucket, Lease, Limits
from gateway.state.redis import RedisState, pool_keys
from gateway.state.urls import check_prefix

NAMES = st.from_regex(NAME_RE.replace("*$", "{0,63}$"), fullmatch=True)
PREFIXES = st.text(st.characters(blacklist_characters="{}", blacklist_categories=("Cs",)),
                   min_size=1, max_size=20)
LUA = resources.files("gateway.state") / "lua"


class Recorder:
    """Stands in for the client's command path: records (command, keys) and answers as the
    scripts would, so every operation runs to its end."""

    def __init__(self, state: RedisState) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.state = state
        self.answers: dict[str, Any] = {
            state._reserve.sha: [1, 1, 1, b""], state._release.sha: 1,
            state._refresh.sha: 1, state._usage.sha: [0, b"b0", 1],
            state._bucket.sha: [1, 100, 0], state._heartbeat.sha: 2}
        self.names = {state._reserve.sha: "reserve", state._release.sha: "release",
                      state._refresh.sha: "refresh", state._usage.sha: "usage",
                      state._bucket.sha: "bucket", state._heartbeat.sha: "heartbeat"}

    async def __call__(self, *args: Any, **kw: Any) -> Any:
        command = str(args[0]).upper()
        if command == "EVALSHA":
            sha, n = args[1], int(args[2])
            self.calls.append((self.names[sha], [str(k) for k in args[3:3 + n]]))
            return self.answers[sha]
        if command in ("SET", "GET"):
            self.calls.append((command.lower(), [str(args[1])]))
            return True if command == "SET" else None
        raise AssertionError(f"a command this test does not know: {args}")


async def every_operation(prefix: str, pools: list[str], tenant: str) -> Recorder:
    state = RedisState("redis+cluster://127.0.0.1:1", prefix=prefix)
    recorder = Recorder(state)
    state.client.execute_command = recorder  # type: ignore[method-assign]
    leases = [Lease(p, "b0", f"id-{i}", 4, 64, tenant) for i, p in enumerate(pools)]
    for lease in leases:
        await state.reserve(lease, Limits(100, 1000, 50), 30)
    await state.refresh(leases, 30)  # one script call per pool
    for p in pools:
        await state.usage(p)
    for lease in leases:
        await state.release(lease)
    for window in ("minute", "day"):
        bucket = Bucket(f"{tenant}:{window}", 1000, 1.0)
        await state.take(bucket, 10, "hold-1")
        await state.settle(bucket, "hold-1", 5)
        await state.adjust(bucket, 5)
    await state.heartbeat("replica-1", 10)
    await state.remember(f"response:{pools[0]}", "v", 10)
    await state.recall(f"response:{pools[0]}")
    return recorder


def assert_one_slot_per_call(recorder: Recorder) -> None:
    for op, keys in recorder.calls:
        assert keys, (op, "a call with no key goes to a random node")
        slots = {key_slot(k.encode()) for k in keys}
        assert len(slots) == 1, (op, {k: key_slot(k.encode()) for k in keys})


@pytest.mark.anyio
@settings(max_examples=200, deadline=None)
@given(prefix=PREFIXES, pools=st.lists(NAMES, min_size=1, max_size=3, unique=True),
       tenant=NAMES)
async def test_every_call_keeps_its_keys_in_one_slot(prefix: str, pools: list[str],
                                                     tenant: str) -> None:
    recorder = await every_operation(prefix, pools, tenant)
    assert_one_slot_per_call(recorder)
    ops = {op for op, _ in recorder.calls}
    assert ops == {"reserve", "refresh", "usage", "release", "bucket", "heartbeat", "set",
                   "get"}, ops
    # and a pool's calls all land in its own slot: the one its hash tag names
    for op, keys in recorder.calls:
        if op in ("reserve", "release", "refresh", "usage"):
            pool = next(p for p in pools if keys[0] in pool_keys(p, prefix))
            assert key_slot(keys[0].encode()) == key_slot(pool.encode()), (op, pool)


@pytest.mark.anyio
async def test_the_shipped_prefix_and_pools() -> None:
    recorder = await every_operation("gw", ["default", "long", "a.b-c_9"], "anonymous")
    assert_one_slot_per_call(recorder)
    assert ("bucket", ["gw:quota:{anonymous:minute}", "gw:quota-held:{anonymous:minute}",
                       "gw:quota-holds:{anonymous:minute}"]) in recorder.calls
    assert ("heartbeat", ["gw:replicas"]) in recorder.calls


def test_every_script_is_registered_and_exercised() -> None:
    """A new script must be called by an operation above, or this fails."""
    state = RedisState("redis+cluster://127.0.0.1:1")
    scripts = {p.name for p in LUA.iterdir() if p.name.endswith(".lua")}
    assert scripts - {"purge.lua"} == {f"{name}.lua" for name in Recorder(state).names.values()}


@pytest.mark.parametrize("name", sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua")))
def test_scripts_touch_only_the_keys_they_are_given(name: str) -> None:
    text = (LUA / name).read_text(encoding="utf-8")
    calls = re.findall(r"redis\.call\(\s*'(\w+)'\s*(?:,\s*([^,)]+))?", text)
    assert calls, name
    for command, first in calls:
        if command.upper() == "TIME":
            continue
        assert first.strip().startswith("KEYS["), (name, command, first)


@pytest.mark.parametrize("prefix", ["", "a{b", "x}", "{}", "gw{"])
def test_a_prefix_that_would_move_the_hash_tag_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="--state-prefix"):
        check_prefix(prefix)
    with pytest.raises(ValueError, match="--state-prefix"):
        RedisState("redis://127.0.0.1:1/0", prefix=prefix)
