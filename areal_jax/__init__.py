"""areal-jax: fully asynchronous reinforcement learning for language reasoning models, in JAX."""

__version__ = "0.1.0"
