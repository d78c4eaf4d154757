"""`extproc optimizer`: re-plans every model every 10 s and serves the result to PodAutoscalers (aiohttp).

Routes (AIBrix's gpu_optimizer/app.py, so an AIBrix PodAutoscaler works unchanged):
    GET    /metrics/<namespace>/<deployment>   vllm:deployment_replicas in hundredths of a replica
    GET    /metrics                            the optimizer's own (plan cost, solve time, ...; metrics.py)
    PUT    /scale/<namespace>/<deployment>     {"replicas": N} pins it; -1 clears the model's overrides
    POST   /monitor/<namespace>/<deployment>   watch it (again); a body {"model": ...} adds a new one; with
                                               Kubernetes discovery the Deployment must exist (AIBrix)
    DELETE /monitor/<namespace>/<deployment>   stop watching it
    GET    /dash/<model>, /dash/<model>/data   the dashboard and its JSON
    GET    /healthz
Errors are OpenAI-style JSON bodies with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from extproc.cancellation import raise_if_cancelled
from extproc.gpu_profiles import ProfileStore
from extproc.openai import OpenAIError
from extproc.optimizer.dashboard import dashboard_data, render_page
from extproc.optimizer.deployments import CheckedSource, ConfigError, DeploymentSource, parse_deployment
from extproc.optimizer.metrics import optimizer_registry
from extproc.optimizer.monitor import Fleet, ModelState, NotMonitored
from extproc.optimizer.planning import PlanSettings, limits_of, plan_demands, plan_model
from extproc.optimizer.policy import PlanPolicy
from extproc.optimizer.traces import read_windows
from extproc.optimizer.workload import DEFAULT_WINDOW_SECONDS, READ_SPAN
from extproc.slo.fleet_factors import encode, factors_key, ttl_seconds

log = logging.getLogger(__name__)

REPLICA_UNITS = 100  # the metric is in hundredths of a replica: a PodAutoscaler targets "100"


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    interval: float = 10.0  # re-plan period
    window_seconds: float = DEFAULT_WINDOW_SECONDS
    profile_refresh: float = 10.0
    io_timeout: float = 5.0  # any one Redis or source call
    refresh_ms: int = 2000  # the dashboard's own refresh
    policy: PlanPolicy = PlanPolicy()  # the plan's constants (the config's `planning:` section)

    def resolved(self) -> PlanPolicy:
        return self.policy.resolved(self.interval, self.window_seconds)


def metrics_text(model: str, value: int) -> str:
    """AIBrix's exposition, byte for byte."""
    label = model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return (
        "# HELP vllm:deployment_replicas Number of suggested replicas.\n"
        "# TYPE vllm:deployment_replicas gauge\n"
        f'vllm:deployment_replicas{{model_name="{label}"}} {value}\n'
    )


def _error(e: OpenAIError) -> web.Response:
    return web.Response(status=e.status, body=e.body(), content_type="application/json")


def not_found(message: str, code: str = "not_found") -> OpenAIError:
    return OpenAIError(404, message, type="not_found_error", code=code)


class OptimizerService:
    def __init__(
        self,
        source: DeploymentSource,
        store: ProfileStore,
        redis: Any | None = None,
        settings: ServiceSettings = ServiceSettings(),
        clock: Callable[[], float] = time.time,
        profile_files: Callable[[], Iterable[str | Path]] = tuple,
    ) -> None:
        self.source = source
        self.store = store
        self.profile_files = profile_files
        self.redis = redis
        self.settings = settings
        self.clock = clock
        self.policy = settings.resolved()
        self.fleet = Fleet(self.policy.feedback)
        self.registry = optimizer_registry(self.fleet, lambda: self.clock())
        self._last_profiles = -float("inf")

    # --- background work -------------------------------------------------------------------------------

    async def _guarded(self, what: str, work: Awaitable[Any]) -> bool:
        try:
            await asyncio.wait_for(work, self.settings.io_timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a failed refresh degrades the plan's inputs, never the endpoint
            log.warning("%s failed: %s: %s", what, type(e).__name__, e)
            return False

    async def refresh_deployments(self) -> None:
        self.fleet.sync(await self.source.deployments())

    async def refresh_profiles(self) -> None:
        self.store.load_files(self.profile_files())  # cheap, and a regenerated file takes effect
        if self.redis is not None:
            await self.store.refresh_redis(self.redis, {model: [d.name for d in state.deployments.values()]
                                                        for model, state in self.fleet.models.items()})

    async def tick(self, now: float | None = None) -> None:
        """One cycle: deployments, profiles (every profile_refresh s), then a re-plan of every model."""
        now = self.clock() if now is None else now
        await self._guarded("deployment refresh", self.refresh_deployments())
        if now - self._last_profiles >= self.settings.profile_refresh:
            if await self._guarded("profile refresh from Redis", self.refresh_profiles()):
                self._last_profiles = now
        for state in list(self.fleet.models.values()):
            await self.replan(state, now)

    def profiles_of(self, state: ModelState) -> dict[str, Any]:
        return {k: self.store.profile_for(d.model, d.namespace, d.name) for k, d in state.deployments.items()}

    async def replan(self, state: ModelState, now: float) -> None:
        profiles = [p for p in self.profiles_of(state).values() if p is not None]
        if self.redis is None:  # no traces to read: the workload set on the state (tests)
            result = await asyncio.to_thread(plan_demands, state.demands, profiles,
                                             {k: state.reported(k) for k in state.deployments},
                                             PlanSettings.of(self.policy, limits_of(state)))
        else:
            try:
                windows = await asyncio.wait_for(
                    read_windows(self.redis, state.model, now, READ_SPAN * self.settings.window_seconds),
                    self.settings.io_timeout,
                )
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep the last workload and plan: Redis may be back next cycle
                state.apply(
                    now, state.demands, None, f"reading request traces failed: {type(e).__name__}: {e}"
                )
                return
            result = await asyncio.to_thread(plan_model, state, windows, now, self.settings.window_seconds,
                                             profiles, self.policy)
        demands, plan, error = result.demands, result.plan, result.error
        await self._guarded("publishing the SLO cuts", self.publish_cuts(state, now))
        if not demands:
            state.apply(now, [], None, None)
            return
        if plan is not None and plan.unserved:
            log.warning("%s: %s", state.model, plan.unserved)  # planned without them: on the dashboard
        if plan is not None and not plan.optimal:
            log.warning("%s: solver time limit, using the best plan found", state.model)
        state.apply(now, demands, plan, error, result.burst, result.held)
        if plan is not None:
            log.info(
                "%s: %.2f req/s -> %s (cost %.2f, %.0f ms)%s",
                state.model,
                plan.rps,
                plan.replicas,
                plan.cost,
                plan.solve_seconds * 1000,
                f"; held, the plan asks for {result.held}" if result.held else "",
            )
        else:
            log.warning("%s: no plan: %s", state.model, error)

    async def publish_cuts(self, state: ModelState, now: float) -> None:
        """The feedback's cuts for the gateways' SLO routers (slo/fleet_factors.py), every re-plan."""
        if self.redis is None:
            return
        await asyncio.wait_for(self.redis.set(factors_key(state.model), encode(state.feedback.factors, now),
                                              ex=ttl_seconds(self.settings.interval)),
                               self.settings.io_timeout)

    async def run(self) -> None:
        """Re-plan forever, every `interval` seconds from the start of the previous cycle."""
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("optimizer cycle failed")
            raise_if_cancelled()  # redis-py's wait_for can swallow a cancel (extproc/cancellation.py)
            await asyncio.sleep(max(0.0, self.settings.interval - (time.monotonic() - started)))

    # --- HTTP ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/metrics", self.get_own_metrics)
        app.router.add_get("/metrics/{namespace}/{name}", self.get_metrics)
        app.router.add_put("/scale/{namespace}/{name}", self.put_scale)
        app.router.add_post("/monitor/{namespace}/{name}", self.post_monitor)
        app.router.add_delete("/monitor/{namespace}/{name}", self.delete_monitor)
        app.router.add_get("/dash/{model}", self.get_dash)
        app.router.add_get("/dash/{model}/data", self.get_dash_data)
        app.router.add_get("/healthz", self.healthz)
        return app

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as e:
            return _error(e)
        except NotMonitored as e:
            return _error(not_found(str(e), "deployment_not_monitored"))
        except web.HTTPMethodNotAllowed:
            return _error(
                OpenAIError(
                    405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed"
                )
            )
        except web.HTTPNotFound:
            return _error(not_found(f"no route {request.method} {request.path}", "unknown_route"))

    def _find(self, request: web.Request) -> tuple[ModelState, Any]:
        return self.fleet.find(request.match_info["namespace"], request.match_info["name"])

    async def get_metrics(self, request: web.Request) -> web.Response:
        state, d = self._find(request)
        return web.Response(text=metrics_text(state.model, state.reported(d.key) * REPLICA_UNITS))

    async def get_own_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _json_body(self, request: web.Request, required: bool) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            if required:
                raise OpenAIError(400, "expected a JSON object body", code="invalid_body")
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise OpenAIError(400, f"the body is not JSON: {e}", code="invalid_body") from None
        if not isinstance(body, dict):
            raise OpenAIError(400, "expected a JSON object body", code="invalid_body")
        return body

    async def put_scale(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, required=True)
        replicas = body.get("replicas")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < -1:
            raise OpenAIError(
                400,
                f"replicas: expected a whole number ≥ 0, or -1 to clear, got {replicas!r}",
                param="replicas",
                code="invalid_replicas",
            )
        state, d = self._find(request)
        self.fleet.override(d.namespace, d.name, replicas)
        message = "Overrides cleared" if replicas < 0 else f"Scaled to {replicas}"
        return web.json_response({"message": message, "deployment": d.key, "model": state.model})

    async def post_monitor(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["namespace"], request.match_info["name"]
        body = await self._json_body(request, required=False)
        try:
            self.fleet.find(ns, name)
            return web.json_response({"message": "Deployment optimization already started"})
        except NotMonitored:
            pass
        known = self.fleet.known(ns, name)
        if known is None and isinstance(self.source, CheckedSource):  # it must exist, as AIBrix checks
            body = {**await self._read_deployment(self.source, ns, name), **body}
        if known is not None and not body:
            self.fleet.start(known, add=False)
        elif body:
            try:
                d = parse_deployment({**body, "name": name, "namespace": ns}, "body")
            except ConfigError as e:
                raise OpenAIError(
                    400, str(e), param=str(e).split(":")[0].removeprefix("body."), code="invalid_deployment"
                ) from None
            self.fleet.start(d, add=True)
        else:
            raise not_found(
                f'deployment {ns}/{name} is not in the deployment source; POST {{"model": "<model>"}} '
                "to add it",
                "deployment_not_found",
            )
        return web.json_response({"message": "Deployment optimization started"})

    async def _read_deployment(self, source: CheckedSource, namespace: str, name: str) -> dict[str, Any]:
        try:
            found = await asyncio.wait_for(source.read(namespace, name), self.settings.io_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("reading Deployment %s/%s failed: %s: %s", namespace, name, type(e).__name__, e)
            raise OpenAIError(503, f"could not read Deployment {namespace}/{name} from the Kubernetes API",
                              type="service_unavailable", code="kubernetes_unavailable") from None
        if found is None:
            raise not_found(f"Deployment {namespace}/{name} does not exist (or is outside the watched "
                            "namespaces)", "deployment_not_found")
        return found

    async def delete_monitor(self, request: web.Request) -> web.Response:
        self.fleet.stop(request.match_info["namespace"], request.match_info["name"])
        return web.json_response({"message": "Deployment optimization stopped"})

    def _model(self, request: web.Request) -> ModelState:
        model = request.match_info["model"]
        state = self.fleet.models.get(model)
        if state is None:
            raise not_found(f"model {model} is not monitored", "model_not_monitored")
        return state

    async def get_dash(self, request: web.Request) -> web.Response:
        state = self._model(request)
        page = render_page(
            dashboard_data(state, self.profiles_of(state), self.clock()), self.settings.refresh_ms
        )
        return web.Response(text=page, content_type="text/html")

    async def get_dash_data(self, request: web.Request) -> web.Response:
        state = self._model(request)
        return web.json_response(dashboard_data(state, self.profiles_of(state), self.clock()))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": sorted(self.fleet.models)})
