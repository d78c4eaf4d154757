"""Where SLO routing's profiles come from: files named in config and Redis (`aibrix:profile_<model>_<dep>`),
the newer `created` winning; a pod's deployment from config, else its labels. And the Process coroutine:
a queued stream cancelled by its client leaves the queue."""

from __future__ import annotations

import asyncio
import json

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, HttpHeaders, ProcessingRequest

from extproc.config import parse
from extproc.gpu_profiles import ProfileStore
from extproc.pool import Pod
from extproc.pool.pod import deployment_of
from extproc.server.gateway import Gateway
from extproc.server.processor import Processor
from extproc.slo.refresh import SloRefresh
from extproc.slo.state import learned
from tests.support.ext_proc import stream_replies
from tests.support.get_pipeline import GetPipeline


def raw_profile(gpu: str, created: float, tput: float) -> dict:
    return {"gpu": gpu, "cost": 1.0, "tputs": [[tput]], "indexes": [[8], [128]], "e2e": [[1.0]],
            "slos": {"e2e": 10}, "created": created}


class FakeRedis:
    """smembers + mget over a dict: the two calls ProfileStore.refresh_redis makes (no SCAN)."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data = data

    async def smembers(self, key: str) -> set[bytes]:
        return set()  # nothing indexed: AIBrix-written profiles are found by their deployments' keys

    async def mget(self, keys):
        return [self.data.get(k) for k in keys]

    def pipeline(self, transaction: bool = False) -> GetPipeline:
        return GetPipeline(self)


def gateway(tmp_path, file_created: float) -> Gateway:
    path = tmp_path / "dep.json"
    path.write_text(json.dumps(raw_profile("dep", file_created, tput=1.0)))
    cfg = {"models": {"m": {"pods": [
        {"name": "a", "address": "10.0.0.1:8000", "deployment": "dep"},
        {"name": "b", "address": "10.0.0.2:8000", "labels": {"app.kubernetes.io/name": "other"}}]}},
        "routing": {"default_strategy": "slo-least-load-pulling", "slo": {"profiles": [str(path)]}}}
    return Gateway(parse(cfg, {}))


@pytest.mark.parametrize(("file_created", "winner_tput"), [(1.0, 4.0), (3.0, 1.0)])
def test_newer_created_wins_between_file_and_redis(tmp_path, file_created, winner_tput):
    gw = gateway(tmp_path, file_created)
    redis = FakeRedis({"aibrix:profile_m_dep": json.dumps(raw_profile("dep", 2.0, tput=4.0)),
                       "aibrix:profile_m_other": json.dumps(raw_profile("other", 2.0, tput=8.0)),
                       "aibrix:profile_x_dep": json.dumps(raw_profile("dep", 9.0, tput=99.0))})
    asyncio.run(SloRefresh(gw).refresh_profiles(ProfileStore(), redis))
    table = learned(gw.router.state.store).table("m")
    assert set(table) == {"dep", "other"}           # "other" found through the pod's label
    assert table["dep"].profile.tputs[0][0] == winner_tput
    assert table["other"].profile.tputs[0][0] == 8.0


def test_deployment_rule():
    assert deployment_of(Pod("m", "p", "10.0.0.1:1", deployment="cfg",
                             labels={"app.kubernetes.io/name": "app"})) == "cfg"
    both = {"orchestration.aibrix.ai/raycluster-fleet-name": "fleet", "app.kubernetes.io/name": "app"}
    assert deployment_of(Pod("m", "p", "10.0.0.1:1", labels=both)) == "fleet"
    assert deployment_of(Pod("m", "p", "10.0.0.1:1", labels={"app.kubernetes.io/name": "app"})) == "app"


def test_utilization_metric(tmp_path):
    gw = gateway(tmp_path, 5.0)
    asyncio.run(SloRefresh(gw).refresh_profiles(ProfileStore(), None))
    from extproc.openai import Request
    gw.route(Request(model="m", path="/v1/chat/completions", prompt_tokens=100, max_tokens=8),
             gw.profile(None, "m"), "r1")
    assert gw.registry.get_sample_value("extproc_slo_utilization", {"model": "m", "deployment": "dep"}) \
        == pytest.approx(1.0)   # tput 1 x e2e 1: one request fills a pod


def _msgs():
    pairs = {":path": "/v1/chat/completions", ":method": "POST", "x-request-id": "q"}
    yield ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])))
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    yield ProcessingRequest(request_body=HttpBody(body=json.dumps(body).encode(), end_of_stream=True))


def test_client_gone_while_queued_leaves_the_queue(tmp_path):
    async def main():
        gw = gateway(tmp_path, 5.0)
        await SloRefresh(gw).refresh_profiles(ProfileStore(), None)
        from extproc.openai import Request
        r = Request(model="m", path="/v1/chat/completions", prompt_tokens=100, max_tokens=8)
        gw.route(r, gw.profile(None, "m"), "r1")        # pod a full (one request fills it)
        replies = []

        async def requests():
            for m in _msgs():
                yield m

        async def consume():
            async for reply in stream_replies(Processor(gw), requests()):
                replies.append(reply)

        task = asyncio.create_task(consume())
        deadline = asyncio.get_running_loop().time() + 5
        while learned(gw.router.state.store).queues.length("m") != 1:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.005)
        assert len(replies) == 1 and gw.open_streams == 1   # headers answered, the body waits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert learned(gw.router.state.store).queues.length("m") == 0 and gw.open_streams == 0
        assert len(gw.open) == 1
        assert gw.registry.get_sample_value("extproc_requests_total", {
            "model": "", "pod": "", "strategy": "slo-least-load-pulling", "code": "aborted"}) == 1
    asyncio.run(main())

