"""A benchmark killed with SIGKILL (as a CI timeout kills it) leaves no Envoy, gateway or upstream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from extproc.die_with_parent import popen

# A bench run: the upstream, Envoy alone, and the full path (gateway with its parser worker + Envoy).
PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from extproc.perf.stack import Stack

    with Stack(Path(sys.argv[1]), 20.0, "least-request", paths=("envoy", "full")):
        print("ready", flush=True)
        time.sleep(600)
""")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (command line, start time) of every process below `root`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = stat
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, started) in parents.items():
            if ppid == parent and pid not in found:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found[pid] = (cmd, started)
                frontier.append(pid)
    return found


def _alive(pid: int, started: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] == started and stat[1] != "Z"  # a zombie has stopped running


def test_children_die_with_a_bench_killed_by_sigkill(tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE,
                              start_new_session=True)
    children: dict[int, tuple[str, int]] = {}
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == b"ready", \
            "the stack did not start"
        children = _descendants(parent.pid)
        commands = " | ".join(cmd for cmd, _ in children.values())
        assert sum("envoy" in cmd for cmd, _ in children.values()) == 2, commands
        assert any(" serve " in cmd for cmd, _ in children.values()), commands
        assert any("extproc.perf.upstream" in cmd for cmd, _ in children.values()), commands
        assert any("multiprocessing" in cmd for cmd, _ in children.values()), commands  # parser worker
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while (left := [cmd for pid, (cmd, t) in children.items() if _alive(pid, t)]) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"still running after the parent was killed: {left}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid, (_, started) in {**children, **_descendants(parent.pid)}.items():
            if _alive(pid, started):  # this test failed: do not leave its processes behind either
                os.kill(pid, signal.SIGKILL)


def test_a_child_started_through_popen_dies_with_its_parent() -> None:
    """The mechanism alone: a parent starts `sleep`, is SIGKILLed, and the sleep goes too."""
    script = ("import sys, time; from extproc.die_with_parent import popen; "
              "p = popen(['sleep', '600']); print(p.pid, flush=True); time.sleep(600)")
    parent = popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    child, stat = 0, None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        stat = _stat(child)
        assert stat is not None and stat[0] == parent.pid
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child, stat[2]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(child, stat[2])
    finally:
        if parent.poll() is None:
            parent.kill()
        if stat is not None and _alive(child, stat[2]):  # failed: do not leave it behind
            os.kill(child, signal.SIGKILL)
