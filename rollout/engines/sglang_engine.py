"""SGLang as a generation engine: launch (or attach to) an SGLang HTTP server and drive it.

Weight updates follow the interrupt-and-resubmit pattern: pause generation in abort mode (every
running request returns its partial output), load the checkpoint from disk with the new
``weight_version``, continue; each interrupted request is resubmitted with
``input_ids = prompt + output so far`` and ``max_new_tokens`` reduced by what was produced. A
token's version is the ``weight_version`` SGLang reports with the answer that produced it, except
for an answer a pause interrupted (older SGLang returns from the pause before such answers are
built, so they may report the post-swap version): its tokens carry the version served when the
last pause before the answer came began. SGLang holds a request that reaches it during a pause
until the generation continues, so a request runs under one version, the one served when the
pause that cuts it began; the version served when the request was sent is older where it reached
SGLang during a pause. Pause works the same way: interrupted requests wait and are resubmitted
after resume. Control calls (pause, continue, abort, loads, status) have connections of their
own, so they never queue behind ``/generate`` calls.

A failed load may leave SGLang partly updated (it records the new path before loading and "rolls
back" from it), so after one the previous checkpoint is loaded again with the previous version;
if that fails too, the engine has failed for good (``failure``). So does a launched server that
exits, or one that no longer answers at all.

Needs a GPU machine with SGLang installed (the ``sglang`` extra); it is tested here against a
protocol double of the HTTP API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import secrets
import sys
import tempfile
from typing import ClassVar
from collections.abc import AsyncIterator
from pathlib import Path

from areal_jax.config import ConfigError, from_dict
from areal_jax.models.config import ModelConfigError, generation_eos_ids, read_json_file
from rollout.config import EngineConfig
from rollout.engine import (
    EngineError,
    GenerationChunk,
    GenerationEngine,
    SamplingParams,
    WeightLoadError,
)
from rollout.engines import sglang_api as api
from rollout.engines.http_json import JsonHttpClient, UnreachableError
from rollout.engines.sglang_launch import SGLangProcess, free_port, wait_ready

log = logging.getLogger(__name__)
CONTROL_CONNECTIONS = 16  # pause, continue, abort, loads and status calls at once
PROBE_TIMEOUT_S = 10.0  # a server that does not answer /model_info within this is gone


@dataclasses.dataclass
class SGLangOptions:
    """``engine.options`` for ``engine.kind: sglang``."""

    url: str | None = None  # attach to a running server instead of launching one
    python: str = sys.executable  # interpreter that has sglang installed
    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    tp_size: int = 1
    dp_size: int = 1
    dtype: str = "auto"
    context_length: int | None = None  # default: the model's max_position_embeddings
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    random_seed: int | None = None
    deterministic_inference: bool = False
    extra_args: list[str] = dataclasses.field(default_factory=list)
    log_path: str | None = None  # default: a file in the temp directory
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    shutdown_timeout_s: float = 30.0
    max_connections: int = 512
    context_option: ClassVar[str] = "context_length"

    def served_context(self, positions: int) -> int:
        """``context_length`` (by default the model's ``positions``) less one: SGLang refuses a
        request whose prompt plus ``max_new_tokens`` reaches it. Its KV pool may allow less
        (read from the server once it runs)."""
        return (self.context_length or positions) - 1

    def __post_init__(self):
        for name in ("tp_size", "dp_size", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.options.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("startup_timeout_s", "request_timeout_s", "shutdown_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"engine.options.{name}: must be > 0, got {getattr(self, name)}")
        if self.context_length is not None and self.context_length < 1:
            raise ConfigError(
                f"engine.options.context_length: must be >= 1, got {self.context_length}"
            )


def _read_config(model_path: str) -> dict:
    """The checkpoint's ``config.json``."""
    path = Path(model_path) / "config.json"
    try:
        cfg = read_json_file(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"engine.model_path: cannot read {path}: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"engine.model_path: {path} is not a JSON object")
    return cfg


def _model_dims(model_path: str, options: SGLangOptions) -> tuple[int, int, set[int]]:
    """``(vocab_size, max_context_len, end-of-sequence ids)`` from the checkpoint's
    ``config.json`` (and ``generation_config.json``, whose end ids SGLang stops on too) and
    ``options.served_context``."""
    raw = _read_config(model_path)
    cfg = raw.get("text_config", raw)  # a multimodal model's language part
    path = Path(model_path) / "config.json"
    if "vocab_size" not in cfg:
        raise ConfigError(f"engine.model_path: {path} has no vocab_size")
    positions = cfg.get("max_position_embeddings")
    if not (options.context_length or positions):
        raise ConfigError(
            f"engine.options.context_length: required, {path} has no max_position_embeddings"
        )
    vocab_size = int(cfg["vocab_size"])
    try:
        eos = _ids(cfg.get("eos_token_id")) | set(generation_eos_ids(model_path, vocab_size))
    except ModelConfigError as e:
        raise ConfigError(f"engine.model_path: {e}") from e
    return vocab_size, options.served_context(int(positions or 0)), eos


def _served_dtype(model_path: str, option: str) -> str:
    """``--dtype`` for the checkpoint at ``model_path`` (``api.launch_dtype``), saying so when
    ``auto`` does not mean what SGLang would make of it."""
    cfg = _read_config(model_path)
    named = cfg.get("dtype", cfg.get("torch_dtype"))  # transformers 5 and 4 spellings
    dtype = api.launch_dtype(option, named if isinstance(named, str) else None)
    if option == "auto" and dtype != named:
        log.warning("engine.options.dtype auto: SGLang would serve this %s checkpoint in float16; "
                    "serving it in %s (set engine.options.dtype to choose)",
                    named or "dtype-less", dtype)
    return dtype


def _ids(value) -> set[int]:
    """Token ids from a config value: an id, a list of ids, or nothing."""
    values = value if isinstance(value, list) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


class SGLangEngine(GenerationEngine):
    """Drives one SGLang server over HTTP; see the module docstring."""

    kind = "sglang"
    tokens_as_generated = False  # one answer per sequence (or per interrupted part of it)

    def __init__(self, options: SGLangOptions, model_path: str, version: int):
        self.options = options
        self._model_path = model_path  # the checkpoint SGLang serves, as ``_version``
        self._version = version
        self._failure: EngineError | None = None
        self._warned_top_p = False
        self._vocab_size, self._context_len, self._eos_ids = _model_dims(model_path, options)
        self.process: SGLangProcess | None = None
        self._client: JsonHttpClient | None = None  # control calls
        self._generate_client: JsonHttpClient | None = None  # /generate calls
        self._control = asyncio.Lock()  # pause / resume / update run one at a time
        self._running = asyncio.Event()  # cleared while paused
        self._running.set()
        self._pause_epoch = 0  # bumped by every pause: tells interruptions from real aborts
        self._version_at_pause = version  # the version served when the last pause began
        self._closed = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._resubmissions = 0
        self._background: set[asyncio.Task] = set()
        self._calls = itertools.count()  # numbers each generate call's rids
        self._rid_tag = secrets.token_hex(4)  # this adapter's part of every rid it sends

    @property
    def version(self) -> int:
        return self._version

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context_len(self) -> int:
        return self._context_len

    @property
    def rid_tag(self) -> str:
        """This adapter's own part of the SGLang rids it sends (``sglang_api.request_rid``)."""
        return self._rid_tag

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    @property
    def failure(self) -> EngineError | None:
        if self._failure is None and not self._closed and self.process is not None:
            code = self.process.exit_code()
            if code is not None:
                self._failure = EngineError(
                    f"SGLang exited with code {code}; last log lines:\n{self.process.log_tail()}"
                )
        return self._failure

    async def start(self) -> None:
        opts = self.options
        url = opts.url
        if url is None:
            port = opts.port or free_port(opts.host)
            flags = api.LaunchFlags(
                model_path=self._model_path,
                host=opts.host,
                port=port,
                weight_version=self._version,
                tp_size=opts.tp_size,
                dp_size=opts.dp_size,
                dtype=_served_dtype(self._model_path, opts.dtype),
                context_length=opts.context_length,
                mem_fraction_static=opts.mem_fraction_static,
                max_running_requests=opts.max_running_requests,
                random_seed=opts.random_seed,
                deterministic_inference=opts.deterministic_inference,
            )
            log_path = opts.log_path
            if log_path is None:
                fd, log_path = tempfile.mkstemp(prefix="sglang-", suffix=".log")
                os.close(fd)
            self.process = SGLangProcess(
                api.launch_command(opts.python, flags, opts.extra_args), Path(log_path)
            )
            self.process.start()
            url = f"http://{opts.host}:{port}"
        self._client = JsonHttpClient(url, CONTROL_CONNECTIONS, opts.request_timeout_s)
        self._generate_client = JsonHttpClient(url, opts.max_connections,
                                               opts.request_timeout_s)
        try:
            await wait_ready(self._client, self.process, opts.startup_timeout_s)
            await self._read_limits()
            if opts.url is not None:
                await self._read_version()
        except BaseException:
            await self._release()
            raise

    async def _model_info(self) -> dict:
        """``GET /model_info`` (or its older name); {} when neither answers with an object."""
        for path in api.MODEL_INFO:
            status, body = await self._client.request("GET", path, timeout_s=PROBE_TIMEOUT_S)
            if status == 200 and isinstance(body, dict):
                return body
        return {}

    async def _read_limits(self) -> None:
        """Lower ``max_context_len`` to what SGLang's scheduler serves whole (its KV pool or
        its own context rules may allow less than the checkpoint's config says)."""
        for path in api.SERVER_INFO:
            status, body = await self._client.request("GET", path, timeout_s=PROBE_TIMEOUT_S)
            if status == 200 and isinstance(body, dict):
                limit = api.request_limit(body)
                if limit is not None and limit < self._context_len:
                    log.info("SGLang serves requests of at most %d tokens (prompt + new): "
                             "below the %d of the model's config", limit, self._context_len)
                    self._context_len = limit
                return

    async def _read_version(self) -> None:
        """Adopt the attached server's checkpoint path and integer ``weight_version``."""
        info = await self._model_info()
        version = api.parse_version(info.get("weight_version"))
        if version is not None:
            self._version = version
        if isinstance(info.get("model_path"), str):
            self._model_path = info["model_path"]

    async def _probe(self) -> None:
        """After a request could not reach SGLang: if nothing answers, fail for good."""
        try:
            await self._model_info()
        except UnreachableError as e:
            self._failure = self._failure or EngineError(f"SGLang does not answer: {e}")

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[GenerationChunk]:
        context, remaining, attempt = list(prompt_ids), params.max_new_tokens, 0
        call = next(self._calls)
        stops = set(params.stop_token_ids) | self._eos_ids
        if params.seed is None:
            # SGLang honours seeds only with deterministic inference, and there it gives every
            # unseeded request the same one: a group's samples would all be alike.
            params = dataclasses.replace(params, seed=random.getrandbits(31))
        if params.top_p < 1.0 and not self._warned_top_p:
            self._warned_top_p = True
            log.warning("top_p %s < 1 on SGLang: some SGLang versions return log-probs "
                        "renormalised over the top-p nucleus, not the full-vocabulary ones the "
                        "trainer weights tokens by; check that ppo/behav_weight_mean stays near 1 "
                        "at staleness 0 (docs/rollout.md)", params.top_p)
        while True:
            await self._running.wait()
            if self._closed:
                yield GenerationChunk((), (), (), "abort")
                return
            if self.failure is not None:
                raise self.failure
            epoch, version = self._pause_epoch, self._version
            rid = api.request_rid(request_id, self._rid_tag, call, attempt)
            try:
                out = await self._post_generate(context, params, remaining, rid)
            except EngineError as e:
                if self._closed:
                    yield GenerationChunk((), (), (), "abort")
                    return
                if isinstance(e, UnreachableError):
                    await self._probe()
                raise self.failure or e from None
            n = len(out.token_ids)
            finish = out.finish_reason
            interrupted = finish == "abort" and epoch != self._pause_epoch and not self._closed
            if interrupted:
                finish = api.interrupted_finish(out.token_ids, remaining, stops)
            reported = out.weight_version
            if interrupted:  # run under the version served as that pause began
                token_version = self._version_at_pause
            else:
                token_version = version if reported is None else reported
            yield GenerationChunk(
                tuple(out.token_ids), tuple(out.logprobs), (token_version,) * n, finish
            )
            if finish is not None:
                return
            context += out.token_ids
            remaining -= n
            attempt += 1
            self._resubmissions += 1

    async def _post_generate(
        self, input_ids: list[int], params: SamplingParams, max_new_tokens: int, rid: str
    ) -> api.GenerateOutput:
        payload = api.generate_payload(input_ids, params, max_new_tokens, rid)
        self._in_flight += 1
        self._idle.clear()
        try:
            status, body = await self._generate_client.request("POST", api.GENERATE, payload)
        except asyncio.CancelledError:
            self._spawn(self._client.request("POST", api.ABORT, api.abort_payload(rid)))
            raise
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()
        if status != 200:
            raise EngineError(f"SGLang /generate answered HTTP {status}: {str(body)[:500]}")
        try:
            return api.parse_generate_response(body)
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise EngineError(f"SGLang /generate answer not understood: {e}") from e

    def _spawn(self, coro) -> None:
        """Run ``coro`` in the background, logging its failure."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("SGLang background call failed: %s", task.exception())

    async def _post_ok(self, path: str, payload: dict) -> None:
        status, body = await self._client.request("POST", path, payload)
        if status != 200:
            raise EngineError(f"SGLang {path} answered HTTP {status}: {str(body)[:500]}")

    async def _pause_backend(self) -> None:
        self._running.clear()
        self._pause_epoch += 1
        self._version_at_pause = self._version
        await self._post_ok(api.PAUSE, api.PAUSE_PAYLOAD)

    async def _resume_backend(self) -> None:
        try:
            await self._post_ok(api.CONTINUE, api.CONTINUE_PAYLOAD)
        finally:
            self._running.set()

    async def pause(self) -> None:
        async with self._control:
            if not self.paused:
                await self._pause_backend()

    async def resume(self) -> None:
        async with self._control:
            if self.paused:
                await self._resume_backend()

    async def update_weights(self, path: str, version: int) -> None:
        async with self._control:
            was_paused = self.paused
            if not was_paused:
                await self._pause_backend()
            try:
                ok, message = await self._load(path, version)
                if not ok:
                    await self._restore()
                    raise WeightLoadError(f"SGLang did not load {path}: {message}")
                self._model_path, self._version = path, version
                await self._confirm_version(version)
            finally:
                if not was_paused:
                    await self._resume_backend()

    async def _confirm_version(self, version: int) -> None:
        """Make SGLang report ``version`` for the weights just loaded: SGLang 0.5.6 and
        0.5.6.post1 load weights sent while paused without taking their ``weight_version``, so
        every later token would carry the old one. Set it then with ``/update_weight_version``;
        a server that still reports another version has failed (its tokens would be
        mislabelled). One that reports none (no ``/model_info`` behind a proxy, or not in time)
        is only warned about: its answers' own versions, or the adapter's, label the tokens."""
        try:
            reported = api.parse_version((await self._model_info()).get("weight_version"))
        except EngineError as e:
            reported, unread = None, e
        else:
            unread = "it reports none"
        if reported is None:
            log.warning("could not check the weight_version SGLang reports after loading "
                        "version %d: %s", version, unread)
            return
        if reported == version:
            return
        try:
            await self._post_ok(api.UPDATE_WEIGHT_VERSION, api.weight_version_payload(version))
            reported = api.parse_version((await self._model_info()).get("weight_version"))
        except EngineError as e:
            reported = f"{reported} ({e})"
        if reported != version:
            self._failure = EngineError(
                f"SGLang loaded version {version} but reports weight_version {reported!r} "
                "even after /update_weight_version: its tokens would carry the wrong version; "
                "use sglang >= 0.5.6.post2")
            raise self._failure

    async def _load(self, path: str, version: int) -> tuple[bool, str]:
        payload = api.update_weights_payload(path, version)
        status, body = await self._client.request("POST", api.UPDATE_WEIGHTS_FROM_DISK, payload)
        return api.update_succeeded(status, body)

    async def _restore(self) -> None:
        """Load the served checkpoint again after a failed load, which may have left SGLang
        partly updated; if even that fails, the engine has failed for good."""
        ok, message = await self._load(self._model_path, self._version)
        if not ok:
            self._failure = EngineError(
                f"SGLang may be partly updated: reloading {self._model_path} as version "
                f"{self._version} after a failed load failed too: {message}"
            )
            raise self._failure

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.set()  # paused requests wake up and end as aborted
        if self._client is not None and self._in_flight:
            try:
                await self._client.request("POST", api.ABORT, api.ABORT_ALL_PAYLOAD, timeout_s=10)
                await asyncio.wait_for(self._idle.wait(), self.options.shutdown_timeout_s)
            except (EngineError, TimeoutError):
                pass  # the server is going away regardless
        await self._release()

    async def _release(self) -> None:
        if self.process is not None:
            await self.process.stop(self.options.shutdown_timeout_s)
        for client in (self._client, self._generate_client):
            if client is not None:
                client.close()

    def stats(self) -> dict[str, float]:
        return {"http_requests_in_flight": self._in_flight, "resubmissions": self._resubmissions}


OPTIONS = SGLangOptions  # the dataclass of engine.options


def build_engine(config: EngineConfig) -> SGLangEngine:
    options = from_dict(OPTIONS, config.options, prefix="engine.options")
    return SGLangEngine(options, config.model_path, config.initial_version)
