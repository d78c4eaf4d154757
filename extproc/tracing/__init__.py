"""Request traces for the GPU optimizer, written to Redis exactly as AIBrix's gateway writes them."""

from extproc.tracing.flusher import TRACE_TTL_SECONDS, TraceFlusher, windows_dropped
from extproc.tracing.window import (
    INTERVAL_SEC,
    PRECISION,
    TRACE_VERSION,
    TraceRecorder,
    bucket,
    trace_key,
    trace_key_prefix,
)

__all__ = ["INTERVAL_SEC", "PRECISION", "TRACE_TTL_SECONDS", "TRACE_VERSION", "TraceFlusher", "TraceRecorder",
           "bucket", "trace_key", "trace_key_prefix", "windows_dropped"]
