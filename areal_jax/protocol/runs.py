"""How a trainer names its run to rollout servers (see ``rollout.run_lease``)."""

from __future__ import annotations

RUN_METADATA_KEY = "areal-run"  # the call metadata that carries the run id
MAX_RUN_ID_CHARS = 128


def is_run_id(text: object) -> bool:
    """Whether ``text`` can name a run: 1 to ``MAX_RUN_ID_CHARS`` printable ASCII characters
    (it travels as gRPC metadata)."""
    return (isinstance(text, str) and 0 < len(text) <= MAX_RUN_ID_CHARS and text.isascii()
            and text.isprintable())
