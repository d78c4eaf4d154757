"""The team's shared test data (AIBrix's profiles and benchmark files), read by tests only.

Where it is: $SHARED_DATA if set, else `shared/data` beside the checkout (the team's layout), else the
team machine's /work/shared/data (a clone elsewhere, as CI's may be). A test that needs it fails with
this message when it is missing: the data is part of the suite, not optional.
"""

from __future__ import annotations

import os
from pathlib import Path

_CANDIDATES = [Path(p) for p in (os.environ.get("SHARED_DATA"),) if p] + [
    Path(__file__).resolve().parents[3] / "shared" / "data", Path("/work/shared/data")]
_ROOT = next((p for p in _CANDIDATES if (p / "aibrix").is_dir()), _CANDIDATES[0])
AIBRIX_DATA = _ROOT / "aibrix"
A40_PROFILE = AIBRIX_DATA / "simulator-llama2-7b-a40.json"

if not AIBRIX_DATA.is_dir():
    raise FileNotFoundError(f"the shared test data is missing: looked in {', '.join(map(str, _CANDIDATES))} "
                            "(set SHARED_DATA to its folder)")
