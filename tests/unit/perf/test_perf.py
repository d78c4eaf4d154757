"""The benchmark's own parsers and statistics: what it reports must be right before it is fast."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import pytest
import yaml

from extproc.envoy_bootstrap import BootstrapOptions
from extproc.perf import upstream
from extproc.perf.epoll_client import Target, request_bytes, run_load
from extproc.perf.memory import Curve, slope
from extproc.perf.overhead import Run, Settings, summarize
from extproc.perf.report import render, target_status
from extproc.perf.stack import EXT_PROC_FILTER, GRPC_ACCESS_LOG, LUA_FILTER, envoy_variant
from extproc.perf.stats import median, metric_sum, parse_proc_stat, percentile


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile(values, 1.0) == 100
    assert percentile([7.0], 0.99) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_median_ignores_missing_samples() -> None:
    assert median([1.0, float("nan"), 3.0]) == 2.0
    assert math.isnan(median([]))


def test_proc_stat_cpu_survives_odd_process_names() -> None:
    fields = ["S"] + ["0"] * 10 + ["250", "150"] + ["0"] * 30
    line = "1234 (envoy) (worker)) " + " ".join(fields)
    import os

    assert parse_proc_stat(line) == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))


def test_metric_sum_matches_labels_and_skips_other_names() -> None:
    text = (
        "# HELP extproc_output_tokens_total tokens\n"
        "# TYPE extproc_output_tokens_total counter\n"
        'extproc_output_tokens_total{model="bench",pod="a"} 10.0\n'
        'extproc_output_tokens_total{model="bench",pod="b"} 5.0\n'
        'extproc_output_tokens_total{model="other",pod="c"} 100.0\n'
        'extproc_output_tokens_totalx{model="bench"} 1000.0\n'
        "extproc_pod_running_requests 3\n")
    assert metric_sum(text, "extproc_output_tokens_total") == 115
    assert metric_sum(text, "extproc_output_tokens_total", model="bench") == 15
    assert metric_sum(text, "extproc_pod_running_requests") == 3
    assert metric_sum(text, "missing") == 0


def test_memory_slope_is_least_squares() -> None:
    assert slope([0, 1, 2, 3], [10, 12, 14, 16]) == pytest.approx(2.0)
    curve = Curve(requests=[0, 1, 2, 3, 4, 5], rss=[0, 900, 1000, 1000, 1000, 1000])
    assert curve.slope() == pytest.approx(0.0)  # the warm-up rise is not in the second half
    assert math.isnan(slope([1], [1]))


def test_variants_remove_only_the_gateway_parts() -> None:
    options = BootstrapOptions(listen_port=1, admin_port=2, extproc_port=3)

    def parts(text: str) -> tuple[list[str], list[str]]:
        hcm = yaml.safe_load(text)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]
        return [f["name"] for f in hcm["http_filters"]], [a["name"] for a in hcm["access_log"]]

    filters, logs = parts(envoy_variant(options, ext_proc=True, tally=True))
    assert EXT_PROC_FILTER in filters and LUA_FILTER in filters and GRPC_ACCESS_LOG in logs
    filters, logs = parts(envoy_variant(options, ext_proc=True, tally=False))
    assert EXT_PROC_FILTER in filters and LUA_FILTER not in filters and GRPC_ACCESS_LOG not in logs
    filters, logs = parts(envoy_variant(options, ext_proc=False, tally=False))
    assert filters == ["envoy.filters.http.router"] and GRPC_ACCESS_LOG not in logs


def test_stream_tail_carries_usage_only_when_asked() -> None:
    with_usage = upstream.stream_tail(5, 3, include_usage=True)
    assert b'"choices":[]' in with_usage and b'"completion_tokens":5' in with_usage
    assert with_usage.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert b"usage" not in upstream.stream_tail(5, 3, include_usage=False)
    body = json.loads(upstream.completion_body(4, 2))
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_request_bytes_carry_the_destination_header() -> None:
    raw = request_bytes(Target(1, (("x-dest", "127.0.0.1:9"),)), "m", True, 7)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"x-dest: 127.0.0.1:9" in head and f"content-length: {len(body)}".encode() in head
    assert json.loads(body) == {"model": "m", "stream": True, "max_tokens": 7,
                                "messages": [{"role": "user", "content": "Say this is a test!"}]}


@pytest.fixture
def live_upstream():
    """The upstream on an ephemeral port in a thread of this process (its own event loop)."""
    loop = asyncio.new_event_loop()
    stats = upstream.Stats()
    ready = threading.Event()
    holder: dict[str, object] = {}

    pacer = upstream.Pacer(loop)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(loop.create_server(
            lambda: upstream.Upstream(stats, 0.002, pacer), "127.0.0.1", 0))
        holder["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(5)
    yield int(holder["port"]), stats  # type: ignore[arg-type]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_client_and_upstream_agree_on_json_requests(live_upstream) -> None:
    port, stats = live_upstream
    result = run_load(Target(port), concurrency=4, duration=0.3, stream=False, max_tokens=16)
    assert not result.errors
    assert result.completed == stats.requests > 0 and stats.tokens == 16 * stats.requests
    assert len(result.latencies) > 0 and result.rps > 0


def test_streams_are_paced_counted_and_usage_is_seen_when_sent(live_upstream) -> None:
    port, stats = live_upstream
    result = run_load(Target(port), concurrency=3, duration=0.2, stream=True, max_tokens=(5, 15), stagger=0.002)
    assert not result.errors  # every stream brought exactly the tokens its request asked for
    assert result.tokens == stats.tokens and 5 * result.completed <= result.tokens <= 15 * result.completed
    # Each token is written 2 ms after the previous one: most gaps are about that (zero when coalesced).
    assert 0.001 < percentile(result.gaps, 0.5) < 0.02
    assert result.usage_leaked == 0  # the client did not ask for usage, the upstream sent none


def test_a_chunked_request_is_one_request_and_the_next_one_follows(live_upstream) -> None:
    """Envoy forwards a full-duplex (ext_proc) body chunked: one request, one answer, and the
    connection stays usable (taking the chunks for a second request made Envoy drop it every time)."""
    port, stats = live_upstream
    body = b'{"model":"m","stream":false,"max_tokens":7,"messages":[]}'
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:20], body[20:]))
               + b"0\r\n\r\n")
    plain = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
             % (len(body), body.replace(b"7", b"5")))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        for i in range(0, len(chunked), 9):  # in small pieces: every split point of the framing
            sock.sendall(chunked[i:i + 9])
        sock.sendall(plain)
        received = b""
        while received.count(b"HTTP/1.1 200") < 2 or not received.endswith(b"}"):
            data = sock.recv(65536)
            assert data, "the upstream closed the connection"
            received += data
    assert received.count(b"HTTP/1.1 ") == 2
    assert stats.requests == 2 and stats.tokens == 7 + 5


def test_dechunk_waits_for_the_whole_body_and_its_trailers() -> None:
    framed = b"5\r\nhello\r\n3\r\nabc\r\n0\r\nx-t: 1\r\n\r\nNEXT"
    body, end = upstream._dechunk(framed, 0)
    assert body == b"helloabc" and framed[end:] == b"NEXT"
    assert all(upstream._dechunk(framed[:i], 0) is None for i in range(len(framed) - 4))


def _run(path: str, load: int, **kw: object) -> Run:
    return Run(path=path, load=load, **kw)  # type: ignore[arg-type]


def test_summary_subtracts_envoy_alone_per_round_and_picks_the_best_tallied_rate() -> None:
    s = Settings(concurrencies=(1,), streams=(64, 512), rounds=2, stream_rounds=1)
    runs = {
        "req/1/envoy": [_run("envoy", 1, p50_ms=1.0, p99_ms=2.0, rps=900),
                        _run("envoy", 1, p50_ms=3.0, p99_ms=4.0, rps=700)],
        "req/1/full": [_run("full", 1, p50_ms=1.5, p99_ms=3.0, rps=500, completed=10,
                            cpu_s={"gateway": 0.001}),
                       _run("full", 1, p50_ms=3.3, p99_ms=5.0, rps=400, completed=10,
                            cpu_s={"gateway": 0.002})],
        "stream/64/envoy": [_run("envoy", 64, itl_p50_ms=20.0, itl_p99_ms=21.0, tokens_per_s=3200)],
        "stream/64/full": [_run("full", 64, itl_p50_ms=20.0, itl_p99_ms=21.5, tokens_per_s=3190,
                                tally_ok=True, tally=100.0, tokens_sent=100, running_after=0.0,
                                cpu_s={"gateway": 0.001}, elapsed_s=1.0)],
        "stream/512/envoy": [_run("envoy", 512, itl_p50_ms=20.0, itl_p99_ms=30.0, tokens_per_s=25000)],
        "stream/512/full": [_run("full", 512, itl_p50_ms=20.5, itl_p99_ms=33.0, tokens_per_s=24000,
                                 tally_ok=True, tally=100.0, tokens_sent=100, running_after=0.0,
                                 cpu_s={"gateway": 0.002}, elapsed_s=1.0)],
    }
    summary = summarize(runs, s)
    assert summary["c1"]["added_p50_ms"] == pytest.approx(0.4)   # median of 0.5 and 0.3
    assert summary["c1"]["added_p99_ms"] == pytest.approx(1.0)
    assert summary["c1"]["direct_rps"] == 800 and summary["c1"]["gateway_rps"] == 450
    assert summary["c1"]["gateway_cpu_us_per_request"] == pytest.approx(150)
    stream = summary["stream"]
    # 512 streams added 3 ms of ITL p99: over budget, so the best tallied rate is the 64-stream one.
    assert stream["max_chunks_per_s"] == 3190 and stream["added_itl_p99_ms"] == pytest.approx(0.5)
    assert stream["gateway_cpu_us_per_token"] == pytest.approx(10.0)
    summary["decision_us"] = {"strategy": "least-request", "10": 5.0, "10_p99": 6.0, "100": 60.0,
                              "100_p99": 70.0}
    status = {name: ok for name, _, ok in target_status(summary)}
    assert status["c1 added p50 <= 0.6 ms"] is True
    assert status["decision <= 30 us at 100 pods"] is False
    assert status["decision <= 300 us at 1000 pods"] is None  # not measured: neither met nor missed
    assert "(c) full path" in render(summary, s.concurrencies)


def test_a_body_mode_is_set_beside_the_buffered_body_of_its_own_attachment() -> None:
    """Full duplex is judged within its attachment (our bootstrap's buffered path; the same pool with a
    buffered body), round by round; the pool beside our bootstrap is reported, not held to the bar."""
    s = Settings(concurrencies=(1,), streams=(), rounds=2, stream_rounds=0)
    cpu = {"gateway": 0.001, "envoy": 0.001}

    def rounds(path: str, *rps: float) -> list[Run]:
        return [_run(path, 1, p50_ms=1000 / r, p99_ms=2000 / r, rps=r, completed=10, cpu_s=cpu) for r in rps]

    runs = {"req/1/full": rounds("full", 500, 400), "req/1/duplex": rounds("duplex", 450, 400),
            "req/1/pool-buffered": rounds("pool-buffered", 300, 250),
            "req/1/pool": rounds("pool", 250, 200)}
    row = summarize(runs, s)["c1"]
    assert row["duplex_vs_buffered_rps_ratio"] == pytest.approx((500 / 450 + 1) / 2)
    assert row["pool_vs_pool_buffered_rps_ratio"] == pytest.approx((1.2 + 1.25) / 2)
    assert row["pool_vs_buffered_rps_ratio"] == pytest.approx((2 + 2) / 2)
    assert row["pool_buffered_vs_buffered_cpu_ratio"] == pytest.approx(1.0)
    status = {name: ok for name, _, ok in target_status({"c1": row, "stream": {"levels": []}})}
    assert status["c1 full-duplex <= 1.15x buffered per request (bootstrap)"] is True  # x1.056
    assert status["c1 full-duplex <= 1.15x buffered per request (pool)"] is False  # x1.2 and x1.25
    assert status["c64 full-duplex <= 1.15x buffered per request (pool)"] is None  # not measured
    text = render({"c1": row, "stream": {"levels": []}}, s.concurrencies)
    assert "pool: full-duplex body beside buffered" in text and "pool, buffered body" in text


def test_top_frames_folds_line_numbers_and_shares_samples() -> None:
    from extproc.perf.profile import top_frames

    collapsed = ("main (app.py:10);handle (processor.py:70);parse (openai.py:101) 6\n"
                 "main (app.py:10);handle (processor.py:71) 2\n"
                 "thread (0x1);main (app.py:12);poll (grpc.py:5) 2\n")
    rows = {f: (own, incl) for f, own, incl in top_frames(collapsed)}
    assert rows["main (app.py)"] == (0.0, 1.0)
    assert rows["handle (processor.py)"] == (pytest.approx(0.2), pytest.approx(0.8))
    assert rows["parse (openai.py)"] == (pytest.approx(0.6), pytest.approx(0.6))
    assert "thread (0x1)" not in rows


def test_the_sync_bench_counts_the_speed_sharing_of_every_pod() -> None:
    """`bench sync`'s other half of sharing's cost: the gateway's own `_share_speed` over every pod and
    the refresh's merge of the others' sums (more work with them than without)."""
    from extproc.perf import sync

    figures = sync.speed_sharing(pods=200, models=4, seconds=2)
    assert figures["share_ms"] > 0 and figures["refresh_alone_ms"] > 0
    assert figures["speed_core_share"] == pytest.approx(
        (figures["share_ms"] + figures["peer_merge_ms"]) / 1000, abs=0.0015)  # each rounded alone
    row = sync.format_row({"code": "this", "gateways": 2, "pods": 200, "sync_cpu_ms_median": 1,
                           "sync_cpu_ms_p99": 2, "sync_core_share": 0.01, "turn_latency_ms_median": 1,
                           "turn_latency_ms_max": 2, "timeouts": 0, "wrong_views": 0, "age_ms_median": 1,
                           "age_ms_max": 2, "redis_cpu_ms_per_fleet_turn": 1, "redis_cores": 0.01,
                           "redis_commands_per_s": 10, "reply_bytes_per_s": 1000, **figures,
                           "whole_core_share": 0.01 + figures["speed_core_share"]})
    assert row.count("|") == len(sync.HEADER) - 1


def test_the_fixed_answer_picker_answers_the_pool_sequence_as_the_gateway_does() -> None:
    """pool-floor (extproc/perf/pool_floor.py): the same replies, in the same order, as the gateway's
    to a pool's full-duplex request, so the bench path differs only in the work behind them."""
    import grpc
    from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest

    from extproc.envoy_contract import DEFAULT_DESTINATION_HEADER, LB_METADATA_NAMESPACE
    from extproc.perf.pool_floor import FloorPicker

    headers = ProcessingRequest()
    headers.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/chat/completions")
    sent = [headers, ProcessingRequest(request_body=HttpBody(body=b'{"model":')),
            ProcessingRequest(request_body=HttpBody(body=b'"m"}', end_of_stream=True)),
            ProcessingRequest(response_headers=headers.request_headers)]
    replies: list = []

    class Context:
        async def read(self):
            return sent.pop(0) if sent else grpc.aio.EOF

        async def write(self, reply) -> None:
            replies.append(reply)

    asyncio.run(FloorPicker("10.0.0.1:8000").Process(None, Context()))
    kinds = [r.WhichOneof("response") for r in replies]
    assert kinds == ["request_headers", "request_body", "response_headers"]
    route = replies[0]
    assert route.request_headers.response.clear_route_cache
    assert route.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"
    lb = route.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    assert lb[DEFAULT_DESTINATION_HEADER].string_value == "10.0.0.1:8000"
    piece = replies[1].request_body.response.body_mutation.streamed_response
    assert piece.body == b'{"model":"m"}' and piece.end_of_stream
