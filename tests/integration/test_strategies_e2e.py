"""The strategies through real Envoy and the gateway, on three simulated engines with prefix caching:
prompts sharing a long prefix land on one pod (and hit its cache), a session keeps its pod, and
round-robin alternates exactly."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.localstack import LocalStack, http_get
from tests.integration.sim_fixtures import SimProcess, running_sims
from tests.support.stack import running_stack

MODEL = "llama2-7b"
SYSTEM = "You are a meticulous assistant who answers in one line. " * 120  # ~1,700 tokens


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimProcess]]:
    log_dir = tmp_path_factory.mktemp("strategies")
    with running_sims(["--gpu", "A100-80GB", "--model", MODEL, "--time-scale", "10"], log_dir, 3) as box:
        yield box


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, sims: list[SimProcess]) -> Iterator[LocalStack]:
    pods = [{"name": f"p{i}", "address": f"127.0.0.1:{sim.port}"} for i, sim in enumerate(sims)]
    with running_stack(tmp_path_factory.mktemp("strategies-stack"), {"models": {MODEL: {"pods": pods}}}) as s:
        yield s


def client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-test", max_retries=0)


def ask(stack: LocalStack, question: str, strategy: str, **headers: str) -> str:
    raw = client(stack).chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, extra_headers={"routing-strategy": strategy, **headers},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return raw.headers["target-pod"]


def prefix_hits(sim: SimProcess) -> float:
    text = http_get(sim.url + "/metrics")[1].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"))


def test_a_shared_long_prefix_lands_on_one_pod_and_hits_its_cache(stack: LocalStack, sims: list[SimProcess]):
    before = [prefix_hits(s) for s in sims]
    pods = [ask(stack, f"question number {i}", "prefix-cache") for i in range(10)]
    assert len(set(pods)) == 1, pods
    chosen = int(pods[0][1:])
    hits = [prefix_hits(s) - b for s, b in zip(sims, before)]
    assert hits[chosen] > 0 and sum(hits) == hits[chosen], hits
    assert stack.sample("extproc_prefix_cache_lookups_total", model=MODEL, result="matched") >= 9


def test_a_session_keeps_its_pod(stack: LocalStack):
    for session in ("alice", "bob", "carol"):
        pods = {ask(stack, f"turn {i}", "session-affinity", **{"x-aibrix-session-key": session})
                for i in range(5)}
        assert len(pods) == 1, (session, pods)
    spread = {ask(stack, "hi", "session-affinity", **{"x-aibrix-session-key": f"user-{i}"})
              for i in range(30)}
    assert len(spread) == 3  # different sessions use every pod


def test_a_session_keeps_its_pod_while_that_pod_is_the_busiest(stack: LocalStack):
    # A bare `session-affinity` is auto-blended with load-balance and least-request; the pin must
    # still hold when the session's pod is not the least loaded (three streams open on it).
    home = ask(stack, "where", "session-affinity", **{"x-aibrix-session-key": "dave"})
    neighbours = [k for k in (f"n-{i}" for i in range(60))
                  if ask(stack, "where", "session-affinity", **{"x-aibrix-session-key": k}) == home][:3]
    assert len(neighbours) == 3
    streams = [client(stack).chat.completions.create(
        model=MODEL, max_tokens=4000, stream=True, extra_headers={
            "routing-strategy": "session-affinity", "x-aibrix-session-key": k},
        messages=[{"role": "user", "content": "a long answer, please"}]) for k in neighbours]
    try:
        for stream in streams:
            next(iter(stream))  # routed and generating: counted in flight on `home`
        turns = [ask(stack, f"turn {i}", "session-affinity", **{"x-aibrix-session-key": "dave"})
                 for i in range(3)]
        assert turns == [home] * 3
        others = {ask(stack, "hi", "load-balance") for _ in range(4)}
        assert home not in others  # it really is the busiest pod
    finally:
        for stream in streams:
            stream.close()


def test_a_session_key_over_256_bytes_is_refused_with_an_openai_error(stack: LocalStack):
    assert ask(stack, "edge", "session-affinity", **{"x-aibrix-session-key": "k" * 256})
    with pytest.raises(openai.BadRequestError) as refused:
        ask(stack, "too long", "session-affinity", **{"x-aibrix-session-key": "k" * 257})
    error = refused.value.body
    assert error["code"] == "invalid_session_key" and error["param"] == "x-aibrix-session-key", error


def test_round_robin_alternates_exactly(stack: LocalStack):
    pods = [ask(stack, f"q{i}", "round-robin") for i in range(9)]
    assert Counter(pods) == {"p0": 3, "p1": 3, "p2": 3}
    assert all(len(set(pods[i:i + 3])) == 3 for i in range(0, 9, 3)), pods


def test_lax_fields_are_served_as_vllm_serves_them(stack: LocalStack):
    """AIBrix's benchmark client sends `"stream": 1`; vLLM's pydantic models read it as true."""
    body = {"model": MODEL, "stream": 1, "max_tokens": 3.0, "stream_options": {"include_usage": "true"},
            "messages": [{"role": "user", "content": "lax"}]}
    status, text = post_json(stack.url + "/v1/chat/completions", body)
    assert status == 200, text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 3
    status, text = post_json(stack.url + "/v1/chat/completions", {**body, "stream": 2})
    assert status == 400 and json.loads(text)["error"]["param"] == "stream"


def post_json(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()

