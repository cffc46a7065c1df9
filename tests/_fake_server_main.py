"""A real rollout-server process over the arithmetic engine double, for fault-injection tests.

``python tests/_fake_server_main.py DIR PORT [--step-s S] [--version V] [--die-after N]
[--hang-update] [--max-concurrent N] [--hang-shutdown] [--stop-margin-s S] [--register FILE]
[--drain-s S] [--parent-pid PID]``: serves on
127.0.0.1:PORT until SIGTERM (graceful) or the engine fails (exit 1); the base checkpoint and
exports live under DIR/exports.
"""

import argparse
import asyncio
import logging
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _rollout_fakes import ArithmeticEngine, ExactAnswerScorer, make_tokenizer_dir  # noqa: E402
from _rollout_fakes import write_checkpoint  # noqa: E402

from areal_jax.config import from_dict  # noqa: E402
from rollout.config import ServerConfig  # noqa: E402
from rollout import server  # noqa: E402
from rollout.server import serve  # noqa: E402


class FaultyEngine(ArithmeticEngine):
    """Dies for good after ``die_after`` requests; or never finishes a weight update, or its
    shutdown (a thread stuck in a device call)."""

    def __init__(self, die_after: int | None, hang_update: bool, hang_shutdown: bool = False,
                 **kwargs):
        super().__init__(**kwargs)
        self.die_after, self.hang_update = die_after, hang_update
        self.hang_shutdown = hang_shutdown

    async def shutdown(self):
        if self.hang_shutdown:
            await asyncio.to_thread(threading.Event().wait)
        await super().shutdown()

    def generate(self, prompt_ids, params, request_id):
        if self.die_after is not None and len(self.requests) >= self.die_after:
            self.die("device lost")
        return super().generate(prompt_ids, params, request_id)

    async def update_weights(self, path, version):
        if self.hang_update:
            await asyncio.sleep(3600)
        await super().update_weights(path, version)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("port", type=int)
    p.add_argument("--step-s", type=float, default=0.005)
    p.add_argument("--version", type=int, default=0)
    p.add_argument("--die-after", type=int)
    p.add_argument("--hang-update", action="store_true")
    p.add_argument("--max-concurrent", type=int, default=64)
    p.add_argument("--hang-shutdown", action="store_true")
    p.add_argument("--stop-margin-s", type=float)
    p.add_argument("--register", help="register_file")
    p.add_argument("--drain-s", type=float, default=0.0)
    p.add_argument("--parent-pid", type=int)
    args = p.parse_args()
    if args.stop_margin_s is not None:
        server.STOP_MARGIN_S = args.stop_margin_s
    logging.basicConfig(level=logging.INFO)
    tok = make_tokenizer_dir(args.dir / "tok")
    base = write_checkpoint(args.dir / "exports" / "base", "base")
    cfg = from_dict(ServerConfig, {
        "engine": {"model_path": str(base), "tokenizer_path": str(tok)}, "port": args.port,
        "push_dir": str(args.dir / f"push{args.port}"), "shutdown_grace_s": 5,
        "max_concurrent_groups": args.max_concurrent, "register_file": args.register,
        "drain_s": args.drain_s, "parent_pid": args.parent_pid})
    engine = FaultyEngine(args.die_after, args.hang_update, args.hang_shutdown,
                          step_s=args.step_s, version=args.version)
    scorer = ExactAnswerScorer()
    return serve(cfg, engine=engine, scorer=scorer, reward_names=scorer.names)


if __name__ == "__main__":
    sys.exit(main())
