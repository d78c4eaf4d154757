"""redis.mode / redis.nodes / redis.master_name: validated whole, naming the key, and the client each
mode opens (no network: clients connect on first use)."""

from __future__ import annotations

import pytest

from extproc import redis_connect
from extproc.config import ConfigError, parse
from extproc.redis_connect import RedisTarget, RedisTargetError

MODELS = {"m": {"pods": [{"name": "p", "address": "10.0.0.1:80"}]}}


def config(redis: dict, env: dict | None = None):
    return parse({"models": MODELS, "redis": redis}, env or {})


def test_single_is_the_url_as_before():
    cfg = config({"url": "redis://:pw@10.0.0.9:6380/2"})
    assert cfg.redis_target == RedisTarget("redis://:pw@10.0.0.9:6380/2")
    assert cfg.redis_url == "redis://:pw@10.0.0.9:6380/2"
    assert config({}).redis_target is None and config({}).redis_url is None


def test_cluster_and_sentinel_take_nodes_and_the_urls_credentials():
    cfg = config({"mode": "cluster", "nodes": ["10.0.0.1:7000", "[::1]:7001"], "url": "rediss://:pw@x/0"})
    assert cfg.redis_target == RedisTarget("rediss://:pw@x/0", "cluster", (("10.0.0.1", 7000), ("::1", 7001)))
    assert cfg.redis_url == "rediss://:pw@x/0"
    cfg = config({"mode": "sentinel", "nodes": "s1:26379,s2:26379", "master_name": "mymaster"})
    assert cfg.redis_target == RedisTarget("redis://s1:26379/0", "sentinel", (("s1", 26379), ("s2", 26379)),
                                           "mymaster")
    assert "pw" not in cfg.redis_target.describe() and "mymaster" in cfg.redis_target.describe()


def test_the_environment_sets_the_mode_nodes_and_master_name():
    cfg = config({}, {"EXTPROC_REDIS_MODE": "sentinel", "EXTPROC_REDIS_NODES": "10.0.0.5:26379",
                      "EXTPROC_REDIS_MASTER_NAME": "primary"})
    assert cfg.redis_target == RedisTarget("redis://10.0.0.5:26379/0", "sentinel", (("10.0.0.5", 26379),),
                                           "primary")


@pytest.mark.parametrize("redis, key", [
    ({"mode": "replicated", "url": "redis://x"}, "redis.mode"),
    ({"mode": "cluster"}, "redis.nodes"),
    ({"mode": "cluster", "nodes": ["10.0.0.1"]}, "redis.nodes"),
    ({"mode": "cluster", "nodes": ["10.0.0.1:99999"]}, "redis.nodes"),
    ({"mode": "cluster", "nodes": 7000}, "redis.nodes"),
    ({"mode": "cluster", "nodes": ["a:1"], "master_name": "m"}, "redis.master_name"),
    ({"mode": "cluster", "nodes": ["a:1"], "url": "redis://a:1/3"}, "redis.url"),
    ({"mode": "sentinel", "nodes": ["a:1"]}, "redis.master_name"),
    ({"mode": "sentinel", "nodes": ["a:1"], "master_name": "m", "url": "rediss://a:1/0"}, "redis.url"),
    ({"url": "redis://x", "nodes": ["a:1"]}, "redis.nodes"),
    ({"url": "redis://x", "master_name": "m"}, "redis.master_name"),
])
def test_a_bad_redis_topology_is_refused_naming_its_key(redis, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config(redis)


def test_each_mode_opens_its_client():
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    single = redis_connect.open_async("redis://127.0.0.1:1/0", timeout=0.5)
    assert type(single) is Redis
    cluster = redis_connect.open_async(RedisTarget("redis://:pw@h/0", "cluster", (("127.0.0.1", 1),)),
                                       timeout=0.5)
    assert isinstance(cluster, RedisCluster)
    assert type(redis_connect.pipeline(cluster)).__name__ == "ClusterPipeline"
    sentinel = redis_connect.open_async(RedisTarget("redis://:pw@h/0", "sentinel", (("127.0.0.1", 1),), "m"),
                                        timeout=0.5)
    assert type(sentinel.connection_pool).__name__ == "SentinelConnectionPool"
    assert sentinel.connection_pool.connection_kwargs["password"] == "pw"


def test_nodes_parse_and_refuse():
    assert redis_connect.parse_nodes(" a:1 , b:2") == (("a", 1), ("b", 2))
    with pytest.raises(RedisTargetError, match="redis.nodes"):
        redis_connect.parse_nodes(["a:1", ":2"])
