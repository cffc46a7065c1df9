"""Subcommands of the ``areal-jax`` CLI, discovered by ``areal_jax.cli``."""
