"""An HTTP/1.1 request whose body goes out in pieces, apart in time (chunked, optionally with trailers), over
a plain socket: what a client streaming its upload looks like to Envoy, which no library client makes on
demand."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass


@dataclass(slots=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def post_in_pieces(port: int, path: str, body: bytes, *, piece: int = 2048, gap_s: float = 0.005,
                   trailers: dict[str, str] | None = None, content_length: bool = False,
                   headers: dict[str, str] | None = None, timeout: float = 15.0) -> Reply:
    """POST `body` to 127.0.0.1:`port` in `piece`-byte writes `gap_s` apart: chunked (with `trailers`),
    or with a content-length (the writes still apart). Reads the whole reply (connection: close)."""
    head = [f"POST {path} HTTP/1.1", f"host: 127.0.0.1:{port}", "content-type: application/json",
            "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    head.append(f"content-length: {len(body)}" if content_length else "transfer-encoding: chunked")
    if trailers and not content_length:
        head.append("trailer: " + ", ".join(trailers))
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            for i in range(0, len(body), piece):
                part = body[i:i + piece]
                sock.sendall(part if content_length else b"%x\r\n%s\r\n" % (len(part), part))
                time.sleep(gap_s)
            if not content_length:
                tail = "".join(f"{k}: {v}\r\n" for k, v in (trailers or {}).items())
                sock.sendall(f"0\r\n{tail}\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered before the body was all sent (a 413): the answer is read below
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            if not data:
                raise
    head_raw, _, rest = data.partition(b"\r\n\r\n")
    lines = head_raw.decode("latin-1").split("\r\n")
    reply_headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if reply_headers.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return Reply(int(lines[0].split()[1]), reply_headers, rest)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return out
