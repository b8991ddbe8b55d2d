"""The transformers ``Cache`` that hands every attention layer to an infinikv policy.

The cache is called three times per layer and step (``hooks.py`` installs what calls it):

1. ``before_attention``, from the pre-attention hook: in a decode step it gives the policy the layer's own
   normalised input x (``policy.before_attention``) and, for a policy that declares ``prefetches``, runs the
   look-ahead, ``policy.plan(i + 1, x, position_ids, queries)`` (layer 0 also plans itself; ``queries``:
   x's projections shared by an engine step's rows, else None), in the order :func:`in_order` picks: layer
   0 and a copier without a worker do the layer's own work first; a CPU worker takes the look-ahead first,
   so it runs beside the layer's own choice. An engine step hands each policy class a layer's input for all
   its rows at once (``Policy.before_attention_rows``, ``Policy.plan_rows``, from ``engine/ragged.py``),
   and where its copier runs everything at once, runs a layer's look-ahead at the next layer's hook
   instead (``RaggedCache.puts_off``);
2. ``update`` (called by the attention module after q/k/v and RoPE): prefill chunks go to
   ``policy.prefill``, decode tokens to ``policy.decode``, which returns the K/V the layer attends to;
3. ``attend``, from the registered attention function: it fits the model's mask to the policy's selection
   and calls ``policy.attend``. A layer that chooses with its own query (``policy.chooses_with_query``:
   Quest, the oracle) is decoded here instead of in ``update``, after ``policy.take_query`` hands it the
   query the model computed (in an engine step, ``Policy.take_query_rows`` hands a policy class its rows'
   queries at once, before any of them decodes: ``waits_for_query``, ``query_taken``).

A forward pass is a prefill when it carries more than one token or the cache is empty; a decode step
feeds exactly one token per sequence.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from .errors import ModelError
from .hooks import ONE_USE, UNSUPPORTED, PolicyCache, install, store
from .kvpool import KVPool
from .paged import BlockStore
from .policies import Policy, PolicyConfig, Selection, make_policy
from .spec import QueryOf, model_spec

Tensor = torch.Tensor


class PolicyLayer(CacheLayerMixin):
    """One layer's view of a cache that routes it to policies (``store_and_select`` and ``seq_length`` of
    ``cache``), in the shape transformers' ``Cache`` expects."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: PolicyCache, layer: int, sliding: bool):
        super().__init__()
        # by a weak reference: the cache holds its layers, and a cycle would keep a finished sequence's
        # policy and K/V until the interpreter's cycle collector runs
        self._cache = weakref.ref(cache)
        self.layer = layer
        self.is_sliding = sliding

    @property
    def cache(self) -> PolicyCache:
        return self._cache()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        return store(self.cache, self.layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.cache.seq_length(self.layer)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Masks always span every position seen; the attention function picks the selected columns.
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def in_order(policy: Policy, layer: int, own: Callable[[], None], ahead: Callable[[], None]) -> None:
    """Run a decode step's ``own`` work of ``layer`` and its look-ahead ``ahead``. Layer 0 starts its own copy
    before the look-ahead for layers 0 and 1; after that the pool's copier orders them
    (``Copier.in_order``): a worker runs the look-ahead beside the layer's own choice."""
    pool = policy.pool()
    if layer == 0 or pool is None:
        own()
        ahead()
    else:
        pool.copier.in_order(own, ahead)


class InfinikvCache(PolicyCache):
    """A transformers ``Cache`` whose storage and selection belong to an infinikv policy.

    Works with infinikv's Generator and as a drop-in for ``model.generate(past_key_values=cache)``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        policy: Policy | PolicyConfig | str = "dense",
        device: torch.device | str | None = None,
        **knobs,
    ):
        install(model)
        spec = model_spec(model)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, spec, device, **knobs)
        self._selections: dict[int, Selection] = {}
        # decode steps' new K/V of layers that choose with their own query, until attend() has the query
        self._waiting: dict[int, tuple[Tensor, Tensor]] = {}
        # layers whose query the policy took with other sequences' (Policy.take_query_rows), not attended yet
        self._queried: set[int] = set()
        # When a list: every prefill call (layer, K, V, key_valid) is appended, for forward.PrefillMemo.
        self.prefill_log: list[tuple[int, Tensor, Tensor, Tensor | None]] | None = None
        layers = [PolicyLayer(self, i, spec.is_sliding(i)) for i in range(spec.num_layers)]
        super().__init__(layers=layers)

    def reserve(self, tokens: int) -> None:
        """Expect prompts of about ``tokens`` tokens per row (``Policy.reserve``)."""
        self.policy.reserve(tokens)

    def draw_from(self, blocks: BlockStore) -> None:
        """Store the policy's host pool in ``blocks``, a block store shared with other caches (the engine's),
        instead of its own (``KVPool.draw_from``); before the first prompt chunk."""
        pool = self.policy.pool()
        if pool is not None:
            pool.draw_from(blocks)

    # -- called by the pre-attention hook ------------------------------------------------------------------
    def before_attention(
        self,
        layer: int,
        x: Tensor,
        mask: Tensor | None,
        position_ids: Tensor,
        queries: QueryOf | None = None,
    ) -> None:
        """``queries``: this row's queries from ``x``, projected once for every row of an engine step
        (``spec.SharedQueries``; None: a policy projects ``x`` itself)."""
        if not self.begin_layer(layer, x, mask):
            return
        policy = self.policy
        pool = policy.pool()
        if layer == 0 and pool is not None:  # before any of the step's look-aheads and copies starts
            KVPool.size_step([pool])

        def own() -> None:
            policy.before_attention(layer, x, position_ids, queries)

        def ahead() -> None:
            for target in self.look_ahead_targets(layer):
                policy.plan(target, x, position_ids, queries)

        in_order(policy, layer, own, ahead)

    def begin_layer(self, layer: int, x: Tensor, mask: Tensor | None) -> bool:
        """Hand the policy which cached positions are real tokens (the last query row of a full-attention
        layer's mask); whether this forward pass is a decode step."""
        decode = self._is_decode(layer, x.shape[1])
        if not self.policy.spec.is_sliding(layer):
            self.policy.set_key_valid(None if mask is None else mask[:, 0, -1, :], decode)
        return decode

    def look_ahead_targets(self, layer: int) -> tuple[int, ...]:
        """The layers a decode step plans from ``layer``'s input: the next one, so that its copy overlaps
        this layer (layer 0 plans itself too), for a policy that ``prefetches``; none for the others."""
        if not self.policy.prefetches:
            return ()
        targets = (0, 1) if layer == 0 else (layer + 1,)
        return tuple(target for target in targets if target < self.policy.spec.num_layers)

    # -- called from the attention module via Cache.update -------------------------------------------------
    def store_and_select(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self._is_decode(layer, k.shape[2]):
            if self.policy.chooses_with_query(layer):  # decoded in attend(), with the model's own query
                self._waiting[layer] = (k, v)
                self._queried.discard(layer)  # a step that failed before its attend() took none
                return k, v
            return self.selected(layer, self.policy.decode(layer, k, v))
        self._selections.pop(layer, None)
        self._waiting.pop(layer, None)
        self._queried.discard(layer)
        if self.prefill_log is not None:
            self.prefill_log.append((layer, k, v, self.policy.key_valid))
        return self.policy.prefill(layer, k, v)

    def waits_for_query(self, layer: int) -> bool:
        """Whether ``layer``'s decode step waits for the layer's query (``attend`` decodes it)."""
        return layer in self._waiting

    def query_taken(self, layer: int) -> None:
        """The policy took ``layer``'s query of this step with other sequences' (``Policy.take_query_rows``):
        ``attend`` does not hand it again."""
        self._queried.add(layer)

    def decodes_in_update(self, layer: int, q_len: int) -> bool:
        """Whether ``Cache.update`` of ``layer`` with ``q_len`` new tokens is a decode step that the policy
        decodes there (``policy.decode``; not one that waits for the layer's query)."""
        return self._is_decode(layer, q_len) and not self.policy.chooses_with_query(layer)

    def selected(self, layer: int, selection: Selection) -> tuple[Tensor, Tensor]:
        """Keep the policy's decode ``selection`` of ``layer`` for ``attend``; the K/V it attends to."""
        self._selections[layer] = selection
        return selection.keys, selection.values

    def seq_length(self, layer: int) -> int:
        return self.policy.seq_length(layer)

    def _is_decode(self, layer: int, q_len: int) -> bool:
        return q_len == 1 and self.policy.seq_length(layer) > 0

    # -- called by the registered attention function -------------------------------------------------------
    def attend(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scaling: float
    ) -> Tensor:
        return self.policy.attend(layer, q, *self.attention_inputs(layer, q, k, v, mask), scaling)

    def attention_inputs(
        self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The K/V and mask ``policy.attend`` gets for ``layer``'s attention with query ``q``: in a decode
        step, the policy's selection (decoded now where the layer waited for its query) and the mask entries
        of the positions it holds."""
        waiting = self._waiting.pop(layer, None)
        if waiting is not None:
            if layer in self._queried:
                self._queried.discard(layer)
            else:
                self.policy.take_query(layer, q[:, :, -1])
            selection = self.policy.decode(layer, *waiting)
            k, v = selection.keys, selection.values
        else:
            selection = self._selections.pop(layer, None)
            if selection is not None:  # a compiled step hands the new token's K/V, not the selection
                k, v = selection.keys, selection.values
        if q.shape[2] == 1 and selection is not None:
            if mask is not None:
                mask = mask[:, :, -1:, :]
                if selection.positions is not None:
                    # Pick the mask entries of the selected positions, per KV head: [batch, kv_heads, 1, n].
                    columns = mask.expand(-1, selection.positions.shape[1], -1, -1)
                    mask = torch.gather(columns, 3, selection.positions[:, :, None, :])
            if selection.valid is not None:  # entries the policy hides (a narrower row's extras)
                hidden = selection.valid[:, :, None, :]
                mask = hidden if mask is None else mask & hidden
        elif mask is not None and q.shape[2] == 1:
            mask = mask[:, :, -1:, :]
        return k, v, mask

    def stats(self) -> dict:
        return self.policy.stats()

    # -- what a policy's storage cannot do ----------------------------------------------------------------
    # Beam search, contrastive search and assisted decoding reorder, repeat or crop the cached rows; the
    # policies keep per-row side state (scores, pages, pools) that cannot follow, so these are refused.
    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise ModelError(UNSUPPORTED)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ModelError(UNSUPPORTED)

    def batch_select_indices(self, indices: Tensor) -> None:
        raise ModelError(UNSUPPORTED)

    def crop(self, tokens_to_remove: int) -> None:
        raise ModelError(UNSUPPORTED)

    def reset(self) -> None:
        raise ModelError(f"an InfinikvCache cannot be reset; {ONE_USE}")

    def close(self) -> None:
        self.policy.close()
