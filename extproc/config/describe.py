"""`extproc check-config`'s report: the loaded Config in words, exactly what `serve` would run.

Built from the Config alone (the loader has already folded in the environment), so the report cannot
disagree with the gateway: Redis found through REDIS_HOST shows here as it is used there.
"""

from __future__ import annotations

from extproc.config.schema import Config
from extproc.redact import redact_url


def describe(config: Config) -> list[str]:
    sync = config.redis_sync
    where = config.redis_target.describe() if config.redis_target else redact_url(config.redis_url or "")
    redis = (f"on ({where}; sync every {sync.interval_seconds:g} s, heartbeat "
             f"{sync.heartbeat_seconds:g} s, timeout {sync.timeout_seconds:g} s, AIBrix rows "
             f"{'on' if sync.aibrix_rows else 'off'})" if config.redis_url else "off")
    lines = [f"default strategy: {config.default_strategy}; destination header: {config.destination_header}; "
             f"max body: {config.max_body_bytes} bytes; Redis: {redis}",
             f"model paths: {', '.join(sorted(config.model_paths))}",
             f"API keys: {_keys(config)}; request traces: "
             f"{('on' if config.redis_url else 'on, but off without Redis') if config.tracing else 'off'}"]
    lines.append(f"rate limits: {_rate_limits(config)}")
    d = config.discovery
    if d.inferencepool is not None:
        pool = d.inferencepool
        lines.append(f"discovery: InferencePool {pool.namespace}/{pool.name}, its selector's ready pods on "
                     f"its target ports, model {pool.model or 'from each pod (else the pool name)'} "
                     "(listed below: the file's pods only)")
    elif d.enabled:
        lines.append(f"discovery: kubernetes, pods labelled {d.label_selector} in "
                     f"{d.namespace or 'all namespaces'} (listed below: the file's pods only)")
    for model in config.models:
        pods = [p for p in config.pods if p.model == model]
        lines.append(f"model {model}: {len(pods)} pod(s)")
        for p in pods:
            lines.append(f"  {p.name:20} {p.address:22} gpu={p.gpu or '-'} deployment={p.deployment or '-'} "
                         f"engine={p.engine}{'' if p.ready else ' (not ready)'}")
    return lines


def _keys(config: Config) -> str:
    sources = ([f"{len(config.api_keys)} from EXTPROC_API_KEYS"] if config.api_keys else []) + \
              ([f"file {config.api_keys_file}"] if config.api_keys_file else [])
    return f"on ({', '.join(sources)})" if sources else "off"


def _rate_limits(config: Config) -> str:
    rl = config.rate_limits
    if not rl.enabled:
        return "off"
    per_minute = [f"{n} {what}/min" for n, what in ((rl.default.requests, "requests"),
                                                     (rl.default.tokens, "tokens")) if n]
    parts = [f"per {rl.key_by} and model", ", ".join(per_minute) or "no default limit",
             f"{len(rl.overrides)} override(s)"]
    if rl.aibrix_users:
        parts.append("AIBrix user records (aibrix-users/<user>)")
    parts.append(f"shared through Redis, {rl.redis_timeout_s * 1000:g} ms bound" if config.redis_url
                 else "in process")
    return "; ".join(parts)
