"""`extproc envoy-config`: the Envoy bootstrap that puts the gateway in front of the model pods.

The only upstream is an ORIGINAL_DST cluster that follows the destination the gateway chose, in its
envoy.lb metadata (which no client can set). The route to it requires that metadata; every other
request gets a local 503. ext_proc fails closed, so no request reaches an upstream without the gateway
choosing it, unless fail-open is asked for (gateway.fail_open): then, while the gateway is unreachable,
Envoy reads the body's "model" itself and sends the model paths, and only those, round robin to that
model's plain cluster (its pods, or its Service); a request the gateway did answer never takes it.

One ext_proc message per request where possible: a request with a body (content-length > 0) skips the
request headers message, and the headers routing reads come as attributes with the buffered body
(a buffer filter holds the headers back from the router until then). Others (no content-length: chunked
or HTTP/2 bodies; bodiless requests such as GET /v1/models) match a route whose per-route override keeps
the headers message, so the gateway still answers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from extproc.config.schema import DEFAULT_MODEL_PATHS, Config
from extproc.envoy_contract import (
    ANSWERED_KEY,
    CLIENT_DESTINATION_HEADERS,
    DEFAULT_DESTINATION_HEADER,
    ENVOY_BUFFER_BYTES,
    ENVOY_MAX_HEADERS,
    ENVOY_MAX_REQUEST_HEADERS_KB,
    EXTPROC_CLUSTER,
    EXTPROC_SERVICE,
    FAIL_OPEN_NAMESPACE,
    GATEWAY_METADATA_NAMESPACE,
    LB_METADATA_NAMESPACE,
    MODEL_CLUSTER,
    POD,
    RATE_LIMIT_HEADERS,
    REQUEST_ID,
    ROUTED_REQUEST_ID_HEADER,
    STRATEGY,
    STRATEGY_HEADER,
    TARGET_POD_HEADER,
    TRACEPARENT,
)
from extproc.server import attributes
from extproc.slo.settings import MAX_WAIT_CEILING_SECONDS

# Long prompts are buffered whole for routing: keep Envoy's buffer well above the gateway's
# max_body_bytes (config.DEFAULT_MAX_BODY_BYTES) so the gateway, not Envoy, answers oversize bodies.
BUFFER_LIMIT_BYTES = ENVOY_BUFFER_BYTES
TYPE = "type.googleapis.com/"
ACCESS_LOG_FORMAT = ('[%START_TIME%] "%REQ(:METHOD)% %REQ(:PATH)%" %RESPONSE_CODE% %RESPONSE_FLAGS% '
                     '%BYTES_RECEIVED% %BYTES_SENT% %DURATION%ms upstream=%UPSTREAM_HOST% '
                     'request-id=%REQ(X-REQUEST-ID)% lb=%DYNAMIC_METADATA(envoy.lb)%\n')
# Envoy response flags of an upstream that failed us: no healthy host, connect failure, overflow,
# connection termination, reset, timeout, protocol error, retry limit.
UPSTREAM_FAILURE_FLAGS = ("UH", "UF", "UO", "UC", "UR", "UT", "UPE", "URX")
# CLIENT_DESTINATION_HEADERS: the route to the pods removes them (the configured destination header
# is overwritten with the gateway's choice instead).


@dataclass(slots=True, frozen=True)
class BootstrapOptions:
    listen_port: int = 8888
    listen_address: str = "127.0.0.1"  # the clients' port: 0.0.0.0 (or an interface) is a choice
    extproc_port: int = 50052
    extproc_address: str = "127.0.0.1"
    extproc_workers: int = 1  # `serve --workers N`: ports extproc_port .. extproc_port + N - 1
    admin_port: int = 9901
    destination_header: str = DEFAULT_DESTINATION_HEADER
    # A long prompt's body is one message; and a request held in the SLO queue is answered only when
    # dispatched: both must outlast the longest allowed queue wait (routing.slo.max_wait_seconds).
    message_timeout_seconds: int = max(300, int(MAX_WAIT_CEILING_SECONDS) + 60)
    upstream_connect_timeout_seconds: int = 5
    # A pod (or client) silent this long mid-request is cut off: 504 to the client, a failure for
    # the pod's health. Long enough for the longest gap between two tokens, prefill included.
    idle_timeout_seconds: int = 600
    max_connections: int = 10_000
    # How often Envoy sends finished requests' records to the gateway: the lag of in-flight counts.
    access_log_flush_seconds: float = 0.02
    # Fail-open (gateway.fail_open): (model, ("host:port", ...)) pairs; empty: fail closed. The paths
    # that may fail open are the gateway's model paths, never an engine's other endpoints.
    fail_open: tuple[tuple[str, tuple[str, ...]], ...] = ()
    model_paths: tuple[str, ...] = DEFAULT_MODEL_PATHS
    # How ext_proc sends the request body: BUFFERED (one message: the cheapest), or the modes a
    # pool's data plane may use (STREAMED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED), which the gateway
    # answers too (server/body.py). The request's trailers are sent with any of them.
    request_body_mode: str = "BUFFERED"


def tally_script() -> str:
    return resources.files("extproc.envoy").joinpath("tally.lua").read_text()


def circuit_breakers(o: BootstrapOptions) -> dict[str, Any]:
    """Envoy's per-cluster defaults (1,024 connections, pending and active requests) would answer
    503 to the 1,025th concurrent request: one ext_proc stream and one pod request per client
    request, so both clusters get as many as the listener admits connections."""
    n = o.max_connections
    return {"thresholds": [{"priority": "DEFAULT", "max_connections": n, "max_pending_requests": n,
                            "max_requests": n}]}


def bootstrap(o: BootstrapOptions) -> dict[str, Any]:
    """The whole bootstrap: Envoy's admin port, the connection cap, the clients' listener (its HTTP
    connection manager) and the clusters (the pods by the gateway's choice, the gateway, fail-open)."""
    key = lb_key(o)  # one object in the route and the cluster: the rendered YAML names it once
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": o.admin_port}}},
        # Each connection may buffer a long prompt; cap connections so memory stays bounded.
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.resource_monitors.downstream_connections.v3"
                                ".DownstreamConnectionsConfig",
                "max_active_downstream_connections": o.max_connections}}]},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": o.listen_address, "port_value": o.listen_port}},
                "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": http_connection_manager(o, key)}]}],
            }],
            "clusters": [model_cluster(o, key), extproc_cluster(o), *fail_open_clusters(o)],
        },
    }


def processing_modes(o: BootstrapOptions) -> tuple[dict[str, str], dict[str, str]]:
    """What ext_proc sends the gateway: (one message, and the route override that keeps the headers)."""
    # A request with a body: one message (the body, the headers routing reads as attributes). Trailers
    # are not sent (they would be a second message), nor is anything of the response: Envoy closes
    # the stream once the request is routed, and the response streams from the pod without the
    # gateway (its outcome comes back through the access log).
    buffered = o.request_body_mode == "BUFFERED"
    # STREAMED and BUFFERED_PARTIAL: the headers message too (Envoy refuses a route-cache refresh for
    # headers that went on before the body); every mode but BUFFERED: the trailers, which may end it.
    # FULL_DUPLEX_STREAMED: one message path too, the route sent ahead of the body (server/body.py).
    one_message_modes = ("BUFFERED", "FULL_DUPLEX_STREAMED")
    one_message = {"request_header_mode": "SKIP" if o.request_body_mode in one_message_modes else "SEND",
                   "request_body_mode": o.request_body_mode,
                   "request_trailer_mode": "SKIP" if buffered else "SEND",
                   "response_header_mode": "SKIP",
                   "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}
    # Without a known body: the headers too (HTTP/2 headers + trailers without a body: a 400).
    two_messages = {**one_message, "request_header_mode": "SEND", "request_trailer_mode": "SEND"}
    return one_message, two_messages


def ext_proc_filter(o: BootstrapOptions, one_message: dict[str, str]) -> dict[str, Any]:
    """The ext_proc filter's config: the gateway's cluster, its timeouts, the metadata it may set."""
    return {
        "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER},
                         "timeout": f"{max(30, o.message_timeout_seconds)}s"},  # > the SLO queue's wait
        "failure_mode_allow": bool(o.fail_open),
        "message_timeout": f"{o.message_timeout_seconds}s",
        # Envoy drops metadata from the processor in namespaces not listed here.
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE,
                                                                  GATEWAY_METADATA_NAMESPACE]}},
        "processing_mode": one_message,
        "allow_mode_override": True,  # STREAMED bodies are asked for buffered (server/body.py)
        "request_attributes": list(attributes.ATTRIBUTES),
    }


def access_log_service(o: BootstrapOptions) -> dict[str, Any]:
    """Once per request, the finished request's status, timings and the tally's metadata go to the
    gateway (batched every access_log_flush_seconds)."""
    return {"name": "envoy.access_loggers.http_grpc", "typed_config": {
        "@type": TYPE + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
        "common_config": {
            "log_name": "extproc", "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
            "buffer_flush_interval": f"{o.access_log_flush_seconds}s",
            "buffer_size_bytes": 65536}}}


def decision_headers() -> list[dict[str, Any]]:
    """The routing decision's response headers, added by Envoy from the gateway's metadata (absent: not
    added)."""
    return [
        {"header": {"key": header, "value": f"%DYNAMIC_METADATA({GATEWAY_METADATA_NAMESPACE}:{key})%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}
        for header, key in ((TARGET_POD_HEADER, POD), (STRATEGY_HEADER, STRATEGY),
                            (ROUTED_REQUEST_ID_HEADER, REQUEST_ID), *((h, h) for h in RATE_LIMIT_HEADERS))]


def local_reply_mappers() -> list[dict[str, Any]]:
    """Envoy's own replies in the OpenAI shape too: upstream failures (connect refused, reset, timeout),
    bodies over its buffer, and the rest (the gateway unreachable, no destination). The gateway's own
    ImmediateResponses carry the `answered` marker in their metadata and pass untouched."""
    not_answered = {"metadata_filter": {"match_if_key_not_found": True, "matcher": {
        "filter": GATEWAY_METADATA_NAMESPACE, "path": [{"key": ANSWERED_KEY}],
        "value": {"present_match": False}}}}
    too_large = {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": 413, "runtime_key": "extproc.too_large"}}}}
    headers_too_large = {"status_code_filter": {"comparison": {"op": "EQ", "value": {
        "default_value": 431, "runtime_key": "extproc.headers_too_large"}}}}
    gateway_down = {"and_filter": {"filters": [
        {"status_code_filter": {"comparison": {"op": "EQ", "value": {
            "default_value": 500, "runtime_key": "extproc.gateway_down"}}}},
        not_answered]}}
    return [
        # No gateway answered (restarting, or unreachable): a retryable 503, at once.
        {**_openai_reply(gateway_down, "service_unavailable", "gateway_unavailable",
                         "the routing gateway is unavailable; retry shortly"),
         "status_code": 503,
         "headers_to_add": [{"header": {"key": "retry-after", "value": "1"},
                             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]},
        _openai_reply({"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
                      "upstream_error", "%RESPONSE_CODE_DETAILS%", "%LOCAL_REPLY_BODY%"),
        _openai_reply({"and_filter": {"filters": [too_large, not_answered]}}, "invalid_request_error",
                      "request_too_large", f"request body exceeds {BUFFER_LIMIT_BYTES} bytes"),
        _openai_reply({"and_filter": {"filters": [headers_too_large, not_answered]}}, "invalid_request_error",
                      "request_header_fields_too_large", f"request headers exceed "
                      f"{ENVOY_MAX_REQUEST_HEADERS_KB} KiB or {ENVOY_MAX_HEADERS} headers"),
        _openai_reply(not_answered, "gateway_error", "%RESPONSE_CODE_DETAILS%",
                      "the gateway could not process this request"),
    ]


def lb_key(o: BootstrapOptions) -> dict[str, Any]:
    """Where the gateway's choice sits: the destination header's key in the envoy.lb metadata."""
    return {"key": LB_METADATA_NAMESPACE, "path": [{"key": o.destination_header}]}


def to_pods(o: BootstrapOptions) -> dict[str, Any]:
    """The route to the pod the gateway chose; the pod gets the destination header from that choice."""
    return {
        "route": {"cluster": MODEL_CLUSTER, "timeout": "0s", "idle_timeout": f"{o.idle_timeout_seconds}s"},
        "request_headers_to_add": [{"header": {
            "key": o.destination_header,
            "value": f"%DYNAMIC_METADATA({LB_METADATA_NAMESPACE}:{o.destination_header})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            # OpenTelemetry on: the request's span, so the engine's spans join its trace
            # (absent: the client's own traceparent, if any, goes through untouched)
            {"header": {"key": "traceparent",
                        "value": f"%DYNAMIC_METADATA({GATEWAY_METADATA_NAMESPACE}:{TRACEPARENT})%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD", "keep_empty_value": False}],
        "request_headers_to_remove": [h for h in CLIENT_DESTINATION_HEADERS if h != o.destination_header]}


def routes(o: BootstrapOptions, two_messages: dict[str, str], key: dict[str, Any]) -> list[dict[str, Any]]:
    """In order: chosen (to the pod), fail-open, a body still coming, anything else (the headers too)."""
    no_route = {"status": 503, "body": {"inline_string": "no destination was chosen for this request"}}
    keep_headers = {"envoy.filters.http.ext_proc": {
        "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {"processing_mode": two_messages}}}
    pods = to_pods(o)
    return [
        # The gateway chose (its metadata; routes are matched again once it answers). The pod
        # gets the destination header from that choice, never a client's.
        {"match": {"prefix": "/", "dynamic_metadata": [{
            "filter": LB_METADATA_NAMESPACE, "path": key["path"],
            "value": {"present_match": True}}]}, **pods},
        *fail_open_routes(o),
        # Not yet: a body is coming (content-length > 0), so is the one message. A full-duplex
        # body goes on behind the route already (Envoy passes its data on before it could clear
        # a route cache): ORIGINAL_DST reads the gateway's metadata when the buffered request
        # reaches the router, and finds no host without it.
        {"match": {"prefix": "/", "headers": [{"name": "content-length", "string_match": {
            "safe_regex": {"regex": "[0-9]*[1-9][0-9]*"}}}]},
         **(pods if o.request_body_mode == "FULL_DUPLEX_STREAMED"
            else {"direct_response": no_route})},
        # Not yet, and no body known to be coming: the gateway gets the headers too.
        {"match": {"prefix": "/"}, "direct_response": no_route,
         "typed_per_filter_config": keep_headers},
    ]


def http_filters(o: BootstrapOptions, one_message: dict[str, str]) -> list[dict[str, Any]]:
    """ext_proc (the gateway), fail-open's model reader, the buffer, the token tally, the router."""
    tally = {"@type": TYPE + "envoy.extensions.filters.http.lua.v3.Lua",
             "default_source_code": {"inline_string": tally_script()}}
    return [
        {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc_filter(o, one_message)},
        *([MODEL_TO_METADATA] if o.fail_open else []),
        # Holds the request headers back from the router while ext_proc buffers the body (without a
        # headers message, ext_proc itself lets them through at once).
        {"name": "envoy.filters.http.buffer", "typed_config": {
            "@type": TYPE + "envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": BUFFER_LIMIT_BYTES}},
        {"name": "envoy.filters.http.lua", "typed_config": tally},
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": TYPE + "envoy.extensions.filters.http.router.v3.Router"}},
    ]


def http_connection_manager(o: BootstrapOptions, key: dict[str, Any]) -> dict[str, Any]:
    """The clients' listener: edge-proxy settings, OpenAI-shaped local replies, access logs, the routes
    and the filter chain."""
    one_message, two_messages = processing_modes(o)
    return {
        "@type": TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{o.idle_timeout_seconds}s",
        # The edge proxy: trust no client x-forwarded-for / x-envoy-* headers, and match routes on
        # the normalised path the engines will see.
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "local_reply_config": {"mappers": local_reply_mappers()},
        "max_request_headers_kb": ENVOY_MAX_REQUEST_HEADERS_KB,
        "access_log": [{"name": "envoy.access_loggers.stdout", "typed_config": {
            "@type": TYPE + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}},
            access_log_service(o)],
        "route_config": {"name": "gateway", "virtual_hosts": [{
            "name": "models", "domains": ["*"],
            "response_headers_to_add": decision_headers(),
            "routes": routes(o, two_messages, key)}]},
        "http_filters": http_filters(o, one_message),
    }


def model_cluster(o: BootstrapOptions, key: dict[str, Any]) -> dict[str, Any]:
    """The pods: ORIGINAL_DST, following the gateway's choice in the envoy.lb metadata."""
    return {
        "name": MODEL_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": f"{o.upstream_connect_timeout_seconds}s",
        "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "circuit_breakers": circuit_breakers(o),
        "original_dst_lb_config": {"metadata_key": key},
    }


def extproc_cluster(o: BootstrapOptions) -> dict[str, Any]:
    """The gateway's cluster: ext_proc streams (and the access log), one endpoint per worker."""
    return {
        "name": EXTPROC_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "circuit_breakers": circuit_breakers(o),
        # A draining gateway replica reports NOT_SERVING; with several replicas behind this cluster,
        # Envoy stops opening streams to it before it stops accepting. no_traffic_interval: Envoy's 60 s
        # default applied here (ext_proc's gRPC streams do not count as traffic), so a dead replica kept
        # its share of streams for a minute.
        "health_checks": [{
            "timeout": "1s", "interval": "2s", "no_traffic_interval": "2s",
            "unhealthy_threshold": 1, "healthy_threshold": 1, "grpc_health_check": {
                "service_name": EXTPROC_SERVICE}}],
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "connection_keepalive": {"interval": "30s", "timeout": "10s"}}},
            }},
        # One endpoint per gateway worker: round robin spreads the routing streams.
        "load_assignment": {"cluster_name": EXTPROC_CLUSTER, "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": o.extproc_address, "port_value": o.extproc_port + i}}}}
            for i in range(o.extproc_workers)]}]},
    }


def lb_endpoints(addresses: tuple[str, ...]) -> list[dict[str, Any]]:
    """"host:port" (or "[v6]:port") addresses as a cluster's endpoints."""
    out = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        out.append({"endpoint": {"address": {"socket_address": {
            "address": host.strip("[]"), "port_value": int(port)}}}})
    return out


# Fail-open: the body's "model" as metadata, for the routes below (a request the gateway answered was
# re-routed by its metadata already, so these match only when the gateway was not reached).
MODEL_TO_METADATA = {"name": "envoy.filters.http.json_to_metadata", "typed_config": {
    "@type": TYPE + "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
    "request_rules": {"rules": [{"selectors": [{"key": "model"}], "on_present": {
        "metadata_namespace": FAIL_OPEN_NAMESPACE, "key": "model", "type": "STRING"}}]}}}


def fail_open_routes(o: BootstrapOptions) -> list[dict[str, Any]]:
    """Per model and model path (exact): to the model's plain cluster, no client destination header."""
    return [{"match": {"path": path, "dynamic_metadata": [{
                "filter": FAIL_OPEN_NAMESPACE, "path": [{"key": "model"}],
                "value": {"string_match": {"exact": model}}}]},
             "route": {"cluster": f"fail-open-{i}", "timeout": "0s",
                       "idle_timeout": f"{o.idle_timeout_seconds}s"},
             "request_headers_to_remove": sorted({*CLIENT_DESTINATION_HEADERS, o.destination_header})}
            for i, (model, _) in enumerate(o.fail_open) for path in o.model_paths]


def fail_open_clusters(o: BootstrapOptions) -> list[dict[str, Any]]:
    """One round-robin cluster per model; STRICT_DNS, so a Service name works as well as pod IPs."""
    clusters = []
    for i, (_, upstreams) in enumerate(o.fail_open):
        endpoints = lb_endpoints(upstreams)
        clusters.append({"name": f"fail-open-{i}", "type": "STRICT_DNS", "lb_policy": "ROUND_ROBIN",
                         "connect_timeout": f"{o.upstream_connect_timeout_seconds}s",
                         "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                         "circuit_breakers": circuit_breakers(o),
                         "load_assignment": {"cluster_name": f"fail-open-{i}",
                                             "endpoints": [{"lb_endpoints": endpoints}]}})
    return clusters


def fail_open_upstreams(config: Config) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """BootstrapOptions.fail_open from a gateway Config: each model's pods from the file, if it fails open."""
    if not config.fail_open:
        return ()
    by_model: dict[str, list[str]] = {}
    for pod in config.pods:
        by_model.setdefault(pod.model, []).append(pod.address)
    return tuple((model, tuple(addresses)) for model, addresses in sorted(by_model.items()))


def _openai_reply(match: dict[str, Any], type_: str, code: str, message: str) -> dict[str, Any]:
    """A local-reply mapper that rewrites matching Envoy replies as an OpenAI error body."""
    return {"filter": match, "body_format_override": {"content_type": "application/json", "json_format": {
        "error": {"message": message, "type": type_, "code": code}}}}


def render(options: BootstrapOptions | None = None) -> str:
    header = "# Generated by `extproc envoy-config`; edit the generator, not this file.\n"
    return header + yaml.safe_dump(bootstrap(options or BootstrapOptions()), sort_keys=False)
