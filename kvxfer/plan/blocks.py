"""Block arithmetic: token ranges, kernel block ids, DCP placement, runs.

Pure integer functions with no JAX import, shared by the save plan (which
plans in the engine's logical block ids) and the copy paths (which move
kernel blocks). docs/save-plans.md gives the formulas.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from kvxfer.errors import InvalidInputError

__all__ = ["NULL_BLOCK", "block_range", "cdiv", "coalesce", "coalesce_pairs", "dcp_location",
           "is_int", "kernel_placement", "kernel_ratio", "table_entries", "to_kernel_ids",
           "to_logical_ids"]

NULL_BLOCK = 0
"""The engine's null block: a placeholder in sliding-window and SSM tables, never copied."""


def cdiv(a: int, b: int) -> int:
    """Ceiling of `a / b` for a non-negative int `a` and a positive int `b`.

    numpy integers are accepted (token counts may come out of numpy arrays);
    bools and floats are not. Raises `InvalidInputError` naming both values.
    """
    if type(a) is not int or type(b) is not int:  # plain ints skip the conversion
        a, b = _cdiv_ints(a, b)
    if a < 0 or b <= 0:
        raise InvalidInputError(
            f"cdiv({a!r}, {b!r}) needs a non-negative int a and a positive int b"
        )
    return -(-a // b)


def _cdiv_ints(a: object, b: object) -> tuple[int, int]:
    """`a` and `b` as plain ints, if both are integers (numpy ones too) other than bools."""
    try:
        if isinstance(a, bool) or isinstance(b, bool):
            raise TypeError
        return operator.index(a), operator.index(b)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidInputError(
            f"cdiv({a!r}, {b!r}) needs ints, got {type(a).__name__} and {type(b).__name__}"
        ) from None


def is_int(value: object) -> bool:
    """A Python int that is not a bool: what kvxfer's ids, counts and sizes must be."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")


def _check_non_negative(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative int, got {value!r}")


def block_range(start: int, end: int, tokens_per_block: int) -> range:
    """Table indices of the blocks holding any token in `[start, end)`.

    A block only partly inside the range (one that straddles `start` or
    `end`) is included: its written part must be copied.
    """
    _check_non_negative("start", start)
    _check_non_negative("end", end)
    _check_positive("tokens_per_block", tokens_per_block)
    if end <= start:
        return range(0)
    return range(start // tokens_per_block, cdiv(end, tokens_per_block))


def kernel_ratio(logical_block_size: int, kernel_block_size: int) -> int:
    """`r`: how many kernel blocks one logical (engine) block spans."""
    _check_positive("logical_block_size", logical_block_size)
    _check_positive("kernel_block_size", kernel_block_size)
    if logical_block_size % kernel_block_size:
        raise InvalidInputError(
            f"logical block size {logical_block_size} is not a multiple of "
            f"kernel block size {kernel_block_size}"
        )
    return logical_block_size // kernel_block_size


def kernel_placement(placed: Iterable[tuple[int, int]], ratio: int) -> list[tuple[int, int]]:
    """The kernel blocks of logical blocks placed in a block table, as `(position, kernel id)`.

    `placed` holds `(table index, logical id)` pairs of non-negative ints (the
    save plan's, or D's checked table entries); each yields its `r = ratio`
    kernel blocks `(index*r + j, L*r + j)`, `j = 0..r-1`, in order. The kernel
    *position* `index*r + j` names a block by the token range it holds, whatever
    its id: P stages and names each block by it, and D writes the block it
    receives at that position of its own table. Both sides call this, so P and
    D cannot disagree on the mapping (the second bug in docs/save-plans.md).
    """
    _check_positive("ratio", ratio)
    if ratio == 1:
        return [(index, logical) for index, logical in placed]
    return [(index * ratio + j, logical * ratio + j) for index, logical in placed
            for j in range(ratio)]


def table_entries(indices: Iterable[int], table: Sequence[int]) -> list[tuple[int, int]]:
    """`(i, table[i])` for each table index, for `kernel_placement`.

    Raises `InvalidInputError` naming the index where the table is too short or
    holds the null block: nothing can be written there.
    """
    size, out = len(table), []
    for i in indices:
        if not 0 <= i < size:
            raise InvalidInputError(f"table entry {i} is past the table's {size} entries")
        block = table[i]
        if block == NULL_BLOCK:
            raise InvalidInputError(f"table entry {i} holds the null block")
        out.append((i, block))
    return out


def to_kernel_ids(logical_ids: Iterable[int], ratio: int) -> list[int]:
    """Kernel block ids covering logical ids: `L -> L*r, ..., L*r + r - 1`, in order."""
    logical_ids = list(logical_ids)
    for logical in logical_ids:
        _check_non_negative("logical block id", logical)
    return [k for _, k in kernel_placement(enumerate(logical_ids), ratio)]


def to_logical_ids(kernel_ids: Iterable[int], ratio: int) -> list[int]:
    """Distinct logical ids owning the kernel ids, in first-seen order.

    Failures are reported to the engine in logical ids: a kernel block that
    failed spoils the whole logical block that holds it.
    """
    _check_positive("ratio", ratio)
    seen: dict[int, None] = {}
    for kernel in kernel_ids:
        _check_non_negative("kernel block id", kernel)
        seen.setdefault(kernel // ratio, None)
    return list(seen)


def dcp_location(
    pos: int, kernel_block_size: int, world: int, interleave: int
) -> tuple[int, int, int]:
    """Where token `pos` lives under decode context parallelism.

    With `W = world` ranks, interleave `I` and kernel block `B`, a table entry
    spans `V = B * W` tokens. Returns `(entry, rank, local_offset)`: the table
    entry `pos // V`, the only rank storing the token `(vo // I) % W`, and its
    offset inside that rank's block `(vo // (W * I)) * I + vo % I`, where
    `vo = pos % V`. NIXL deployments force `I = B`.
    """
    _check_non_negative("pos", pos)
    _check_positive("kernel_block_size", kernel_block_size)
    _check_positive("world", world)
    _check_positive("interleave", interleave)
    if kernel_block_size % interleave:
        raise InvalidInputError(
            f"interleave {interleave} does not divide kernel block size {kernel_block_size}"
        )
    span = kernel_block_size * world
    entry, vo = divmod(pos, span)
    rank = (vo // interleave) % world
    local = (vo // (world * interleave)) * interleave + vo % interleave
    return entry, rank, local


def coalesce(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ids as `(first_id, length)`, in the given order.

    `[3, 4, 5, 9, 10, 2]` -> `[(3, 3), (9, 2), (2, 1)]`. Each run is one copy
    or one NIXL descriptor.
    """
    runs: list[tuple[int, int]] = []
    for block_id in ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def coalesce_pairs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs where source and destination ids both advance by one: `(src0, dst0, length)`.

    A read from P's block `s` into D's block `d` is one descriptor per run.
    """
    if len(src) != len(dst):
        raise InvalidInputError(
            f"source and destination id lists differ in length: {len(src)} != {len(dst)}"
        )
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
