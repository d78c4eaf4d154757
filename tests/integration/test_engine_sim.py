"""engine-sim over real sockets: the real openai client, /metrics through prometheus-client's parser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.sim_fixtures import SimProcess, start_sim

pytestmark = pytest.mark.integration
MODEL = "llama2-7b"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-sim")


@pytest.fixture(scope="module")
def sim(log_dir: Path) -> Iterator[SimProcess]:
    s = start_sim(["--gpu", "A100", "--model", MODEL, "--time-scale", "100", "--seed", "1"], log_dir)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sglang_sim(log_dir: Path) -> Iterator[SimProcess]:
    s = start_sim(
        ["--gpu", "L20", "--model", "llama3-8b", "--engine", "sglang", "--time-scale", "100"], log_dir
    )
    yield s
    s.stop()


def client(s: SimProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)


async def scrape(s: SimProcess) -> dict[str, dict[str, float]]:
    """{family: {sample name + labels: value}} via prometheus-client's own parser."""
    async with aiohttp.ClientSession() as http, http.get(s.url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            key = sample.name + json.dumps(sample.labels, sort_keys=True)
            out.setdefault(fam.name, {})[key] = sample.value
    return out


def sample(metrics: dict[str, dict[str, float]], family: str, name: str | None = None) -> float:
    series = metrics[family]
    name = name or family
    return next(v for k, v in series.items() if k.startswith(name + "{") and '"model_name"' in k)


async def test_openai_client_streams_chat_with_usage(sim: SimProcess) -> None:
    stream = await client(sim).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say this is a test! " * 20}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    contents, finish, usage, ids = [], None, None, set()
    async for chunk in stream:
        ids.add(chunk.id)
        assert chunk.object == "chat.completion.chunk" and chunk.model == MODEL
        if chunk.choices:
            delta = chunk.choices[0].delta
            if delta.content:
                contents.append(delta.content)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert len(contents) == 12  # one chunk per token
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 100
    assert usage.total_tokens == usage.prompt_tokens + 12
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")


async def test_openai_client_completions_and_non_streaming(sim: SimProcess) -> None:
    c = client(sim)
    done = await c.completions.create(model=MODEL, prompt="hello " * 40, max_tokens=5)
    assert done.object == "text_completion" and done.usage.completion_tokens == 5
    assert done.choices[0].finish_reason == "length" and done.choices[0].text
    chat = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    texts = []
    async for chunk in await c.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True):
        texts.append(chunk.choices[0].text)
    assert len(texts) == 4
    models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_sampled_length_without_max_tokens_is_seeded_and_stops(sim: SimProcess) -> None:
    chat = await client(sim).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens >= 1


async def test_bad_requests_get_openai_errors(sim: SimProcess) -> None:
    c = client(sim)
    with pytest.raises(openai.BadRequestError) as err:
        await c.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10**6
        )
    with pytest.raises(openai.NotFoundError):
        await c.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
    async with aiohttp.ClientSession() as http:
        for body in (
            b"{not json",
            b'{"model": "llama2-7b", "messages": "x"}',
            b'{"model": "llama2-7b", "prompt": "x", "max_tokens": -1}',
        ):
            path = "/v1/completions" if b"prompt" in body else "/v1/chat/completions"
            async with http.post(sim.url + path, data=body) as resp:
                assert resp.status == 400
                error = (await resp.json())["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]
        for method, path, status in (("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405)):
            async with http.request(method, sim.url + path) as resp:
                assert resp.status == status
                assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}


async def test_metrics_parse_with_vllm_names(sim: SimProcess) -> None:
    before = await scrape(sim)
    await client(sim).completions.create(model=MODEL, prompt="a" * 400, max_tokens=7)
    after = await scrape(sim)
    for fam in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sim:gpu_utilization",
    ):
        assert after[fam], fam
    assert 0.0 <= sample(after, "vllm:kv_cache_usage_perc") <= 1.0
    gen = "vllm:generation_tokens"  # the parser strips _total from counter family names
    assert sample(after, gen, gen + "_total") - sample(before, gen, gen + "_total") == 7
    prompt = "vllm:prompt_tokens"
    assert sample(after, prompt, prompt + "_total") - sample(before, prompt, prompt + "_total") == 100
    for hist in (
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        count = sample(after, hist, hist + "_count")
        assert count >= 1, hist

    def delta(hist: str) -> float:
        return sample(after, hist, hist + "_count") - sample(before, hist, hist + "_count")

    # Per output token after the first, as vLLM observes it; the per-request mean has its own histogram.
    assert delta("vllm:time_per_output_token_seconds") == 6
    assert delta("vllm:inter_token_latency_seconds") == 6
    assert delta("vllm:request_time_per_output_token_seconds") == 1
    # Latencies are simulated seconds: an A100 llama2-7b 7-token answer takes tens of ms, whatever the scale.
    e2e = "vllm:e2e_request_latency_seconds"
    assert sample(after, e2e, e2e + "_sum") > 0.03


async def test_metrics_sglang_names(sglang_sim: SimProcess) -> None:
    await client(sglang_sim).completions.create(model="llama3-8b", prompt="hi", max_tokens=2)
    m = await scrape(sglang_sim)
    for fam in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:time_to_first_token_seconds",
        "sglang:gen_throughput",
        "sglang:cache_hit_rate",
    ):
        assert fam in m, fam
    assert not any(name.startswith("vllm:") for name in m)


async def test_concurrent_streams_share_batches(sim: SimProcess) -> None:
    import asyncio

    c = client(sim)

    async def one() -> int:
        n = 0
        async for chunk in await c.completions.create(
            model=MODEL, prompt="p" * 200, max_tokens=20, stream=True
        ):
            n += len(chunk.choices)
        return n

    assert await asyncio.gather(*(one() for _ in range(50))) == [20] * 50


async def test_prefix_cache_hits_show_in_metrics_and_ttft(sim: SimProcess) -> None:
    c = client(sim)
    system = "You are a careful assistant. Follow the policy below exactly. " * 60  # ~900 tokens
    hits = "vllm:prefix_cache_hits"
    before = sample(await scrape(sim), hits, hits + "_total")
    for question in ("first question?", "second question?"):
        await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=1,
        )
    after = await scrape(sim)
    assert sample(after, hits, hits + "_total") - before >= 800  # the second request reused the system prompt
    queries = "vllm:prefix_cache_queries"
    assert sample(after, queries, queries + "_total") >= sample(after, hits, hits + "_total")
