"""The `tools` extra: the plots and progress bars of the tools (fleet-sim, the benchmark, the demo, the
bench) need matplotlib and tqdm, which the gateway and optimizer images do not install
(`pip install .`; `make setup` installs `.[test]`, which includes `tools`). A tool run without them
stops with one line saying what to install, not a traceback."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

INSTALL = "pip install 'extproc[tools]'"


class ToolsMissing(RuntimeError):
    """A tool needs a package of the `tools` extra that is not installed."""


def _module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ToolsMissing(f"{name.split('.')[0]} is not installed; it comes with the tools extra "
                           f"({INSTALL})") from e


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: files only, no display (servers, CI, worker processes)."""
    matplotlib = _module("matplotlib")
    matplotlib.use("Agg")
    return _module("matplotlib.pyplot")


def tqdm() -> Any:
    """tqdm's progress bar class."""
    return _module("tqdm").tqdm
