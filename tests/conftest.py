import os

# tests/interop needs AIBrix's own virtualenv: `make interop` builds it and sets AIBRIX_PYTHON.
collect_ignore = [] if os.environ.get("AIBRIX_PYTHON") else ["interop"]
