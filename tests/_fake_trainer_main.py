"""A real trainer-side process for fault-injection tests: the RL loop over given rollout
servers, with the recording trainer double checkpointing (version + loop state) to a JSON file
after every version, so it can be SIGKILLed and restarted like ``areal-jax train``.

``python tests/_fake_trainer_main.py DIR STEPS ADDRESS [ADDRESS ...]``
"""

import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _loop_kit import RecordingTrainer, config, exports_dir, items  # noqa: E402

from areal_jax.controller.ledger import RunLedger  # noqa: E402
from areal_jax.controller.loop import RLLoop  # noqa: E402
from areal_jax.controller.rollout_pool import PoolOptions, RolloutPool  # noqa: E402
from areal_jax.controller.servers import sync_servers  # noqa: E402
from areal_jax.data.sampler import PromptIterator  # noqa: E402

PROMPTS = 300


class CheckpointingTrainer(RecordingTrainer):
    def __init__(self, run_dir: Path, **kwargs):
        self.ckpt = run_dir / "checkpoint.json"
        saved = json.loads(self.ckpt.read_text()) if self.ckpt.is_file() else None
        super().__init__(exports_dir(run_dir), version=saved["version"] if saved else 0, **kwargs)
        self.extra = saved["extra"] if saved else None

    def save(self, state):
        tmp = self.ckpt.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self.version, "extra": state}))
        os.replace(tmp, self.ckpt)


async def main(run_dir: Path, steps: int, addresses: list[str]) -> None:
    trainer = CheckpointingTrainer(run_dir, train_s=0.05)
    cfg = config(run_dir, {"batch_size": 3, "max_staleness": 1, "max_in_flight": 8},
                 checkpoint_every=1)
    prompts = items(PROMPTS)
    pool = RolloutPool(addresses, options=PoolOptions(rejoin_interval_s=0.2))
    await pool.start()
    ledger = RunLedger(run_dir / "ledger.jsonl")
    try:
        path = trainer.snapshot_for_publish().write()
        await sync_servers(pool, Path(path), trainer.version, cfg)
        loop = RLLoop(cfg, trainer, pool, PromptIterator(prompts, seed=0),
                      {i.id: i for i in prompts}, on_step=lambda s, m: None, ledger=ledger)
        if trainer.extra:
            loop.load_state_dict(trainer.extra)
        await loop.run(steps, trainer.save)
    finally:
        ledger.close()
        await pool.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
