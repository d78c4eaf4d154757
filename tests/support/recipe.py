"""docs/optimizer.md's profiling steps as a user types them: `extproc benchmark`, `extproc gen-profile`,
`extproc benchmark --admitted PROFILE`, `extproc gen-profile --admitted`, each a real subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from extproc.profiling.plan import LoadPlan


def extproc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"extproc {' '.join(args[:1])}: {result.stderr}"
    return result


def profile_gpu(endpoint: str, model: str, plan: LoadPlan, deployment: str, cost: float,
                slo_flags: list[str], out_dir: Path, output: str) -> None:
    """The four steps for one GPU type, the profile written to `output` (a file, or a redis:// URL)."""
    rates, first = out_dir / f"{deployment}.jsonl", out_dir / f"{deployment}.rate.json"
    admitted = out_dir / f"{deployment}.admitted.jsonl"
    extproc("benchmark", "-m", model, "--endpoint", endpoint, "-o", str(rates), *plan.flags())
    extproc("gen-profile", deployment, "--benchmark", str(rates), "--cost", str(cost), *slo_flags,
            "-o", str(first))
    extproc("benchmark", "-m", model, "--endpoint", endpoint, "-o", str(admitted), "--admitted", str(first),
            *plan.flags())
    extproc("gen-profile", deployment, "--benchmark", str(rates), "--admitted", str(admitted),
            "--cost", str(cost), *slo_flags, "-o", output)
