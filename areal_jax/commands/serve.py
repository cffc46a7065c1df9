"""``areal-jax serve --config CONFIG [key=value ...]``: run a rollout server until SIGTERM."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from areal_jax.config import ConfigError, load_config

NAME = "serve"
HELP = "Run a rollout server (gRPC) until SIGTERM/SIGINT."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file with the server config (rollout.config)")
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. port=50052"
    )
    parser.add_argument(
        "--compile-only", action="store_true",
        help="compile the JAX engine's prefill and decode programs into the persistent "
             "compilation cache and exit, serving nothing: servers started later with the same "
             "engine options, model shape and devices read them from the cache",
    )


def run(args: argparse.Namespace) -> int:
    from areal_jax.compilation import enable_compilation_cache
    from rollout.config import ServerConfig
    from rollout.engine import EngineError
    from rollout.server import serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # JAX's probes of backends this machine lacks ("Unable to initialize backend 'tpu'") are
    # INFO records of its own: not the server's news
    logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        config = load_config(ServerConfig, args.config, args.overrides)
        # The launching trainer's cache when it set one (inherited), else the user's.
        cache = enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
        if args.compile_only:
            return _compile_only(config, cache)
        return serve(config)
    except ConfigError as e:
        print(f"areal-jax serve: config error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:  # e.g. SGLang not installed where it is launched
        print(f"areal-jax serve: the {config.engine.kind} engine did not start: {e}",
              file=sys.stderr)
        return 1


def _compile_only(config, cache) -> int:
    """Start the JAX engine with ``precompile`` on, then shut it down; 0 when every program
    compiled (and is in ``cache``)."""
    import asyncio
    import dataclasses

    from rollout.engines.jax_engine import build_engine

    if config.engine.kind != "jax":
        raise ConfigError(f"engine.kind: --compile-only compiles the JAX engine's programs; "
                          f"got {config.engine.kind!r}")
    if cache is None:
        raise ConfigError("--compile-only needs the persistent compilation cache, which is off "
                          "(JAX_COMPILATION_CACHE_DIR is empty)")
    engine = build_engine(dataclasses.replace(
        config.engine, options={**config.engine.options, "precompile": True}))

    async def start_and_stop() -> None:
        await engine.start()  # compiles and runs every program once
        await engine.shutdown()

    asyncio.run(start_and_stop())
    print(f"compiled the JAX engine's programs into {cache}", flush=True)
    return 0
