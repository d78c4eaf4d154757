"""Per-key limits through real Envoy, with one and two gateways sharing a real redis-server: the limit
holds across gateways under concurrent load, output tokens are counted once, a key's budget comes
back, the real `openai` client's retry honours Retry-After, reloads apply and a bad one is refused
whole, and losing Redis lifts the limits without failing a request."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from extproc.localstack import LocalStack, wait_until
from tests.integration.sim_fixtures import SimProcess, start_sim
from tests.support.redis_server import RedisServer
from tests.support.stack import running_stacks

MODEL = "llama2-7b"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say this is a test!"}]}
# One key per test, each with its own override, so the tests' budgets never meet.
SHARED, TOKENS, RESETS, LOCAL, ANYONE = "sk-shared", "sk-tokens", "sk-resets", "sk-local", "sk-anyone"
BOTH = "sk-both"  # a requests and a tokens limit on one key
UNICODE, UNICODE_RPM = "sk-ключ-🔑", 12_345  # a key that is not ASCII, with its own limit
SHARED_RPM, TOKENS_TPM, RESETS_RPM = 10, 600, 20
BOTH_RPM, BOTH_TPM = 20, 100_000


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(sim_port: int, default_rpm: int = 100_000) -> dict:
    return {"models": {MODEL: {"pods": [{"name": "a100-0", "address": f"127.0.0.1:{sim_port}"}]}},
            "routing": {"default_strategy": "least-request"},
            # 100 ms (the most allowed): this box is shared by several suites (load 3-5 on 2 cores), and
            # the bound counts the event loop's own queueing in a burst; a late answer admits unchecked,
            # which the first test would count against the limit. The default is 5 ms.
            "rate_limits": {"requests_per_minute": default_rpm, "redis_timeout_ms": 100, "overrides": [
                {"api_key_sha256": digest(SHARED), "requests_per_minute": SHARED_RPM},
                {"api_key_sha256": digest(TOKENS), "tokens_per_minute": TOKENS_TPM},
                {"api_key_sha256": digest(RESETS), "requests_per_minute": RESETS_RPM},
                {"api_key_sha256": digest(LOCAL), "requests_per_minute": 5},
                {"api_key_sha256": digest(UNICODE), "requests_per_minute": UNICODE_RPM},
                {"api_key_sha256": digest(BOTH), "requests_per_minute": BOTH_RPM,
                 "tokens_per_minute": BOTH_TPM}]}}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rate-limits")


@pytest.fixture(scope="module")
def redis(log_dir: Path) -> Iterator[list[RedisServer]]:
    box = [RedisServer(log_dir)]
    yield box
    box[0].stop()


@pytest.fixture(scope="module")
def sim(log_dir: Path) -> Iterator[SimProcess]:
    s = start_sim(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "20"], log_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gateways(log_dir: Path, redis: list[RedisServer], sim: SimProcess) -> Iterator[list[LocalStack]]:
    with running_stacks(log_dir, config(sim.port), {"EXTPROC_REDIS_URL": redis[0].url}) as stacks:
        yield stacks


def client(stack: LocalStack, key: str, retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=retries, timeout=30)


async def call(stack: LocalStack, key: str, max_tokens: int = 4):
    """(status, headers, body): a 429 as the client sees it, without retries."""
    async with client(stack, key) as c:
        try:
            raw = await c.chat.completions.with_raw_response.create(max_tokens=max_tokens, **CHAT)
            return 200, raw.headers, raw.parse()
        except openai.APIStatusError as exc:
            return exc.status_code, exc.response.headers, exc.body


async def test_the_limit_holds_across_two_gateways_under_concurrent_load(gateways: list[LocalStack]):
    a, b = gateways
    results = await asyncio.gather(*(call(a if i % 2 else b, SHARED) for i in range(3 * SHARED_RPM)))
    admitted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(admitted) + len(refused) == len(results)
    # within one request: the budget refills one request every 6 s while the burst runs
    unchecked = [s.sample("extproc_rate_limit_unchecked_requests_total") for s in (a, b)]
    assert SHARED_RPM <= len(admitted) <= SHARED_RPM + 1, ([r[0] for r in results], unchecked)
    for _, headers, _ in admitted:
        assert headers["x-ratelimit-limit-requests"] == str(SHARED_RPM)
        assert 0 <= int(headers["x-ratelimit-remaining-requests"]) < SHARED_RPM
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    for _, headers, body in refused:
        assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
        assert 1 <= int(headers["retry-after"]) <= 6 and headers["x-ratelimit-remaining-requests"] == "0"
    # both gateways refused some, and none admitted a request unchecked
    assert a.sample("extproc_rate_limited_requests_total", key_class="override") > 0
    assert b.sample("extproc_rate_limited_requests_total", key_class="override") > 0
    assert unchecked == [0, 0]


async def test_output_tokens_are_counted_once_across_gateways(gateways: list[LocalStack],
                                                              redis: list[RedisServer]):
    from redis import asyncio as aioredis

    a, b = gateways
    output = 200
    started = time.monotonic()
    status, headers, first = await call(a, TOKENS, max_tokens=output)
    assert status == 200 and first.usage.completion_tokens == output
    after_first = int(headers["x-ratelimit-remaining-tokens"])  # the prompt taken on admission
    assert 0 < TOKENS_TPM - after_first < 100
    bucket = f"extproc:ratelimit:{MODEL}:key:{digest(TOKENS)}"
    r = aioredis.Redis.from_url(redis[0].url)
    try:
        async def charged() -> bool:
            return float(await r.hget(bucket, "t")) < after_first - output / 2

        deadline = time.monotonic() + 10
        while not await charged():  # the access log's record reaches gateway a, which charges it
            assert time.monotonic() < deadline, "the output tokens were never charged"
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()
    status, headers, _ = await call(b, TOKENS)  # the other gateway sees the same budget
    refilled = (time.monotonic() - started) * TOKENS_TPM / 60  # at most, since the first admission
    prompt = TOKENS_TPM - after_first
    expected = after_first - output - prompt  # charged once; twice would be `output` lower still
    assert status == 200 and refilled < output / 2  # else the check could not tell once from twice
    assert expected <= int(headers["x-ratelimit-remaining-tokens"]) <= expected + refilled + 1


async def test_a_key_with_both_limits_keeps_its_requests_budget_when_output_is_charged(
        gateways: list[LocalStack], redis: list[RedisServer]):
    """Charging the output (tokens) must refill and keep the requests dimension: the key lives until
    its slowest dimension is full again, so a spent requests budget does not come back full when the
    tokens one (about 1,500 of 100,000 spent: full in a second) is."""
    from redis import asyncio as aioredis

    a, b = gateways
    output = 50
    counted_before = sum(s.sample("extproc_output_tokens_total") for s in gateways)
    results = await asyncio.gather(*(call(a if i % 2 else b, BOTH, max_tokens=output)
                                     for i in range(BOTH_RPM)))
    assert [r[0] for r in results] == [200] * BOTH_RPM
    assert {r[1]["x-ratelimit-limit-tokens"] for r in results} == {str(BOTH_TPM)}
    bucket = f"extproc:ratelimit:{MODEL}:key:{digest(BOTH)}"

    def all_counted() -> bool:  # each gateway charges a record just before it counts its tokens
        return sum(s.sample("extproc_output_tokens_total") for s in gateways) >= (
            counted_before + BOTH_RPM * output)

    await asyncio.to_thread(wait_until, all_counted, 10, "the output tokens counted")
    r = aioredis.Redis.from_url(redis[0].url)
    try:
        # For a second after the charges went out, every look finds the key living at least until
        # its requests budget is full again (TTL counted from the bucket's own stamp).
        watch_until = time.monotonic() + 1.0
        while time.monotonic() < watch_until:
            async with r.pipeline(transaction=True) as pipe:
                held, ttl_ms, clock = await pipe.hgetall(bucket).pttl(bucket).time().execute()
            now_ms = clock[0] * 1000 + clock[1] // 1000
            assert int(held[b"rl"]) == BOTH_RPM and int(held[b"tl"]) == BOTH_TPM
            spent = BOTH_RPM - float(held[b"r"])
            assert spent >= BOTH_RPM - 5, held  # the burst's takes are still owed (seconds of refill)
            assert ttl_ms + (now_ms - int(held[b"ts"])) >= spent * 60_000 / BOTH_RPM, (ttl_ms, held)
            await asyncio.sleep(0.05)
    finally:
        await r.aclose()
    status, headers, body = await call(b, BOTH)
    left = int(headers["x-ratelimit-remaining-requests"])
    assert (status == 429 and body["type"] == "requests") or (status == 200 and left < 5), (status, left)


def test_a_non_ascii_key_draws_on_its_override_however_the_request_travels(gateways: list[LocalStack]):
    """The key's override (its UTF-8 bytes' SHA-256, as `printf %s "$KEY" | sha256sum` gives it) applies
    to a buffered request (Envoy sends attributes, UTF-8), a chunked one and an HTTP/2 one with
    trailers (Envoy sends the headers' raw bytes): one decoding of the header on every path."""
    import http.client
    import json

    a, _ = gateways
    body = json.dumps({**CHAT, "max_tokens": 2}).encode()
    auth = ("Bearer " + UNICODE).encode()

    def http1(chunked: bool) -> dict[str, str]:
        conn = http.client.HTTPConnection("127.0.0.1", a.envoy_port, timeout=30)
        try:
            conn.putrequest("POST", "/v1/chat/completions")
            conn.putheader("content-type", "application/json")
            conn.putheader("authorization", auth)  # bytes: sent as they are
            conn.putheader("transfer-encoding" if chunked else "content-length",
                           "chunked" if chunked else str(len(body)))
            conn.endheaders()
            conn.send(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if chunked else body)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            return {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    from tests.support.http2 import h2_request

    h2_headers, data = h2_request(a.envoy_port, [
        (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
        (":authority", "gateway"), ("content-type", "application/json"), ("authorization", auth)],
        body, [("x-checksum", "abc")])
    assert h2_headers[":status"] == "200", data
    for headers in (http1(chunked=False), http1(chunked=True), h2_headers):
        assert headers["x-ratelimit-limit-requests"] == str(UNICODE_RPM)


async def test_bursts_against_a_key_with_both_limits_admit_no_more_than_its_rate(
        redis: list[RedisServer]):
    """The issue's numbers: 8 bursts of 60, 1.5 s apart, against 60 requests a minute with a tokens
    limit too, each admitted request's output charged: at most 60 + 10.5 s of refill (~71) admitted.
    Before the fix the charge set the key's expiry from the tokens alone and each burst found a full
    budget (480 admitted)."""
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.ratelimit.settings import Limits

    limits = Limits(requests=60, tokens=1_000_000)
    store = RedisStore(redis[0].url, timeout=1.0)
    bucket = "bursts:key:both"
    try:
        admitted, started = 0, time.monotonic()
        for burst in range(8):
            while time.monotonic() < started + 1.5 * burst:  # paced, not synchronised
                await asyncio.sleep(0.01)
            answers = await asyncio.gather(*(store.take(bucket, limits, 10, None) for _ in range(60)))
            assert all(isinstance(a, tuple) for a in answers)
            taken = sum(verdict.admitted for _, verdict in answers)
            admitted += taken
            for _ in range(taken):
                store.charge(bucket, limits.tokens, 20)
        elapsed = time.monotonic() - started
        assert admitted <= 60 + elapsed * 60 / 60 + 1, (admitted, elapsed)
        assert admitted >= 60
    finally:
        await store.close()


async def test_a_keys_budget_comes_back_and_the_openai_client_waits_as_told(gateways: list[LocalStack]):
    a, _ = gateways
    statuses = [(await call(a, RESETS))[0] for _ in range(RESETS_RPM + 1)]
    assert statuses.count(429) >= 1 and statuses[0] == 200
    status, headers, _ = await call(a, RESETS)
    assert status == 429
    told = int(headers["retry-after-ms"]) / 1000
    assert 0 < told <= 60 / RESETS_RPM
    # One retry only: exponential backoff (0.5 s) would come back too early and fail; waiting as told works.
    started = time.monotonic()
    async with client(a, RESETS, retries=1) as c:
        raw = await c.chat.completions.with_raw_response.create(max_tokens=4, **CHAT)
    assert raw.http_response.status_code == 200
    assert time.monotonic() - started >= told * 0.8
    assert raw.http_request.headers["x-stainless-retry-count"] == "1"


async def test_reloads_apply_and_a_bad_one_is_refused_whole(gateways: list[LocalStack], sim: SimProcess):
    a, _ = gateways
    status, headers, _ = await call(a, ANYONE)
    assert status == 200 and headers["x-ratelimit-limit-requests"] == "100000"
    a.write_config(config(sim.port, default_rpm=50_000))

    async def limit_now() -> str:
        return (await call(a, ANYONE))[1].get("x-ratelimit-limit-requests", "")

    deadline = time.monotonic() + 10
    while await limit_now() != "50000":
        assert time.monotonic() < deadline, "the reload never applied"
        await asyncio.sleep(0.2)
    refused_before = a.sample("extproc_config_reload_errors_total")
    bad = config(sim.port, default_rpm=3)  # a change that must not apply either
    bad["rate_limits"]["overrides"][3]["requests_per_minute"] = 0
    a.write_config(bad)
    await asyncio.to_thread(wait_until,
                            lambda: a.sample("extproc_config_reload_errors_total") > refused_before,
                            10, "the bad config refused")
    assert "rate_limits.overrides[3].requests_per_minute" in a.gateway.log()
    status, headers, _ = await call(a, ANYONE)
    assert status == 200 and headers["x-ratelimit-limit-requests"] == "50000"
    a.write_config(config(sim.port))


async def test_aibrix_user_records_set_the_limits_as_aibrix_keeps_them(redis: list[RedisServer]):
    """AIBrix's gateway keeps each user's limits as JSON at aibrix-users/<name> (pkg/utils/users.go);
    a record's rpm/tpm win over the config's, and a user without one keeps the config's."""
    import json

    from redis import asyncio as aioredis

    from extproc.config import parse
    from extproc.openai import Request
    from extproc.ratelimit import RateLimiter
    from extproc.ratelimit.limiter import RateLimited
    from extproc.ratelimit.redis_store import RedisStore

    r = aioredis.Redis.from_url(redis[0].url)
    await r.set("aibrix-users/alice", json.dumps({"name": "alice", "rpm": 2, "tpm": 0}))
    await r.aclose()
    settings = parse({"models": {MODEL: {"pods": [{"name": "p", "address": "127.0.0.1:1"}]}},
                      "rate_limits": {"key_by": "user", "aibrix_users": True, "requests_per_minute": 50,
                                      "redis_timeout_ms": 100}}, {}).rate_limits
    limiter = RateLimiter(settings, store=RedisStore(redis[0].url, settings.redis_timeout_s))
    try:
        def request(user: str) -> Request:
            return Request(model=MODEL, path="/v1/chat/completions", prompt_tokens=5, user=user)

        async def admit(user: str):
            return await limiter.admit_shared(limiter.budget(None, request(user)), request(user))

        alice = [await admit("alice") for _ in range(2)]
        assert [a.limits.requests for a in alice] == [2, 2] and alice[1].verdict.requests < 1
        with pytest.raises(RateLimited):
            await admit("alice")
        assert limiter.limited.labels(MODEL, "requests", "aibrix_user")._value.get() == 1
        bob = await admit("bob")
        assert bob.limits.requests == 50
    finally:
        await limiter.close()


async def test_an_answer_later_than_the_bound_admits_unchecked_and_is_counted_late(
        redis: list[RedisServer]):
    from extproc.openai import Request
    from extproc.ratelimit import RateLimiter
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.ratelimit.settings import Limits, RateLimitSettings

    settings = RateLimitSettings(enabled=True, default=Limits(requests=1))
    store = RedisStore(redis[0].url, timeout=1e-6)  # no round trip is that fast
    limiter = RateLimiter(settings, store=store)
    request = Request(model=MODEL, path="/v1/chat/completions", prompt_tokens=1)
    try:
        await store.start()
        for _ in range(3):  # over the limit of 1: a checked request would be refused
            assert await limiter.admit_shared(limiter.budget(None, request), request) is None
        assert limiter.unchecked.labels("late")._value.get() == 3
        assert limiter.unchecked.labels("unavailable")._value.get() == 0
    finally:
        await limiter.close()


async def test_gateways_taking_at_once_never_overspend_a_budget(redis: list[RedisServer]):
    """The script takes atomically: 4 stores (as 4 gateways) racing for 25 requests admit exactly 25."""
    from extproc.ratelimit.redis_store import RedisStore
    from extproc.ratelimit.settings import Limits

    stores = [RedisStore(redis[0].url, timeout=1.0) for _ in range(4)]
    try:
        answers = await asyncio.gather(*(stores[i % 4].take("race:key:x", Limits(requests=25), 1, None)
                                         for i in range(60)))
        assert all(isinstance(a, tuple) for a in answers)
        assert sum(verdict.admitted for _, verdict in answers) == 25
    finally:
        for store in stores:
            await store.close()


async def test_losing_redis_lifts_the_limits_and_fails_no_request(gateways: list[LocalStack],
                                                                  redis: list[RedisServer], log_dir: Path):
    a, _ = gateways
    redis[0].stop()
    results = await asyncio.gather(*(call(a, SHARED) for _ in range(5)))  # its budget is spent
    assert [r[0] for r in results] == [200] * 5
    assert all("x-ratelimit-limit-requests" not in h for _, h, _ in results)
    assert a.sample("extproc_rate_limit_unchecked_requests_total", reason="unavailable") >= 1
    redis[0] = RedisServer(log_dir, redis[0].port)
    deadline = time.monotonic() + 10
    while "x-ratelimit-limit-requests" not in (await call(a, ANYONE))[1]:  # checked again
        assert time.monotonic() < deadline, "limits never came back with Redis"
        await asyncio.sleep(0.2)


def test_without_redis_one_gateway_limits_in_process(log_dir: Path, sim: SimProcess):
    d = log_dir / "local"
    d.mkdir()
    stack = LocalStack(config_path=d / "gateway.yaml", log_dir=d)
    try:
        stack.write_config(config(sim.port))
        stack.start_gateway()
        stack.start_envoy()
        results = [asyncio.run(call(stack, LOCAL)) for _ in range(6)]
        assert [r[0] for r in results] == [200] * 5 + [429]
        assert results[-1][2]["code"] == "rate_limit_exceeded" and results[-1][1]["retry-after"] == "12"
        assert [r[1]["x-ratelimit-remaining-requests"] for r in results] == ["4", "3", "2", "1", "0", "0"]
    finally:
        stack.stop()

