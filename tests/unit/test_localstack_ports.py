"""`serve --workers N` listens on N consecutive ports; the local stack picks them where no outgoing
connection can take one between the check and the bind (the CI failure of 2026-12-06)."""

from __future__ import annotations

from extproc.localstack import _ephemeral_low, free_ports, port_free


def test_worker_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        base = free_ports(4)
        assert 10000 <= base and base + 3 < low  # connect() only assigns ports from `low` up
        assert all(port_free(p) for p in range(base, base + 4))
