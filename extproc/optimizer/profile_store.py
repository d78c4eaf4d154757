"""The newest profile per deployment, from files and from Redis (`aibrix:profile_<model>_<deployment>`).

A profile names its deployment in "gpu" (AIBrix). The same deployment may have a file profile and a Redis
profile; the one with the newer `created` wins, so re-running gen-profile takes effect without a restart.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from extproc.optimizer.deployments import Deployment
from extproc.profiles import Profile, ProfileError, load_profile, parse_profile, profile_key_prefix

log = logging.getLogger(__name__)


def _glob_escape(text: str) -> str:
    """A model name taken literally in a Redis MATCH pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


class ProfileStore:
    def __init__(self) -> None:
        self._files: dict[str, Profile] = {}  # gpu -> profile, whatever the model
        self._redis: dict[str, dict[str, Profile]] = {}  # model -> gpu -> profile
        self._refused: set[tuple[str, str]] = set()  # (source, message) already logged

    def _refuse(self, source: str, error: Exception) -> None:
        if (source, str(error)) not in self._refused:
            self._refused.add((source, str(error)))
            log.warning("profile refused: %s: %s", source, error)

    def load_files(self, paths: Iterable[str | Path]) -> list[str]:
        """Read profile files; returns the errors (also logged) so a CLI can fail on them."""
        errors = []
        for path in paths:
            try:
                p = load_profile(path)
            except ProfileError as e:
                errors.append(str(e))
                self._refuse(str(path), e)
                continue
            self._offer(self._files, p)
        return errors

    @staticmethod
    def _offer(table: dict[str, Profile], p: Profile) -> None:
        old = table.get(p.gpu)
        if old is None or p.created >= old.created:
            table[p.gpu] = p

    def offer_redis(self, model: str, key: str, raw: Any) -> None:
        try:
            data = json.loads(raw)
            p = parse_profile(data)
        except (ValueError, TypeError) as e:  # ProfileError and JSONDecodeError are ValueErrors
            self._refuse(key, e)
            return
        self._offer(self._redis.setdefault(model, {}), p)

    def profile_for(self, d: Deployment) -> Profile | None:
        """The newest profile for the deployment, renamed to its `namespace/name` key for the plan."""
        candidates = [t.get(n) for t in (self._files, self._redis.get(d.model, {})) for n in (d.key, d.name)]
        found = [p for p in candidates if p is not None]
        if not found:
            return None
        best = max(found, key=lambda p: p.created)
        return dataclasses.replace(best, gpu=d.key)

    async def refresh_redis(self, redis: Any, models: Iterable[str]) -> int:
        """SCAN each model's profile keys and take what is newer; returns how many keys were read."""
        n = 0
        for model in models:
            pattern = f"{_glob_escape(profile_key_prefix(model))}*"
            keys = [k async for k in redis.scan_iter(match=pattern, count=100)]
            if not keys:
                continue
            for key, raw in zip(keys, await redis.mget(keys)):
                if raw is not None:
                    self.offer_redis(model, key.decode() if isinstance(key, bytes) else key, raw)
                    n += 1
        return n
