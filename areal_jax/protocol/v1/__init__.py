"""Generated stubs of the ``areal_jax.rollout.v1`` wire protocol (``protos/``); do not edit."""
