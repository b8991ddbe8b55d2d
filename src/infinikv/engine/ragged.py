"""One decode step over sequences of different lengths, each with its own cache and policy.

The model runs once over the step's rows: embeddings, norms, projections, RoPE (each row at its own
position) and MLPs are one batched computation. Attention is per sequence: :class:`RaggedCache` hands
each row's normalised input, new K/V and query to that sequence's own ``InfinikvCache``, which asks its
policy as it would with the sequence alone, and stacks the rows' outputs. No row is padded to another's
length, and a row's selection, its copies and its attention follow its own sequence alone, by the same
rules and in the same order. Their inputs come from the batched projections, which give each row what
it gets in a step alone, bit for bit (``invariant.rows_alone``, inside ``forward.decode_rows``). A look-ahead
that projects its input to a layer's query (InfiniGen's rehearsal) gets its row of one projection of
every row (``spec.SharedQueries``): one call for all rows, not one by each row's policy.
Where nothing would run beside it, a layer's look-ahead waits for the next layer's start, so that such a
projection shares one product with that layer's own query (``RaggedCache.puts_off``).
A layer's own work, look-ahead, decode, for rows whose layer waits for its query that query, and the
attention reach each policy class once for all its rows (``Policy.before_attention_rows``, ``plan_rows``,
``decode_rows``, ``take_query_rows``, ``attend_rows``): a class may take its rows together where each
still gets what it gets alone (InfiniGen scores them in one product, Quest picks their pages in one pass,
H2O attends its rows of one width in one pass); a row whose layer waits for its query decodes through its
own cache.

The model's own decode mask spans the longest row; it is not used. A row needs no mask on a full-attention
layer (it attends to what its policy selected) and its own window on a sliding layer, built here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache import InfinikvCache, PolicyLayer, in_order
from ..forward import decode_rows
from ..hooks import PolicyCache
from ..kvpool import KVPool
from ..models import LoadedModel
from ..policies import Policy, RowAttention, StepRows
from ..spec import ModelSpec, SharedQueries

Tensor = torch.Tensor


def decode_step(
    loaded: LoadedModel, caches: list[InfinikvCache], past: list[int], tokens: Tensor, compile: bool = False
) -> Tensor:
    """The engine's decode step: row r feeds ``tokens[r]`` at position ``past[r]`` through ``caches[r]``
    (which holds ``past[r]`` tokens); returns the next-token logits [rows, vocab]. ``compile``:
    ``forward.decode_call``."""
    cache = RaggedCache(loaded.spec, caches, past, compile)
    return decode_rows(loaded, cache, tokens, torch.tensor(past), compile)


class RaggedCache(PolicyCache):
    """The caches of one decode step's rows: ``rows[r]`` holds ``past[r]`` tokens before this step;
    ``compiled``: the step's model runs as a compiled graph (``forward.decode_call``)."""

    def __init__(self, spec: ModelSpec, rows: list[InfinikvCache], past: list[int], compiled: bool = False):
        self.spec = spec
        self.rows = rows
        self.past = past
        self.compiled = compiled
        # a look-ahead put off to the next layer, which it plans (puts_off): its input's queries, the work
        self._put_off: tuple[SharedQueries, Callable[[], None]] | None = None
        self.longest = max(past)
        self._selected: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._windows: dict[int, list[Tensor]] = {}  # sliding window -> each row's mask
        self._real: list[Tensor] | None = None  # each row's full-attention mask, all True
        # each row's positions, sliced once a step (a look-ahead projecting its row's query takes them from
        # the step's shared projections, spec.SharedQueries, instead)
        self._positions: list[Tensor] | None = None
        super().__init__(layers=[PolicyLayer(self, i, spec.is_sliding(i)) for i in range(spec.num_layers)])

    def seq_length(self, layer: int) -> int:
        # The model's own mask, which spans the longest row, is built from it and not used.
        return self.longest

    def before_attention(self, layer: int, x: Tensor, mask: Tensor | None, position_ids: Tensor) -> None:
        if self._put_off is not None:  # the look-ahead for this layer, first, as it would have run
            ahead_queries, planned = self._put_off
            self._put_off = None
            ahead_queries.beside(layer, x)
            planned()
        # A row's own mask: every position real (the policy's key_valid, as for an unpadded row alone).
        if self._real is None:
            device = self.rows[0].policy.device
            self._real = [torch.ones(1, 1, 1, n + 1, dtype=torch.bool, device=device) for n in self.past]
            self._positions = [position_ids[r : r + 1] for r in range(len(self.rows))]
            # every row's copier sizes the step by all its rows (their look-aheads share the step's cores)
            KVPool.size_step([pool for row in self.rows if (pool := row.policy.pool()) is not None])
        queries = SharedQueries(self.spec, None if self.compiled else layer, x, position_ids)
        decoding = [
            r
            for r, row in enumerate(self.rows)
            if row.begin_layer(layer, x[r : r + 1], None if self.spec.is_sliding(layer) else self._real[r])
        ]

        # each policy class takes a layer's own work and its look-ahead for all its rows at once
        # (Policy.before_attention_rows, Policy.plan_rows)
        classes: dict[tuple[type, tuple[int, ...]], list[int]] = {}
        for r in decoding:
            row = self.rows[r]
            classes.setdefault((type(row.policy), row.look_ahead_targets(layer)), []).append(r)

        inputs: dict[tuple[type, tuple[int, ...]], tuple[list[Policy], StepRows]] = {
            key: (
                [self.rows[r].policy for r in rows],
                StepRows(
                    [x[r : r + 1] for r in rows],
                    [self._positions[r] for r in rows],
                    [queries.of_row(r) for r in rows],
                ),
            )
            for key, rows in classes.items()
        }

        def own() -> None:
            for (policy_class, _), (policies, step_rows) in inputs.items():
                policy_class.before_attention_rows(policies, layer, step_rows)

        def ahead() -> None:
            for (policy_class, targets), (policies, step_rows) in inputs.items():
                for target in targets:
                    policy_class.plan_rows(policies, target, step_rows)

        if decoding:  # ordered by the first row with a pool (the rows' copiers are of one kind)
            pooled = [self.rows[r].policy for r in decoding if self.rows[r].policy.pool() is not None]
            first = (pooled or [self.rows[decoding[0]].policy])[0]
            targets = {target for _, class_targets in classes for target in class_targets}
            if self.puts_off(layer, first, targets):
                own()
                self._put_off = (queries, ahead)
            else:
                in_order(first, layer, own, ahead)

    def puts_off(self, layer: int, policy: Policy, targets: set[int]) -> bool:
        """Whether ``layer``'s look-ahead, which plans ``targets``, runs at the start of the next layer
        instead: where it plans that layer alone and nothing would overlap it (``policy``'s copier runs it
        at once, ``Copier.overlaps``), so it can wait until that layer's input exists and project its query
        in one call with it (``SharedQueries.beside``: the query weights read once for both, or as vectors
        back to back). Not from
        layer 0, which plans itself too, nor in a compiled step, whose projections are the graph's. The
        model must leave ``layer``'s input as it is until the next layer's hook (Llama and Gemma-3 do: it is
        a normalised tensor of its own that nothing writes to)."""
        pool = policy.pool()
        return (
            layer > 0
            and targets == {layer + 1}
            and not self.compiled
            and (pool is None or not pool.copier.overlaps())
        )

    def store_and_select(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # the rows a policy decodes here, a policy class's at once (Policy.decode_rows); the others (those
        # that wait for the layer's query) through their own cache
        selected: dict[int, tuple[Tensor, Tensor]] = {}
        classes: dict[type, list[int]] = {}
        for r, row in enumerate(self.rows):
            if row.decodes_in_update(layer, k.shape[2]):
                classes.setdefault(type(row.policy), []).append(r)
            else:
                selected[r] = row.store_and_select(layer, k[r : r + 1], v[r : r + 1])
        for policy_class, rows in classes.items():
            policies = [self.rows[r].policy for r in rows]
            row_k, row_v = [k[r : r + 1] for r in rows], [v[r : r + 1] for r in rows]
            for r, selection in zip(
                rows, policy_class.decode_rows(policies, layer, row_k, row_v), strict=True
            ):
                selected[r] = self.rows[r].selected(layer, selection)
        self._selected[layer] = [selected[r] for r in range(len(self.rows))]
        return k, v  # the rows' own K/V reach attend() through _selected

    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        selected = self._selected.pop(layer)
        # the rows whose layer waits for its query: each policy class takes its rows' queries at once
        # (Policy.take_query_rows), then each row decodes through its own cache
        classes: dict[type, list[int]] = {}
        for r, row in enumerate(self.rows):
            if row.waits_for_query(layer):
                classes.setdefault(type(row.policy), []).append(r)
        for policy_class, rows in classes.items():
            policies = [self.rows[r].policy for r in rows]
            policy_class.take_query_rows(policies, layer, [q[r : r + 1, :, -1] for r in rows])
            for r in rows:
                self.rows[r].query_taken(layer)
        inputs = [
            RowAttention(
                q[r : r + 1],
                *row.attention_inputs(layer, q[r : r + 1], keys, values, self._row_mask(layer, r)),
            )
            for r, (row, (keys, values)) in enumerate(zip(self.rows, selected, strict=True))
        ]
        # each policy class attends for all its rows at once (Policy.attend_rows)
        by_class: dict[type, list[int]] = {}
        for r, row in enumerate(self.rows):
            by_class.setdefault(type(row.policy), []).append(r)
        outputs: list[Tensor | None] = [None] * len(self.rows)
        for policy_class, rows in by_class.items():
            policies = [self.rows[r].policy for r in rows]
            attended = policy_class.attend_rows(policies, layer, [inputs[r] for r in rows], scaling)
            for r, out in zip(rows, attended, strict=True):
                outputs[r] = out
        return torch.cat(outputs, dim=0)

    def _row_mask(self, layer: int, row: int) -> Tensor | None:
        """[1, 1, 1, past + 1]: the positions row ``row``'s new token may see on ``layer`` (None: all)."""
        window = self.spec.sliding_window[layer]
        if window is None:
            return None
        if window not in self._windows:
            self._windows[window] = [
                (torch.arange(n + 1, device=self.rows[0].policy.device) > n - window)[None, None, None]
                for n in self.past
            ]
        return self._windows[window][row]
