"""Limits on the ext_proc request path (in process): the 429, the headers Envoy adds from the decision's
metadata, output tokens charged from the access log, reloads, and labels no client chooses."""

from __future__ import annotations

import hashlib
import json

from extproc.config import parse
from extproc.server.access_log import AccessLogService
from extproc.server.gateway import Gateway
from extproc.server.processor import Processor
from tests.support.ext_proc import stream_replies
from tests.unit.server.test_access_log import entry
from tests.unit.server.test_stream import CHAT, req_body, req_headers

MODELS = {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"}]}}
PROCESSORS: dict[Gateway, Processor] = {}  # one per gateway (each registers its metrics once)


def gateway(limits: dict, clock=lambda: 0.0) -> Gateway:
    return Gateway(parse({"models": MODELS, "rate_limits": limits}, {}), clock=clock)


async def send(gw: Gateway, body=CHAT, key: str | None = "sk-a"):
    extra = {"authorization": f"Bearer {key}"} if key else {}

    async def envoy():
        yield req_headers(**extra)
        yield req_body(body)

    if gw not in PROCESSORS:
        PROCESSORS[gw] = Processor(gw)
    replies = [r async for r in stream_replies(PROCESSORS[gw], envoy())]
    return replies[-1]


def metadata(reply) -> dict[str, str]:
    fields = reply.dynamic_metadata.fields["extproc"].struct_value.fields
    return {k: v.string_value for k, v in fields.items()}


def refusal(reply) -> tuple[int, dict, dict[str, str]]:
    imm = reply.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    return imm.status.code, json.loads(imm.body)["error"], headers


async def test_requests_past_the_limit_get_openai_429_with_retry_after_and_headers():
    gw = gateway({"requests_per_minute": 2})
    first = metadata(await send(gw))
    assert first["x-ratelimit-limit-requests"] == "2" and first["x-ratelimit-remaining-requests"] == "1"
    assert first["x-ratelimit-reset-requests"] == "30s"
    assert "x-ratelimit-limit-tokens" not in first  # no token limit set
    await send(gw)
    status, error, headers = refusal(await send(gw))
    assert status == 429 and error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert headers["retry-after"] == "30" and headers["retry-after-ms"] == "30000"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert len(gw.open) == 2  # the refused request holds no in-flight count
    assert gw.limiter.limited.labels("m", "requests", "default")._value.get() == 1


async def test_budgets_are_per_key_and_the_key_never_appears():
    gw = gateway({"requests_per_minute": 1})
    reply = await send(gw, key="sk-a")
    assert "sk-a" not in str(reply)
    assert metadata(reply)["ratelimit_bucket"] == "m:key:" + hashlib.sha256(b"sk-a").hexdigest()
    assert refusal(await send(gw, key="sk-a"))[0] == 429
    assert metadata(await send(gw, key="sk-b"))["x-ratelimit-remaining-requests"] == "0"  # its own


async def test_an_override_applies_to_its_key_and_its_class_labels_the_metric():
    digest = hashlib.sha256(b"sk-vip").hexdigest()
    gw = gateway({"requests_per_minute": 1,
                  "overrides": [{"api_key_sha256": digest, "requests_per_minute": 3}]})
    for _ in range(3):
        assert metadata(await send(gw, key="sk-vip"))["x-ratelimit-limit-requests"] == "3"
    assert refusal(await send(gw, key="sk-vip"))[0] == 429
    assert gw.limiter.limited.labels("m", "requests", "override")._value.get() == 1


async def test_output_tokens_from_the_access_log_are_owed_once():
    gw = gateway({"tokens_per_minute": 1000})
    reply = await send(gw)
    ours = metadata(reply)
    assert ours["ratelimit_tokens_limit"] == "1000"
    prompt = 1000 - int(ours["x-ratelimit-remaining-tokens"])
    assert prompt > 0  # the prompt as estimated, taken on admission
    record = entry(ours["key"], tally={"output_tokens": 1000.0, "source": "usage"})
    record.common_properties.metadata.filter_metadata["extproc"].CopyFrom(
        reply.dynamic_metadata.fields["extproc"].struct_value)
    AccessLogService(gw).record(record)
    status, error, _ = refusal(await send(gw))
    assert status == 429 and error["type"] == "tokens"
    assert gw.limiter._local._buckets[ours["ratelimit_bucket"]].tokens == -prompt


async def test_a_reload_changes_limits_without_resetting_budgets():
    gw = gateway({"requests_per_minute": 5})
    await send(gw)
    gw.apply(parse({"models": MODELS, "rate_limits": {"requests_per_minute": 2}}, {}))
    # 4 left of 5, capped at the new limit of 2, one taken
    assert metadata(await send(gw))["x-ratelimit-remaining-requests"] == "1"
    gw.apply(parse({"models": MODELS}, {}))
    reply = await send(gw)
    assert "x-ratelimit-limit-requests" not in metadata(reply) and reply.HasField("request_body")


async def test_key_by_user_reads_the_body_and_a_long_user_is_a_400():
    gw = gateway({"key_by": "user", "requests_per_minute": 1})
    assert metadata(await send(gw, body={**CHAT, "user": "alice"}))["ratelimit_bucket"] == "m:user:alice"
    assert refusal(await send(gw, body={**CHAT, "user": "alice"}))[0] == 429
    assert "ratelimit_bucket" in metadata(await send(gw, body={**CHAT, "user": "bob"}))
    status, error, _ = refusal(await send(gw, body={**CHAT, "user": "x" * 300}))
    assert status == 400 and error["param"] == "user"


async def test_requests_without_a_subject_share_the_anonymous_budget():
    gw = gateway({"requests_per_minute": 1})
    assert metadata(await send(gw, key=None))["ratelimit_bucket"] == "m:anonymous"
    assert refusal(await send(gw, key=None))[0] == 429


async def test_the_dashboard_sees_the_most_used_budgets_by_rank_only():
    gw = gateway({"requests_per_minute": 4})
    for key, n in (("sk-a", 3), ("sk-b", 1)):
        for _ in range(n):
            await send(gw, key=key)
    assert gw.limiter.top.ratios() == {("m", "requests"): [0.25, 0.75]}
    samples = {tuple(sorted(s.labels.items())): s.value for m in gw.registry.collect()
               if m.name == "extproc_rate_limit_remaining_ratio" for s in m.samples}
    assert samples == {(("limit", "requests"), ("model", "m"), ("rank", "1")): 0.25,
                       (("limit", "requests"), ("model", "m"), ("rank", "2")): 0.75}
