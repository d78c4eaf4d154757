"""Benchmarks of the gateway itself: `extproc bench overhead` (vs Envoy alone) and `extproc bench memory`."""
