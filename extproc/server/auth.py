"""Optional client authentication: `Authorization: Bearer <key>` checked against a set of API keys.

Off unless keys are configured (`gateway.api_keys_file`, one key per line, `#` comments; or the
EXTPROC_API_KEYS variable, comma-separated). Only SHA-256 digests are kept in memory, compared in
constant time against every key, and no key or presented token is ever logged or echoed. The file is
re-read when it changes (`reload_if_changed`, from the config watcher), so keys rotate without a restart;
an unreadable file keeps the previous keys.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from pathlib import Path

from extproc.config.keys import read_keys
from extproc.openai import OpenAIError

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, path: Path | None = None, env_keys: Iterable[str] = ()) -> None:
        self._path = path
        self._env = list(env_keys)  # EXTPROC_API_KEYS, read by the config loader
        self._stamp: tuple[int, int] | None = None
        self._digests: tuple[bytes, ...] = ()
        self._set(self._env)
        if path is not None:
            self._stamp = self._file_stamp()
            self._set([*self._env, *read_keys(path)])  # unreadable at start: the config is refused

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def _set(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self._path.stat()  # type: ignore[union-attr]
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def reload_if_changed(self) -> bool:
        if self._path is None or (stamp := self._file_stamp()) == self._stamp or stamp is None:
            return False
        try:
            keys = read_keys(self._path)
        except OSError as exc:
            log.error("API keys file %s unreadable, keeping the previous keys: %s", self._path, exc.strerror)
            return False
        self._stamp = stamp
        self._set([*self._env, *keys])
        log.info("API keys reloaded from %s: %d keys", self._path, len(self._digests))
        return True

    def check(self, authorization: str | None) -> None:
        """Raise a 401 unless the header carries a configured key (always passes when none is)."""
        if not self._digests:
            return
        scheme, _, token = (authorization or "").strip().partition(" ")
        presented = _digest(token.strip()) if scheme.lower() == "bearer" else b""
        ok = False
        for digest in self._digests:  # no early exit: the time taken says nothing about which key
            ok |= hmac.compare_digest(digest, presented)
        if not ok:
            raise OpenAIError(401, "Invalid or missing API key: send Authorization: Bearer <key>",
                              code="invalid_api_key", headers=(("www-authenticate", "Bearer"),))
