"""The rollout server process: gRPC (asyncio) with health, reflection, TLS and a shared token.

``start_server(config)`` builds the engine, reward pool, tokenizer and workflow from the config
(any of them can be passed in instead), starts serving and returns a ``RolloutServer``;
``serve(config)`` runs one until SIGTERM/SIGINT. Stopping is graceful: health turns
NOT_SERVING, nothing new is admitted, in-flight generations end as aborted and their groups are
delivered, then the gRPC server and the engine shut down.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import shutil
import signal
import tempfile
from collections.abc import Collection
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from areal_jax.config import ConfigError
from areal_jax.protocol import SERVICE_NAME
from areal_jax.protocol.v1 import rollout_pb2_grpc as pb_grpc
from rollout.auth import TokenAuthInterceptor
from rollout.config import RewardConfig, ServerConfig
from rollout.engine import GenerationEngine
from rollout.engines import create_engine
from rollout.service import RolloutServicer
from rollout.workflows import RewardScorer, Tokenizer, load_workflow

log = logging.getLogger(__name__)


class RolloutServer:
    """A started server; ``stop()`` shuts it down gracefully."""

    def __init__(self, server, servicer, health_servicer, engine, closers, port):
        self._server: grpc.aio.Server = server
        self.servicer: RolloutServicer = servicer
        self._health: health.aio.HealthServicer = health_servicer
        self.engine: GenerationEngine = engine
        self._closers = closers
        self.port: int = port
        self._stopped = False

    async def stop(self, grace: float | None = None) -> None:
        """Stop admitting, abort in-flight generation, deliver what finished, shut down."""
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        self.servicer.begin_shutdown()
        await self.engine.shutdown()
        await self._server.stop(grace)
        await _close_all(self._closers)


async def _close_all(closers: list) -> None:
    for close in reversed(closers):
        result = close()
        if inspect.isawaitable(result):
            await result


async def _start_grpc(config: ServerConfig, servicer: RolloutServicer, token, credentials):
    """Bind and start the gRPC server; return ``(server, port, health_servicer)``."""
    limit = config.max_message_mb * 1024 * 1024
    server = grpc.aio.server(
        interceptors=[TokenAuthInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
        ],
    )
    pb_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    address = f"{host}:{config.port}"
    if credentials is not None:
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    await server.start()
    return server, port, health_servicer


def _read_tls(config: ServerConfig) -> grpc.ServerCredentials:
    pems = {}
    for key in ("tls_cert_path", "tls_key_path"):
        path = Path(getattr(config, key))
        if not path.is_file():
            raise ConfigError(f"{key}: {path} does not exist")
        pems[key] = path.read_bytes()
    return grpc.ssl_server_credentials([(pems["tls_key_path"], pems["tls_cert_path"])])


class _RegistryRewards(Collection[str]):
    """The reward registry as a collection: its listed names, and any dotted path it resolves."""

    def __contains__(self, name: object) -> bool:
        from areal_jax.rewards import RewardNotFoundError, get_reward

        try:
            get_reward(name)
        except RewardNotFoundError:
            return False
        return True

    def __iter__(self):
        from areal_jax.rewards import available_rewards

        return iter(available_rewards())

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _reward_pool(config: RewardConfig) -> tuple[RewardScorer, Collection[str]]:
    from areal_jax.rewards import RewardPool

    return RewardPool(config.num_workers, config.timeout_s), _RegistryRewards()


def _load_tokenizer(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"engine.tokenizer_path: cannot load a tokenizer from {path}: {e}") from e


async def start_server(
    config: ServerConfig,
    *,
    engine: GenerationEngine | None = None,
    scorer: RewardScorer | None = None,
    reward_names: Collection[str] | None = None,
    tokenizer: Tokenizer | None = None,
) -> RolloutServer:
    """Build what is not given from ``config``, start the engine and serve on ``config.port``."""
    if (scorer is None) != (reward_names is None):
        raise ValueError("pass scorer and reward_names together")
    token = config.resolve_auth_token()
    credentials = _read_tls(config) if config.tls_cert_path else None
    workflow = load_workflow(
        config.workflow, tokenizer or _load_tokenizer(config.engine.tokenizer_path)
    )
    engine = engine or create_engine(config.engine)
    closers: list = []
    try:
        if scorer is None:
            scorer, reward_names = _reward_pool(config.rewards)
            closers.append(scorer.close)
        push_dir = config.push_dir
        if push_dir is None:
            push_dir = tempfile.mkdtemp(prefix="areal-jax-push-")
            closers.append(lambda: shutil.rmtree(push_dir, ignore_errors=True))
        await engine.start()
        try:
            servicer = RolloutServicer(
                config, engine, workflow, scorer, reward_names, Path(push_dir)
            )
            server, port, health_servicer = await _start_grpc(config, servicer, token, credentials)
        except BaseException:
            await engine.shutdown()
            raise
    except BaseException:
        await _close_all(closers)
        raise
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, serving)
    log.info(
        "rollout server on %s:%d (%s engine, version %d, %s)",
        config.host,
        port,
        engine.kind,
        engine.version,
        "TLS" if credentials else "plaintext",
    )
    return RolloutServer(server, servicer, health_servicer, engine, closers, port)


async def _serve(config: ServerConfig, **components) -> int:
    server = await start_server(config, **components)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    interval = config.status_log_interval_s or None
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except TimeoutError:
            s = server.servicer.status()
            log.info(
                "version %d | running %d | queued %d | %.1f tok/s | %d tokens%s",
                s.version,
                s.running_requests,
                s.queued_requests,
                s.tokens_per_second,
                s.tokens_generated,
                " | paused" if s.paused else "",
            )
    log.info("shutting down (grace %.0f s)", config.shutdown_grace_s)
    await server.stop(config.shutdown_grace_s)
    return 0


def serve(config: ServerConfig, **components) -> int:
    """Run a rollout server until SIGTERM or SIGINT; return the exit code.

    ``components`` (engine, scorer, reward_names, tokenizer) go to ``start_server``.
    """
    return asyncio.run(_serve(config, **components))
