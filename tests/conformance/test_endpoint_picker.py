"""The endpoint-picker protocol (Gateway API Inference Extension, proposal 004, v1.0.0), case by case,
through real Envoy configured as a gateway configures an InferencePool. docs/conformance.md lists each
case beside the sentence of the protocol it checks."""

from __future__ import annotations

import json
import signal
import socket
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.localstack import LocalStack, free_port, wait_until
from tests.conformance.conftest import GREEDY, MODEL, Pool
from tests.integration.sim_fixtures import http_status
from tests.support.pieces import post_in_pieces

PATH = "/v1/chat/completions"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def chat(words: int = 20, **extra: object) -> dict:
    return {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "word " * words}],
            **extra}


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + PATH, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def settled(pool: Pool) -> None:
    """Every request the picker routed has ended there too (the stream's end): counts at zero."""
    wait_until(lambda: pool.running() == 0, what="the picker's in-flight counts back to zero")


def health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2).status


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_streaming_mode_full_duplex_request_routed_with_the_body_unchanged(pool: Pool, tmp_path):
    """MUST support streaming mode: a full-duplex body in pieces (chunked, 2 KB apart), also ended by
    trailers; the OpenAI client's streamed and plain requests."""
    body = json.dumps(chat(3000)).encode()
    before = sum(pool.served(i) for i in range(3))
    reply = post_in_pieces(port_of(pool.url), PATH, body)
    assert reply.status == 200, reply.body
    assert json.loads(reply.body)["usage"]["prompt_tokens"] >= 3000  # the whole body reached the pod
    # Trailers, on a data plane without retries: Envoy 1.40 sends a full-duplex body twice when the
    # route retries and trailers end the body (docs/conformance.md), whatever the picker answers.
    no_retries = pool.envoy(tmp_path, "envoy-no-retries", pool.picker.extproc_port, fallback_endpoints=1)
    reply = post_in_pieces(port_of(no_retries), PATH, body, trailers={"x-checksum": "1"})
    assert reply.status == 200, reply.body
    assert json.loads(reply.body)["usage"]["prompt_tokens"] >= 3000
    client = openai.OpenAI(base_url=pool.url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.chat.completions.create(**chat(), stream=True))
    assert chunks and not any(c.usage for c in chunks)  # the body went on as sent: no usage asked for
    assert client.chat.completions.create(**chat()).choices[0].message.content
    wait_until(lambda: sum(pool.served(i) for i in range(3)) == before + 4, what="four served")
    settled(pool)


@pytest.mark.parametrize("target", [0, 2])
def test_subset_hint_is_honoured(pool: Pool, target: int):
    """If x-gateway-destination-endpoint-subset is set, the EPP MUST only select endpoints from it."""
    before = [pool.served(i) for i in range(3)]
    for _ in range(4):
        status, _ = post(pool.url, chat(), {SUBSET: pool.address(target)})
        assert status == 200
    wait_until(lambda: pool.served(target) == before[target] + 4, what="all four on the subset's pod")
    assert [pool.served(i) for i in range(3) if i != target] == [before[i] for i in range(3) if i != target]
    settled(pool)


@pytest.mark.parametrize("subset", [",", "127.0.0.1:1", "10.255.0.1:8000,127.0.0.1:2"],
                         ids=["empty", "not-in-pool", "none-eligible"])
def test_empty_or_ineligible_subset_is_503(pool: Pool, subset: str):
    """If none of the endpoints in the list is eligible or the list is empty, the EPP MUST return an
    ImmediateResponse with 503."""
    before = sum(pool.served(i) for i in range(3))
    status, body = post(pool.url, chat(), {SUBSET: subset})
    assert status == 503 and body["error"]["code"] == "no_eligible_endpoint"
    assert sum(pool.served(i) for i in range(3)) == before
    settled(pool)


def test_no_ready_endpoint_is_503(pool: Pool):
    """ImmediateResponse with 503 (Service Unavailable) if there are no ready endpoints."""
    status, body = post(pool.url, {**chat(), "model": "no-pods"})
    assert status == 503 and body["error"]["code"] == "no_ready_pod"


def test_shed_request_is_429(pool: Pool):
    """ImmediateResponse with 429 (Too Many Requests) if the request should be dropped."""
    statuses = [post(pool.url, chat(user=GREEDY))[0] for _ in range(2)]
    assert statuses == [200, 429]
    settled(pool)


def test_fallback_list_is_retried_and_the_served_endpoint_accounted(pool: Pool):
    """One or more endpoints, `<ip:port>,<ip:port>,...`: if retry is configured, the proxy goes down the
    list until one valid endpoint is found; the data plane MUST report the endpoint that served the
    request (x-gateway-destination-endpoint-served), and the picker accounts the request there."""
    # pod-1 goes down between two scrapes: the picker still takes it for ready
    urllib.request.urlopen(urllib.request.Request(
        pool.sims[1].url + "/sim/faults", method="POST", headers={"content-type": "application/json"},
        data=json.dumps({"refuse_connections": "refuse", "outage_seconds": 4}).encode()), timeout=5)
    before = [pool.accounted(i) for i in range(3)]
    served_before = pool.served(0)
    retries = pool.envoy_stat(pool.url, "cluster.inference_pool.upstream_rq_retry")
    # round robin over pod-1 and pod-0: one of two requests is picked onto pod-1 first
    subset = f"{pool.address(1)},{pool.address(0)}"
    statuses = [post(pool.url, chat(), {SUBSET: subset, "routing-strategy": "round-robin"})[0]
                for _ in range(2)]
    assert statuses == [200, 200]  # the refused connection was retried on the next endpoint
    wait_until(lambda: pool.served(0) == served_before + 2, what="both served by pod-0")
    settled(pool)
    # both are accounted to the pod that served them; none stays on the pod that refused
    wait_until(lambda: pool.accounted(0) - before[0] == 2, what="both accounted to pod-0 as they end")
    assert pool.accounted(1) == before[1]
    assert pool.envoy_stat(pool.url, "cluster.inference_pool.upstream_rq_retry") == retries + 1
    # the pods are shared with the other cases: pod-1 back before the next one
    wait_until(lambda: http_status(pool.sims[1].url + "/health") == 200, what="pod-1 back from its outage")


def test_health_services(pool: Pool, tmp_path):
    """The EPP MUST expose the gRPC health services: liveness, readiness and
    envoy.service.ext_proc.v3.ExternalProcessor (the readiness criteria)."""
    port = pool.picker.extproc_port
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
        assert health(port, service) == SERVING
    # a picker that knows no pod yet is alive but not ready
    empty = LocalStack(config_path=tmp_path / "gateway.yaml", log_dir=tmp_path)
    empty.write_config({"models": {MODEL: {"pods": []}}})
    empty.start_gateway()
    try:
        assert health(empty.extproc_port, "liveness") == SERVING
        assert health(empty.extproc_port, "readiness") == NOT_SERVING
        assert health(empty.extproc_port, "envoy.service.ext_proc.v3.ExternalProcessor") == NOT_SERVING
        # pods appear (a reload here; discovery alike): ready within the refresh
        empty.write_config({"models": {MODEL: {"pods": [{"name": "p", "address": pool.address(0)}]}}})
        wait_until(lambda: health(empty.extproc_port, "readiness") == SERVING,
                   what="ready once pods are known")
    finally:
        empty.stop()


@pytest.mark.parametrize("fail_open,mode,expected",
                         [(True, "BUFFERED", 200), (False, "FULL_DUPLEX_STREAMED", 500)],
                         ids=["FailOpen", "FailClose"])
def test_picker_down(pool: Pool, tmp_path, fail_open: bool, mode: str, expected: int):
    """The pool's failureMode: FailOpen serves from the pool's own load balancing while the picker is
    unreachable; FailClose refuses. Envoy 1.40 fails open only before a full-duplex body has started
    (its failureModeAllow is off once one was received; whether the picker's absence is noticed first
    is a race), so a pool that fails open buffers the body (`extproc envoy-config --pool` does, with
    gateway.fail_open)."""
    url = pool.envoy(tmp_path, f"envoy-{fail_open}-{mode}", free_port(), fail_open=fail_open, body_mode=mode)
    before = sum(pool.served(i) for i in range(3))
    status, _ = post(url, chat())
    assert status == expected
    wait_until(lambda: sum(pool.served(i) for i in range(3)) == before + (expected == 200),
               what="served only when failing open")


def set_faults(pool: Pool, i: int, faults: dict) -> None:
    urllib.request.urlopen(urllib.request.Request(
        pool.sims[i].url + "/sim/faults", method="POST", headers={"content-type": "application/json"},
        data=json.dumps(faults).encode()), timeout=5)


def test_counts_follow_the_response_to_its_end_and_a_reset_releases_once(pool: Pool, tmp_path):
    """The request is in flight until its response ends, not when its headers come back (the stream
    stays open: response trailers SEND); a data plane that goes away mid-response (Envoy killed) cuts
    the picker's stream, and the request it routed is released once."""
    url = pool.envoy(tmp_path, "envoy-reset", pool.picker.extproc_port, subset_from_header=True)
    envoy = pool.envoys[-1]
    before = pool.picker.sample("extproc_requests_total", pod="pod-2")
    set_faults(pool, 2, {"stall_after_tokens": 1, "stall_seconds": 10})  # the response holds mid-way
    try:
        sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=10)
        body = json.dumps(chat(stream=True)).encode()
        sock.sendall((f"POST {PATH} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      f"{SUBSET}: {pool.address(2)}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body)
        seen = b""
        while b"data: " not in seen:  # the first token: the response is streaming
            chunk = sock.recv(65536)
            assert chunk, seen
            seen += chunk
        wait_until(lambda: pool.running() == 1, what="still in flight while the response streams")
        envoy.stop(signal.SIGKILL)
        sock.close()
        settled(pool)
        wait_until(lambda: pool.picker.sample("extproc_requests_total", pod="pod-2") > before,
                   what="released")
        released = pool.picker.sample("extproc_requests_total", pod="pod-2") - before
        assert released == 1, [line for line in pool.picker.metrics().splitlines() if "pod-2" in line]
    finally:
        set_faults(pool, 2, {})
