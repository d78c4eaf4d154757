"""The team's shared test data (AIBrix's profiles and benchmark files), read by tests only.

Where it is: $SHARED_DATA if set, else `shared/data` beside the checkout (the team's layout). A test that
needs it fails with this message when it is missing: the data is part of the suite, not optional.
"""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(os.environ.get("SHARED_DATA") or Path(__file__).resolve().parents[3] / "shared" / "data")
AIBRIX_DATA = _ROOT / "aibrix"
A40_PROFILE = AIBRIX_DATA / "simulator-llama2-7b-a40.json"

if not AIBRIX_DATA.is_dir():
    raise FileNotFoundError(f"the shared test data is missing: {AIBRIX_DATA} (set SHARED_DATA to its folder)")
