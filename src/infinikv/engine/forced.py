"""Rows fed tokens the caller chooses, on the engine's own prefill and decode step: teacher forcing.

The eval scores a policy by feeding known tokens through the decode path (a perplexity window, a retrieval
question before its answer), and lm-eval's log-likelihoods score a continuation after its context. Each
needs the logits of every step, which the engine's scheduler does not hand out. :class:`ForcedRows` runs
the same two calls the engine makes, without the scheduler:

* each row is one sequence with its own cache and policy instance, its prompt read alone in chunks from its
  start (``forward.Driver.read_prompt``: the engine's ``extend``, recorded in or replayed from a
  ``PrefillMemo`` when one is given);
* each step feeds the rows the caller names one token each, at their own positions
  (``ragged.decode_step``, the engine's decode step: no padding, each row's projections as alone).

So a row's logits are those of its sequence served by the engine alone (with prompt chunks of the same
size), whatever rows run beside it, and rows need not share a length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ..cache import InfinikvCache
from ..forward import Driver, PrefillMemo
from ..models import LoadedModel
from ..policies import Policy, PolicyConfig
from .ragged import decode_step

Tensor = torch.Tensor

# Counters of ``Policy.stats`` that add up over rows (each row's cache moves and holds its own bytes)
SUMMED = (
    "kv_bytes_host",
    "kv_bytes_device",
    "bytes_h2d",
    "bytes_d2h",
    "bytes_h2d_on_demand",
    "prefetch_wait_s",
    "fetch_peak_bytes",
    "selector_bytes",
    "selector_s",
    "selector_inline_s",
)


class ForcedRows:
    """One sequence per entry of ``policies``: a config, or a policy object or an empty cache built for this
    model (which then serves that row only). ``compile``: decode steps run compiled
    (``forward.decode_call``). Not thread-safe; :meth:`close` (or use it as a context manager) releases the
    rows' pools."""

    def __init__(
        self,
        loaded: LoadedModel,
        policies: Sequence[PolicyConfig | Policy | InfinikvCache],
        compile: bool = False,
    ):
        objects = [id(_policy_of(policy)) for policy in policies if not isinstance(policy, PolicyConfig)]
        if not policies:
            raise ValueError("no rows: give a policy per row")
        if len(set(objects)) < len(objects):
            raise ValueError("a policy object serves one row; give a config for several")
        self.loaded = loaded
        self.compile = compile
        self.drivers: list[Driver] = []
        try:
            for policy in policies:
                cache = (
                    policy
                    if isinstance(policy, InfinikvCache)
                    else InfinikvCache(loaded.model, policy, device=loaded.device)
                )
                self.drivers.append(Driver(loaded, cache))
        except BaseException:
            self.close()
            raise
        self.lengths = [0] * len(self.drivers)  # tokens in each row's cache
        self.steps = [0] * len(self.drivers)  # decode steps each row took

    def __enter__(self) -> ForcedRows:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every row's cache, each even when one before it fails (the first failure is raised)."""
        with contextlib.ExitStack() as stack:
            for driver in self.drivers:
                stack.callback(driver.close)

    def prefill(self, row: int, input_ids: Tensor, chunk: int, memo: PrefillMemo | None = None) -> Tensor:
        """Read row ``row``'s prompt (``input_ids``: [1, tokens]) in chunks of ``chunk`` tokens; return its
        last position's logits [1, vocab]."""
        logits = self.drivers[row].read_prompt(input_ids, chunk, memo)
        self.lengths[row] = input_ids.shape[1]
        return logits

    def step(self, rows: Sequence[int], tokens: Tensor) -> Tensor:
        """Feed ``tokens[i]`` to row ``rows[i]`` in one decode step; return the next-token logits
        [len(rows), vocab]."""
        past = [self.lengths[row] for row in rows]
        caches = [self.drivers[row].cache for row in rows]
        logits = decode_step(self.loaded, caches, past, tokens, self.compile)
        for row in rows:
            self.lengths[row] += 1
            self.steps[row] += 1
        return logits

    def stats(self) -> dict[str, Any]:
        """The rows' policy statistics together: the counters in ``SUMMED`` added up, the tokens attended
        averaged over every row's decode steps; any other value is the rows' common one, or the list of
        each row's where they differ (a policy's description of its choices)."""
        rows = [driver.stats() for driver in self.drivers]
        if len(rows) == 1:
            return rows[0]
        out: dict[str, Any] = {}
        for name in rows[0]:
            values = [row.get(name) for row in rows]
            if name in SUMMED:
                out[name] = sum(values)
            else:
                out[name] = values[0] if all(value == values[0] for value in values) else values
        steps = sum(self.steps)
        attended = sum(row["mean_tokens_attended"] * n for row, n in zip(rows, self.steps, strict=True))
        out["mean_tokens_attended"] = attended / steps if steps else 0.0
        return out


def _policy_of(row: Policy | InfinikvCache) -> Policy:
    return row.policy if isinstance(row, InfinikvCache) else row
