"""Interop tests run a peer's own package (AIBrix from PyPI) on our inputs.

`make interop` builds that package's virtualenv and points AIBRIX_PYTHON at its interpreter;
the tests call it in a subprocess so its pinned dependencies never meet ours.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def aibrix_python() -> Path:
    python = Path(os.environ["AIBRIX_PYTHON"])
    assert python.exists(), f"AIBRIX_PYTHON={python} does not exist: run `make interop`"
    return python
