"""The API key file's format: one key per line, `#` comments (read at load and on rotation)."""

from __future__ import annotations

from pathlib import Path


def read_keys(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]
