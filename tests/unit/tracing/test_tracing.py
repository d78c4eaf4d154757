"""Request-trace windows: AIBrix's keys, buckets and meta fields; the writer drops and counts Redis errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from extproc.environment import tracing_enabled
from extproc.tracing import TraceFlusher, TraceRecorder, bucket, trace_key, windows_dropped


@pytest.mark.parametrize(("tokens", "expected"), [
    (-3, 0), (0, 0), (1, 0), (2, 10), (3, 16), (4, 20), (128, 70), (1000, 100), (20, 43), (4096, 120),
])
def test_bucket_is_log2_in_tenths(tokens: int, expected: int) -> None:
    assert bucket(tokens) == expected


def test_key_layout() -> None:
    assert trace_key("llama2-7b", 1700000010) == "aibrix:llama2-7b_request_trace_1700000010"


@pytest.mark.parametrize(("value", "on"), [("true", True), ("1", True), ("True", True), ("false", False),
                                          ("yes", False), ("", False)])
def test_flag_reads_like_go_parsebool(value: str, on: bool) -> None:
    assert tracing_enabled({"AIBRIX_GPU_OPTIMIZER_TRACING_FLAG": value}) is on
    assert tracing_enabled({}) is False


def test_window_value_matches_aibrix_layout() -> None:
    r = TraceRecorder()
    for t in (1000.0, 1001.5, 1009.99):
        r.arrived("m", t)
    r.completed("m", 128, 8, 1002.0)
    r.completed("m", 130, 8, 1003.0)  # log2(130)*10 = 70.2 -> same bucket
    r.completed("m", 1000, 1, 1009.0)
    r.snapshot("m", pending=4, queueing=2)
    assert r.due(1009.99) == []  # the window [1000, 1010) is still open
    [(key, value)] = r.due(1010.0)
    assert key == "aibrix:m_request_trace_1010"
    assert json.loads(value) == {"70:30": 2, "100:0": 1, "meta_v": 4, "meta_interval_sec": 10,
                                 "meta_precision": 10, "meta_total_reqs": 3, "meta_pending_reqs": 4,
                                 "meta_queueing_reqs": 2}
    assert r.due(2000.0) == [] and len(r) == 0  # handed out once


def test_windows_align_to_unix_time_and_models_stay_apart() -> None:
    r = TraceRecorder()
    r.arrived("a", 1009.9)
    r.arrived("a", 1010.0)  # the next window
    r.completed("b", 10, 10, 1015.0)
    due = dict(r.due(1030.0))
    assert set(due) == {"aibrix:a_request_trace_1010", "aibrix:a_request_trace_1020",
                        "aibrix:b_request_trace_1020"}
    assert json.loads(due["aibrix:a_request_trace_1010"])["meta_total_reqs"] == 1
    b = json.loads(due["aibrix:b_request_trace_1020"])
    assert b["33:33"] == 1 and b["meta_total_reqs"] == 0 and b["meta_pending_reqs"] == 0


def test_empty_windows_are_not_written() -> None:
    r = TraceRecorder()
    r.snapshot("m", 3, 0)  # a gauge alone is not traffic
    assert r.due(10_000.0) == []


class FakeRedis:
    """The merge script's calls, recorded (its arithmetic runs in a real redis-server in
    tests/integration/test_trace_merge.py); `fail` refuses them, `land_then_fail` runs then times out."""

    def __init__(self) -> None:
        self.data: dict[str, tuple[str, int]] = {}
        self.write_ids: list[str] = []
        self.fail = False
        self.land_then_fail = False

    def register_script(self, script: str):
        assert "cjson" in script

        async def run(keys: list[str], args: list) -> int:
            if self.fail:
                raise ConnectionError("connection refused")
            value, ttl, write_id = args
            self.data[keys[0]] = (value, ttl)
            self.write_ids.append(write_id)
            if self.land_then_fail:
                raise TimeoutError("reply lost")
            return 1

        return run


class HangingRedis:
    def register_script(self, script: str):
        async def run(keys: list[str], args: list) -> int:
            await asyncio.Event().wait()
            return 1

        return run


async def test_flusher_writes_with_ttl_and_retries_a_failed_window() -> None:
    r = TraceRecorder()
    redis = FakeRedis()
    f = TraceFlusher(redis, r, retry_for=60.0)
    r.arrived("m", 100.0)
    r.arrived("m", 115.0)
    assert await f.flush(111.0) == 1
    value, ttl = redis.data["aibrix:m_request_trace_110"]
    assert ttl == 600 and json.loads(value)["meta_total_reqs"] == 1

    redis.fail = True  # e.g. the stale connection after a Redis restart
    assert await f.flush(121.0) == 0  # never raises
    assert await f.flush(122.0) == 0 and f.dropped == 0
    redis.fail = False
    assert await f.flush(123.0) == 1 and "aibrix:m_request_trace_120" in redis.data
    assert await f.flush(124.0) == 0  # written once


async def test_a_retried_window_keeps_its_write_id_so_redis_merges_it_once() -> None:
    r = TraceRecorder()
    redis = FakeRedis()
    f = TraceFlusher(redis, r, retry_for=60.0)
    r.arrived("m", 100.0)
    redis.land_then_fail = True  # the script ran in Redis, the reply never came back
    assert await f.flush(111.0) == 0
    redis.land_then_fail = False
    r.arrived("m", 115.0)
    assert await f.flush(121.0) == 2
    first, retry, window_120 = redis.write_ids
    assert retry == first and window_120 != first
    other_gateway = TraceRecorder()
    other_gateway.arrived("m", 100.0)
    assert await TraceFlusher(redis, other_gateway).flush(111.0) == 1
    assert redis.write_ids[-1] not in (first, window_120)  # its writes never share an id with ours


async def test_flusher_drops_a_window_it_could_not_write_for_retry_for() -> None:
    r = TraceRecorder()
    redis = FakeRedis()
    f = TraceFlusher(redis, r, retry_for=60.0)
    r.arrived("m", 100.0)
    before = windows_dropped._value.get()
    redis.fail = True
    assert await f.flush(111.0) == 0 and f.dropped == 0
    assert await f.flush(172.0) == 0
    assert windows_dropped._value.get() == before + 1 and f.dropped == 1
    redis.fail = False
    assert await f.flush(200.0) == 0 and redis.data == {}  # given up, not written late
    r.arrived("m", 205.0)
    assert await f.flush(210.0) == 1 and "aibrix:m_request_trace_210" in redis.data


async def test_flusher_times_out_a_hanging_redis() -> None:
    r = TraceRecorder()
    r.arrived("m", 100.0)
    f = TraceFlusher(HangingRedis(), r, timeout=0.05, retry_for=0.0)
    assert await f.flush(110.0) == 0 and f.dropped == 1


async def test_run_loop_flushes_until_cancelled() -> None:
    r = TraceRecorder()
    redis = FakeRedis()
    r.arrived("m", 100.0)
    f = TraceFlusher(redis, r, interval=0.01, clock=lambda: 500.0)
    task = asyncio.create_task(f.run())
    for _ in range(500):  # bounded: 500 loop turns at most
        if redis.data:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert list(redis.data) == ["aibrix:m_request_trace_110"]


def test_open_windows_are_bounded_when_nothing_drains_them() -> None:
    r = TraceRecorder(max_windows=3)
    for k in range(5):
        r.arrived("m", 1000.0 + 10 * k)
    assert len(r) == 3 and r.discarded == 2
    assert [key for key, _ in r.due(2000.0)] == [f"aibrix:m_request_trace_{e}" for e in (1030, 1040, 1050)]
