"""Per-token log-probs and entropies from final hidden states, without materialising all logits.

The logits ``hidden @ head_kernel`` are computed ``chunk_size`` positions of the T axis at a
time inside ``jax.lax.map``, and each chunk is rematerialised in the backward pass, so at most
``R * chunk_size * V`` logits exist at once, forward or backward. Chunking runs along T, not
along the flattened R*T axis, so rows sharded over the data axis stay sharded and every chunk
keeps all devices busy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from areal_jax.models.dense import dense


def token_logprobs(
    hidden: jax.Array,
    head_kernel: jax.Array,
    targets: jax.Array,
    temperature: float | jax.Array = 1.0,
    chunk_size: int = 256,
) -> tuple[jax.Array, jax.Array]:
    """``log_softmax(hidden @ head_kernel / temperature)[targets]`` and the entropy, in fp32.

    hidden [R, T, D] (any float dtype; the matmul accumulates in fp32), head_kernel [D, V],
    targets [R, T] int in [0, V). Returns (logp [R, T], entropy [R, T]) float32; the entropy is
    that of the temperature-scaled distribution. Differentiable in hidden and head_kernel.
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [R, T, D], got shape {hidden.shape}")
    if head_kernel.ndim != 2 or head_kernel.shape[0] != hidden.shape[2]:
        raise ValueError(
            f"head_kernel must be [D={hidden.shape[2]}, V], got shape {head_kernel.shape}"
        )
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [R, T]={hidden.shape[:2]}, got shape {targets.shape}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if isinstance(temperature, (int, float)) and temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _token_logprobs(
        hidden, head_kernel, targets, temperature, min(chunk_size, hidden.shape[1])
    )


@functools.partial(jax.jit, static_argnames="chunk_size")
def _token_logprobs(hidden, head_kernel, targets, temperature, chunk_size):
    rows, length, dim = hidden.shape
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [n_chunks, R, chunk, ...]: the scanned axis is the chunk index, R stays in place.
    hidden = hidden.reshape(rows, n_chunks, chunk_size, dim).swapaxes(0, 1)
    targets = targets.reshape(rows, n_chunks, chunk_size).swapaxes(0, 1)
    temperature = jnp.asarray(temperature, jnp.float32)

    @jax.checkpoint
    def chunk(args):
        h, t = args
        logits = dense(h, head_kernel, out_dtype=jnp.float32) / temperature  # engines' convention
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0] - log_z
        probs = jnp.exp(logits - log_z[..., None])
        entropy = log_z - jnp.sum(probs * logits, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(chunk, (hidden, targets))

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(rows, n_chunks * chunk_size)[:, :length]

    return unchunk(logp), unchunk(entropy)
