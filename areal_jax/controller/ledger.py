"""The run ledger: an append-only JSONL record of what happened to every prompt group.

Events: ``submit`` (request id, prompt id, gate version), ``reject`` (the server found the
request invalid, or its answers were too long to train: field and message), ``drop``
(over-stale at batch formation, prompt generated again), ``train`` (version and the prompt ids
of its batch), ``start`` (the loop (re)starts from the trainer at a version, restored from a
checkpoint or not, with the count of groups rejected up to that checkpoint: trained records of
later versions, and rejections past that count, are void: their prompts are generated again)
and ``end`` (groups still pending and the data position). From it one can check that nothing
accepted was lost or trained twice, across crashes and restarts (``trained_batches``,
``rejected_prompts``).
"""

from __future__ import annotations

import json
from pathlib import Path


class RunLedger:
    """Appends one JSON object per event to ``path``; every line is flushed when written."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = self.path.is_file() and _ends_mid_line(self.path)
        self._file = self.path.open("a", encoding="utf-8")
        if torn:  # a crash cut the last line: the next event starts a line of its own
            self._file.write("\n")

    def record(self, event: str, **fields) -> None:
        self._file.write(json.dumps({"event": event, **fields}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RunLedger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ends_mid_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            return False
        f.seek(-1, 2)
        return f.read(1) != b"\n"


def read_ledger(path: str | Path) -> list[dict]:
    """Every event of the ledger at ``path``, in order; lines torn by a crash are skipped (a
    resumed run appends after them)."""
    events = []
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def trained_batches(events: list[dict]) -> dict[int, list[str]]:
    """Version -> prompt ids of the batch that produced it, as the run finally stands: a
    ``start`` at version v voids every trained record of a version above v."""
    batches: dict[int, list[str]] = {}
    for e in events:
        if e["event"] == "start":
            batches = {v: ids for v, ids in batches.items() if v <= e["version"]}
        elif e["event"] == "train":
            batches[e["version"]] = e["prompts"]
    return batches


def rejected_prompts(events: list[dict]) -> list[str]:
    """The prompt ids rejected, in order, as the run finally stands: a ``start`` that restored
    a checkpoint counting k rejections voids every rejection after the first k (those came
    after that checkpoint, and their prompts were generated again). ``ValueError`` where a
    ``start`` that does not say (an older ledger's) follows rejections."""
    rejected: list[str] = []
    for e in events:
        if e["event"] == "start" and "rejected" in e:
            rejected = rejected[: e["rejected"]]
        elif e["event"] == "start" and rejected:
            raise ValueError(f"a start at version {e['version']} does not say how many "
                             "rejections its checkpoint counted (an older areal-jax wrote it): "
                             "the rejections before it that were void cannot be told")
        elif e["event"] == "reject":
            rejected.append(e["prompt"])
    return rejected
