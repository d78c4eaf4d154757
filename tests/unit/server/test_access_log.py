"""Envoy's access-log entries become request records: tokens, status, timings, failures."""

from __future__ import annotations

from envoy.config.core.v3.address_pb2 import Address, SocketAddress
from envoy.data.accesslog.v3.accesslog_pb2 import (
    AccessLogCommon,
    HTTPAccessLogEntry,
    HTTPResponseProperties,
    ResponseFlags,
)
from google.protobuf.duration_pb2 import Duration
from google.protobuf.struct_pb2 import Struct
from google.protobuf.wrappers_pb2 import UInt32Value

from extproc.config import parse
from extproc.openai import Request
from extproc.server.access_log import AccessLogService
from extproc.server.gateway import Gateway

CONFIG = {"models": {"m": {"pods": [{"name": "p0", "address": "10.0.0.1:8000"}]}}}
POD_KEY = ("m", "p0", "10.0.0.1:8000")


def entry(key: str | None, status: int = 200, tally: dict | None = None, flags: ResponseFlags | None = None,
          ttfb: float | None = 0.05, upstream: str = "10.0.0.1") -> HTTPAccessLogEntry:
    common = AccessLogCommon(response_flags=flags or ResponseFlags(),
                             time_to_last_downstream_tx_byte=Duration(seconds=1, nanos=500_000_000),
                             upstream_remote_address=Address(socket_address=SocketAddress(
                                 address=upstream, port_value=8000)))
    if ttfb is not None:
        common.time_to_first_upstream_rx_byte.FromNanoseconds(int(ttfb * 1e9))
    if key is not None:
        ours = Struct()
        ours.update({"key": key, "pod": "p0"})
        common.metadata.filter_metadata["extproc"].CopyFrom(ours)
    if tally is not None:
        t = Struct()
        t.update(tally)
        common.metadata.filter_metadata["extproc.tally"].CopyFrom(t)
    return HTTPAccessLogEntry(common_properties=common,
                              response=HTTPResponseProperties(response_code=UInt32Value(value=status)))


def routed(gw: Gateway) -> str:
    decision = gw.route(Request(model="m", path="/v1/chat/completions", prompt_tokens=3), gw.profile("random"),
                        "rid")
    assert decision is not None
    return decision.key


def test_a_record_completes_the_request_and_credits_tokens():
    gw = Gateway(parse(CONFIG, {}))
    seen = []
    gw.add_hook(type("Spy", (), {"post_response": lambda self, r, now: seen.append(r)})())
    key = routed(gw)
    AccessLogService(gw).record(entry(key, tally={"output_tokens": 42.0, "prompt_tokens": 7.0,
                                                  "source": "usage"}))
    (record,) = seen
    assert (record.status, record.output_tokens, record.prompt_tokens, record.token_source) == (200, 42, 7, "usage")
    assert abs(record.ttfb_s - 0.05) < 1e-6 and record.e2e_s == 1.5
    assert not record.aborted and not record.connect_failure
    assert len(gw.open) == 0 and gw.accounting.output_tokens[POD_KEY] == 42


def test_connect_failure_takes_the_pod_out():
    gw = Gateway(parse(CONFIG, {}))
    key = routed(gw)
    AccessLogService(gw).record(entry(key, status=503, ttfb=None,
                                      flags=ResponseFlags(upstream_connection_failure=True)))
    assert not gw.accounting.health.healthy(POD_KEY)
    assert len(gw.open) == 0


def test_entries_without_our_key_are_ignored_and_unknown_keys_only_credit():
    gw = Gateway(parse(CONFIG, {}))
    service = AccessLogService(gw)
    service.record(entry(None))
    service.record(entry("from-a-previous-process", tally={"output_tokens": 5.0, "source": "counted"}))
    assert gw.accounting.output_tokens[POD_KEY] == 5
    assert gw.unmatched_records._value.get() == 1


def test_client_gone_mid_stream_is_aborted():
    gw = Gateway(parse(CONFIG, {}))
    seen = []
    gw.add_hook(type("Spy", (), {"post_response": lambda self, r, now: seen.append(r)})())
    key = routed(gw)
    AccessLogService(gw).record(entry(key, tally={"output_tokens": 3.0, "source": "counted"},
                                      flags=ResponseFlags(downstream_remote_reset=True)))
    assert seen[0].aborted and seen[0].output_tokens == 3


def test_a_removed_pod_loses_its_request_series():
    gw = Gateway(parse(CONFIG, {}))
    AccessLogService(gw).record(entry(routed(gw)))
    sample = {"model": "m", "pod": "p0", "strategy": "random", "code": "200"}
    assert gw.registry.get_sample_value("extproc_requests_total", sample) == 1.0
    gw.count("", "", "", "400")  # refused before any model or pod was known: not a pod's series
    gw.apply(parse({"models": {"m": {"pods": [{"name": "p1", "address": "10.0.0.2:8000"}]}}}, {}))
    assert gw.registry.get_sample_value("extproc_requests_total", sample) is None
    refused = {"model": "", "pod": "", "strategy": "", "code": "400"}
    assert gw.registry.get_sample_value("extproc_requests_total", refused) == 1.0
