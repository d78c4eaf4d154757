"""Presets, overrides, fleet files and CLI flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from extproc.sim import cli
from extproc.sim.faults import FaultConfig, decide
from extproc.sim.fleet import load_fleet, parse_fleet
from extproc.sim.gpus import GPUS, get_gpu, override, parse_overrides
from extproc.sim.models import MODELS, get_model
from extproc.sim.replica import ReplicaSpec

FLEETS = Path(__file__).parents[3] / "extproc" / "sim" / "fleets"


def test_required_presets_exist_and_are_sane() -> None:
    for name in (
        "V100",
        "T4",
        "A10",
        "L4",
        "L20",
        "A40",
        "A100-40GB",
        "A100-80GB",
        "H100",
        "H200",
        "B100",
        "B200",
    ):
        g = GPUS[name]
        assert g.memory_gb > 0 and g.bandwidth_gbps > 0 and g.tflops > 0 and g.price_per_hour > 0
    for name in ("llama2-7b", "deepseek-coder-7b", "llama3-8b", "llama3-70b"):
        assert MODELS[name].kv_bytes_per_token > 0
    assert get_gpu("a100") is GPUS["A100-80GB"]
    # Llama 3.1 is Llama 3's weights and KV layout with a 16x longer context, not an alias of it.
    l31, l3 = get_model("Meta-Llama/Llama-3.1-8B-Instruct"), get_model("llama3-8b")
    assert l31.name == "llama3.1-8b" and l31.max_model_len == 131072
    assert get_model("llama-3.1-70b").max_model_len == 131072
    assert (l31.params_b, l31.kv_bytes_per_token) == (l3.params_b, l3.kv_bytes_per_token)
    with pytest.raises(KeyError):
        get_gpu("A10G")  # about half an A10's tensor throughput: not an alias
    assert GPUS["H100"].bandwidth_gbps / GPUS["A100-80GB"].bandwidth_gbps == pytest.approx(1.64, abs=0.01)
    with pytest.raises(KeyError):
        get_gpu("GTX-480")


def test_overrides_are_typed_and_checked() -> None:
    g = override(get_gpu("A100"), parse_overrides(["bandwidth_gbps=1500", "price_per_hour=2"]))
    assert g.bandwidth_gbps == 1500.0 and g.price_per_hour == 2.0 and g.name == "A100-80GB"
    with pytest.raises(KeyError):
        override(g, {"bandwith": 1})
    with pytest.raises(ValueError):
        parse_overrides(["novalue"])
    spec = ReplicaSpec(
        gpu="A100", gpu_overrides={"bandwidth_gbps": "1000"}, engine_overrides={"max_num_seqs": "8"}
    )
    engine = spec.build_engine()
    assert engine.perf.gpu.bandwidth_gbps == 1000 and engine.config.max_num_seqs == 8


def test_example_fleet_loads() -> None:
    specs = load_fleet(FLEETS / "mixed.yaml")
    assert len({s.gpu for s in specs}) >= 3 and len({s.port for s in specs}) == len(specs)
    flaky = next(s for s in specs if s.faults.error_rate)
    assert flaky.faults.error_status == 503 and flaky.model == "llama2-7b"


def test_fleet_validation() -> None:
    with pytest.raises(ValueError):
        parse_fleet({"replicas": []})
    with pytest.raises(ValueError):
        parse_fleet(
            {"replicas": [{"name": "a", "gpu": "A100", "port": 1}, {"name": "a", "gpu": "L4", "port": 2}]}
        )
    with pytest.raises(KeyError):
        parse_fleet({"replicas": [{"name": "a", "gpu": "A100", "port": 1, "faults": {"explode": 1}}]})
    with pytest.raises(KeyError):
        parse_fleet({"replicas": [{"name": "a", "gpu": "A100", "port": 1, "colour": "red"}]})
    specs = parse_fleet(
        {
            "defaults": {"model": "llama3-8b", "faults": {"error_rate": 0.1}},
            "replicas": [{"name": "a", "gpu": "H100", "port": 1, "faults": {"error_status": 503}}],
        }
    )
    assert specs[0].model == "llama3-8b" and specs[0].faults == FaultConfig(error_rate=0.1, error_status=503)


def test_cli_flags_become_a_spec() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--gpu",
            "L20",
            "--model",
            "llama3-8b",
            "--port",
            "9000",
            "--time-scale",
            "50",
            "--engine",
            "sglang",
            "--gpu-override",
            "bandwidth_gbps=900",
            "--max-num-seqs",
            "32",
            "--error-rate",
            "0.5",
            "--error-status",
            "503",
            "--abort-after-tokens",
            "3",
            "--stall-after-tokens",
            "2",
            "--stall-seconds",
            "1",
            "--no-enable-prefix-caching",
            "--slow-start-seconds",
            "4",
            "--refuse-connections",
            "reset",
            "--kv-pressure",
            "0.8",
        ]
    )
    (spec,) = cli.specs_from_args(args)
    assert (spec.gpu, spec.model, spec.port, spec.time_scale, spec.engine) == (
        "L20",
        "llama3-8b",
        9000,
        50,
        "sglang",
    )
    assert spec.gpu_overrides == {"bandwidth_gbps": "900"}
    assert spec.engine_overrides == {"max_num_seqs": 32, "enable_prefix_caching": False}
    f = spec.faults
    assert (f.error_rate, f.error_status, f.abort_after_tokens, f.stall_after_tokens) == (0.5, 503, 3, 2)
    assert (f.slow_start_seconds, f.refuse_connections, f.kv_pressure) == (4, "reset", 0.8)
    assert spec.build_engine().kv_cache_usage >= 0.8


def test_fault_decisions_are_seeded() -> None:
    import random

    cfg = FaultConfig(error_rate=0.3, abort_prob=0.3)
    first = [decide(cfg, rng, 100) for rng in [random.Random(7)] for _ in range(50)]
    again = [decide(cfg, rng, 100) for rng in [random.Random(7)] for _ in range(50)]
    assert first == again
    r = random.Random(1)
    outcomes = [decide(cfg, r, 100) for _ in range(2000)]
    errors = sum(o.error_status is not None for o in outcomes)
    assert 450 < errors < 750
    with pytest.raises(ValueError):
        FaultConfig(error_status=404)


def test_a_stall_needs_its_position() -> None:
    with pytest.raises(ValueError, match="stall_after_tokens"):
        FaultConfig(stall_seconds=2.0)  # would silently do nothing
    with pytest.raises(ValueError):
        FaultConfig.from_dict({"stall_after_tokens": -1, "stall_seconds": 1.0})
    assert FaultConfig(stall_after_tokens=0, stall_seconds=1.0).stall_after_tokens == 0
