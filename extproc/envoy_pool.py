"""`extproc envoy-config --pool`: Envoy configured as a gateway configures an InferencePool's picker.

The Gateway API Inference Extension's endpoint-picker protocol (docs/conformance.md), as Envoy Gateway and
Envoy AI Gateway set it up: ext_proc with the request headers, the body in FULL_DUPLEX_STREAMED mode (any
mode may be chosen), request trailers and the response headers; `envoy.lb` metadata both ways; the pool's
pods in one cluster whose load balancer follows the picker's ordered endpoint list (Envoy's override_host
policy: the `envoy.lb` value, one endpoint per attempt, the next on retry) and reports the endpoint that
served in `envoy.lb` metadata, which ext_proc forwards with the response headers. Users and the conformance
suite (tests/conformance/) run the same configuration.

The destination comes from the picker's metadata only: a client's `x-gateway-destination-endpoint`
header is removed by the picker and never read by the load balancer. With fail-open, the pool's own
round robin serves while the picker is unreachable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from extproc.envoy_bootstrap import BootstrapOptions, circuit_breakers, extproc_cluster, lb_endpoints
from extproc.envoy_contract import (
    EXTPROC_CLUSTER,
    GATEWAY_METADATA_NAMESPACE,
    LB_METADATA_NAMESPACE,
    SERVED_KEY,
    SUBSET_HINT_NAMESPACE,
    SUBSET_KEY,
)

TYPE = "type.googleapis.com/"
POOL_CLUSTER = "inference_pool"
BODY_MODES = ("FULL_DUPLEX_STREAMED", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL")
# What the data plane retries on, over the picker's list: the pod refused or dropped the connection.
RETRY_ON = "connect-failure,refused-stream,reset"


@dataclass(slots=True, frozen=True)
class PoolOptions:
    pods: tuple[str, ...]  # the pool's endpoints, "ip:port" (the InferencePool's selector and targetPorts)
    body_mode: str = "FULL_DUPLEX_STREAMED"
    fallback_endpoints: int = 3  # gateway.fallback_endpoints: the data plane tries this many at most
    fail_open: bool = False  # the pool's failureMode: FailOpen
    # A data plane that narrows the pick (subsetting) sends the subset hint; this one takes it from the
    # request header of that name, so a test or a demo can play that data plane. Off: no hint is sent.
    subset_from_header: bool = False


def pool_bootstrap(o: BootstrapOptions, pool: PoolOptions) -> dict[str, Any]:
    if pool.body_mode not in BODY_MODES:
        raise ValueError(f"body mode {pool.body_mode!r}: one of {', '.join(BODY_MODES)}")
    ext_proc = {
        "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER},
                         "timeout": f"{max(30, o.message_timeout_seconds)}s"},
        "failure_mode_allow": pool.fail_open,
        "message_timeout": f"{o.message_timeout_seconds}s",
        "allow_mode_override": True,
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": pool.body_mode,
                            "request_trailer_mode": "SEND", "response_header_mode": "SEND",
                            # response trailers SEND: Envoy keeps the stream to the end of the
                            # response (else it closes it after the headers), and that end is the
                            # request's end for the picker's counts; no message per response chunk
                            "response_body_mode": "NONE", "response_trailer_mode": "SEND"},
        "metadata_options": {
            "forwarding_namespaces": {"untyped": [SUBSET_HINT_NAMESPACE, LB_METADATA_NAMESPACE]},
            "receiving_namespaces": {"untyped": [LB_METADATA_NAMESPACE, GATEWAY_METADATA_NAMESPACE]}},
    }
    subset = {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": TYPE + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": SUBSET_KEY, "remove": True, "on_header_present": {
            "metadata_namespace": SUBSET_HINT_NAMESPACE, "key": SUBSET_KEY, "type": "STRING"}}]}}
    retries = max(0, pool.fallback_endpoints - 1)
    hcm = {
        "@type": TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "pool_gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": f"{o.idle_timeout_seconds}s",
        "use_remote_address": True,
        "normalize_path": True,
        "merge_slashes": True,
        "http_protocol_options": {"enable_trailers": True},  # HTTP/1 requests may end with trailers too
        "route_config": {"name": "pool", "virtual_hosts": [{
            "name": "pool", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {
                "cluster": POOL_CLUSTER, "timeout": "0s", "idle_timeout": f"{o.idle_timeout_seconds}s",
                **({"retry_policy": {"retry_on": RETRY_ON, "num_retries": retries}} if retries else {})}}],
        }]},
        "http_filters": [
            *([subset] if pool.subset_from_header else []),
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": TYPE + "envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    lb_key = {"key": LB_METADATA_NAMESPACE, "path": [{"key": o.destination_header}]}
    endpoints = lb_endpoints(pool.pods)
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": o.admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "pool_gateway",
                "address": {"socket_address": {"address": o.listen_address, "port_value": o.listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": [
                {
                    "name": POOL_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": f"{o.upstream_connect_timeout_seconds}s",
                    "circuit_breakers": circuit_breakers(o),
                    "load_assignment": {"cluster_name": POOL_CLUSTER,
                                        "endpoints": [{"lb_endpoints": endpoints}]},
                    # The picker's list, one endpoint per attempt; the served one back in envoy.lb.
                    "load_balancing_policy": {"policies": [{"typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": TYPE + "envoy.extensions.load_balancing_policies.override_host.v3"
                                            ".OverrideHost",
                            "override_host_sources": [{"metadata": lb_key}],
                            "selected_host_key": {"key": LB_METADATA_NAMESPACE,
                                                  "path": [{"key": SERVED_KEY}]},
                            "fallback_policy": {"policies": [{"typed_extension_config": {
                                "name": "envoy.load_balancing_policies.round_robin",
                                "typed_config": {
                                    "@type": TYPE + "envoy.extensions.load_balancing_policies.round_robin"
                                                    ".v3.RoundRobin"}}}]},
                        }}}]},
                },
                extproc_cluster(o),
            ],
        },
    }


def render_pool(options: BootstrapOptions, pool: PoolOptions) -> str:
    import yaml

    header = ("# Generated by `extproc envoy-config --pool`: Envoy as a gateway configures an\n"
              "# InferencePool's endpoint picker. Edit the generator, not this file.\n")
    return header + yaml.safe_dump(pool_bootstrap(options, pool), sort_keys=False)

