"""Limits between Envoy and the gateway sized for the listener's connection cap: a burst of 2,000
concurrent requests once met Envoy's default circuit breakers (1,024) and gRPC's pending-call limit
(1,000, then random cancels): 503s that no pod or gateway caused."""

from __future__ import annotations

from extproc.envoy_bootstrap import BootstrapOptions, bootstrap
from extproc.server.app import MAX_PENDING_CALLS


def test_both_clusters_admit_as_many_requests_as_the_listener_admits_connections():
    options = BootstrapOptions(max_connections=5000)
    clusters = {c["name"]: c for c in bootstrap(options)["static_resources"]["clusters"]}
    for name in ("extproc", "model_pods"):
        (limits,) = clusters[name]["circuit_breakers"]["thresholds"]
        assert limits["max_connections"] == limits["max_pending_requests"] == limits["max_requests"] == 5000


def test_the_gateway_queues_as_many_calls_as_envoy_can_open():
    assert MAX_PENDING_CALLS >= BootstrapOptions().max_connections


def test_gateway_replicas_are_health_checked_at_the_same_pace_with_or_without_traffic():
    # Envoy's default no_traffic_interval (60 s) applied to the ext_proc cluster: a dead replica kept
    # its share of routing streams (each a 503) for a minute instead of one interval.
    clusters = {c["name"]: c for c in bootstrap(BootstrapOptions())["static_resources"]["clusters"]}
    (check,) = clusters["extproc"]["health_checks"]
    assert check["no_traffic_interval"] == check["interval"] == "2s"
