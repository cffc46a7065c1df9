"""The rollout side of a run, seen from the leader: local servers launched (and restarted) or
external ones attached, the pool that drives them, and bringing them to the trainer's version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import jax

from areal_jax.config import ConfigError, from_dict
from areal_jax.controller.local_servers import LocalServers, ServerExitedError
from areal_jax.controller.local_servers import with_deterministic_ops
from areal_jax.controller.rollout_pool import NoLiveServerError, PoolOptions, RolloutPool
from areal_jax.experiment import ExperimentConfig
from areal_jax.protocol.v1 import rollout_pb2 as pb
from areal_jax.trainer.publish import link_newest_export, remove_restart_copies
from rollout.config import EngineConfig, ServerConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_LOCAL_RESTARTS = 3  # per local server within an hour; more means it is failing, not flaking
SERVER_COMPILE_WAIT_S = 900.0  # after SFT, the longest wait for the servers' compile to end


def listed_rewards(cfg: ExperimentConfig) -> dict[str, str]:
    """``rollout.server.rewards.custom``: name -> ``pkg.module:function``."""
    return dict(cfg.rollout.server.get("rewards", {}).get("custom", {}))


def with_dataset_reward(listed: dict[str, str], reward: str) -> dict[str, str]:
    """``listed`` plus a dataset's ``reward`` when it is a path (``pkg.module:function``),
    registered under that path (a listed entry of that name wins)."""
    return {reward: reward, **listed} if ":" in reward else dict(listed)


def custom_rewards(cfg: ExperimentConfig) -> dict[str, str]:
    """The rewards the servers offer besides the built-ins: those of
    ``rollout.server.rewards.custom`` and those the datasets name by path."""
    custom = listed_rewards(cfg)
    for d in [cfg.dataset] + ([cfg.eval.dataset] if cfg.eval.dataset else []):
        custom = with_dataset_reward(custom, d.reward)
    return custom


def server_config(cfg: ExperimentConfig, model_path: Path, version: int) -> dict:
    """The config of the local servers: ``rollout.server`` plus the model, version and rewards."""
    server = dict(cfg.rollout.server)
    engine = dict(server.pop("engine", {}))
    engine.update({"model_path": str(model_path), "initial_version": version})
    engine.setdefault("kind", "jax")
    server["engine"] = engine
    custom = custom_rewards(cfg)
    if custom:
        server["rewards"] = {**server.get("rewards", {}), "custom": custom}
    if cfg.rollout.auth_token_env:
        server["auth_token_env"] = cfg.rollout.auth_token_env
    return server


def _check_context(cfg: ExperimentConfig, context: int, what: str, remedy: str,
                   training: list[int], held_out: list[int]) -> None:
    """Refuse a context of ``context`` tokens (``what`` names it and where it comes from;
    ``remedy`` says what can raise it, empty where nothing can) too short for the longest
    training prompt and
    ``sampling.max_new_tokens``, or the longest held-out prompt and ``eval.max_new_tokens``:
    each such request would be rejected. ``training`` and ``held_out``: token counts."""
    answers = [("training", training if cfg.schedule.total_steps else (), "sampling",
                cfg.sampling.max_new_tokens),
               ("held-out", held_out, "eval", cfg.eval.max_new_tokens)]
    for kind, lengths, section, max_new in answers:
        longest = max(lengths, default=None)
        if longest is None or longest + max_new <= context:
            continue
        raise ConfigError(
            f"{what} is below the longest {kind} prompt ({longest} tokens) + "
            f"{section}.max_new_tokens ({max_new}) = {longest + max_new}: the servers would "
            f"reject those requests; {remedy + ' or ' if remedy else ''}lower "
            f"{section}.max_new_tokens")


def _check_rewards(cfg: ExperimentConfig, offered: list[str], address: str,
                   training: list[int], held_out: list[int]) -> None:
    """Refuse a server that does not offer the reward the training requests name (with
    ``training`` prompts) or the held-out ones (with ``held_out``): each such request would be
    rejected. ``offered``: its status's ``reward_names`` (empty from a server too old to say)."""
    wanted = [("dataset.reward", cfg.dataset.reward if training and cfg.schedule.total_steps
               else None),
              ("eval.dataset.reward", cfg.eval.dataset.reward if held_out and cfg.eval.dataset
               else None)]
    for setting, name in wanted:
        if offered and name is not None and name not in offered:
            raise ConfigError(
                f"rollout server {address} does not offer the reward {name!r} ({setting}): it "
                f"offers {', '.join(offered)}; add it to that server's rewards.custom "
                f"(name: \"pkg.module:function\") and start it again")


def _check_group_size(cfg: ExperimentConfig, limit: int, address: str,
                      training: list[int]) -> None:
    """Refuse a server that takes groups of at most ``limit`` samples (its status's
    ``max_group_size``; 0 from a server too old to say) when the run asks for more: each
    training request would be rejected, and the prompts blamed."""
    group = cfg.sampling.group_size
    if limit and training and cfg.schedule.total_steps and group > limit:
        raise ConfigError(
            f"rollout server {address} takes groups of at most {limit} samples (its "
            f"max_group_size), this run asks for sampling.group_size {group}: raise "
            f"max_group_size there (and start it again) or lower sampling.group_size")


def check_local_engine_context(cfg: ExperimentConfig, model_path: Path, *,
                               training: list[int] = (), held_out: list[int] = ()) -> None:
    """Refuse, before anything runs, a local engine's context beyond the model's positions
    (each server would exit at its start) or too short for the longest prompts and their
    ``max_new_tokens`` (see ``_check_context``): the engine options' ``served_context``
    (SGLang's KV pool may lower it further once it starts: ``make_pool``)."""
    if cfg.rollout.remote:
        return
    from areal_jax.models.config import ModelConfig
    from rollout.engines import check_engine_options

    engine = cfg.rollout.server.get("engine", {})
    options = check_engine_options(from_dict(EngineConfig, {"model_path": str(model_path),
                                                            **engine}))
    key = f"rollout.server.engine.options.{options.context_option}"
    positions = ModelConfig.from_pretrained(model_path).max_position_embeddings
    try:
        context = options.served_context(positions)
    except ConfigError as e:
        raise ConfigError(f"rollout.server.{e} ({model_path / 'config.json'})") from e
    unset = "" if getattr(options, options.context_option) else "unset: "
    at_limit = context >= positions
    _check_context(cfg, context, f"{key} ({unset}{context}"
                   f"{', all the model holds' if at_limit else ''})",
                   "" if at_limit else f"raise it (the model holds {positions})",
                   list(training), list(held_out))


def make_pool(cfg: ExperimentConfig, addresses: list[str], *, addresses_file: str | None = None,
              training: list[int] = (), held_out: list[int] = (),
              vocab_size: int | None = None, run_id: str | None = None) -> RolloutPool:
    """The pool of ``addresses`` (and those ``addresses_file`` lists, followed as it changes),
    with the run's settings; it admits only servers whose model has ``vocab_size`` entries
    (when given), whose served context (``max_context_len`` of their status: remote
    servers, or an SGLang whose KV pool allows less than the model) holds the longest
    ``training`` and ``held_out`` prompts (token counts) and their ``max_new_tokens``
    (``_check_context``), that offer the rewards those prompts name (``_check_rewards``) and
    take groups of ``sampling.group_size`` (``_check_group_size``),
    at the start and whenever a server joins later; ``run_id`` names the
    run to the servers (``RolloutPool``)."""
    def admit(address: str, status: pb.ServerStatus) -> None:
        if vocab_size is not None and status.vocab_size != vocab_size:
            raise ConfigError(f"rollout server {address} serves a model with a vocabulary of "
                              f"{status.vocab_size}, the trainer's has {vocab_size}: another "
                              "model; start it with this run's model")
        _check_context(cfg, status.max_context_len, f"the context rollout server {address} "
                       f"serves ({status.max_context_len} tokens)", "serve a longer one there",
                       list(training), list(held_out))
        _check_rewards(cfg, list(status.reward_names), address, list(training), list(held_out))
        _check_group_size(cfg, status.max_group_size, address, list(training))

    r = cfg.rollout
    token = os.environ.get(r.auth_token_env) if r.auth_token_env else None
    try:
        tls = Path(r.tls_root_cert).read_bytes() if r.tls_root_cert else None
    except OSError as e:
        raise ConfigError(f"rollout.tls_root_cert: cannot read {r.tls_root_cert}: "
                          f"{e.strerror}") from None
    options = PoolOptions(rpc_timeout_s=r.rpc_timeout_s, update_timeout_s=r.update_timeout_s,
                          rpc_retries=r.rpc_retries, rejoin_interval_s=r.rejoin_interval_s,
                          no_server_timeout_s=r.no_server_timeout_s,
                          max_attempts=r.max_request_attempts, keepalive_s=r.keepalive_s,
                          stall_timeout_s=r.stall_timeout_s,
                          max_message_mb=r.server.get("max_message_mb",
                                                      ServerConfig.max_message_mb))
    try:
        return RolloutPool(addresses, auth_token=token, tls_root_cert=tls, options=options,
                           admit=admit, run_id=run_id,
                           addresses_file=Path(addresses_file) if addresses_file else None)
    except ValueError as e:  # no server listed, or a file that cannot be read
        raise ConfigError(str(e)) from None


def _local_servers(cfg: ExperimentConfig, model_path: Path, version: int,
                   with_trainer: bool = True) -> LocalServers:
    r = cfg.rollout
    _, memory_fraction = cfg.memory_fractions(with_trainer)
    return LocalServers(server_config(cfg, model_path, version), r.num_local_servers,
                        Path(cfg.run_dir) / "logs", r.cpu_sets, env=server_env(cfg),
                        devices=r.server_devices, memory_fraction=memory_fraction)


def server_env(cfg: ExperimentConfig) -> dict[str, str] | None:
    """What the local servers' environment changes from this process's: ``deterministic`` is
    the trainer's alone, so the servers get ``XLA_FLAGS`` without it (the engine's KV-cache
    writes are scatters whose dropped padding rows share an index, which XLA may run as a loop
    over the indices under deterministic ops)."""
    if not cfg.deterministic:
        return None
    return {"XLA_FLAGS": with_deterministic_ops(os.environ.get("XLA_FLAGS", ""), False)}


def launch_local(cfg: ExperimentConfig, model_path: Path, version: int,
                 with_trainer: bool = True) -> LocalServers | None:
    """Start ``rollout.num_local_servers`` servers unless the run is given its servers
    (``rollout.remote``); ``with_trainer``: a trainer process shares their devices (their
    memory shares)."""
    if cfg.rollout.remote:
        return None
    servers = _local_servers(cfg, model_path, version, with_trainer)
    servers.start()
    return servers


def servers_spare_the_trainer(cfg: ExperimentConfig) -> bool:
    """Whether work done on the local servers' side takes no CPU from the trainer, or the
    other way round: on an accelerator backend, or with ``trainer_cpus`` disjoint from every
    ``rollout.cpu_sets``."""
    if jax.default_backend() != "cpu":
        return True
    server_cpus = {c for cpus in cfg.rollout.cpu_sets or [] for c in cpus}
    return bool(cfg.trainer_cpus and server_cpus and not server_cpus & set(cfg.trainer_cpus))


def compiles_servers_during_sft(cfg: ExperimentConfig, sft_pending: bool) -> bool:
    """Whether the local servers' JAX-engine programs compile while SFT runs
    (``compile_servers_during_sft``; unset: where that takes no CPU from SFT). Only where
    local JAX-engine servers will start, an SFT is ``sft_pending`` and the persistent
    compilation cache is on (asking for it with the cache off is an error)."""
    wanted = cfg.compile_servers_during_sft
    if wanted is False or cfg.rollout.remote or not sft_pending:
        return False
    if cfg.rollout.server.get("engine", {}).get("kind", "jax") != "jax":
        return False
    if not jax.config.jax_compilation_cache_dir:
        if wanted:
            raise ConfigError("compile_servers_during_sft: needs the persistent compilation "
                              "cache, which compilation_cache_dir turns off")
        return False
    return wanted or servers_spare_the_trainer(cfg)


@contextlib.contextmanager
def servers_compiling(cfg: ExperimentConfig, base_model: Path, sft_pending: bool) -> Iterator[None]:
    """While the body (SFT) runs, compile the local servers' programs into the persistent
    cache in a process of their own, on ``base_model`` (the same shapes as the SFT model they
    will serve), where ``compiles_servers_during_sft``; on leaving, wait for that process to
    end (at most ``SERVER_COMPILE_WAIT_S``), so its device memory is free before the servers
    start, and print how it went. A compile that cannot start, fails or overruns is reported,
    not raised: the servers then compile as they start. If the body raises, it is killed."""
    if not compiles_servers_during_sft(cfg, sft_pending):
        yield
        return
    log_path = Path(cfg.run_dir) / "logs" / "server_compile.log"
    began = time.monotonic()
    try:
        proc = _local_servers(cfg, base_model, 0).compile_programs()
    except OSError as e:
        print(f"could not start compiling the rollout servers' programs during SFT ({e}); "
              "the servers compile them as they start", flush=True)
        yield
        return
    ended: list[float] = []  # when the process ended, seen by a thread that waits for it
    waiter = threading.Thread(target=lambda: (proc.wait(), ended.append(time.monotonic())),
                              name="server-compile-wait", daemon=True)
    waiter.start()
    try:
        yield
        sft_ended = time.monotonic()
        waiter.join(SERVER_COMPILE_WAIT_S)
        overran = waiter.is_alive()
    finally:
        if proc.poll() is None:  # the body raised, or the compile overran
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the tools it ran too
            except ProcessLookupError:
                proc.kill()
            proc.wait()
    if overran:
        print(f"compiling the rollout servers' programs did not end within "
              f"{SERVER_COMPILE_WAIT_S:g} s after SFT: stopped it (log: {log_path}); the servers "
              "compile them as they start", flush=True)
    elif proc.returncode != 0:
        print(f"compiling the rollout servers' programs during SFT failed (exit code "
              f"{proc.returncode}, log: {log_path}); the servers compile them as they start",
              flush=True)
    else:
        after = ended[0] - sft_ended
        waited = f", {after:.1f} s of it after SFT" if after >= 0.1 else ""
        print(f"rollout servers' programs compiled during SFT in {ended[0] - began:.1f} s"
              f"{waited}", flush=True)


WAIT_REPORT_S = 30.0  # how often remote servers not answering yet are named at the start


async def wait_ready(pool: RolloutPool, servers: LocalServers | None,
                     timeout_s: float) -> None:
    """Connect the pool; fail early, with the log, if a local server exits while starting;
    remote servers not answering yet are named every ``WAIT_REPORT_S``."""
    start = asyncio.create_task(pool.start(
        ready_timeout_s=timeout_s, report_every_s=WAIT_REPORT_S if servers is None else None))
    while not start.done():
        if servers is not None:
            try:
                servers.check_alive()
            except ServerExitedError:
                start.cancel()
                raise
        await asyncio.sleep(0.5)
    await start


@contextlib.asynccontextmanager
async def rollout_servers(cfg: ExperimentConfig, model_path: Path, version: int,
                          with_trainer: bool = True, *, training: list[int] = (),
                          held_out: list[int] = (), vocab_size: int | None = None,
                          run_id: str | None = None):
    """Local servers serving ``model_path`` as ``version`` (or the given servers) and a
    connected pool whose servers' contexts hold the ``training`` and ``held_out`` prompts (token
    counts) and whose models have ``vocab_size`` entries, naming the run ``run_id``
    (``make_pool``): yields ``(pool, local
    servers or None)``; closes and stops both on exit. ``with_trainer``: whether this process
    is a trainer sharing the servers' devices."""
    servers = pool = None
    try:
        servers = launch_local(cfg, model_path, version, with_trainer)
        pool = make_pool(cfg, servers.addresses if servers else list(cfg.rollout.addresses),
                         addresses_file=None if servers else cfg.rollout.addresses_file,
                         training=training, held_out=held_out, vocab_size=vocab_size,
                         run_id=run_id)
        await wait_ready(pool, servers, cfg.rollout.start_timeout_s)
        yield pool, servers
    finally:
        try:
            if pool is not None:
                await pool.close()
        finally:  # a stop that cancels the close, or a close that fails, stops them too
            if servers is not None:  # off the loop: a SIGTERM meanwhile is still a stop
                await asyncio.to_thread(servers.stop)


REMOTE_CHECK_S = 10.0  # how long the check before SFT waits for remote servers to answer


async def check_remote_servers(cfg: ExperimentConfig, model_path: Path, *,
                               training: list[int] = (), held_out: list[int] = (),
                               run_id: str | None = None) -> None:
    """Before the work that comes ahead of the RL phase (SFT), check the remote servers that
    answer within ``REMOTE_CHECK_S`` as the RL phase will (``make_pool``'s admission: model,
    context, rewards, group size, token), so a server that cannot serve the run is named
    before that work, not after it. Servers that do not answer yet are checked as they
    connect later."""
    from areal_jax.models.config import ModelConfig

    if not cfg.rollout.remote:
        return
    pool = make_pool(cfg, list(cfg.rollout.addresses), addresses_file=cfg.rollout.addresses_file,
                     training=training, held_out=held_out, run_id=run_id,
                     vocab_size=ModelConfig.from_pretrained(model_path).vocab_size)
    try:
        await pool.start(min(REMOTE_CHECK_S, cfg.rollout.start_timeout_s))
    except NoLiveServerError:
        pass
    finally:
        await pool.close()


async def supervise_local(servers: LocalServers, exports_dir: Path,
                          interval_s: float = 2.0) -> None:
    """Restart local servers that exit, on a copy of the newest export in ``exports_dir`` (the
    one they were launched with may be pruned by now, and the newest may be pruned while they
    start; the pool lets them rejoin and brings them to its version); raises
    ``ServerExitedError`` when one keeps exiting."""
    remove_restart_copies(exports_dir)  # of a run that was killed
    copying = None
    try:
        while True:
            await asyncio.sleep(interval_s)
            exited = servers.exited()
            if not exited:
                continue
            copying = asyncio.ensure_future(asyncio.to_thread(
                lambda: {i: link_newest_export(exports_dir, f"server{i}") for i in exited}))
            weights = await asyncio.shield(copying)  # cancelled, it is still waited for below
            for index, ended in servers.restart_exited(MAX_LOCAL_RESTARTS, weights):
                log.warning("local rollout server %d exited (%s); restarted it", index, ended)
    finally:
        if copying is not None:
            await asyncio.gather(copying, return_exceptions=True)
        remove_restart_copies(exports_dir)


class Supervision:
    """Local servers restarted when they exit (``supervise_local``) while it is open (an
    async context manager); ``run(work)`` awaits ``work``, or, should a server keep exiting,
    cancels it and raises the ``ServerExitedError``. With no local servers, ``run`` only
    awaits."""

    def __init__(self, servers: LocalServers | None, exports_dir: Path, interval_s: float = 2.0):
        self._servers, self._exports_dir, self._interval_s = servers, exports_dir, interval_s
        self._watch: asyncio.Task | None = None

    async def __aenter__(self) -> Supervision:
        if self._servers is not None:
            self._watch = asyncio.create_task(
                supervise_local(self._servers, self._exports_dir, self._interval_s))
        return self

    async def __aexit__(self, *exc) -> None:
        """Stop supervising; a server that kept exiting after the last ``run`` is logged as an
        error (the work is done: nothing is left for it to cut short)."""
        if self._watch is not None:
            self._watch.cancel()
            (failure,) = await asyncio.gather(self._watch, return_exceptions=True)
            if isinstance(failure, ServerExitedError) and exc[0] is None:
                log.error("after the last step: %s", failure)

    async def run(self, work: Awaitable[T]) -> T:
        """``await work``, cut short by a server that keeps exiting."""
        if self._watch is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait({task, self._watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if self._watch.done():
                    self._watch.result()  # the ServerExitedError
        return task.result()


async def sync_servers(pool: RolloutPool, path: Path, version: int, cfg: ExperimentConfig) -> None:
    """Bring every server to the trainer's weights at ``version``, forced, whatever version
    the servers report: servers that outlived an earlier trainer go back to the restored one,
    and fresh servers, which call their starting checkpoint version 0 too, get the trainer's
    version 0 (the SFT model, where SFT ran), not their own."""
    push = cfg.rollout.weights_transport == "push"
    await pool.update_weights(path, version, push=push, force=True)
