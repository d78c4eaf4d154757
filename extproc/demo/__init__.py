"""`extproc demo`: the heterogeneous before/after demo (run: python -m extproc.demo)."""
