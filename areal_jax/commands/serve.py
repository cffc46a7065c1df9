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


def run(args: argparse.Namespace) -> int:
    from areal_jax.compilation import enable_compilation_cache
    from rollout.config import ServerConfig
    from rollout.server import serve

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(ServerConfig, args.config, args.overrides)
        # The launching trainer's cache when it set one (inherited), else the user's.
        enable_compilation_cache(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
        return serve(config)
    except ConfigError as e:
        print(f"areal-jax serve: config error: {e}", file=sys.stderr)
        return 2
