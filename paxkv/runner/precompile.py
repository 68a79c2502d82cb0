"""The step shapes a fixed-shape run can reach, and the dummy work that compiles each one.

A new shape bucket compiles on its first step, and every running request waits for it (about
a second per program for Llama-3-8B on an H200, `results/serving.md`). Requests arriving over
time mix prefill chunks into running decodes and so reach shapes an all-at-once warm-up does
not. `Runner.precompile` walks the list below before the first request instead, the way
vLLM's TPU backend precompiles its buckets and its GPU backend captures CUDA graphs at start.

Only fixed shapes (the GPU layout: block tables full width, or narrow for short decode steps;
prefill/mixed steps always `max_num_seqs` rows) make the list short: decode steps vary by
their sequence, row and table-width buckets, prefill/mixed steps by their token and row
buckets. Rows are one per sequence; steps
that sample several rows per sequence (n > 1 forks, beams) or ask for logprobs, penalties,
structured outputs or hidden states compile on first use as before.
"""
from __future__ import annotations

from typing import NamedTuple

from paxkv.config import RunnerConfig
from paxkv.cache.kv_layout import kv_layout
from paxkv.engine.step_io import SampleRow, WorkItem
from paxkv.runner.buckets import mixed_step_row_floor, pick_bucket

NULL_BLOCK = 0   # every dummy token is written to the null block, which no sequence owns


class StepShape(NamedTuple):
    """One compiled step program's shape, by a step of real sizes that packs to it."""

    decode_only: bool
    num_tokens: int   # tokens of the step (a decode step: one per sequence)
    num_rows: int     # sampled rows
    table_blocks: int = 1   # a decode step's longest block table (picks the width bucket)


def reachable_step_shapes(config: RunnerConfig) -> list[StepShape]:
    """One representative step per (kind, token or sequence bucket, row bucket) that a run with
    one sampled row per sequence reaches, smallest first."""
    if not config.fixed_shapes:
        raise ValueError("precompile needs fixed step shapes (the GPU layout); on other "
                         "platforms every block-table width is a shape of its own")
    seqs, rows, tokens = config.seq_buckets, config.row_buckets, config.token_buckets
    max_seqs = config.max_num_seqs
    shapes: dict[tuple, StepShape] = {}
    for width in config.block_buckets:
        for n in range(1, max_seqs + 1):
            shapes.setdefault((True, pick_bucket(n, seqs), pick_bucket(n, rows), width),
                              StepShape(True, n, n, width))
    for t in tokens:
        if -(-t // config.max_model_len) > max_seqs:
            continue   # more tokens than max_num_seqs sequences of max_model_len can hold
        # A prefill or mixed step has one sequence with two or more tokens, so at most t - 1
        # sequences (rows) in a step of t tokens.
        floor = mixed_step_row_floor(t, seqs[-1])
        for n in range(1, min(max_seqs, t - 1) + 1):
            shapes.setdefault((False, t, pick_bucket(max(n, floor), rows)), StepShape(False, t, n))
    return list(shapes.values())


# One row per sampler mode (`sampling.rows.sampling_mode`): greedy, sampled, and sampled
# through a filter (top-p here), each its own program: (temperature, top_p).
SAMPLERS = ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9))


def dummy_step(shape: StepShape, config: RunnerConfig,
               sampler: tuple[float, float] = SAMPLERS[0]) -> tuple[list[WorkItem], list[SampleRow]]:
    """Work items and rows that pack to `shape`, every token written to the null block;
    the rows sample with `sampler` ((temperature, top_p), one of `SAMPLERS`)."""
    bs = config.block_size
    extra_groups = kv_layout(config.model).num_groups - 1

    def item(q: int, blocks: int = 0) -> WorkItem:
        table = [NULL_BLOCK] * max(blocks, -(-q // bs))
        return WorkItem([0] * q, 0, table, None, [table] * extra_groups)

    if shape.decode_only:
        items = [item(1, shape.table_blocks) for _ in range(shape.num_tokens)]
    else:
        chunk = min(config.max_model_len, shape.num_tokens)
        items, left = [], shape.num_tokens
        while left:
            q = min(chunk, left)
            items.append(item(q))
            left -= q
    temperature, top_p = sampler
    rows = [SampleRow(i % len(items), temperature, top_p=top_p, seed=i) for i in range(shape.num_rows)]
    return items, rows
