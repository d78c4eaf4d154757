"""Envoy's gRPC access-log service: how each request's outcome reaches the gateway, once per request.

The tally script (extproc/envoy/tally.lua) leaves output/prompt tokens in dynamic metadata as the
response streams through Envoy; Envoy's http_grpc access logger sends the finished request's entry,
with that metadata, status, timings and response flags, in batches. One message per request instead
of one per streamed token, and no response ever waits on the gateway.
"""

from __future__ import annotations

import logging

from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from extproc.envoy_contract import (
    GATEWAY_METADATA_NAMESPACE,
    KEY,
    RATE_LIMIT_BUCKET,
    RATE_LIMIT_TOKENS,
    TALLY_NAMESPACE,
)
from extproc.server.gateway import Gateway
from extproc.vocabulary import TOKENS_UNKNOWN, RequestEnd

log = logging.getLogger(__name__)


def _seconds(duration) -> float:
    return duration.seconds + duration.nanos * 1e-9


def _number(fields, name: str) -> int | None:
    value = fields.get(name)
    return int(value.number_value) if value is not None and value.HasField("number_value") else None


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self._gw = gateway

    async def StreamAccessLogs(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        async for message in request_iterator:
            for entry in message.http_logs.log_entry:
                try:
                    self.record(entry)
                except Exception:  # one odd entry must not end the stream for the others
                    log.exception("bad access-log entry")
        return als_pb2.StreamAccessLogsResponse()

    def record(self, entry) -> None:
        common = entry.common_properties
        filters = common.metadata.filter_metadata
        ours = filters.get(GATEWAY_METADATA_NAMESPACE)
        if ours is None:
            return  # answered by the gateway itself, or by Envoy before routing
        key = ours.fields.get(KEY)
        if key is None:
            return
        tally = filters.get(TALLY_NAMESPACE)
        fields = tally.fields if tally is not None else {}
        source = fields.get("source")
        flags = common.response_flags
        status = entry.response.response_code.value
        # Bytes already sent to the client and then a reset: the client saw a cut stream.
        aborted = (flags.downstream_connection_termination or flags.downstream_remote_reset
                   or flags.upstream_remote_reset or flags.upstream_connection_termination
                   or flags.stream_idle_timeout or flags.upstream_request_timeout)
        connect_failure = (flags.upstream_connection_failure or flags.upstream_retry_limit_exceeded or
                           ((flags.upstream_remote_reset or flags.upstream_connection_termination)
                            and not common.HasField("time_to_first_upstream_rx_byte")))
        upstream = common.upstream_remote_address.socket_address
        output_tokens = _number(fields, "output_tokens")
        budget = ours.fields.get(RATE_LIMIT_BUCKET)
        if budget is not None:  # the output counted, charged once: Envoy sends each record to one gateway
            limit = ours.fields.get(RATE_LIMIT_TOKENS)
            self._gw.limiter.charge(budget.string_value, int(limit.string_value or 0) if limit else 0,
                                    output_tokens)
        self._gw.complete(key.string_value, RequestEnd(
            status, _number(fields, "prompt_tokens"), output_tokens,
            source.string_value if source is not None else TOKENS_UNKNOWN,
            _seconds(common.time_to_first_upstream_rx_byte)
            if common.HasField("time_to_first_upstream_rx_byte") else None,
            _seconds(common.time_to_last_downstream_tx_byte)
            if common.HasField("time_to_last_downstream_tx_byte") else None,
            bool(connect_failure), bool(aborted), _address(upstream)))


def _address(socket_address) -> str:
    host = socket_address.address
    if not host:
        return ""
    return f"[{host}]:{socket_address.port_value}" if ":" in host else f"{host}:{socket_address.port_value}"
