"""Capacity-aware LLM gateway for heterogeneous GPU fleets (an Envoy ext_proc server)."""

__version__ = "0.1.0"
