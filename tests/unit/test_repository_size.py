"""No large file is tracked outside docs/: a committed wheel once made up 62 % of the repository's pack
(10.6 MB, used by nothing). Tools come from PyPI through the extras; pictures live in docs/."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 1024 * 1024


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist or an image): nothing is tracked")
    return [name for name in out.stdout.decode().split("\0") if name]


def test_no_file_over_a_megabyte_outside_docs() -> None:
    large = []
    for name in tracked_files():
        path = ROOT / name
        if name.startswith("docs/") or not path.is_file():
            continue
        size = path.stat().st_size
        if size > LIMIT_BYTES:
            large.append(f"{name} ({size / 1e6:.1f} MB)")
    assert not large, f"files over 1 MB tracked outside docs/: {large}"
