"""Requests the usual clients do not send: HTTP/2 with prior knowledge and trailers, raw header bytes."""

from __future__ import annotations

import socket

import h2.config
import h2.connection
import h2.events


def h2_request(port: int, headers: list[tuple[str, str | bytes]], body: bytes,
               trailers: list[tuple[str, str]]) -> tuple[dict[str, str], bytes]:
    """One HTTP/2 (prior knowledge) request whose body is followed by trailers (header values may be
    bytes: sent as they are)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        conn.initiate_connection()
        conn.send_headers(1, headers)
        conn.send_data(1, body)
        conn.send_headers(1, trailers, end_stream=True)
        sock.sendall(conn.data_to_send())
        got_headers: dict[str, str] = {}
        data = b""
        while True:
            chunk = sock.recv(65536)
            assert chunk, "connection closed before the response ended"
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.ResponseReceived):
                    got_headers = {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    return got_headers, data
            sock.sendall(conn.data_to_send())
