"""``python -m areal_jax COMMAND ...``, the same as ``areal-jax COMMAND ...``."""

import sys

from areal_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
