"""Dynamic micro-batching (AReaL Algorithm 1) and packing of trajectories into [R, T] rows.

The ``fixed`` mode is the paper's baseline for comparison: a fixed count of micro-batches of
about equal sequence count, one sequence per row, each padded to its longest sequence.

A PPO minibatch is split into micro-batches of at most ``token_budget`` tokens each; a
micro-batch is then packed into ``R`` rows of ``T`` tokens, several sequences per row, with
``T`` taken from a fixed set of row-length buckets and ``R`` rounded up to the ladder 1, 2, 3,
4, 6, 8, 12, ... (times ``row_multiple``), so the number of distinct compiled shapes stays
small. Among the buckets that hold the longest sequence, the layout with the lowest estimated
cost ``R * T * (1 + T / attention_break_even)`` wins: padding costs, and so do long rows,
since attention work per token grows with the row length. A shape the caller has already
compiled (``known`` shapes) is taken instead when it costs at most ``reuse_tolerance`` times
the best, so a run settles on the shapes it met first rather than compiling a new one for
each small change of lengths; and, where the caller asks (``split``) and the best layout is
a new shape, a micro-batch is cut into up to ``MAX_SPLIT`` micro-batches of one known shape
when they cost at most that much together (a new shape's programs take seconds to compile; the
caller compiles them ahead, and uses them once they are known). All per-token arrays
are aligned to the *predicted* token: position ``j`` holds what the model predicts there, i.e.
the next token of the same sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Literal

import numpy as np

from areal_jax.trajectory import Trajectory, TrajectoryGroup

MAX_SPLIT = 4  # micro-batches of a known shape that one micro-batch may be cut into


@dataclasses.dataclass(frozen=True)
class MicroBatchConfig:
    """How a minibatch is cut into micro-batches and padded into rows.

    ``mode``: ``dynamic`` packs micro-batches of at most ``token_budget`` tokens (Algorithm 1,
    at least ``min_micro_batches`` of them, or one per sequence in a minibatch of fewer
    sequences: minibatches are balanced by tokens, so one long answer can be a minibatch of its
    own); ``fixed`` cuts the minibatch, in its order, into
    ``num_micro_batches`` micro-batches of about equal sequence count (fewer when there are
    fewer sequences), one sequence per row, each padded to its longest sequence; there a
    micro-batch of more than ``token_budget`` padded tokens (sequences x longest) is an error.
    ``row_buckets``: allowed row lengths T (ascending); empty means ``default_row_buckets``.
    ``row_multiple``: R is always a multiple of it (e.g. the data-parallel size).
    ``attention_break_even``: the row length at which a token's attention costs as much as its
    matmuls; None leaves it to the trainer, which derives it from the model (matmul parameters
    per layer / query width). Without one, layouts are compared by padded area alone.
    ``reuse_tolerance``: a known (compiled) shape is used when its estimated cost is at most
    this times the best layout's; 1 always takes the best layout.
    """

    token_budget: int = 16384
    min_micro_batches: int = 1
    mode: Literal["dynamic", "fixed"] = "dynamic"
    num_micro_batches: int = 1
    row_buckets: tuple[int, ...] = ()
    bucket_base: int = 128
    row_multiple: int = 1
    attention_break_even: int | None = None
    reuse_tolerance: float = 1.5

    def __post_init__(self):
        if self.mode not in ("dynamic", "fixed"):
            raise ValueError(f"mode must be dynamic or fixed, got {self.mode!r}")
        for name in ("token_budget", "min_micro_batches", "num_micro_batches", "bucket_base",
                     "row_multiple"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.reuse_tolerance >= 1:
            raise ValueError(f"reuse_tolerance must be >= 1, got {self.reuse_tolerance}")
        if self.attention_break_even is not None and self.attention_break_even < 1:
            raise ValueError(
                f"attention_break_even must be >= 1 or null, got {self.attention_break_even}"
            )
        buckets = self.row_buckets
        if buckets:
            if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"row_buckets must be strictly ascending positive, got {buckets}")
            if buckets[-1] < self.token_budget:
                raise ValueError(
                    f"row_buckets: largest bucket {buckets[-1]} is below token_budget "
                    f"{self.token_budget}, so a sequence that fits the budget could fit no row"
                )

    @property
    def buckets(self) -> tuple[int, ...]:
        """Row lengths T in use."""
        return self.row_buckets or default_row_buckets(self.token_budget, self.bucket_base)


def default_row_buckets(token_budget: int, base: int = 128) -> tuple[int, ...]:
    """``base * 2**k`` below the budget, then the budget rounded up to a multiple of ``base``."""
    top = -(-token_budget // base) * base
    buckets, b = [], base
    while b < top:
        buckets.append(b)
        b *= 2
    return tuple(buckets) + (top,)


def row_count_bucket(rows: int, row_multiple: int = 1) -> int:
    """Smallest ``row_multiple * n`` >= ``rows`` with n on the ladder 1, 2, 3, 4, 6, 8, 12, ...

    (powers of two and 1.5 times powers of two: at most a third of the rows are padding).
    """
    groups = max(-(-rows // row_multiple), 1)
    power = 1 << (groups - 1).bit_length()  # smallest power of two >= groups
    n = power * 3 // 4 if power >= 4 and power * 3 // 4 >= groups else power
    return row_multiple * n


def _row_count_ladder(limit: int, row_multiple: int) -> list[int]:
    """Every ``row_count_bucket`` value up to and including ``row_count_bucket(limit)``."""
    top = row_count_bucket(limit, row_multiple) // row_multiple
    ladder = {n for k in range(top.bit_length()) for n in (1 << k, (3 << k) >> 1) if n <= top}
    return [row_multiple * n for n in sorted(ladder)]


def plan_micro_batches(
    lengths: Sequence[int], token_budget: int, min_count: int = 1
) -> list[list[int]]:
    """AReaL Algorithm 1: assign sequence indices to micro-batches of <= ``token_budget`` tokens.

    Sequences go longest first into the micro-batch that fits them and holds the fewest
    sequences (ties: fewer tokens, then lower index); a new micro-batch opens when none fits or
    fewer than ``min_count`` exist. Returns index lists, each in ascending order.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if min_count < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    if min_count > len(lengths):
        raise ValueError(
            f"min_count={min_count} micro-batches cannot be filled by {len(lengths)} sequences"
        )
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch token budget "
                f"{token_budget}"
            )
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; lengths must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        fits = [b for b in range(len(batches)) if loads[b] + lengths[i] <= token_budget]
        if len(batches) < min_count or not fits:
            batches.append([i])
            loads.append(lengths[i])
            continue
        b = min(fits, key=lambda b: (len(batches[b]), loads[b], b))
        batches[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in batches]


def plan_fixed_micro_batches(
    lengths: Sequence[int], count: int, token_budget: int
) -> list[list[int]]:
    """The fixed-count baseline: sequence indices in order, cut into ``min(count, N)`` runs
    whose sizes differ by at most one (the first ones larger).

    Each run, padded to its longest sequence, must hold at most ``token_budget`` tokens.
    """
    if count < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {count}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; lengths must be >= 1")
    if not lengths:
        raise ValueError("no sequences to split into micro-batches")
    runs = np.array_split(np.arange(len(lengths)), min(count, len(lengths)))
    for j, run in enumerate(runs):
        longest = max(lengths[i] for i in run)
        if len(run) * longest > token_budget:
            raise ValueError(
                f"num_micro_batches={count}: micro-batch {j} holds {len(run)} sequences padded "
                f"to {longest} tokens, {len(run) * longest} in all, more than token_budget "
                f"{token_budget}; raise num_micro_batches or token_budget"
            )
    return [run.tolist() for run in runs]


def split_minibatches(
    items: Sequence[Trajectory | TrajectoryGroup | int], n: int
) -> list[list[Trajectory | TrajectoryGroup | int]]:
    """Split trajectories, whole groups or token counts into ``n`` minibatches balanced by
    token count.

    Largest item first into the lightest minibatch (ties: lower index); each minibatch keeps the
    input order. Deterministic.
    """
    if n < 1:
        raise ValueError(f"number of minibatches must be >= 1, got {n}")
    if n > len(items):
        raise ValueError(f"cannot split {len(items)} items into {n} non-empty minibatches")
    sizes = [_token_count(x) for x in items]
    order = sorted(range(len(items)), key=lambda i: (-sizes[i], i))
    members: list[list[int]] = [[] for _ in range(n)]
    loads = [0] * n
    for i in order:
        b = min(range(n), key=lambda b: (loads[b], b))
        members[b].append(i)
        loads[b] += sizes[i]
    return [[items[i] for i in sorted(m)] for m in members]


def _token_count(item: Trajectory | TrajectoryGroup | int) -> int:
    if isinstance(item, int):
        return item
    if isinstance(item, TrajectoryGroup):
        return sum(t.length for t in item.trajectories)
    return item.length


def first_fit_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit-decreasing of sequence indices into rows of ``row_len`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r in range(len(rows)) if free[r] >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(row_len)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def choose_row_layout(
    lengths: Sequence[int],
    buckets: Sequence[int],
    row_multiple: int = 1,
    attention_break_even: int | None = None,
    known: Collection[tuple[int, int]] = (),
    reuse_tolerance: float = 1.0,
) -> tuple[int, int, list[list[int]]]:
    """Pick the shape (R, T) of least estimated cost; ties: smaller T.

    Cost: ``R * T * (1 + T / attention_break_even)``, the padded area alone when
    ``attention_break_even`` is None, with R the row count bucket of the rows first-fit needs
    at T. A ``known`` shape (R', T) with R' >= those rows (and a multiple of ``row_multiple``)
    is chosen instead when it costs at most ``reuse_tolerance`` times the best. Returns
    (T, R, rows) with rows as lists of sequence indices; ``len(rows)`` is the used rows.
    """
    longest = max(lengths)
    best = reuse = None
    for t in buckets:
        if t < longest:
            continue
        rows = first_fit_rows(lengths, t)
        r = row_count_bucket(len(rows), row_multiple)
        cost = layout_cost(r, t, attention_break_even)
        if best is None or cost < best[0]:
            best = (cost, t, r, rows)
        for rk, tk in known:
            if tk != t or rk < len(rows) or rk % row_multiple:
                continue
            cost = layout_cost(rk, t, attention_break_even)
            if reuse is None or cost < reuse[0]:
                reuse = (cost, t, rk, rows)
    if best is None:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the largest row bucket {buckets[-1]}"
        )
    if reuse is not None and reuse[0] <= reuse_tolerance * best[0]:
        best = reuse
    return best[1], best[2], best[3]


def layout_cost(rows: int, row_len: int, attention_break_even: int | None) -> float:
    """Estimated cost of a micro-batch of shape (rows, row_len): its padded area, each token
    weighted by ``1 + row_len / attention_break_even`` for attention's work."""
    return rows * row_len * (1 + row_len / attention_break_even if attention_break_even else 1)


def split_into_known(
    lengths: Sequence[int],
    known: Collection[tuple[int, int]],
    max_cost: float,
    row_multiple: int = 1,
    attention_break_even: int | None = None,
) -> list[tuple[list[int], tuple[int, int], list[list[int]]]] | None:
    """One micro-batch of sequences of ``lengths`` tokens cut into at most ``MAX_SPLIT``
    micro-batches of one ``known`` shape (R, T): first-fit rows of T tokens, R rows at a time,
    the shape whose parts cost least in all (then: the fewest parts), if that is at most
    ``max_cost``; else None.

    Per part: (its sequence indices, ascending; (R, T); its rows as positions in them).
    """
    longest, best = max(lengths), None
    for r, t in sorted(known):
        if t < longest or r % row_multiple:
            continue
        rows = first_fit_rows(lengths, t)
        parts = -(-len(rows) // r)
        cost = parts * layout_cost(r, t, attention_break_even)
        if parts <= MAX_SPLIT and cost <= max_cost and (best is None
                                                        or (cost, parts) < best[:2]):
            best = (cost, parts, (r, t), rows)
    if best is None:
        return None
    _, _, (r, t), rows = best
    out = []
    for start in range(0, len(rows), r):
        part = rows[start:start + r]
        members = sorted(i for row in part for i in row)
        position = {i: k for k, i in enumerate(members)}
        out.append((members, (r, t), [[position[i] for i in row] for row in part]))
    return out


def padded_row_layout(
    lengths: Sequence[int], buckets: Sequence[int], row_multiple: int = 1
) -> tuple[int, int, list[list[int]]]:
    """One sequence per row, in order, rows of the smallest bucket T that holds the longest;
    (T, R, rows) as ``choose_row_layout``."""
    longest = max(lengths)
    row_len = next((t for t in buckets if t >= longest), None)
    if row_len is None:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the largest row bucket {buckets[-1]}"
        )
    return row_len, row_count_bucket(len(lengths), row_multiple), [[i] for i in range(len(lengths))]


def possible_shapes(cfg: MicroBatchConfig) -> set[tuple[int, int]]:
    """Every (R, T) that packing a micro-batch under ``cfg`` can produce.

    dynamic: first-fit leaves at most one row at most half full, so k rows of length T hold
    more than (k - 1) * T / 2 tokens: k <= ceil(2 * budget / T). fixed: rows of bucket T hold
    sequences longer than the bucket below it (p), so k * (p + 1) <= budget.
    """
    shapes = set()
    below = 0
    for t in cfg.buckets:
        if cfg.mode == "fixed":
            max_rows = cfg.token_budget // (below + 1)
            below = t
            if max_rows < 1:
                continue
        else:
            max_rows = max(1, -(-2 * cfg.token_budget // t))
        shapes.update((r, t) for r in _row_count_ladder(max_rows, cfg.row_multiple))
    return shapes


def neighbour_shapes(
    shapes: Collection[tuple[int, int]], cfg: MicroBatchConfig
) -> list[tuple[int, int]]:
    """Shapes a later micro-batch is likely to need when lengths drift from those that packed
    as ``shapes``, likeliest first: one rung more rows at the same row length (lengths grow a
    little), then at the next longer row bucket the rows that hold as many tokens (a sequence
    outgrows the row). Only ``possible_shapes(cfg)``, none of ``shapes``."""
    possible, given = possible_shapes(cfg), set(shapes)
    more_rows, longer_rows = [], []
    for rows, length in sorted(given):
        more_rows.append((row_count_bucket(rows + cfg.row_multiple, cfg.row_multiple), length))
        longer = [b for b in cfg.buckets if b > length]
        if longer:
            rows_needed = row_count_bucket(-(-rows * length // longer[0]), cfg.row_multiple)
            longer_rows.append((rows_needed, longer[0]))
    ordered = dict.fromkeys(s for s in more_rows + longer_rows if s in possible and s not in given)
    return list(ordered)


@dataclasses.dataclass
class PackedBatch:
    """One micro-batch packed into rows. All arrays are [R, T]; position j predicts token j+1.

    tokens, segment_ids (1.. per sequence in a row, 0 = padding), positions (restart at 0 per
    sequence): model inputs. targets: next token of the same sequence (0 where none).
    loss_mask: 1.0 iff targets is a policy-generated output token. behav_logprobs, versions
    (-1 where masked), advantages: of the target token, 0 where masked. seq_index: index of the
    trajectory in this micro-batch (-1 padding). placements [N, 4]: per trajectory
    (row, offset, prompt_len, output_len). traj_index [N]: index into the packed list.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    advantages: np.ndarray
    seq_index: np.ndarray
    placements: np.ndarray
    traj_index: np.ndarray

    # Each [R, T] field with its dtype and padding value.
    ROW_FIELDS = {
        "tokens": (np.int32, 0), "segment_ids": (np.int32, 0), "positions": (np.int32, 0),
        "targets": (np.int32, 0), "loss_mask": (np.float32, 0), "behav_logprobs": (np.float32, 0),
        "versions": (np.int32, -1), "advantages": (np.float32, 0), "seq_index": (np.int32, -1),
    }  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens.shape

    @property
    def n_valid_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def n_sequences(self) -> int:
        """Trajectories with at least one loss-mask token (the seq-mean count)."""
        return len(np.unique(self.seq_index[self.loss_mask > 0]))

    def arrays(self) -> dict[str, np.ndarray]:
        """The [R, T] arrays by name (what goes to the device)."""
        return {name: getattr(self, name) for name in self.ROW_FIELDS}


def _output_advantages(adv, traj: Trajectory, i: int) -> np.ndarray:
    """Per-output-token advantages [O] from a scalar or an [O] array."""
    a = np.asarray(adv, dtype=np.float32)
    n_out = len(traj.output_ids)
    if a.ndim == 0:
        return np.full(n_out, a, dtype=np.float32)
    if a.shape != (n_out,):
        raise ValueError(
            f"advantages[{i}] has shape {a.shape}; expected a scalar or ({n_out},) for the "
            f"trajectory's output tokens"
        )
    return a


def _row_layout(
    lengths: Sequence[int],
    buckets: Sequence[int],
    row_multiple: int,
    attention_break_even: int | None,
    one_per_row: bool,
    known: Collection[tuple[int, int]],
    reuse_tolerance: float,
) -> tuple[int, int, list[list[int]]]:
    """(T, R, rows) of one micro-batch: ``padded_row_layout``'s with ``one_per_row``, else
    ``choose_row_layout``'s."""
    if one_per_row:
        return padded_row_layout(lengths, buckets, row_multiple)
    return choose_row_layout(
        lengths, buckets, row_multiple, attention_break_even, known, reuse_tolerance
    )


def pack_micro_batch(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | np.ndarray],
    buckets: Sequence[int],
    row_multiple: int = 1,
    attention_break_even: int | None = None,
    one_per_row: bool = False,
    known: Collection[tuple[int, int]] = (),
    reuse_tolerance: float = 1.0,
) -> PackedBatch:
    """Pack one micro-batch of trajectories into [R, T] rows (see ``PackedBatch``).

    ``advantages[i]`` is a scalar or a per-output-token array [O_i] for ``trajectories[i]``;
    the layout is ``choose_row_layout``'s (given ``known`` shapes and ``reuse_tolerance``), or
    ``padded_row_layout``'s with ``one_per_row``.
    """
    if not trajectories:
        raise ValueError("cannot pack an empty micro-batch")
    row_len, n_rows, rows = _row_layout(
        [t.length for t in trajectories], buckets, row_multiple, attention_break_even,
        one_per_row, known, reuse_tolerance,
    )
    return _fill_rows(trajectories, advantages, (n_rows, row_len), rows)


def _fill_rows(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | np.ndarray],
    shape: tuple[int, int],
    rows: list[list[int]],
) -> PackedBatch:
    """The PackedBatch of ``shape`` holding ``rows`` (trajectory indices per row, in order)."""
    if len(advantages) != len(trajectories):
        raise ValueError(
            f"advantages has {len(advantages)} entries for {len(trajectories)} trajectories"
        )
    fields = PackedBatch.ROW_FIELDS.items()
    out = {name: np.full(shape, fill, dtype) for name, (dtype, fill) in fields}
    placements = np.zeros((len(trajectories), 4), np.int32)
    for r, members in enumerate(rows):
        offset = 0
        for seg, i in enumerate(members, start=1):
            traj = trajectories[i]
            adv = _output_advantages(advantages[i], traj, i)
            n_p, n_o = len(traj.prompt_ids), len(traj.output_ids)
            span = slice(offset, offset + n_p + n_o)
            out["tokens"][r, span] = np.concatenate([traj.prompt_ids, traj.output_ids])
            out["segment_ids"][r, span] = seg
            out["positions"][r, span] = np.arange(n_p + n_o)
            out["seq_index"][r, span] = i
            # Output token k is predicted at sequence position n_p - 1 + k.
            pred = slice(offset + n_p - 1, offset + n_p - 1 + n_o)
            mask = traj.output_mask.astype(bool)
            out["targets"][r, pred] = traj.output_ids
            out["targets"][r, offset : offset + n_p - 1] = traj.prompt_ids[1:]
            out["loss_mask"][r, pred] = mask
            out["behav_logprobs"][r, pred] = np.where(mask, traj.behav_logprobs, 0.0)
            out["versions"][r, pred] = np.where(mask, traj.versions, -1)
            out["advantages"][r, pred] = np.where(mask, adv, 0.0)
            placements[i] = (r, offset, n_p, n_o)
            offset += n_p + n_o
    return PackedBatch(
        **out, placements=placements, traj_index=np.arange(len(trajectories), dtype=np.int32)
    )


def micro_batch_layouts(
    lengths: Sequence[int], cfg: MicroBatchConfig, known: Collection[tuple[int, int]] = (),
    split: bool = False,
) -> list[tuple[list[int], tuple[int, int], list[list[int]]]]:
    """How a minibatch of sequences of ``lengths`` tokens is cut and laid out (Algorithm 1,
    or the fixed count of ``cfg.mode``), preferring ``known`` (already compiled) shapes, and
    those of the micro-batches before, within ``cfg.reuse_tolerance``: one known shape holding
    a micro-batch, or (``split``, dynamic mode) parts of one (``split_into_known``) where the
    best layout is a new shape. Without ``split``: the shapes worth compiling for it.

    Per micro-batch: (its sequence indices, its shape (R, T), its rows as lists of positions
    in those indices). Arrays are not built: ``pack_micro_batches`` fills them.
    """
    fixed = cfg.mode == "fixed"
    if fixed:
        plan = plan_fixed_micro_batches(lengths, cfg.num_micro_batches, cfg.token_budget)
    else:
        plan = plan_micro_batches(lengths, cfg.token_budget,
                                  min(cfg.min_micro_batches, len(lengths)))
    layouts, known = [], set(known)
    for members in plan:
        sizes = [lengths[i] for i in members]
        row_len, n_rows, rows = _row_layout(
            sizes, cfg.buckets, cfg.row_multiple, cfg.attention_break_even, fixed, known,
            cfg.reuse_tolerance,
        )
        parts = None
        if split and not fixed and (n_rows, row_len) not in known:
            parts = split_into_known(
                sizes, known, cfg.reuse_tolerance * layout_cost(n_rows, row_len,
                                                                cfg.attention_break_even),
                cfg.row_multiple, cfg.attention_break_even)
        if parts is None:
            layouts.append((members, (n_rows, row_len), rows))
            known.add((n_rows, row_len))  # the next micro-batches may share its program
        else:
            layouts += [([members[i] for i in part], shape, part_rows)
                        for part, shape, part_rows in parts]
    return layouts


def pack_micro_batches(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | np.ndarray],
    cfg: MicroBatchConfig,
    known: Collection[tuple[int, int]] = (),
    split: bool = False,
) -> list[PackedBatch]:
    """Pack a minibatch into the micro-batches ``micro_batch_layouts`` plans for it.

    Each result's ``traj_index`` maps its local trajectory index to the position in
    ``trajectories``.
    """
    if len(advantages) != len(trajectories):
        raise ValueError(
            f"advantages has {len(advantages)} entries for {len(trajectories)} trajectories"
        )
    packed = []
    for members, shape, rows in micro_batch_layouts([t.length for t in trajectories], cfg, known,
                                                    split):
        batch = _fill_rows([trajectories[i] for i in members], [advantages[i] for i in members],
                           shape, rows)
        batch.traj_index = np.asarray(members, dtype=np.int32)
        packed.append(batch)
    return packed


def unpack_outputs(values: np.ndarray, placements: np.ndarray) -> list[np.ndarray]:
    """Per-trajectory slices [O_i] of a predicted-token-aligned [R, T] array.

    ``out[i][k]`` is the value at the position predicting output token k of trajectory i,
    e.g. recomputed log-probs or KL terms.
    """
    values = np.asarray(values)
    result = []
    for row, offset, n_p, n_o in np.asarray(placements):
        start = offset + n_p - 1
        result.append(values[row, start : start + n_o].copy())
    return result
