"""``python -m rollout --config CONFIG [key=value ...]``, the same as ``areal-jax serve``."""

import sys

from areal_jax.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
