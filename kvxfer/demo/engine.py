"""The demo's engine loop around `ShardedDecoder`: chunked prefill, then greedy decode.

Prefill is scheduled by `kvxfer.plan.simulate.SimEngine`, which allocates blocks
as vLLM's scheduler does: under a token budget per step, several requests per
step, speculative lookahead blocks past each step's end, and prefix-cache
hits whose blocks already hold the prefix's KV. P runs this loop with a
connector saving after each step; the colocated reference runs the very same
loop without one, so at equal TP the two write the same KV bytes.

Decode follows vLLM's decode instance: with the prompt's KV in place it runs
the last prompt token again (rewriting that token's KV) and samples
greedily, one sequence per step. D and the colocated reference decode with
the same step shapes and the same table length (their caches differ in size,
which changes only which blocks the gather reads), so at equal TP and equal
KV their logits are bit-identical.

Every step has one shape (`[max_seqs, budget]` tokens for prefill, `[1, 1]`
for decode, tables padded to a fixed length): one compile each per mesh.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from kvxfer.demo.model import ShardedDecoder
from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import cdiv
from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.plan.simulate import SimEngine

__all__ = ["AfterStep", "Decoded", "NewBlocksTracker", "Prefilled", "Shapes", "cache_blocks",
           "colocated", "decode", "decode_blocks", "decode_each", "demo_prompts", "pool_blocks",
           "prefill"]

AfterStep = Callable[[list[ScheduledRequest], list[jax.Array], SimEngine], list[jax.Array]]


def demo_prompts(seed: int, lengths: Sequence[int], cached: Sequence[int]) -> list[np.ndarray]:
    """Byte prompts from `seed`. A prompt with a prefix-cache hit of `c` tokens starts with
    the first `c` tokens of an earlier prompt at least that long, as a real hit would."""
    rng = np.random.default_rng(seed)
    prompts: list[np.ndarray] = []
    for n, hit in zip(lengths, cached):
        tokens = rng.integers(0, 256, n, dtype=np.int32)
        donor = next((p for p in prompts if len(p) >= hit), None) if hit else None
        if donor is not None:
            tokens[:hit] = donor[:hit]
        prompts.append(tokens)
    return prompts


@dataclass(frozen=True)
class Shapes:
    """The fixed step shapes of one demo run, the same on P, D and the colocated reference."""

    max_seqs: int  # sequences per prefill step
    budget: int  # tokens per prefill step (and per sequence row)
    prefill_blocks: int  # table length of a prefill row
    decode_blocks: int  # table length of a decode row

    @classmethod
    def of(cls, lengths: Sequence[int], block_size: int, budget: int, lookahead: int,
           decode_tokens: int) -> Shapes:
        longest = max(lengths)
        return cls(max_seqs=len(lengths), budget=budget,
                   prefill_blocks=cdiv(longest + lookahead, block_size),
                   decode_blocks=cdiv(longest + max(lookahead, decode_tokens), block_size))


@dataclass
class Prefilled:
    """One request once its prefill is complete."""

    table: list[int]  # its block table (lookahead blocks included)
    chunks: int  # prefill steps it was scheduled in


def decode_blocks(prompt_tokens: int, steps: int, block_size: int) -> int:
    """Blocks a request's table needs to decode `steps` tokens after its prompt: the first
    step rewrites the last prompt token, so the last decoded token's KV is never written."""
    return cdiv(prompt_tokens + steps - 1, block_size)


def _rows(rows: Sequence[tuple[np.ndarray, int, Sequence[int]]], seqs: int, width: int,
          blocks: int, block_size: int, num_blocks: int) -> tuple[np.ndarray, ...]:
    """Pad `(tokens, start position, table)` rows to one `[seqs, width]` step.

    Every token's position must fall inside its table, and the table's ids
    inside the cache, not on the null block 0: a position past the table
    would read and write block 0 (the padding), and an id past the cache
    would drop the write; neither may pass silently.
    """
    for toks, start, table in rows:
        if len(toks) > width or len(table) > blocks:
            raise InvalidInputError(f"a row of {len(toks)} tokens and {len(table)} blocks does not "
                                    f"fit a step of {width} tokens and {blocks} blocks")
        if cdiv(start + len(toks), block_size) > len(table):
            raise InvalidInputError(f"tokens [{start}, {start + len(toks)}) run past a table of "
                                    f"{len(table)} blocks of {block_size}")
        bad = [b for b in table if not 0 < b < num_blocks]
        if bad:
            raise InvalidInputError(f"block ids {bad[:4]} are outside [1, {num_blocks})")
    tokens = np.zeros((seqs, width), np.int32)
    positions = np.zeros((seqs, width), np.int32)
    valid = np.zeros((seqs, width), bool)
    tables = np.zeros((seqs, blocks), np.int32)
    for i, (toks, start, table) in enumerate(rows):
        tokens[i, : len(toks)] = toks
        positions[i, : len(toks)] = np.arange(start, start + len(toks))
        valid[i, : len(toks)] = True
        tables[i, : len(table)] = table
    return tokens, positions, valid, tables


def prefill(model: ShardedDecoder, caches: list[jax.Array], prompts: Mapping[str, np.ndarray],
            cached: Mapping[str, int], shapes: Shapes, *, lookahead: int, num_blocks: int,
            after_step: AfterStep | None = None) -> tuple[list[jax.Array], dict[str, Prefilled]]:
    """Prefill `prompts` in chunks; `after_step(scheduled, caches, engine)` runs after each
    step's forward (P saves there). Returns the caches and each request's table and chunk count."""
    block_size = model.cfg.block_size
    engine = SimEngine([GroupSpec(block_size)], num_blocks=num_blocks, lookahead=lookahead)
    for req_id, tokens in prompts.items():
        engine.add(req_id, len(tokens), cached.get(req_id, 0))
    chunks: Counter[str] = Counter()
    done: dict[str, Prefilled] = {}
    while len(done) < len(prompts):
        scheduled = engine.schedule(shapes.budget)
        rows = []
        for s in scheduled:
            table = engine.requests[s.req_id].tables[0]
            if s.full_table and s.num_computed_tokens:
                caches = _fill_prefix(model, caches, prompts[s.req_id][: s.num_computed_tokens],
                                      table, shapes)
            end = s.num_computed_tokens + s.num_scheduled_tokens
            rows.append((prompts[s.req_id][s.num_computed_tokens:end], s.num_computed_tokens, table))
            chunks[s.req_id] += 1
        _, caches = model.step(caches, *_rows(rows, shapes.max_seqs, shapes.budget,
                                               shapes.prefill_blocks, block_size, cache_blocks(caches)))
        engine.forward(scheduled)
        if after_step is not None:
            caches = after_step(scheduled, caches, engine)
        for s in scheduled:
            req = engine.requests[s.req_id]
            if req.remaining == 0:
                done[s.req_id] = Prefilled(list(req.tables[0]), chunks[s.req_id])
    return caches, done


def _fill_prefix(model: ShardedDecoder, caches: list[jax.Array], prefix: np.ndarray,
                 table: Sequence[int], shapes: Shapes) -> list[jax.Array]:
    """A prefix-cache hit: the blocks hold the prefix's KV before the request's first step."""
    for start in range(0, len(prefix), shapes.budget):
        row = (prefix[start:start + shapes.budget], start, table)
        _, caches = model.step(caches, *_rows([row], shapes.max_seqs, shapes.budget,
                                               shapes.prefill_blocks, model.cfg.block_size,
                                               cache_blocks(caches)))
    return caches


def cache_blocks(caches: Sequence[jax.Array]) -> int:
    """Blocks in each cache."""
    return caches[0].shape[0]


@dataclass
class Decoded:
    tokens: list[int] = field(default_factory=list)  # greedy, one per step
    logits: list[np.ndarray] = field(default_factory=list)  # [vocab] float32 per step


def decode(model: ShardedDecoder, caches: list[jax.Array], prompt: np.ndarray,
           table: Sequence[int], steps: int, shapes: Shapes) -> tuple[list[jax.Array], Decoded]:
    """Greedy decode of `steps` tokens after `prompt`, whose KV (but for the last token's,
    which the first step rewrites) is in `table`'s blocks. The table must cover
    `len(prompt) + steps - 1` tokens."""
    if not len(prompt) + steps - 1 <= len(table) * model.cfg.block_size <= \
            shapes.decode_blocks * model.cfg.block_size:
        raise InvalidInputError(
            f"a table of {len(table)} blocks does not fit {len(prompt)} prompt tokens + {steps} "
            f"decoded in at most {shapes.decode_blocks} blocks")
    out = Decoded()
    token, position = int(prompt[-1]), len(prompt) - 1
    for _ in range(steps):
        logits, caches = model.step(caches, *_rows([(np.array([token]), position, table)], 1, 1,
                                                    shapes.decode_blocks, model.cfg.block_size,
                                                    cache_blocks(caches)))
        out.logits.append(logits[0, 0])
        token = int(np.argmax(logits[0, 0]))
        out.tokens.append(token)
        position += 1
    return caches, out


def decode_each(model: ShardedDecoder, caches: list[jax.Array], prompts: Mapping[str, np.ndarray],
                tables: Mapping[str, Sequence[int]], steps: int, shapes: Shapes,
                spare: Iterator[int], between: Callable[[], object] | None = None
                ) -> tuple[list[jax.Array], dict[str, Decoded]]:
    """`decode` each prompt in turn; a table too short for the decode takes blocks from `spare`.
    `between()` runs after each request (P answers D there)."""
    out = {}
    for req_id, prompt in prompts.items():
        need = decode_blocks(len(prompt), steps, model.cfg.block_size)
        table = list(tables[req_id][:need])
        table += [next(spare) for _ in range(need - len(table))]
        caches, out[req_id] = decode(model, caches, prompt, table, steps, shapes)
        if between is not None:
            between()
    return caches, out


def pool_blocks(prompts: Mapping[str, np.ndarray], block_size: int, lookahead: int) -> int:
    """Blocks a prefill of `prompts` allocates, plus the null block."""
    return 1 + sum(cdiv(len(p) + lookahead, block_size) for p in prompts.values())


def colocated(model: ShardedDecoder, prompts: Mapping[str, np.ndarray], cached: Mapping[str, int],
              shapes: Shapes, *, lookahead: int, decode_tokens: int) -> dict[str, Decoded]:
    """One instance doing prefill and decode: the reference D's output must equal."""
    pool = pool_blocks(prompts, model.cfg.block_size, lookahead)
    extra = shapes.decode_blocks * len(prompts)
    caches, done = prefill(model, model.new_caches(pool + extra), prompts, cached, shapes,
                           lookahead=lookahead, num_blocks=pool)
    _, out = decode_each(model, caches, prompts, {r: p.table for r, p in done.items()},
                         decode_tokens, shapes, iter(range(pool, pool + extra)))
    return out


class NewBlocksTracker(SaveTracker):
    """The old save rule, kept to show its damage: copy only the blocks newly allocated in a
    step (all of them on a new request's first step), whatever tokens they hold yet.

    The block straddling a chunk boundary is copied half-written and never
    again, and a completing step that allocates no block saves nothing.
    Lookahead blocks past the prompt are left out (D's table does not reach them).
    """

    def _update_table(self, req, step):
        before = [0] * len(self.groups) if step.full_table else [len(t) for t in req.tables]
        super()._update_table(req, step)
        req.added = [range(b, len(t)) for b, t in zip(before, req.tables)]

    def _group_plan(self, spec, req, g, end, done):
        prompt_blocks = cdiv(req.num_prompt_tokens, spec.tokens_per_block)
        return [(i, req.tables[g][i]) for i in req.added[g] if i < prompt_blocks]
