"""Linear layers whose rows do not depend on their batchmates, for the engine's decode steps.

A BLAS picks its kernel by the shape of a product, and kernels add up in different orders. On the CPU
this project is measured on (MKL, float32), one row (a matrix-vector product), 2 to 15 rows and 16 or more
rows take three kernels whose results differ in the last bits, while within one of them a row's result
depends neither on the other rows nor on its place among them. So an engine step's projections, over all
its decode rows, would give a row other bits than the same request alone (one row); in a quantised or
selective cache such a bit can change what is kept, and then a token.

Inside :func:`rows_alone` (the engine's decode step, ``forward.decode_rows``, and its rows' shared query
projections, ``spec.SharedQueries``) each ``nn.Linear`` of a model :func:`install` has prepared gives each
row what it gets alone, in one of two ways:

* **As vectors** (:func:`rows_as_vectors`: on a CPU whose kernel for a few rows is no faster per row than
  its matrix-vector one, in float32 or float64, where a probe confirms the bits): each row is a
  matrix-vector product, a lone row's own kernel, and the rows of a step are batched calls of such
  products (``torch.bmm`` with the weight broadcast), which give each row the lone product's bits. A lone
  row then pays for no other row. On an AMD EPYC with MKL a product of two rows takes 1.9 lone rows'
  time (three rows about three), so padding a lone row to two, as below, made every projection of a
  batch-1 step cost twice its own (the whole step about 1.45×), and a class of two or three rows reads
  the weights as often as the vectors do. Several rows take the weight a block of outputs at a time
  (:data:`BLOCK_BYTES`), every row's products over one block before the next: a matrix-vector product
  over a block of the weight's rows gives those outputs the whole product's bits (probed too), and the
  rows after the first read the block from the core's cache instead of memory.
* **In a class of rows** (elsewhere: a GPU, a CPU whose few-row kernel is fast, and bfloat16 or float16
  on the CPU): each product's rows lie in
  one class of sizes that share a kernel, the class of two rows, found for each weight shape, device and
  dtype by a probe (:func:`invariant_rows`). A lone row is padded to the class's smallest size; more rows
  than its largest go in several products. Rounded to bfloat16, another kernel's sums show in some draws
  only, so a probe cannot rule a lone row's kernel in: a lone row is always padded there. float16 products
  on the CPU differ with their number of rows in some draws (subnormal results among them): they run a
  row at a time.

Outside it, and while compiling, a linear layer is the plain one.

:func:`project_beside` computes other rows with a layer's own input in one call, ahead of the layer's own
call, which then takes its rows' result from there: a look-ahead that projects layer i's input to layer
i+1's query, run at layer i+1 (``engine/ragged.py``), reads those weights right before the layer reads
them again (once for both, where the rows of both fit one product of a class). Each row still gets what it
gets alone. :func:`project_ahead` does the same for the layer's own input alone: a choice by a layer's own
query projects it once, for the choice and the layer.

The cost: as vectors, a step's rows each multiply by all of the weights, where one product of four rows
or more would read them once for all (on that AMD EPYC, four rows take 2.6 lone rows' time and eight about
3.6); block by block, the rows after the first read them from the core's cache (in a decode step of
SmolLM2-135M there, eight rows' projections take 2.7 times a lone row's). In a class, a step with more rows
than the class holds makes several products where one would do.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .errors import InputError

Tensor = torch.Tensor
PROBE_ROWS = 32  # most rows a probe tries (and so most rows in one product)
PROBE_OUTPUTS = 1024  # output features a probe computes (the weight's first ones)
PAIR_COST = 1.5  # a product of two rows taking this many lone rows' time or more: rows run as vectors
# Rows as vectors read the weight a block of outputs at a time, this many bytes of it, so that a block stays
# in the core's own cache (1 MiB on the AMD EPYC measured) from one row's product to the next. Blocks of
# 128 KiB to 768 KiB gave about the same decode step there, 1 MiB ones a slower one.
BLOCK_BYTES = 256 * 2**10
# "vectors" or "classes" pins the choice pairs_cost_more times (same bits from process to process and
# machine to machine of one CPU model); read at a weight shape's first product
ROWS_ALONE_ENV = "INFINIKV_ROWS_ALONE"

# on this thread: .active, linear layers run their rows as alone; .kept, what a layer's next call takes
# (project_beside, project_ahead)
_state = threading.local()


class _Kept(NamedTuple):
    """A result :func:`project_beside` or :func:`project_ahead` computed ahead for ``module``'s next call
    with ``input`` (which the caller leaves as it is: an inference tensor keeps no version to check)."""

    module: torch.nn.Module
    input: Tensor
    output: Tensor


_classes: dict[tuple, tuple[int, int]] = {}
_vectors: dict[tuple, bool] = {}
_probing = threading.Lock()


@contextmanager
def rows_alone() -> Iterator[None]:
    """On this thread, the linear layers of installed models give each row what it gets alone."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous
        if not previous:  # what no call took is dropped with the outermost
            _state.kept = None


def install(model: torch.nn.Module) -> None:
    """Let ``model``'s linear layers follow :func:`rows_alone` (once per model; each module's ``forward``
    is replaced, an instance-level wrapper set before included)."""
    if getattr(model, "_infinikv_rows_alone", False):
        return
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = functools.partial(_forward, module)
    model._infinikv_rows_alone = True


def _forward(module: torch.nn.Linear, input: Tensor) -> Tensor:  # noqa: A002 (nn.Linear.forward's name)
    if not torch.compiler.is_compiling() and getattr(_state, "active", False):
        kept = getattr(_state, "kept", None)
        if kept is not None and kept.module is module and kept.input is input:
            _state.kept = None
            return kept.output
        return linear_rows_alone(input, module.weight, module.bias)
    return F.linear(input, module.weight, module.bias)


def _keeps_for(module: torch.nn.Module) -> bool:
    """Whether a result computed ahead for ``module`` is kept for its next call: inside :func:`rows_alone`,
    for a plain ``nn.Linear`` (what :func:`install` prepares)."""
    return type(module) is torch.nn.Linear and getattr(_state, "active", False)


def project_beside(module: torch.nn.Module, own: Tensor, others: Tensor) -> Tensor:
    """``module(others)`` [..., out] for ``others`` [..., in], computed in one product with the rows of
    ``own``, the input ``module``'s next call on this thread takes: that call returns its rows' result from
    here, so the weights are read once for both (where both inputs' rows fit one product of a class: else
    in as many as :func:`linear_rows_alone` makes; as vectors, once per row, back to back). Every row gets
    what it gets alone. Inside :func:`rows_alone`, for a
    plain ``nn.Linear`` (what :func:`install` prepares); otherwise ``module(others)``, nothing kept."""
    if not _keeps_for(module):
        return module(others)
    width = own.shape[-1]
    mine = own.numel() // width
    both = torch.cat([own.reshape(mine, width), others.reshape(-1, width)])
    out = linear_rows_alone(both, module.weight, module.bias)
    _state.kept = _Kept(module, own, out[:mine].reshape(*own.shape[:-1], -1))
    return out[mine:].reshape(*others.shape[:-1], -1)


def project_ahead(module: torch.nn.Module, own: Tensor) -> Tensor:
    """``module(own)``, computed ahead of ``module``'s next call on this thread with that very input, which
    then takes it from here (a choice made by a layer's own query, before the layer projects it: the
    weights read once). Inside :func:`rows_alone`, for a plain ``nn.Linear``; otherwise ``module(own)``,
    nothing kept. A result kept already for that call (:func:`project_beside`) is the one returned."""
    if not _keeps_for(module):
        return module(own)
    kept = getattr(_state, "kept", None)
    if kept is not None and kept.module is module and kept.input is own:
        return kept.output
    out = linear_rows_alone(own, module.weight, module.bias)
    _state.kept = _Kept(module, own, out)
    return out


def linear_rows_alone(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, each row of ``x`` [..., in] computed as it is alone (as a product of
    the rows laid out one after the other, whatever ``x``'s strides)."""
    width = x.shape[-1]
    rows = x.numel() // width
    flat = x.reshape(rows, width)
    if rows_as_vectors(weight):
        out = _vector_products(flat, weight)
        if bias is not None:  # added apart, as in every row's own product
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])
    low, high = invariant_rows(weight)
    if low <= rows <= high or rows == 0:
        out = F.linear(flat, weight, bias)
    else:  # a lone row padded with copies of itself; more rows than a product holds, in several
        outs = [
            F.linear(_padded(flat[start : start + high], low), weight, bias) for start in range(0, rows, high)
        ]
        out = (outs[0] if len(outs) == 1 else torch.cat(outs))[:rows]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _vector_products(rows: Tensor, weight: Tensor) -> Tensor:
    """``rows`` [n, in] times ``weight`` [out, in] transposed, each row as a matrix-vector product: a lone
    row in one over the whole weight; several, block by block of the weight's outputs
    (:func:`block_outputs`), each block in one batched call of them, so that every row after the first
    reads the block from the core's cache (at most :data:`PROBE_ROWS` rows at a time, as probed)."""
    if rows.shape[0] == 1:
        return F.linear(rows, weight)
    if rows.shape[0] > PROBE_ROWS:
        return torch.cat([_vector_products(part, weight) for part in rows.split(PROBE_ROWS)])
    stacked = rows[:, None, :]
    blocks = weight.t().split(block_outputs(weight), dim=1)  # views, each [in, block]
    products = [torch.bmm(stacked, block.expand(rows.shape[0], -1, -1)) for block in blocks]
    return (products[0] if len(products) == 1 else torch.cat(products, dim=2))[:, 0]


def block_outputs(weight: Tensor) -> int:
    """Output features of ``weight`` [out, in] whose rows fill :data:`BLOCK_BYTES` (a multiple of 16, at
    least 16): the block several rows' matrix-vector products read in turn."""
    row_bytes = weight.shape[1] * weight.element_size()
    return max(16, BLOCK_BYTES // row_bytes // 16 * 16)


def rows_as_vectors(weight: Tensor) -> bool:
    """Whether products with ``weight`` [out, in] run each row as a matrix-vector product
    (:func:`_vector_products`): on a CPU where a product of two rows takes at least
    :data:`PAIR_COST` lone rows' time (:func:`pairs_cost_more`, or as :data:`ROWS_ALONE_ENV` pins it), in
    full precision, where a batch of such
    products gives each row what the lone one gives it (probed once per shape and dtype on the weight's
    first outputs, as :func:`invariant_rows`, with every number of rows a call takes, in either order)."""
    key = (tuple(weight.shape), weight.device, weight.dtype)
    found = _vectors.get(key)
    if found is None:
        with _probing:
            found = _vectors.get(key)
            if found is None:
                found = _vectors[key] = _probe_vectors(weight)
    return found


@torch.inference_mode()
def _probe_vectors(weight: Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.float64):
        return False
    pinned = _pinned()
    if pinned == "classes" or (not pinned and not pairs_cost_more(weight.dtype)):
        return False
    w = weight[:PROBE_OUTPUTS]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(weight.dtype)
    lone = torch.cat([F.linear(x[r : r + 1], w) for r in range(PROBE_ROWS)])
    for n in range(2, PROBE_ROWS + 1):
        if not (
            torch.equal(_vector_products(x[:n], w), lone[:n])
            and torch.equal(_vector_products(x[:n].flip(0), w).flip(0), lone[:n])
        ):
            return False
    # and over the whole weight, whose last block may be narrower than the probed outputs' last one
    return torch.equal(
        _vector_products(x[:2], weight), torch.cat([F.linear(x[r : r + 1], weight) for r in (0, 1)])
    )


@functools.cache
@torch.inference_mode()
def pairs_cost_more(dtype: torch.dtype) -> bool:
    """Whether on this CPU a product of two rows in ``dtype`` takes at least :data:`PAIR_COST` times a lone
    row's (the fastest of interleaved timings on a 2,048 × 1,024 weight, once per process: 1.89–1.92 on an
    AMD EPYC with MKL at one thread). Load only adds time, so the fastest timings are the least disturbed:
    beside two memory-bound processes on that machine's two cores the ratio of medians fell as low as 1.15,
    the ratio of the fastest to 1.70, and a process that decided otherwise would compute every row by the
    class of rows, which gives other last bits. Rows as vectors save a lone row the padded pair's cost, and
    cost two rows at most a third more than the pair's product."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=generator).to(dtype)
    rows = torch.randn(2, 1024, generator=generator).to(dtype)
    lone: list[float] = []
    pair: list[float] = []
    for _ in range(15):
        for times, x in ((lone, rows[:1]), (pair, rows)):
            start = time.perf_counter()
            F.linear(x, weight)
            times.append(time.perf_counter() - start)
    return min(pair) >= PAIR_COST * min(lone)


def rows_alone_choice() -> str:
    """How this process computes rows alone on a CPU in float32: ``"vectors"`` or ``"classes"``, as
    :data:`ROWS_ALONE_ENV` pins it or :func:`pairs_cost_more` times it. A process whose results must be this
    one's bit for bit (a cluster's workers, ``cluster.connect``) gets it as its own pin, which holds for
    float64 too (this process times float64 apart where nothing pins it)."""
    return _pinned() or ("vectors" if pairs_cost_more(torch.float32) else "classes")


def _pinned() -> str:
    """:data:`ROWS_ALONE_ENV`'s pin ("" where it pins nothing)."""
    pinned = os.environ.get(ROWS_ALONE_ENV, "")
    if pinned not in ("", "vectors", "classes"):
        raise InputError(f"{ROWS_ALONE_ENV} must be 'vectors' or 'classes', got {pinned!r}")
    return pinned


def _padded(rows: Tensor, low: int) -> Tensor:
    """``rows`` [n, in], at least ``low`` of them: a lone row (``low`` is at most 2) as ``low`` copies of
    itself, an expanded view the product lays out as rows."""
    return rows if rows.shape[0] >= low else rows[:1].expand(low, rows.shape[1])


def invariant_rows(weight: Tensor) -> tuple[int, int]:
    """The smallest and largest number of rows (``low``, ``high``) of a product with ``weight`` [out, in]
    within which a row's result is the same whatever the other rows and its place among them, and the
    same as with two rows; measured once per shape, device and dtype (``low`` is 1 where one row agrees in
    full precision, and ``high`` at most :data:`PROBE_ROWS`). Where even two rows do not agree, and for
    float16 on the CPU, (1, 1): one row at a time.
    The probe computes the weight's first :data:`PROBE_OUTPUTS` outputs without the bias, taking the
    kernel a BLAS picks for them as the one it picks for the whole product (so it is on this CPU's MKL, at
    every output width tried up to 8,192; a GPU library, which may split a wide product otherwise, is
    not checked)."""
    key = (tuple(weight.shape), weight.device, weight.dtype)
    found = _classes.get(key)
    if found is None:
        with _probing:
            found = _classes.get(key) or _probe(weight)
            _classes[key] = found
    return found


@torch.inference_mode()
def _probe(weight: Tensor) -> tuple[int, int]:
    if weight.dtype == torch.float16 and weight.device.type == "cpu":
        # float16 products on the CPU differ with their number of rows in some draws only (subnormal
        # results among them), which no probe can rule out: one row at a time
        return 1, 1
    w = weight[:PROBE_OUTPUTS]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
    # each row's result first of a pair (its partner the next row): what the class of two gives it
    paired = torch.cat([F.linear(x[r : r + 2], w)[:1] for r in range(PROBE_ROWS - 1)])

    def agrees(rows: int) -> bool:
        """Every row of a product of ``rows``, in either order, as in its pair. Every row is compared:
        rounded to bfloat16, another kernel's sums show in some rows only."""
        forward = F.linear(x[:rows], w)
        backward = F.linear(x[:rows].flip(0), w).flip(0)
        n = min(rows, PROBE_ROWS - 1)
        return torch.equal(forward[:n], paired[:n]) and torch.equal(backward[:n], paired[:n])

    if not agrees(2):
        return 1, 1
    # A lone row counts as its own class only in full precision, where another kernel's sums show in every
    # draw; rounded to bfloat16 they show in some draws only (in one of about 14 rows of a 1,536-wide
    # product here), so a lone row there is always padded.
    lone = weight.dtype in (torch.float32, torch.float64) and all(
        torch.equal(F.linear(x[r : r + 1], w), paired[r : r + 1]) for r in range(PROBE_ROWS - 1)
    )
    low = 1 if lone else 2
    high = 2
    while high < PROBE_ROWS and agrees(high + 1):
        high += 1
    return low, high
