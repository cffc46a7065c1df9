"""The rollout server process: gRPC (asyncio) with health, reflection, TLS and a shared token.

``start_server(config)`` builds the engine, reward pool, tokenizer and workflow from the config
(any of them can be passed in instead), starts serving and returns a ``RolloutServer``;
``serve(config)`` runs one until SIGTERM/SIGINT. Stopping is graceful: health turns
NOT_SERVING, nothing new is admitted, every group not complete (queued or generating) comes back
as an ABORTED error group, then the gRPC server and the engine shut down.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import inspect
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from areal_jax.config import ConfigError
from areal_jax.models.config import ModelConfigError
from areal_jax.models.tokenizer import check_tokenizer, load_tokenizer
from areal_jax.processes import process_running
from areal_jax.protocol import SERVICE_NAME
from areal_jax.protocol.addresses import register_address, unregister_address
from rollout.auth import TokenAuthInterceptor
from rollout.config import WILDCARD_HOSTS, RewardConfig, ServerConfig, resolves_to_loopback
from rollout.engine import EngineError, GenerationEngine
from rollout.engines import create_engine
from rollout.health import BoundedHealthServicer
from rollout.service import RolloutServicer
from rollout.wire import add_rollout_service
from rollout.workflows import RewardScorer, Tokenizer, load_workflow

log = logging.getLogger(__name__)
ENGINE_POLL_S = 0.1  # how often the server looks at engine.failure
PARENT_POLL_S = 0.5  # how often it checks that parent_pid is still its parent
STOP_MARGIN_S = 30.0  # past shutdown_grace_s, how long a stop may take before the process exits
DRAIN_POLL_S = 0.1
# Once nothing is held, how long a drain waits for its trainers to close their streams (they do
# when their last group is back; until then requests they sent before the notice may arrive).
DRAIN_STREAMS_S = 2.0


class RolloutServer:
    """A started server; ``stop()`` shuts it down gracefully.

    It watches the engine: once ``engine.failure`` is set, health turns NOT_SERVING, every
    unfinished group comes back as UNAVAILABLE (for the client to resubmit elsewhere), and
    ``failure`` / ``failed`` tell the owner, who should ``stop()`` it (``serve`` then exits 1).
    """

    def __init__(self, server, servicer, health_servicer, engine, closers, port):
        self._server: grpc.aio.Server = server
        self.servicer: RolloutServicer = servicer
        self._health: health.aio.HealthServicer = health_servicer
        self.engine: GenerationEngine = engine
        self._closers = closers
        self.port: int = port
        self._stopped = False
        self.failure: EngineError | None = None
        self.failed = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        while (failure := self.engine.failure) is None:
            await asyncio.sleep(ENGINE_POLL_S)
        log.error("the engine failed for good, no longer serving: %s", failure)
        self.failure = failure
        await self._health.enter_graceful_shutdown()
        self.servicer.end(grpc.StatusCode.UNAVAILABLE, f"engine failed: {failure}")
        self.failed.set()

    async def drain(self, timeout: float) -> bool:
        """Admit no new work (health NOT_SERVING; the trainers are told on their streams and
        send their next requests elsewhere) and wait until no group is queued or generating,
        at most ``timeout`` seconds, then until its trainers closed their streams, at most
        ``DRAIN_STREAMS_S`` more; whether nothing was held at the end."""
        await self._health.enter_graceful_shutdown()
        self.servicer.drain()
        deadline, empty_since = time.monotonic() + timeout, None
        while not self.failed.is_set():
            now = time.monotonic()
            if self.servicer.held:
                empty_since = None
            else:
                empty_since = empty_since or now
                if not self.servicer.open_streams or now - empty_since >= DRAIN_STREAMS_S:
                    return True
            if now >= deadline:
                return not self.servicer.held
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    async def stop(self, grace: float | None = None) -> None:
        """Stop admitting, return unfinished groups as ABORTED errors, shut down."""
        if self._stopped:
            return
        self._stopped = True
        self._watcher.cancel()
        await self._health.enter_graceful_shutdown()
        self.servicer.end(grpc.StatusCode.ABORTED, "server shutting down")
        await self.engine.shutdown()
        await self._server.stop(grace)
        await _close_all(self._closers)


async def _close_all(closers: list) -> None:
    for close in reversed(closers):
        result = close()
        if inspect.isawaitable(result):
            await result


_PUSH_PREFIX = "areal-jax-push-"


_PUSH_LOCK = ".owner.lock"  # in each push directory, locked while its server runs


def _fresh_push_dir(root: str | None = None) -> tuple[str, int]:
    """A new push directory under ``root`` (default: the temp dir), named by this process and
    host, and the descriptor of the lock this server holds on it while it runs. Directories
    of servers that are gone without removing theirs (killed: each holds a full checkpoint)
    are removed first: those whose lock nobody holds (which holds across hosts and PID
    namespaces sharing ``root``), and, of an older server without a lock, one of this host's
    whose pid is gone."""
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    for stale in base.glob(f"{_PUSH_PREFIX}*-*"):
        if _owner_gone(stale):
            shutil.rmtree(stale, ignore_errors=True)
            log.info("removed %s, left by a server that is gone", stale)
    # Made under a hidden name and renamed once locked: a server starting beside this one
    # never sees it unlocked (it would take it for a gone server's and remove it).
    hidden = tempfile.mkdtemp(prefix=f".{_PUSH_PREFIX}{os.getpid()}@{socket.gethostname()}-",
                              dir=base)
    lock = os.open(os.path.join(hidden, _PUSH_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(base, os.path.basename(hidden)[1:])
    os.rename(hidden, path)
    return path, lock


def _owner_gone(directory: Path) -> bool:
    """Whether the server that made push ``directory`` is gone (see ``_fresh_push_dir``)."""
    owner = directory.name[len(_PUSH_PREFIX):].rsplit("-", 1)[0]  # "pid@host", or "pid"
    pid, at, _ = owner.partition("@")
    lock_path = directory / _PUSH_LOCK
    if at:  # this version's: its lock tells (none yet: being made)
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError:  # held: its server runs
            return False
        finally:
            os.close(fd)
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    return not process_running(int(pid))


def _check_port_free(host: str, port: int) -> None:
    """Raise ``ConfigError`` naming ``port`` when something listens on ``host:port`` already
    (a duplicate launch); the bind in ``_start_grpc`` stays the authority."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return  # unresolvable: gRPC's bind reports it
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise _cannot_listen(f"{host}:{port}", e.strerror) from e
                return


def _cannot_listen(address: str, why: str) -> ConfigError:
    return ConfigError(f"port: cannot listen on {address} (another process listens there?): "
                       f"{why}")


async def _start_grpc(config: ServerConfig, servicer: RolloutServicer, token, credentials):
    """Bind and start the gRPC server; return ``(server, port, health_servicer)``."""
    limit = config.max_message_mb * 1024 * 1024
    server = grpc.aio.server(
        interceptors=[TokenAuthInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Clients ping to find a server that stopped answering (the pool's keepalive_s):
            # allow pings as often as every second, on idle connections too, without strikes.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.http2.max_ping_strikes", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            # And it pings them: a trainer whose host vanished has its streams closed (their
            # groups cancelled, its run's lease starting to run out) within about 50 s.
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 20_000),
            ("grpc.http2.ping_timeout_ms", 20_000),  # what gRPC 1.8x uses
            # gRPC sets SO_REUSEPORT by default: a second server started on a busy port (a
            # duplicate launch) would take a share of its connections, unseen.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_rollout_service(servicer, server)
    health_servicer = BoundedHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    host = f"[{config.host}]" if ":" in config.host else config.host
    address = f"{host}:{config.port}"
    try:
        if credentials is not None:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:  # gRPC's "Failed to bind to address ..."
        raise _cannot_listen(address, str(e)) from e
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


def _reward_pool(config: RewardConfig) -> tuple[RewardScorer, Collection[str]]:
    from areal_jax.rewards import RewardConfigError, RewardPool

    try:
        pool = RewardPool(config.num_workers, config.timeout_s, custom=config.custom,
                          max_call_s=config.max_call_s,
                          timeouts_to_probe=config.timeouts_to_probe)
    except RewardConfigError as e:
        raise ConfigError(f"rewards.custom: {e}") from e
    return pool, pool.reward_names


def _load_tokenizer(engine) -> Tokenizer:
    """The engine's tokenizer (``engine.tokenizer_path``, which defaults to ``model_path``),
    its vocabulary present (``load_tokenizer``; checked against the model once the engine
    started, ``_check_tokenizer``)."""
    path = engine.tokenizer_path
    key = _tokenizer_key(engine)
    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path} is not a directory (a local Hugging Face model or "
                          "tokenizer directory; nothing is downloaded)")
    try:
        return load_tokenizer(path, None, key)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from e


def _tokenizer_key(engine) -> str:
    """The setting that names the tokenizer's directory."""
    separate = engine.tokenizer_path != engine.model_path
    return "engine.tokenizer_path" if separate else "engine.model_path"


def _check_tokenizer(tokenizer, vocab_size: int, engine) -> None:
    """``check_tokenizer`` against the served model, as a ``ConfigError`` naming the key."""
    try:
        check_tokenizer(tokenizer, vocab_size, _tokenizer_key(engine))
    except ModelConfigError as e:
        raise ConfigError(str(e)) from e


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
    _check_port_free(config.host, config.port)  # before the engine loads, compiles, takes memory
    loaded = tokenizer or _load_tokenizer(config.engine)
    workflow = load_workflow(config.workflow, loaded)
    engine = engine or create_engine(config.engine)
    closers: list = []
    try:
        if scorer is None:
            scorer, reward_names = _reward_pool(config.rewards)
            closers.append(scorer.close)
        push_dir, push_lock = _fresh_push_dir(config.push_dir)
        closers.append(lambda: os.close(push_lock))  # closers run last first: after the rmtree
        closers.append(lambda: shutil.rmtree(push_dir, ignore_errors=True))
        await engine.start()
        try:
            if tokenizer is None:  # the engine's vocabulary is known once it started
                _check_tokenizer(loaded, engine.vocab_size, config.engine)
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
        "rollout server on %s:%d (%s engine, version %d, %s; rewards: %s)",
        config.host,
        port,
        engine.kind,
        engine.version,
        "TLS" if credentials else "plaintext",
        ", ".join(sorted(reward_names)),
    )
    return RolloutServer(server, servicer, health_servicer, engine, closers, port)


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == pid:
        await asyncio.sleep(PARENT_POLL_S)
    log.warning("parent process %d is gone, shutting down", pid)
    stop.set()


async def _serve(config: ServerConfig, **components) -> int:
    server = await start_server(config, **components)
    registered = None
    if config.register_file:
        registered = _register(config, server.port)
        if registered is None:  # its trainers would never find it
            await server.stop(0)
            return 1
        await asyncio.to_thread(_warn_if_listed_as_loopback, config, registered)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchers = [asyncio.create_task(stop.wait()), asyncio.create_task(server.failed.wait())]
    if config.parent_pid is not None:
        watchers.append(asyncio.create_task(_watch_parent(config.parent_pid, stop)))
    interval = config.status_log_interval_s or None
    try:
        while not any(w.done() for w in watchers):
            done, _ = await asyncio.wait(
                watchers, timeout=interval, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                _log_status(server)
    finally:
        for watcher in watchers:
            watcher.cancel()
        if registered is not None:  # first: trainers stop trying it once it is gone
            _unregister(config, registered)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second one ends the process at once
        loop.add_signal_handler(sig, _signal_during_shutdown, config, sig, [])
    if config.drain_s and server.failure is None:
        log.info("draining: the groups held may finish for %g s (drain_s)", config.drain_s)
        if not await server.drain(config.drain_s):
            log.warning("groups still held after drain_s (%g s) come back aborted",
                        config.drain_s)
    log.info("shutting down (grace %.0f s)", config.shutdown_grace_s)
    limit = config.shutdown_grace_s + STOP_MARGIN_S
    try:
        await asyncio.wait_for(server.stop(config.shutdown_grace_s), limit)
    except TimeoutError:  # an engine stuck in a device call: the process must not outlive it
        _exit_now(f"the shutdown did not finish within {limit:g} s (shutdown_grace_s + "
                  f"{STOP_MARGIN_S:g} s)")
    return 1 if server.failure is not None else 0


def _register(config: ServerConfig, port: int) -> str | None:
    """List the server serving on ``port`` in ``config.register_file``: its address, or None
    (an error logged) when the file cannot be written."""
    address = config.advertised(port)
    try:
        register_address(Path(config.register_file), address)
    except OSError as e:
        log.error("register_file: cannot list %s in %s: %s", address, config.register_file,
                  e.strerror or e)
        return None
    log.info("listed as %s in %s", address, config.register_file)
    return address


def _warn_if_listed_as_loopback(config: ServerConfig, address: str) -> None:
    """Warn when the machine's name a wildcard server listed resolves to a loopback address
    here (a name lookup: run it off the event loop)."""
    host = address.rpartition(":")[0]
    if config.advertise_address is None and config.host in WILDCARD_HOSTS and \
            resolves_to_loopback(host):
        log.warning("register_file: this machine's name, %s, resolves to a loopback address "
                    "here (its hosts file): a trainer on another host dialling it may reach "
                    "itself; set advertise_address to a name or address others can reach", host)


def _unregister(config: ServerConfig, address: str) -> None:
    try:
        unregister_address(Path(config.register_file), address)
    except OSError as e:  # the trainers find it gone when its stream ends
        log.warning("register_file: cannot remove %s from %s: %s", address,
                    config.register_file, e.strerror or e)


def _signal_during_shutdown(config: ServerConfig, sig: signal.Signals, said: list) -> None:
    """A stop signal during the shutdown ends the process at once, except a SIGTERM with
    ``parent_pid`` set: that is the parent-death signal, which the kernel sends again each
    time the server passes to another thread of its dying parent (``getppid`` changes only once
    every thread has begun to exit), and the shutdown goes on within its limit. ``said``:
    whether that was logged."""
    if config.parent_pid is not None and sig == signal.SIGTERM:
        if not said:
            said.append(True)
            log.info("SIGTERM again during the shutdown: with parent_pid set, the parent's death "
                     "signal comes once per thread it had; the shutdown goes on (SIGINT ends it)")
        return
    _exit_now(f"signal {sig.name} during the shutdown")


def _exit_now(why: str) -> None:
    """End the process without waiting for anything more (a thread stuck in the engine would
    hold a normal exit for ever); exit code 1."""
    log.error("exiting now: %s", why)
    logging.shutdown()
    os._exit(1)


def _log_status(server: RolloutServer) -> None:
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


def serve(config: ServerConfig, **components) -> int:
    """Run a rollout server until SIGTERM, SIGINT, the engine failing for good (exit code 1)
    or, with ``config.parent_pid``, the parent process going away; return the exit code.

    ``components`` (engine, scorer, reward_names, tokenizer) go to ``start_server``.
    """
    return asyncio.run(_serve(config, **components))
