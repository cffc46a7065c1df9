"""Typed configuration of a rollout server, loaded with ``areal_jax.config``."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from typing import Any, Literal

from areal_jax.config import ConfigError
from areal_jax.protocol.addresses import check_address
from rollout.engine import MAX_VERSION

DEFAULT_WORKFLOW = "rollout.workflows.single_turn.SingleTurnWorkflow"
log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")  # a server on these listens on every address
MAX_MESSAGE_MB = 2047  # gRPC takes message limits as int32 byte counts


def machine_name() -> str:
    """This machine's name as other hosts would dial it: its fully qualified name, or its host
    name where that is the loopback's (a hosts file mapping the machine's name to 127.0.0.1, as
    many images and containers have, makes ``getfqdn`` answer ``localhost``)."""
    name = socket.getfqdn()
    return socket.gethostname() if name.split(".")[0] == "localhost" else name


def resolves_to_loopback(host: str) -> bool:
    """Whether ``host`` resolves, on this machine, only to loopback addresses (False when it
    does not resolve: the trainer's side says so)."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host.strip("[]"), None)}
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


@dataclasses.dataclass
class EngineConfig:
    """Which engine serves the model. ``options`` are engine-specific and checked by the engine."""

    kind: Literal["jax", "sglang"] = "jax"
    model_path: str = ""  # Hugging Face checkpoint directory
    tokenizer_path: str = ""  # default: model_path
    initial_version: int = 0  # version of the weights at model_path
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not self.model_path:
            raise ConfigError("engine.model_path: required (a Hugging Face checkpoint directory)")
        if not 0 <= self.initial_version <= MAX_VERSION:
            raise ConfigError(f"engine.initial_version: must be in [0, {MAX_VERSION}], got "
                              f"{self.initial_version}")
        self.tokenizer_path = self.tokenizer_path or self.model_path


@dataclasses.dataclass
class WorkflowConfig:
    """The workflow class (dotted path) and the keyword options it is constructed with."""

    path: str = DEFAULT_WORKFLOW
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RewardConfig:
    """The reward process pool (``areal_jax.rewards.RewardPool``).

    Requests may name only the built-in rewards and the ``custom`` ones (name ->
    ``"pkg.module:function"``, imported when the server starts).
    """

    num_workers: int = 4
    timeout_s: float = 30.0
    max_call_s: float = 600.0
    timeouts_to_probe: int = 8
    custom: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.num_workers < 1:
            raise ConfigError(f"rewards.num_workers: must be >= 1, got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ConfigError(f"rewards.timeout_s: must be > 0, got {self.timeout_s}")
        if not self.max_call_s >= self.timeout_s:
            raise ConfigError(f"rewards.max_call_s: must be >= rewards.timeout_s "
                              f"({self.timeout_s}), got {self.max_call_s}")
        if self.timeouts_to_probe < 1:
            raise ConfigError(f"rewards.timeouts_to_probe: must be >= 1, got "
                              f"{self.timeouts_to_probe}")


@dataclasses.dataclass
class ServerConfig:
    """A rollout server. Binds 127.0.0.1 unless ``host`` says otherwise, and any other host only
    with an auth token (or ``allow_insecure_remote``)."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    workflow: WorkflowConfig = dataclasses.field(default_factory=WorkflowConfig)
    rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    max_concurrent_groups: int = 64  # groups being generated at once
    max_queued_requests: int = 1024  # admitted groups waiting for a slot; then reading stops
    max_group_size: int = 256
    # message bytes of admitted (queued and running) requests; then reading stops (one request
    # is admitted whatever its size when none is held)
    max_admitted_mb: int = 512
    # Rollout streams open at once (a client needs one per server); one more is refused with
    # RESOURCE_EXHAUSTED
    max_rollout_streams: int = 64
    tls_cert_path: str | None = None  # PEM; with tls_key_path turns on TLS
    tls_key_path: str | None = None
    auth_token: str | None = None  # clients must send "authorization: Bearer <token>"
    auth_token_env: str | None = None  # or: name of the environment variable holding it
    # PushWeights writes checkpoints in a directory of this server's own in it (default: in the
    # temp dir)
    push_dir: str | None = None
    max_message_mb: int = 64
    push_idle_timeout_s: float = 60.0  # a PushWeights stream silent this long is ended
    # ... and one not complete after push_idle_timeout_s + its size at this rate
    push_min_mib_per_s: float = 1.0
    shutdown_grace_s: float = 30.0
    # on SIGTERM / SIGINT, how long the groups it holds may go on to finish before the rest come
    # back aborted; its trainers are told it drains and send it no new work (0: at once)
    drain_s: float = 0.0
    # once it serves a run's weights, weights from any other client are refused until that
    # run's trainer has been gone this long (no stream open, no call) (rollout.run_lease)
    run_lease_s: float = 30.0
    status_log_interval_s: float = 30.0  # how often `serve` logs a status line; 0 = never
    parent_pid: int | None = None  # `serve` stops once its parent process is not this pid
    # UpdateWeights loads only paths under these (real paths compared); empty: push_dir (unset:
    # this server's own push directory) and the directory holding engine.model_path
    weights_allowed_roots: list[str] = dataclasses.field(default_factory=list)
    allow_insecure_remote: bool = False  # serve a non-loopback host without an auth token
    # an addresses file (a trainer's rollout.addresses_file) this server lists itself in while
    # it serves, as advertise_address (default: host:port, or this machine's name:port where
    # host is a wildcard such as 0.0.0.0)
    register_file: str | None = None
    advertise_address: str | None = None

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        for name in (
            "max_concurrent_groups",
            "max_queued_requests",
            "max_group_size",
            "max_message_mb",
            "max_admitted_mb",
            "max_rollout_streams",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_message_mb > MAX_MESSAGE_MB:
            raise ConfigError(f"max_message_mb: must be <= {MAX_MESSAGE_MB} (gRPC's message "
                              f"limits are 32-bit byte counts), got {self.max_message_mb}")
        for name in ("shutdown_grace_s", "status_log_interval_s", "drain_s", "run_lease_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("push_idle_timeout_s", "push_min_mib_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if (self.tls_cert_path is None) != (self.tls_key_path is None):
            raise ConfigError("tls_cert_path and tls_key_path: set both or neither")
        if self.auth_token is not None and self.auth_token_env is not None:
            raise ConfigError("auth_token and auth_token_env: set at most one")
        if self.parent_pid is not None and self.parent_pid < 1:
            raise ConfigError(f"parent_pid: must be >= 1, got {self.parent_pid}")
        if self.auth_token == "":
            raise ConfigError("auth_token: must not be empty (leave it unset for no token)")
        for i, root in enumerate(self.weights_allowed_roots):
            if not root:
                raise ConfigError(f"weights_allowed_roots[{i}]: must not be empty")
        if self.advertise_address is not None:
            try:
                check_address(self.advertise_address, "advertise_address")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if self.advertise_address is not None and self.register_file is None:
            raise ConfigError("advertise_address: set only with register_file (where it goes)")
        if not is_loopback(self.host) and self.auth_token is None and self.auth_token_env is None:
            if not self.allow_insecure_remote:
                raise ConfigError(
                    f"host: {self.host} is reachable from other machines but no auth_token or "
                    "auth_token_env is set, so anyone reaching it could load weights and run "
                    "rewards; set a token (see docs/security.md) or allow_insecure_remote: true"
                )
            log.warning(
                "INSECURE: serving %s without an auth token (allow_insecure_remote): anyone "
                "who reaches this port can generate, load weights and pause the server",
                self.host,
            )

    def advertised(self, port: int) -> str:
        """The address this server lists in ``register_file`` when it serves on ``port``."""
        if self.advertise_address is not None:
            return self.advertise_address
        host = self.host
        if host in WILDCARD_HOSTS:
            host = machine_name()
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{port}"

    def allowed_weight_roots(self, push_dir: str) -> list[str]:
        """Real paths of the directories UpdateWeights may load from (see the field). By
        default ``push_dir`` and the directory holding ``engine.model_path``, or the model's own
        directory where that is the filesystem's root (``/model`` in a container must not open
        every path)."""
        if self.weights_allowed_roots:
            return [os.path.realpath(root) for root in self.weights_allowed_roots]
        model = os.path.realpath(self.engine.model_path)
        parent = os.path.dirname(model)
        return [os.path.realpath(push_dir), model if parent == os.path.dirname(parent) else parent]

    def resolve_auth_token(self) -> str | None:
        """The shared token, read from the environment when ``auth_token_env`` names it."""
        if self.auth_token_env is None:
            return self.auth_token
        token = os.environ.get(self.auth_token_env, "")
        if not token:
            raise ConfigError(
                f"auth_token_env: environment variable {self.auth_token_env} is unset or empty"
            )
        return token
