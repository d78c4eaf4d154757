"""The config's `models:` section: each model's pods, checked one by one (the error names the pod)."""

from __future__ import annotations

import ipaddress
from typing import Any

from extproc.config.schema import ConfigError, check_known
from extproc.config.source import line_of
from extproc.pool.pod import ENGINE_LABEL, ENGINES, METRIC_PORT_LABEL, Pod

MODEL_KEYS = frozenset({"pods", "routingConfig"})
POD_KEYS = frozenset({"name", "address", "deployment", "labels", "ready", "namespace", "engine",
                      "metrics_port"})


def model_pods(model: str, spec: Any) -> list[Pod]:
    if not isinstance(spec, dict):
        raise ConfigError(f"models.{model} must be a mapping with a pods list")
    check_known(f"models.{model}", spec, MODEL_KEYS)
    entries = spec.get("pods") or []
    if not isinstance(entries, list):
        raise ConfigError(f"models.{model}.pods must be a list")
    pods: list[Pod] = []
    names: dict[str, int] = {}      # name -> index of the pod that has it
    addresses: dict[str, int] = {}  # address -> index
    for i, entry in enumerate(entries):
        where = f"models.{model}.pods[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a mapping with a name and an address")
        check_known(where, entry, POD_KEYS)  # first: `adress:` is named as misspelt, not as missing
        missing = [k for k in ("name", "address") if k not in entry]
        if missing:
            raise ConfigError(f"{where} needs a name and an address (no {' and no '.join(missing)})")
        name = str(entry["name"])
        if name in names:
            raise ConfigError(f"{where}.name {name!r}{line_of(entry, 'name')} is also pods[{names[name]}]'s: "
                              "a pod's name must be unique in its model")
        names[name] = i
        labels = entry.get("labels") or {}
        if not isinstance(labels, dict):
            raise ConfigError(f"{where}.labels must be a mapping")
        ready = entry.get("ready", True)
        if not isinstance(ready, bool):
            raise ConfigError(f"{where}.ready must be true or false")
        labels = {str(k): str(v) for k, v in labels.items()}
        engine = str(entry.get("engine", labels.get(ENGINE_LABEL, "vllm"))).lower()
        if engine not in ENGINES:
            raise ConfigError(f"{where}.engine {engine!r} is not one of {', '.join(ENGINES)}")
        metrics_port = entry.get("metrics_port", labels.get(METRIC_PORT_LABEL))
        if metrics_port is not None:
            try:
                metrics_port = int(metrics_port)
                if not 0 < metrics_port < 65536:
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.metrics_port {metrics_port!r} is not a port") from None
        address = _address(str(entry["address"]), where)
        if address in addresses:
            raise ConfigError(f"{where}.address {address}{line_of(entry, 'address')} is also "
                              f"pods[{addresses[address]}]'s: one engine would be counted as two pods")
        addresses[address] = i
        pods.append(Pod(model=model, name=name, address=address,
                        deployment=str(entry.get("deployment", "")), labels=labels, ready=ready,
                        namespace=str(entry.get("namespace", "default")), engine=engine,
                        metrics_port=metrics_port))
    return pods


def _address(value: str, where: str) -> str:
    """ORIGINAL_DST needs a literal ip:port; a hostname here would never connect."""
    host, sep, port_text = value.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError
    except ValueError:
        raise ConfigError(f"{where}.address {value!r} must be ip:port") from None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"{where}.address {value!r} is not one host's address")
    port = int(port_text)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
