"""py-spy around a benchmark run: where a gateway process spends its time under a given load.

`py-spy record --format raw` writes collapsed stacks (one "frame;frame;... count" line per distinct
stack); `top_frames` folds them into self and inclusive shares per function, which is what the
benchmark prints and the docs quote.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from extproc.die_with_parent import popen

_LINE_NO = re.compile(r":\d+\)$")


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter, or on PATH."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


@dataclass
class Recording:
    proc: subprocess.Popen[bytes]
    path: Path

    def wait(self, timeout: float = 30.0) -> Path | None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()
        return self.path if self.path.exists() else None


def record(pid: int, seconds: float, path: Path, native: bool = False) -> Recording | None:
    """Start sampling `pid` for `seconds` (100 Hz, without pausing it); None without py-spy."""
    exe = py_spy()
    if exe is None:
        return None
    args = [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", "100",
            "--nonblocking", "--format", "raw", "--output", str(path)]
    if native:
        args.append("--native")
    return Recording(popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path)


def _frame(text: str) -> str:
    return _LINE_NO.sub(")", text.strip())


def top_frames(collapsed: str, n: int = 12) -> list[tuple[str, float, float]]:
    """(function, self share, inclusive share) of the `n` functions with the most inclusive time.

    Shares are of the samples py-spy kept (it drops idle threads by default); a function is
    "name (file)", line numbers folded.
    """
    self_count: Counter[str] = Counter()
    incl_count: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        # With --threads / --subprocesses py-spy adds "thread (...)" / "process ..." pseudo-frames.
        frames = [_frame(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        k = int(count)
        total += k
        self_count[frames[-1]] += k
        for f in set(frames):
            incl_count[f] += k
    if not total:
        return []
    return [(f, self_count[f] / total, c / total) for f, c in incl_count.most_common(n)]


def top_self(collapsed: str, n: int = 12) -> list[tuple[str, float]]:
    """The `n` functions with the most self time (share of non-idle samples)."""
    rows = top_frames(collapsed, n=10_000)
    return sorted(((f, s) for f, s, _ in rows), key=lambda r: -r[1])[:n]
