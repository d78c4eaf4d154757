"""`serve --workers N` listens on N consecutive ports; the local stack picks them, and every single
port (Envoy's, the gateway's, Redis's), where no outgoing connection can take one between the check
and the bind (the CI failure of 2026-12-06; Envoy's listener, 2026-12-07)."""

from __future__ import annotations

from extproc.localstack import _ephemeral_low, free_port, free_ports, port_free


def test_worker_ports_are_free_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        base = free_ports(4)
        assert 10000 <= base and base + 3 < low  # connect() only assigns ports from `low` up
        assert all(port_free(p) for p in range(base, base + 4))


def test_single_ports_are_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(300)]  # a stack takes four before it binds any
    assert all(10000 <= p < low for p in ports)
    assert len(set(ports)) == len(ports)
    block = free_ports(4)
    assert not set(ports) & set(range(block, block + 4))  # nor inside a block of consecutive ones
