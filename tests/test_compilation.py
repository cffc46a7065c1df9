"""The persistent compilation cache and the per-step compile meter."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.compilation import CompileMeter

PROGRAM = """
import sys
import jax, jax.numpy as jnp
from areal_jax.compilation import enable_compilation_cache
import numpy as np
from areal_jax.compilation import CompileMeter
hits = []
jax.monitoring.register_event_listener(
    lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
enable_compilation_cache(sys.argv[1])
meter = CompileMeter()
jax.jit(lambda x: jnp.tanh(x) @ x.T * 3.5)(np.ones((24, 24), np.float32)).block_until_ready()
print(meter.take()[1], len(hits))
"""


def _run(cache_dir) -> tuple[int, int]:
    """(programs compiled or loaded, of them loaded from the cache) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(cache_dir)], capture_output=True,
                         text=True, check=True)
    programs, hits = out.stdout.split()
    return int(programs), int(hits)


def test_a_second_process_reuses_the_first_ones_programs(tmp_path):
    assert _run(tmp_path / "cache") == (1, 0)  # compiled, and stored
    assert any((tmp_path / "cache").iterdir())
    assert _run(tmp_path / "cache") == (1, 1)  # loaded from the cache, not compiled


def test_compile_meter_counts_new_programs_only():
    meter = CompileMeter()
    f = jax.jit(lambda x: jnp.sin(x) * 7.25 + 1)
    f(np.ones(5, np.float32)).block_until_ready()
    seconds, programs = meter.take()
    assert programs == 1 and seconds > 0
    f(np.ones(5, np.float32)).block_until_ready()  # same shape: nothing new
    assert meter.take() == (0.0, 0)
    f(np.ones(6, np.float32)).block_until_ready()  # a new shape compiles again
    assert meter.take()[1] == 1
