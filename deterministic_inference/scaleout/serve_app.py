"""`detinf serve --replicas N`: the Ray Serve application and the process that runs it.

Shape (chosen so the API stays the one-process server's, not a re-implementation):

    client --HTTP--> Serve proxy --> Router (ingress.py) --stream--> EngineReplica i (replica.py)
                                       prefix affinity,               the unchanged server app +
                                       fingerprint check,             its AsyncEngine
                                       /healthz, /metrics

Each replica is its own single-replica Serve deployment (`replica-0` ... `replica-{N-1}`), so the router
addresses replicas by name and routes by prefix affinity itself (Serve's own router would pick any).
`build_application` is used by the CLI; `app_builder` is the same for `serve run` / a KubeRay
RayService (`import_path: deterministic_inference.scaleout.serve_app:app_builder`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import httpx
from ray import serve

from deterministic_inference.config import EngineConfig
from deterministic_inference.errors import ConfigError
from deterministic_inference.scaleout import cluster
from deterministic_inference.scaleout.ingress import Router, RouterSettings
from deterministic_inference.scaleout.replica import EngineReplica
from deterministic_inference.server.app import DEFAULT_MAX_WAITING, DEFAULT_SHUTDOWN_TIMEOUT, ServerSettings
from deterministic_inference.server.process import arm_watchdog

APP_NAME = "detinf"
READY_TIMEOUT = 600.0  # seconds `serve` waits for the first routable replica before giving up
SHUTDOWN_MARGIN = 30.0  # seconds beyond --shutdown-timeout that undeploying may take before exit 1
ROUTER_MAX_ONGOING = 4096  # requests the router holds at once (each replica bounds its own queue: 429)


@dataclass(frozen=True)
class ReplicatedSpec:
    """Everything that defines a replicated deployment."""

    replicas: int
    engine: EngineConfig
    settings: ServerSettings
    expected_system_fingerprint: str | None = None  # pin; None = replica 0's fingerprint
    cpus_per_replica: float = 1.0  # Ray CPUs reserved per replica (defaults to --threads)
    replica_engines: tuple[tuple[int, EngineConfig], ...] = ()  # per-replica configs (tests: other numerics)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas: {self.replicas} must be >= 1")
        if any(not 0 <= index < self.replicas for index, _ in self.replica_engines):
            raise ConfigError("replica_engines: every index must be in [0, replicas)")

    def engine_for(self, index: int) -> EngineConfig:
        """The EngineConfig replica `index` runs."""
        return dict(self.replica_engines).get(index, self.engine)


def build_application(spec: ReplicatedSpec) -> Any:
    """The Serve application: the router bound to N single-replica engine deployments."""
    capacity = spec.engine.max_num_seqs + spec.settings.max_waiting
    replica_deployment: Any = serve.deployment(EngineReplica)
    bound = [
        replica_deployment.options(
            name=f"replica-{index}",
            num_replicas=1,
            max_ongoing_requests=capacity + 16,  # the app answers 429 itself past its capacity
            graceful_shutdown_timeout_s=spec.settings.shutdown_timeout,
            health_check_period_s=5.0,
            ray_actor_options={"num_cpus": spec.cpus_per_replica},
        ).bind(index, spec.engine_for(index), spec.settings)
        for index in range(spec.replicas)
    ]
    router_deployment: Any = serve.deployment(Router)
    router = router_deployment.options(
        name="router",
        num_replicas=1,
        max_ongoing_requests=ROUTER_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    )
    settings = RouterSettings(spec.settings.api_key, spec.expected_system_fingerprint)
    return router.bind(settings, *bound)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder for `serve run` / KubeRay: `args` = {"replicas": N, "engine": {EngineConfig
    fields}, "served_model_name", "max_waiting", "shutdown_timeout", "expected_system_fingerprint",
    "cpus_per_replica"}; the API key comes from $DETINF_API_KEY."""
    known = {f.name for f in fields(EngineConfig)}
    engine_args = dict(args.get("engine") or {})
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise ConfigError(f"engine: unknown field(s) {', '.join(unknown)}; use EngineConfig field names")
    settings = ServerSettings(
        api_key=os.environ.get("DETINF_API_KEY") or None,
        served_model_name=args.get("served_model_name"),
        max_waiting=int(args.get("max_waiting", DEFAULT_MAX_WAITING)),
        shutdown_timeout=float(args.get("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT)),
    )
    spec = ReplicatedSpec(
        replicas=int(args.get("replicas", 1)),
        engine=EngineConfig(**engine_args),
        settings=settings,
        expected_system_fingerprint=args.get("expected_system_fingerprint"),
        cpus_per_replica=float(args.get("cpus_per_replica", 1.0)),
    )
    return build_application(spec)


def deploy(spec: ReplicatedSpec, host: str, port: int) -> None:
    """Start Serve's HTTP proxy on host:port and deploy the application (Ray is connected already)."""
    serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
    serve.run(build_application(spec), name=APP_NAME, route_prefix="/")


def undeploy(connected: bool) -> None:
    """Delete the application (if it was deployed); stop Serve when nothing else runs on it; disconnect
    if `connected`."""
    try:
        if APP_NAME in serve.status().applications:
            serve.delete(APP_NAME)
        if not serve.status().applications:
            serve.shutdown()
    finally:
        if connected:
            cluster.disconnect()


def wait_routable(
    base_url: str, stop: threading.Event, timeout: float = READY_TIMEOUT
) -> dict[str, Any] | None:
    """Poll the router's /healthz until it answers 200 (bounded); its document, or None once `stop` is set."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline and not stop.is_set():
        try:
            response = httpx.get(base_url + "/healthz", timeout=10.0)
            last = response.json()
            if response.status_code == 200:
                return last
        except (httpx.HTTPError, ValueError):
            pass
        stop.wait(0.5)
    if stop.is_set():
        return None
    raise ConfigError(f"no replica became routable within {timeout:.0f} s: {last.get('replicas')}")


def _stop_on_signals(stop: threading.Event, shutdown_timeout: float) -> None:
    """SIGTERM/SIGINT set `stop` and arm a watchdog (bounded: if Ray is gone, because its processes got the
    signal too, undeploying could wait forever). Replaces the handler ray.init installs (sys.exit(15)),
    which would skip undeploying and leave the application running on a shared cluster."""

    def on_signal(signum: int, frame: Any) -> None:
        if not stop.is_set():
            arm_watchdog(shutdown_timeout + SHUTDOWN_MARGIN)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)


def run_replicated(spec: ReplicatedSpec, host: str, port: int, ray_address: str | None) -> int:
    """Deploy, report readiness, serve until SIGTERM/SIGINT, then undeploy (replicas get
    --shutdown-timeout seconds to finish in-flight requests). Exit code 0 after a clean stop, also when
    the signal arrives while the application is still being deployed."""
    stop = threading.Event()
    connected = cluster.connect(ray_address, int(spec.replicas * spec.cpus_per_replica) + 1)
    try:
        _stop_on_signals(stop, spec.settings.shutdown_timeout)
        deploy(spec, host, port)
        health = wait_routable(f"http://{host}:{port}", stop)
        if health is not None:
            states = ", ".join(
                f"{r['name']} {'routed' if r['routable'] else r['reason']}" for r in health["replicas"]
            )
            print(f"detinf serve: ready: {spec.replicas} replica(s) on Ray, system_fingerprint "
                  f"{health['system_fingerprint']}, http://{host}:{port} ({states})", file=sys.stderr,
                  flush=True)
        stop.wait()
        print("detinf serve: shutting down the replicas", file=sys.stderr, flush=True)
        return 0
    finally:
        undeploy(connected)
