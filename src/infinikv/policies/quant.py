"""``quant``: quantized KV in the host pool, the INT-n baseline of InfiniGen and FlexGen.

Sheng et al., 2023 (FlexGen, https://arxiv.org/abs/2303.06865): group-wise asymmetric min-max quantization,
groups of ``group_size`` along head_dim, ``bits`` 8/4/2 (16 = stored unquantized). Liu et al., 2024 (KIVI,
https://arxiv.org/abs/2402.02750), ``scheme="kivi"``: keys quantized per channel in groups of
``group_size`` tokens, values per token, and the newest ``residual`` tokens (at least, fewer than
``residual + group_size``) kept in full precision on the compute device.

Each code is round((x - min) / scale), scale = (max - min) / (2^bits - 1), so a value comes back within
scale / 2. Codes are packed 8 / bits to a byte; scales and minimums are kept in the KV's dtype. Every decode
step copies a layer's packed codes and scales from the host pool (prefetched while the previous layer
runs), dequantizes them on the device (on a CPU, the look-ahead on the pool's worker dequantizes them too)
and attends densely; bytes moved count the compressed size. Groups
along head_dim are min(group_size, head_dim) wide. KIVI's key groups skip left padding when taking their
minimum and maximum; they are cut on the batch's slot grid, so in a left-padded batch (the bench's) a row
keeps its own groups only when its padding is a whole number of groups; the engine pads nothing. Gemma-3
sliding-window layers copy only what their window needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..copiers import Transfer, on_worker
from ..errors import PolicyError
from ..spec import ModelSpec
from .base import HostPoolPolicy, QueryOf, Selection
from .config import PolicyConfig, knob
from .registry import register

Tensor = torch.Tensor
PARAMS = ("key_scale", "key_min", "value_scale", "value_min")  # stored beside the codes, in the pool


@dataclass(frozen=True)
class QuantConfig(PolicyConfig):
    bits: int = knob(
        4, "bits per value: 8, 4 or 2 (16 = stored unquantized)", low=2, high=16, examples=(2, 8, 16)
    )
    group_size: int = knob(
        64,
        "values per scale and minimum (a group wider than head_dim is the whole head; kivi's key groups: "
        "tokens, and more than the context quantizes none)",
        low=1,
    )
    scheme: str = knob(
        "group",
        '"group": per token, groups along head_dim (FlexGen); "kivi": keys per channel over groups of '
        "tokens, values per token (KIVI)",
        choices=("group", "kivi"),
    )
    residual: int = knob(
        128,
        "kivi only: newest tokens kept in full precision on the device (more than the context: all of them)",
        low=0,
    )

    def __post_init__(self):
        super().__post_init__()
        if self.bits not in (2, 4, 8, 16):
            raise PolicyError(f"bits must be 2, 4, 8 or 16, got {self.bits}", knob="bits")

    def check_spec(self, spec: ModelSpec) -> None:
        if spec.head_dim % min(self.group_size, spec.head_dim):
            raise PolicyError(
                f"quant: group_size {self.group_size} does not divide head_dim {spec.head_dim}",
                knob="group_size",
            )

    @property
    def kivi(self) -> bool:
        """Keys quantized per channel over groups of tokens (at 16 bits nothing is quantized)."""
        return self.scheme == "kivi" and self.bits != 16


# -- codes ---------------------------------------------------------------------------------------------------
def pack(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., d] of ``bits`` bits each -> [..., d * bits / 8] bytes."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.view(*codes.shape[:-1], -1, per) << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: Tensor, bits: int) -> Tensor:
    """[..., n] bytes of :func:`pack` -> uint8 codes [..., n * 8 / bits]. One shift and mask by a scalar per
    code in a byte, then interleaved: on a CPU about twice as fast as one shift by a tensor of shifts."""
    if bits == 8:
        return packed
    mask = 2**bits - 1
    codes = [(packed >> shift) & mask for shift in range(0, 8, bits)]
    return torch.stack(codes, dim=-1).flatten(-2)


def quantize(x: Tensor, bits: int, dim: int, valid: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric min-max over axis ``dim`` of grouped x. Returns (uint8 codes like x, scale, minimum) with
    ``dim`` reduced to 1. ``valid`` (broadcastable to x) excludes entries from the min and max."""
    top = 2**bits - 1
    if valid is None:
        minimum, maximum = torch.aminmax(x, dim=dim, keepdim=True)
    else:
        minimum = torch.where(valid, x, float("inf")).amin(dim=dim, keepdim=True)
        maximum = torch.where(valid, x, float("-inf")).amax(dim=dim, keepdim=True)
    empty = ~torch.isfinite(minimum)  # a group of padding only (or of values that are not finite)
    minimum, maximum = minimum.masked_fill(empty, 0), maximum.masked_fill(empty, 0)
    scale = ((maximum - minimum) / top).clamp(min=torch.finfo(x.dtype).tiny)
    codes = ((x - minimum) / scale).round().clamp(0, top).to(torch.uint8)
    return codes, scale, minimum


def dequantize(codes: Tensor, scale: Tensor, minimum: Tensor, out: Tensor | None = None) -> Tensor:
    """codes * scale + minimum, in the scale's dtype (``out``: written there, a view of a larger buffer)."""
    values = torch.mul(codes.to(scale.dtype), scale, out=out)
    return values.add_(minimum)


@register("quant")
class QuantPolicy(HostPoolPolicy):
    config_class = QuantConfig
    prefill_family = None  # later prompt chunks attend to K/V quantized with this config's knobs
    keeps_prompt_kv = False  # the pool holds codes
    prefetches = True

    def __init__(self, config: QuantConfig, spec: ModelSpec, device: torch.device):
        super().__init__(config, spec, device)
        self.raw = config.bits == 16
        self.kivi = config.kivi
        config.check_spec(spec)
        self.width = min(config.group_size, spec.head_dim)  # group width along head_dim
        # The pool holds the packed codes (or raw K/V at 16 bits) as its keys and values, and the scales and
        # minimums beside them (PARAMS), copied with the codes in one fetch.
        self.codes = self.host_pool
        self.tail: list[tuple[Tensor, Tensor] | None] = [None] * spec.num_layers  # kivi: newest, unquantized

    # -- storage -------------------------------------------------------------------------------------------
    def seq_length(self, layer: int) -> int:
        tail = self.tail[layer]
        return self.codes.length(layer) + (tail[0].shape[2] if tail is not None else 0)

    def _store(self, layer: int, k: Tensor, v: Tensor) -> None:
        if self.raw:
            self.codes.append(layer, k, v)
            return
        if not self.kivi:
            self._append(layer, self._per_token(k), self._per_token(v))
            return
        tail = self.tail[layer]
        start = self.codes.length(layer)  # position of the first token not yet quantized
        if tail is not None:
            k, v = torch.cat([tail[0], k], dim=2), torch.cat([tail[1], v], dim=2)
        size = self.config.group_size
        flush = max(0, (k.shape[2] - self.config.residual) // size * size)
        if flush:
            block_k = k[:, :, :flush].unflatten(2, (-1, size))  # [batch, heads, blocks, size, d]
            valid = self._valid(layer, start, flush, k.device)
            valid = None if valid is None else valid.unflatten(1, (-1, size))[:, None, :, :, None]
            codes, scale, minimum = quantize(block_k, self.config.bits, 3, valid)
            keys = pack(codes.flatten(2, 3), self.config.bits), scale[:, :, :, 0], minimum[:, :, :, 0]
            self._append(layer, keys, self._per_token(v[:, :, :flush]))
        self.tail[layer] = (k[:, :, flush:], v[:, :, flush:])

    def _per_token(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Groups along head_dim: (packed codes, scale [.., d / width], minimum [.., d / width])."""
        codes, scale, minimum = quantize(x.unflatten(-1, (-1, self.width)), self.config.bits, -1)
        return pack(codes.flatten(-2), self.config.bits), scale[..., 0], minimum[..., 0]

    def _append(self, layer: int, keys: tuple[Tensor, ...], values: tuple[Tensor, ...]) -> None:
        """Write (packed codes, scale, minimum) of keys and values into the pool."""
        params = dict(zip(PARAMS, (*keys[1:], *values[1:]), strict=True))
        self.codes.append(layer, keys[0], values[0], **params)

    def _valid(self, layer: int, start: int, count: int, device: torch.device) -> Tensor | None:
        """Which of positions start..start+count-1 are real tokens (None: all, or unknown: sliding layer)."""
        if self.key_valid is None or self.spec.is_sliding(layer):
            return None
        return self.key_valid[:, start : start + count].to(device)

    # -- loading -------------------------------------------------------------------------------------------
    def start_fetch(
        self,
        layer: int,
        x: Tensor | None = None,
        position_ids: Tensor | None = None,
        queries: QueryOf | None = None,
    ) -> tuple[int, Loading]:
        ahead = on_worker()  # a look-ahead on the pool's worker: it copies and dequantizes, beside the layer
        # slots after the copied ones: the tail, then the next token (decode writes them: no concatenation)
        extra = self._tail_length(layer) + 1
        first, transfer = self._start(layer, extra, now=ahead)
        loading = Loading(lambda: self._dequantized(transfer, extra))
        if ahead:
            loading.wait()
        return first, loading

    def _tail_length(self, layer: int) -> int:
        tail = self.tail[layer]
        return 0 if tail is None else tail[0].shape[2]

    def _start(
        self, layer: int, extra: int, whole: bool = False, now: bool = False
    ) -> tuple[int, Transfer | None]:
        """Begin copying what ``layer``'s next token attends to (``whole``: everything) from the pool
        (``now``: on this thread, ``KVPool.fetch``): returns (first position copied, the transfer; None
        when nothing is quantized yet). Unquantized K/V come with ``extra`` free slots after them."""
        n = self.codes.length(layer)
        if n == 0:  # kivi: every token so far is still in the full-precision tail
            return 0, None
        window = self.spec.sliding_window[layer]
        first = 0
        if window is not None and not whole:  # the next token's window starts at seq_length - window + 1
            first = max(0, self.seq_length(layer) - window + 1)
            if self.kivi:
                first = first // self.config.group_size * self.config.group_size
            first = min(first, n)
        names = ("keys", "values") if self.raw else ("keys", "values", *PARAMS)
        extra = extra if self.raw else 0  # codes are dequantized into a buffer with the free slots
        if first == 0:
            return 0, self.codes.fetch(layer, extra=extra, now=now, parts=dict.fromkeys(names))
        batch_heads = (self.codes.rows, self.spec.num_kv_heads)
        rows = torch.arange(first, n).expand(*batch_heads, -1)
        parts = dict.fromkeys(names, rows)
        if self.kivi:  # key scales and minimums: one per group of tokens
            blocks = torch.arange(first // self.config.group_size, self.codes.length(layer, "key_scale"))
            parts["key_scale"] = parts["key_min"] = blocks.expand(*batch_heads, -1)
        return first, self.codes.fetch(layer, extra=extra, now=now, parts=parts)

    def _load(
        self, layer: int, copied: tuple[Tensor, Tensor] | None, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """What ``layer`` attends to with the new tokens ``k``, ``v``: the ``copied`` K/V
        (:meth:`_dequantized`), the tail, then the new tokens, written into the copy's free slots."""
        tail = self.tail[layer]
        if copied is None:  # nothing quantized yet (kivi): the tail holds every token
            return torch.cat([tail[0], k], dim=2), torch.cat([tail[1], v], dim=2)
        keys, values = copied
        at = keys.shape[2] - k.shape[2]
        if tail is not None:
            held = tail[0].shape[2]
            keys[:, :, at - held : at], values[:, :, at - held : at] = tail
        keys[:, :, at:], values[:, :, at:] = k, v
        return keys, values

    def _dequantized(self, transfer: Transfer | None, extra: int) -> tuple[Tensor, Tensor] | None:
        """The K/V that ``transfer`` (:meth:`_start`'s) copies, dequantized, with ``extra`` free slots after
        them (None: nothing was copied)."""
        if transfer is None:
            return None
        if self.raw:
            return transfer.wait()
        key_codes, value_codes, key_scale, key_min, value_scale, value_min = transfer.wait()
        values = self._dequantize_tokens(value_codes, value_scale, value_min, extra)
        if not self.kivi:
            return self._dequantize_tokens(key_codes, key_scale, key_min, extra), values
        keys = values.new_empty(values.shape)
        blocks = unpack(key_codes, self.config.bits).unflatten(2, (-1, self.config.group_size))
        into = keys[:, :, : keys.shape[2] - extra].unflatten(2, (-1, self.config.group_size))
        dequantize(blocks, key_scale[:, :, :, None], key_min[:, :, :, None], out=into)
        return keys, values

    def _dequantize_tokens(self, packed: Tensor, scale: Tensor, minimum: Tensor, extra: int) -> Tensor:
        codes = unpack(packed, self.config.bits).unflatten(-1, (-1, self.width))
        batch, heads, count, groups, width = codes.shape
        out = scale.new_empty(batch, heads, count + extra, groups * width)
        into = out[:, :, :count].unflatten(-1, (groups, width))
        dequantize(codes, scale[..., None], minimum[..., None], out=into)
        return out

    # -- the seam ------------------------------------------------------------------------------------------
    def prefill(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.seq_length(layer) == 0:
            self._store(layer, k, v)
            return k, v
        if self.raw:  # K/V copied as stored: free slots in the copy would each be a slot gathered for nothing
            _, transfer = self._start(layer, 0, whole=True)
            past_k, past_v = transfer.wait()
            self._store(layer, k, v)
            return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        extra = self._tail_length(layer) + k.shape[2]
        _, transfer = self._start(layer, extra, whole=True)  # the prompt's mask spans every position
        keys, values = self._load(layer, self._dequantized(transfer, extra), k, v)
        self._store(layer, k, v)
        return keys, values

    def decode(self, layer: int, k_new: Tensor, v_new: Tensor) -> Selection:
        first, loading = self.take_fetch(layer)
        keys, values = self._load(layer, loading.wait(), k_new, v_new)
        n_past = self.seq_length(layer)
        self._store(layer, k_new, v_new)
        self.record_attended(layer, keys.shape[2])
        if first == 0:
            return Selection(keys, values)
        positions = torch.arange(first, n_past + 1, device=k_new.device).expand(*keys.shape[:2], -1)
        return Selection(keys, values, positions)

    def kv_bytes(self) -> dict[str, int]:
        device = sum(2 * t[0].numel() * t[0].element_size() for t in self.tail if t is not None)
        return {"host": self.codes.nbytes(), "device": device}


class Loading:
    """A layer's copied K/V, dequantized once, by the first ``wait()``."""

    def __init__(self, work: Callable[[], tuple[Tensor, Tensor] | None]):
        self._work: Callable[[], tuple[Tensor, Tensor] | None] | None = work
        self._result: tuple[Tensor, Tensor] | None = None

    def wait(self) -> tuple[Tensor, Tensor] | None:
        if self._work is not None:
            self._result, self._work = self._work(), None
        return self._result
