"""Envoy configured as a gateway configures an InferencePool (`extproc envoy-config --pool`: full-duplex
body with trailers, `envoy.lb` metadata both ways, the ordered endpoint list retried, the served endpoint
reported), our picker behind it, and engine-sims as the pool's pods: what the conformance cases run on."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.envoy_bootstrap import BootstrapOptions
from extproc.envoy_pool import PoolOptions, render_pool
from extproc.localstack import LocalStack, Proc, free_port, http_get, port_open, start_envoy
from tests.integration.sim_fixtures import SimProcess, running_sims

MODEL = "llama2-7b"
SIM_ARGS = ["--gpu", "H100", "--model", MODEL, "--time-scale", "50"]
GREEDY = "greedy"  # a user whose budget is one request a minute: the second is shed (429)


@dataclass
class Pool:
    """The data plane (Envoy) in front of the picker (our gateway) and the pool's pods (engine-sims)."""
    picker: LocalStack
    sims: list[SimProcess]
    envoys: list[Proc] = field(default_factory=list)
    url: str = ""  # the data plane every case sends to (full duplex, the subset hint from a header)
    admins: dict[str, int] = field(default_factory=dict)  # each data plane's URL -> its admin port

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.sims[i].port}"

    def served(self, i: int) -> float:
        """Requests the i-th pod finished (its own counter)."""
        text = http_get(self.sims[i].url + "/metrics")[1].decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:request_success_total")

    def accounted(self, i: int, code: str = "200") -> float:
        """Requests the picker accounts to the i-th pod, ended with `code`."""
        return self.picker.sample("extproc_requests_total", pod=f"pod-{i}", code=code)

    def running(self) -> float:
        """The picker's own in-flight count over the pool (exact: not the cached views routing reads)."""
        return self.picker.sample("extproc_pod_local_running_requests", model=MODEL)

    def envoy(self, log_dir: Path, name: str, extproc_port: int, **pool: object) -> str:  # noqa: D417
        """Another data plane in front of these pods (its own ports); its URL."""
        listen, admin = free_port(), free_port()
        options = BootstrapOptions(listen_port=listen, extproc_port=extproc_port, admin_port=admin)
        pods = tuple(self.address(i) for i in range(len(self.sims)))
        proc = start_envoy(name, render_pool(options, PoolOptions(pods=pods, **pool)),  # type: ignore[arg-type]
                           log_dir)
        self.envoys.append(proc)
        proc.wait_ready(lambda: port_open(listen))
        url = f"http://127.0.0.1:{listen}"
        self.admins[url] = admin
        return url

    def envoy_stat(self, url: str, name: str) -> int:
        """One of Envoy's counters, by its full name (0 before it first counts)."""
        text = http_get(f"http://127.0.0.1:{self.admins[url]}/stats?filter=^{name}$")[1].decode()
        return sum(int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if k == name)


@pytest.fixture(scope="package")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    log_dir = tmp_path_factory.mktemp("conformance")
    with running_sims(SIM_ARGS, log_dir, 3) as sims:
        picker = LocalStack(config_path=log_dir / "gateway.yaml", log_dir=log_dir)
        picker.write_config({
            "models": {MODEL: {"pods": [{"name": f"pod-{i}", "address": f"127.0.0.1:{s.port}"}
                                        for i, s in enumerate(sims)]},
                       "no-pods": {"pods": []}},
            # scraped once at the start, then rarely: an outage a case starts stays unseen by the
            # picker, as one that starts between two scrapes would
            "telemetry": {"refresh_seconds": 30},
            "rate_limits": {"key_by": "user", "overrides": [{"user": GREEDY, "requests_per_minute": 1}]},
        })
        picker.start_gateway()
        p = Pool(picker, sims)
        try:
            p.url = p.envoy(log_dir, "envoy-pool", picker.extproc_port, subset_from_header=True)
            yield p
        finally:
            for proc in p.envoys:
                proc.stop()
            picker.stop()
