"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that reads client or engine bytes.

    python -m tests.reliability.fuzz TARGET [libFuzzer flags, e.g. -runs=100000 -max_total_time=300]

Targets:
  body      openai.parse_request on every served path: a Request or an OpenAIError with a 4xx, nothing
            else; a routed request's usage splice (with_usage_requested) yields JSON that still parses
            to the same request with include_usage set
  strategy  the routing-strategy header: a StrategySpec or a StrategySpecError, nothing else
  config    a config file's text: a Config or a ConfigError naming the key, nothing else (YAML
            syntax errors are load()'s to report)
The Envoy tally's SSE reader is Lua, invisible to atheris' coverage: it gets property tests over
arbitrary bytes and splits instead (tests/unit/test_tally_lua.py).
Any other exception is a crash and libFuzzer keeps the input. `make fuzz` runs each for minutes; the
suite runs each for a few thousand inputs (tests/reliability/test_fuzz.py).
"""

from __future__ import annotations

import sys

import atheris
import yaml

with atheris.instrument_imports():
    from extproc import openai
    from extproc.config import ConfigError, parse
    from extproc.config.source import DuplicateKey, read_yaml
    from extproc.openai import OpenAIError
    from extproc.routing import Router, RoutingSettings, StrategySpecError

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def body(data: bytes) -> None:
    """First byte: the path (and whether a model header is sent); the rest: the body."""
    if not data:
        return
    path = PATHS[data[0] % len(PATHS)]
    header_model = "m" if data[0] & 0x80 else None
    raw = data[1:]
    try:
        request = openai.parse_request(path, raw, header_model)
    except OpenAIError as err:
        assert 400 <= err.status < 500, err.status
        return
    spliced = openai.with_usage_requested(raw, request)
    if spliced is not None:
        again = openai.parse_request(path, spliced, header_model)
        assert again.model == request.model and again.stream and again.include_usage


_ROUTER = Router(RoutingSettings())


def strategy(data: bytes) -> None:
    value = data.decode("latin-1")  # header values reach us as latin-1 text
    try:
        _ROUTER.parse(value)
    except StrategySpecError:
        pass


def config(data: bytes) -> None:
    try:
        raw = read_yaml(data.decode("utf-8", "replace"))
    except (yaml.YAMLError, DuplicateKey):
        return
    try:
        parse(raw, {})
    except ConfigError:
        pass


TARGETS = {"body": body, "strategy": strategy, "config": config}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: python -m tests.reliability.fuzz {{{','.join(TARGETS)}}} [libFuzzer flags]")
    target = TARGETS[argv[1]]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
