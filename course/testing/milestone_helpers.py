"""What the milestones share besides their oracles (course/testing/oracles.py): reproducible prompts,
and where two token lists part, in the words a failing test reports.

- `prompt_ids(length, seed)`: a seeded prompt of byte ids.
- `first_difference(expected, got)`: the first position where two token lists differ.
- `step_difference(expected, got)`: that position as a sentence ("step 3: expected token 7, got 9").
- `assert_same_tokens(what, expected, got)`: fail with the first differing output token and
  both lists.
- `OperatorCounter`: a context that counts the torch operators run inside it, by name (a cost
  contract's "one call, whatever the size" or "this many small operations").

Nothing here imports an implementation, so milestones and the learner's edition can use it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def prompt_ids(length: int, seed: int, vocab: int = 256) -> list[int]:
    """`length` token ids below `vocab` (byte ids by default), the same for the same seed."""
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def first_difference(expected: Sequence[int], got: Sequence[int]) -> int:
    """The first position where the lists hold different tokens; where one is a prefix of the
    other, the shorter one's length (the first token one of them lacks)."""
    return next((i for i, (e, g) in enumerate(zip(expected, got)) if e != g), min(len(expected), len(got)))


def token_at(tokens: Sequence[int], position: int) -> int | str:
    """tokens[position], or "(end)" past the last token."""
    return tokens[position] if position < len(tokens) else "(end)"


def step_difference(expected: Sequence[int], got: Sequence[int], expected_by: str = "expected",
                    got_by: str = "got") -> str:
    """The first difference as one sentence: "step 3: expected token 7, got 9", or, where one
    list is a prefix of the other, "lengths differ: expected 5 tokens, got 4". `expected_by`
    and `got_by` name the two sides (e.g. "transformers" and "ours")."""
    step = first_difference(expected, got)
    if step < min(len(expected), len(got)):
        return f"step {step}: {expected_by} token {expected[step]}, {got_by} {got[step]}"
    return f"lengths differ: {expected_by} {len(expected)} tokens, {got_by} {len(got)}"


def assert_same_tokens(what: str, expected: Sequence[int], got: Sequence[int],
                       oracle: str = "solo generate") -> None:
    """Fail, naming `what` (e.g. "request r3"), the first output token that differs from
    `oracle`'s and both lists, unless the lists are equal."""
    if expected == got:
        return
    import pytest
    i = first_difference(expected, got)
    pytest.fail(f"{what}: output differs from {oracle} at output token {i}: expected {token_at(expected, i)}, "
                f"got {token_at(got, i)}\n  expected {expected}\n  got      {got}")


class OperatorCounter(TorchDispatchMode):
    """`with OperatorCounter() as counter:` counts every torch operator the block runs in
    `counter.ops` ({"add": 3, "index_select": 1, ...}), below autograd and Python wrappers."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
