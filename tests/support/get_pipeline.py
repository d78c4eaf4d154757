"""A fake Redis client's pipeline of GETs: the readers fetch AIBrix's keys one by one (cluster-safe), and
the unit tests' fakes answer them with their own `mget`."""

from __future__ import annotations


class GetPipeline:
    def __init__(self, redis) -> None:  # noqa: ANN001  (any fake with an async mget)
        self.redis, self.keys = redis, []

    def get(self, key: str) -> None:
        self.keys.append(key)

    async def execute(self) -> list:
        return await self.redis.mget(self.keys)
