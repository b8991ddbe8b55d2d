"""Drive a model through the decode path token by token, with an infinikv policy owning the KV cache.

The Generator prefills a whole prompt and then samples. Evaluation needs more control: teacher forcing (feed a
known token at every decode step, so the policy's selection decides every scored prediction) and feeding a
question through the decode path before the answer is generated. :class:`DecodeRun` does exactly that on
the engine's own prefill and decode step (:class:`~infinikv.engine.forced.ForcedRows`): each row is one
sequence with its own cache, its prompt read in chunks from its start and each token fed through the
engine's decode step, so a row's figures are those of its sequence served alone (prompt chunks of
``prefill_chunk`` tokens), whatever rows run beside it.

It also measures the three costs of a policy, each as a fraction of the dense KV cache: the bytes it copied
from the host pool during decode, against what full offload would move for the same steps (every layer's
whole cache, every step); the bytes it keeps resident on the compute device (and, apart, its largest copy:
the fetch buffer); and its selector's work, the bytes it read to choose, on the same scale as the bytes
moved, and its share of the decode time.

A :class:`~infinikv.forward.PrefillMemo` shared between runs records the first prefill of a prompt in each
prefill family and replays it into the next runs of that family (each row's prompt apart), so a sweep runs
the model over each prompt once per family, not once per policy. The replayed cache holds exactly what the
policy's own prefill would have built.
"""

from __future__ import annotations

from typing import Any

import torch

from ..clock import now
from ..engine.forced import ForcedRows
from ..forward import PrefillMemo
from ..models import LoadedModel
from ..policies import POLICIES, Policy, PolicyConfig, prepare

Tensor = torch.Tensor
# A run's costs beside the bytes it moved (``kv_fetched_fraction``), each a fraction (DecodeRun.stats)
COSTS = ("device_resident_fraction", "fetch_buffer_fraction", "selector_fraction", "selector_time_fraction")
# The decode path a result was measured on (its ``decode_path``): the engine's prefill and decode step,
# each row alone. Results without it came from a left-padded batch's Driver, whose bits can differ.
DECODE_PATH = "engine"


def policy_name(config: PolicyConfig) -> str:
    """The registered name of the policy that ``config`` configures."""
    return next(name for name, cls in POLICIES.items() if cls.config_class is type(config))


class DecodeRun:
    """One batch of equal-length sequences: ``prefill`` once, then ``step`` one token per row at a time.

    Not thread-safe; call :meth:`close` (or use it as a context manager) to release the policy's pool.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        policy: PolicyConfig | Policy,
        prefill_chunk: int = 2048,
        memo: PrefillMemo | None = None,
    ):
        """``policy``: a config, or a policy object built for this model (then its ``prepare`` is the
        caller's, and it serves one row)."""
        self.loaded = loaded
        if isinstance(policy, PolicyConfig):
            prepare(policy, loaded)  # e.g. InfiniGen's calibration, once per model
        self.policy = policy
        self.rows: ForcedRows | None = None  # made by prefill, one row per prompt
        self.prefill_chunk = prefill_chunk
        self.memo = memo
        self.length = 0  # tokens fed so far
        self.batch = 0
        self._h2d_after_prefill = 0
        self._offload_bytes = 0  # what full offload would copy over the decode steps so far
        self._context_sum = 0.0  # tokens attendable (cached + new; a window at most), summed over steps
        self._steps = 0
        self._decode_s = 0.0
        spec = loaded.spec
        dtype_bytes = next(loaded.model.parameters()).element_size()
        self._bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes
        self._windows = spec.sliding_window

    def __enter__(self) -> DecodeRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.rows is not None:
            self.rows.close()

    def prefill(self, input_ids: Tensor) -> Tensor:
        """Read ``input_ids`` [batch, tokens] densely, each row alone (in chunks); return the last position's
        logits [batch, vocab]. Called once."""
        if self.rows is not None:
            raise ValueError("a DecodeRun prefills once")
        self.batch, total = input_ids.shape
        self.rows = ForcedRows(self.loaded, [self.policy] * self.batch)
        chunk, memo = self.prefill_chunk, self.memo
        rows = range(self.batch)
        logits = torch.cat([self.rows.prefill(r, input_ids[r : r + 1], chunk, memo) for r in rows])
        self.length = total
        self._h2d_after_prefill = self.rows.stats()["bytes_h2d"]
        return logits.float()

    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per row ([batch]) through the decode path; return next-token logits [batch, V]."""
        self._offload_bytes += self._bytes_per_token * self.batch * self.length
        seen = self.length + 1
        attendable = [seen if window is None else min(seen, window) for window in self._windows]
        self._context_sum += sum(attendable) / len(attendable)
        self._steps += 1
        start = now(self.loaded.device)
        logits = self.rows.step(range(self.batch), tokens).float()
        self._decode_s += now(self.loaded.device) - start
        self.length += 1
        return logits

    def stats(self) -> dict[str, Any]:
        """The policy's statistics plus the fractions of the KV cache it moved and attended during decode.

        ``kv_fetched_fraction``: bytes copied from the host pool during decode / bytes full offload would
        copy for the same steps (None when the policy keeps its cache on the compute device and moves
        nothing). ``kv_attended_fraction``: tokens attended per layer and step / tokens the layer could attend
        (all cached tokens, or its window on a sliding-window layer).
        ``kv_fraction``: the first when defined, else the second (dense: 1.0) — the x axis of the plots.
        ``device_resident_fraction``: bytes the policy keeps on the compute device at the end (its KV, partial
        keys, summaries) / the dense KV cache of the tokens seen; ``fetch_buffer_fraction``: its largest copy
        (one layer's fetch) on the same scale. ``selector_fraction``: bytes its selector read during decode /
        what full offload would copy; ``selector_time_fraction``: the selector's share of the decode time.
        """
        stats = self.rows.stats()
        moved = stats["bytes_h2d"] - self._h2d_after_prefill
        host = stats.get("kv_bytes_host", 0) > 0
        fetched = moved / self._offload_bytes if host and self._offload_bytes else None
        mean_context = self._context_sum / self._steps if self._steps else 0.0
        attended = stats.get("mean_tokens_attended", 0.0) / mean_context if mean_context else None
        stats.update(
            decode_path=DECODE_PATH,
            decode_steps=self._steps,
            decode_bytes_h2d=moved,
            offload_equivalent_bytes=self._offload_bytes,
            kv_fetched_fraction=fetched,
            kv_attended_fraction=attended,
            kv_fraction=fetched if fetched is not None else attended,
        )
        dense_kv = self._bytes_per_token * self.batch * self.length
        stats.update(
            device_resident_fraction=stats.get("kv_bytes_device", 0) / dense_kv if dense_kv else None,
            fetch_buffer_fraction=stats.get("fetch_peak_bytes", 0) / dense_kv if dense_kv else None,
            selector_fraction=stats["selector_bytes"] / self._offload_bytes if self._offload_bytes else None,
            selector_time_fraction=stats["selector_s"] / self._decode_s if self._decode_s else None,
        )
        return stats
