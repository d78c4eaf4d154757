"""The names the gateway and Envoy agree on: headers, metadata namespaces and keys, the cluster, the buffer.

Envoy's bootstrap (`envoy_bootstrap`), the gateway's replies (`server/`), the Lua tally
(`envoy/tally.lua`, which spells TALLY_NAMESPACE, GATEWAY_METADATA_NAMESPACE and STRIP_USAGE itself),
the local stack and the benchmarks all read them here, so a rename on one side cannot miss the other.
Names only: no imports, nothing that runs.
"""

from __future__ import annotations

# -- headers -------------------------------------------------------------------------------------
# The Gateway API Inference Extension's endpoint-picker header: where ORIGINAL_DST sends the request
# (gateway.destination_header may rename it; Envoy's bootstrap must then be rendered with the same name).
DEFAULT_DESTINATION_HEADER = "x-gateway-destination-endpoint"
STRATEGY_HEADER = "routing-strategy"  # the client's choice of strategy (AIBrix's header)
MODEL_HEADER = "model"                # the model, when the client names it outside the body
SESSION_HEADER = "x-aibrix-session-key"  # session-affinity's key (AIBrix's header)
AUTHORIZATION_HEADER = "authorization"   # the client's API key (`Bearer ...`), when keys are required
TRACEPARENT_HEADER = "traceparent"    # W3C trace context: read only when OpenTelemetry is on
# Two request ids on the wire, kept apart: Envoy's (or the client's) on the request, read as the id to
# route under; the gateway's answer on the response, as AIBrix names it.
ENVOY_REQUEST_ID_HEADER = "x-request-id"  # request header: the id Envoy assigns (or the client sent)
ROUTED_REQUEST_ID_HEADER = "request-id"   # response header: the request id the gateway routed under
TARGET_POD_HEADER = "target-pod"      # AIBrix's response header naming the pod; never taken from clients
# Headers that steer Envoy's ORIGINAL_DST or AIBrix-style gateways: never accepted from clients.
CLIENT_DESTINATION_HEADERS = (DEFAULT_DESTINATION_HEADER, TARGET_POD_HEADER)

# -- dynamic metadata ----------------------------------------------------------------------------
LB_METADATA_NAMESPACE = "envoy.lb"    # the endpoint-picker protocol's metadata namespace
# The endpoint-picker protocol's other names (Gateway API Inference Extension, proposal 004): the subset
# the data plane may restrict a pick to (request metadata), and the endpoint that served the request
# (response metadata, in LB_METADATA_NAMESPACE).
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
GATEWAY_METADATA_NAMESPACE = "extproc"  # the gateway's own decision, read back by Envoy and the access log
TALLY_NAMESPACE = "extproc.tally"     # written by tally.lua: the response's token counts
FAIL_OPEN_NAMESPACE = "extproc.fail_open"  # the body's "model", for the fail-open routes (Envoy only)
ANSWERED_KEY = "answered"             # set on the gateway's own replies: local-reply mappers leave them
# Keys of the routing decision in GATEWAY_METADATA_NAMESPACE: the access log brings KEY back, Envoy
# adds response headers from POD/STRATEGY/REQUEST_ID, the tally script reads STRIP_USAGE.
KEY, POD, STRATEGY, REQUEST_ID, STRIP_USAGE = "key", "pod", "strategy", "request_id", "strip_usage"
TRACEPARENT = "traceparent"  # the request's span (OpenTelemetry on): the route sends it to the pod
# An admitted request's rate-limit budget (extproc/ratelimit/): the access log brings the bucket and its
# token limit back (output tokens are charged to it); Envoy adds each RATE_LIMIT_HEADERS name, kept
# under the same key, to the response.
RATE_LIMIT_BUCKET, RATE_LIMIT_TOKENS = "ratelimit_bucket", "ratelimit_tokens_limit"
RATE_LIMIT_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
                      "x-ratelimit-reset-requests", "x-ratelimit-limit-tokens",
                      "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")

# -- the cluster and the buffer ------------------------------------------------------------------
EXTPROC_CLUSTER = "extproc"  # Envoy's cluster of the gateway: ext_proc and the gRPC access log
MODEL_CLUSTER = "model_pods"  # the ORIGINAL_DST cluster that follows LB_METADATA_NAMESPACE
EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # the gRPC health check's service name
# The endpoint-picker protocol's other gRPC health services: the process answers (liveness); config
# loaded and pods known (readiness, which EXTPROC_SERVICE and the default service "" follow).
LIVENESS_SERVICE, READINESS_SERVICE = "liveness", "readiness"
# Envoy's per-connection buffer; the gateway's max_body_bytes must stay below it, so that oversized
# bodies reach the gateway and get an OpenAI-style 413 instead of Envoy's plain-text one.
ENVOY_BUFFER_BYTES = 16 * 1024 * 1024
ENVOY_MAX_HEADERS = 100  # Envoy's default header count limit, also applied after the gateway's mutation
# The request's header block Envoy accepts (its default is 60 KiB). Engines take less: aiohttp (the
# simulator, many tools) refuses a header line over 8 KiB, h11 (uvicorn) a block over 16 KiB, each in
# plain text. Envoy refuses more than this itself, in the OpenAI JSON shape, before any engine sees
# it, with room below 16 KiB for the headers Envoy adds; the simulator takes lines up to this size.
ENVOY_MAX_REQUEST_HEADERS_KB = 12
