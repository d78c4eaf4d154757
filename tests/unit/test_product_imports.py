"""The gateway and the optimizer stand apart from the tools: importing the product (the ext_proc server,
the optimizer service, the CLI's parser) loads none of the tools' packages (the engine simulator, the
fleet simulation, the benchmarks, the profiling tools, the demo) and nothing of the `tools` extra
(matplotlib, tqdm), which the images do not install; and a tool missing that extra says what to install."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRODUCT = ("extproc.server.app", "extproc.server.supervisor", "extproc.optimizer.service",
           "extproc.optimizer.cli", "extproc.routing", "extproc.slo", "extproc.state", "extproc.ratelimit")
TOOLS = ("extproc.sim", "extproc.fleetsim", "extproc.perf", "extproc.profiling", "extproc.demo",
         "extproc.localstack", "extproc.score_cli")
EXTRA = ("matplotlib", "tqdm")


def loaded_after(code: str) -> set[str]:
    listing = "import json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", f"{code}\n{listing}"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return set(json.loads(out.splitlines()[-1]))


def under(modules: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == r or m.startswith(r + ".") for r in roots))


def test_the_product_imports_no_tool_and_nothing_of_the_tools_extra() -> None:
    modules = loaded_after("\n".join(f"import {m}" for m in PRODUCT))
    assert "extproc.server.app" in modules and "extproc.optimizer.service" in modules
    assert under(modules, TOOLS) == []
    assert under(modules, EXTRA) == []


def test_building_the_cli_loads_nothing_of_the_tools_extra() -> None:
    # `extproc serve` builds the whole parser: the tools' commands register without their extra
    modules = loaded_after("from extproc.cli import build_parser\nbuild_parser()")
    assert "extproc.fleetsim.cli" in modules  # the tools' commands did register
    assert under(modules, EXTRA) == []


def test_a_tool_without_the_extra_says_what_to_install(monkeypatch, capsys) -> None:
    from extproc import cli, extras

    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(extras.importlib, "import_module", missing)
    with pytest.raises(extras.ToolsMissing, match=r"^tqdm is not installed.*pip install 'extproc\[tools\]'"):
        extras.tqdm()
    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(extras.pyplot))
    assert cli.main(["plot"]) == 1
    assert capsys.readouterr().err.startswith("extproc plot: matplotlib is not installed")


def _parser_running(func):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("plot").set_defaults(func=lambda args: func())
    return parser
