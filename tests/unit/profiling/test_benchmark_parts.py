"""The benchmark's pure parts: prompt lengths, request bodies, arrivals, stream parsing, metric lines."""

from __future__ import annotations

import io
import json
import random
import statistics

import pytest

from extproc.profiling.client import RequestResult, StreamReader
from extproc.profiling.measure import CellOutcome, cell_lines
from extproc.profiling.records import BenchmarkError, read_lines, write_lines
from extproc.profiling.stats import Summary, percentile
from extproc.profiling.workload import Cell, arrival_times, doubling, request_body
from extproc.sim.protocol import CHAT_TOKENS_PER_MESSAGE, parse_request


@pytest.mark.parametrize("tokens", [4, 128, 1000, 4096])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_prompts_are_the_requested_tokens_by_the_simulators_estimate(api: str, tokens: int) -> None:
    body = request_body(api, "m", tokens, 16, random.Random(0))
    parsed = parse_request(body, chat=api == "chat")
    # a chat message cannot be shorter than its template's tokens plus one word
    assert parsed.prompt_tokens == (max(tokens, CHAT_TOKENS_PER_MESSAGE + 1) if api == "chat" else tokens)
    assert parsed.max_tokens == 16 and parsed.stream and parsed.include_usage
    assert body["min_tokens"] == 16 and body["ignore_eos"] is True


def test_prompts_differ_so_prefix_caching_cannot_flatter_a_cell() -> None:
    rng = random.Random(0)
    a, b = (request_body("completions", "m", 64, 4, rng)["prompt"] for _ in range(2))
    assert a != b and a[:16] != b[:16]
    assert "min_tokens" not in request_body("completions", "m", 8, 4, rng, exact_length=False)


def test_poisson_arrivals_average_the_rate_and_repeat_with_the_seed() -> None:
    times = arrival_times(5000, 8.0, random.Random(1))
    assert times[0] == 0.0 and times == sorted(times)
    assert 7.5 < len(times) / times[-1] < 8.5
    assert arrival_times(10, 2.0, random.Random(3)) == arrival_times(10, 2.0, random.Random(3))
    # a cell offers the rate it is labelled with, whatever the seed: exponential gaps from seed 0 summed
    # to 120 s for 100 requests at 1/s, and gen-profile then found that no rate "kept up"
    for seed in range(20):
        last = arrival_times(100, 1.0, random.Random(seed))[-1]
        assert 0.9 * 100 < last < 100
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert statistics.pstdev(gaps) == pytest.approx(statistics.fmean(gaps), rel=0.05)  # exponential-like
    assert doubling(4, 64) == [4, 8, 16, 32, 64]


def test_percentile_matches_numpy_linear() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    assert percentile(values, 50) == pytest.approx(statistics.median(values))
    assert percentile(values, 90) == pytest.approx(0.8)  # numpy.percentile(values, 90)
    assert percentile([5.0], 99) == 5.0
    assert Summary.of([1.0, 3.0]).as_fields() == {"mean": 2.0, "P50": 2.0, "P90": 2.8, "P99": 2.98}


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n"


def test_stream_reader_times_tokens_and_prefers_usage() -> None:
    reader = StreamReader(RequestResult(False, start=10.0))
    reader.feed(b"\n", 10.1)
    reader.feed(sse({"choices": [{"text": ""}]}), 10.2)  # role/empty chunks are not tokens
    reader.feed(sse({"choices": [{"text": " a"}]}), 10.5)
    reader.feed(sse({"choices": [{"delta": {"content": " b"}}]}), 10.7)
    reader.feed(sse({"choices": [{"text": " c"}]}), 11.0)
    reader.feed(sse({"choices": [], "usage": {"completion_tokens": 3}}), 11.0)
    reader.feed(b"data: [DONE]\n", 11.1)
    r = reader.finish(11.2)
    assert r.ok and r.output_tokens == 3
    assert r.ttft == pytest.approx(0.5) and r.gaps == pytest.approx([0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)


@pytest.mark.parametrize("lines, error", [
    ([sse({"choices": [{"text": "a"}]})], "before [DONE]"),
    ([sse({"error": {"message": "kv cache full"}}), b"data: [DONE]\n"], "kv cache full"),
    ([b"data: [DONE]\n"], "no tokens"),
])
def test_stream_reader_failures(lines: list[bytes], error: str) -> None:
    reader = StreamReader(RequestResult(False, start=0.0))
    for line in lines:
        reader.feed(line, 1.0)
    r = reader.finish(2.0)
    assert not r.ok and error in r.error


def ok(start: float, ttft: float, gaps: list[float], tokens: int) -> RequestResult:
    return RequestResult(True, start, start + ttft + sum(gaps), ttft, tokens, gaps)


def test_cell_lines_are_aibrix_lines_with_failures_counted() -> None:
    results = [ok(0.0, 0.1, [0.05, 0.05], 3), ok(1.0, 0.3, [0.1, 0.1], 3),
               RequestResult(False, 2.0, 2.1, error="HTTP 500: boom")]
    outcome = CellOutcome(Cell(128, 3, 2.0), planned=4, results=results, duration=2.0, unfinished=1,
                          overloaded="1 requests unfinished")
    lines = cell_lines(outcome, "llama2-7b", seed=0)
    assert [line.metric for line in lines] == ["TPUT", "TT", "E2E", "TTFT", "TPOT"]
    by = {line.metric: line for line in lines}
    assert by["TPUT"].stats == {"mean": 1.0} and by["TT"].stats == {"mean": 3.0}  # 2 ok / 2 s, 6 tokens / 2 s
    assert by["E2E"].stat("mean") == pytest.approx(0.35) and by["TTFT"].stat("P50") == pytest.approx(0.2)
    assert by["TPOT"].stat("mean") == pytest.approx(0.075)  # per request: 0.05 and 0.1
    first = json.loads(lines[0].to_json())
    assert list(first)[:9] == ["input_tokens", "output_tokens", "request_rate", "seed", "model",
                               "temperature",
                               "samples", "metric", "mean"]
    assert first["failed"] == 1 and first["unfinished"] == 1
    assert first["overloaded"] == "1 requests unfinished"


def closed_loop(budget: int, requests: int, e2e: float) -> list[RequestResult]:
    """`budget` clients staggered over one e2e, each sending its next request as the last ends."""
    out = []
    for n in range(requests):
        client, turn = n % budget, n // budget
        start = client * e2e / budget + turn * e2e
        out.append(ok(start, 0.5, [(e2e - 0.5) / 99] * 99, 100))
    return out


def test_an_admitted_cell_reads_its_rate_while_the_budget_is_held() -> None:
    # 4 in flight, 10 s each: a replica held there serves 0.4 req/s; over the whole run (the stagger's
    # 7.5 s ramp and the last turn's drain) 40 requests take 107.5 s, 0.372/s
    results = closed_loop(4, 40, 10.0)
    whole = max(r.end for r in results)
    outcome = CellOutcome(Cell(128, 100, 4.0), planned=40, results=results, duration=whole, held=4)
    by = {line.metric: line for line in cell_lines(outcome, "m", seed=0)}
    assert by["TPUT"].stat("mean") == pytest.approx(0.4)
    assert by["TT"].stat("mean") == pytest.approx(40.0)
    assert 40 / whole < 0.38  # what the whole run reads
    # a rate run (not a closed loop) reads the whole run, as AIBrix does
    rate_run = CellOutcome(Cell(128, 100, 4.0), planned=40, results=results, duration=whole)
    assert {line.metric: line for line in cell_lines(rate_run, "m", 0)}["TPUT"].stat("mean") == \
        pytest.approx(40 / whole)


def test_a_budget_never_held_long_enough_reads_the_whole_run() -> None:
    results = closed_loop(32, 40, 10.0)  # 8 requests past the ramp: fewer than MIN_STEADY complete
    whole = max(r.end for r in results)
    for held in (32, 64):
        outcome = CellOutcome(Cell(128, 100, float(held)), planned=40, results=results, duration=whole,
                              held=held)
        tput = {line.metric: line for line in cell_lines(outcome, "m", 0)}["TPUT"].stat("mean")
        assert tput == pytest.approx(40 / whole)


def test_a_cell_with_no_success_writes_null_latencies_that_round_trip() -> None:
    outcome = CellOutcome(Cell(8, 8, 1.0), 2, [RequestResult(False, 0, 1, error="x")] * 2, duration=1.0)
    out = io.StringIO()
    write_lines(out, cell_lines(outcome, "m", 0))
    back = read_lines(io.StringIO("\n" + out.getvalue()), "mem")
    assert back[0].stat("mean") == 0.0 and back[2].metric == "E2E" and back[2].stat("P99") is None


@pytest.mark.parametrize("text, error", [
    ("", "no benchmark lines"),
    ("\n\n", "no benchmark lines"),
    ("{not json}\n", "mem:1: not JSON"),
    ('{"input_tokens": 1, "output_tokens": 1, "request_rate": 1, "mean": 1}\n', "'metric' is missing"),
    ('{"input_tokens": "a", "output_tokens": 1, "request_rate": 1, "metric": "TT", "mean": 1}\n',
     "input_tokens"),
    ('{"input_tokens": 1, "output_tokens": 1, "request_rate": 1, "metric": "TT"}\n', "'mean' is missing"),
])
def test_bad_benchmark_files(text: str, error: str) -> None:
    with pytest.raises(BenchmarkError, match=error.replace("[", r"\[")):
        read_lines(io.StringIO(text), "mem")


def test_tpot_is_per_request_not_pooled_gaps() -> None:
    # 20 requests of 11 tokens, each with one 0.5 s stall (another request's prefill) among 0.02 s gaps:
    # pooled, the stalls are 1 gap in 10 and rule P99; per request, each TPOT is (9 x 0.02 + 0.5) / 10
    results = [ok(float(k), 0.1, [0.02] * 9 + [0.5], 11) for k in range(20)]
    outcome = CellOutcome(Cell(128, 11, 1.0), planned=20, results=results, duration=20.0)
    tpot = {line.metric: line for line in cell_lines(outcome, "m", seed=0)}["TPOT"]
    assert tpot.stat("P99") == pytest.approx(0.068) and tpot.stat("mean") == pytest.approx(0.068)
