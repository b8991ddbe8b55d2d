"""The CUDA path: pinned host pool, the copy stream's overlap and its CUDA-event timings, byte counts, and
every policy at full budget equal to dense on the GPU. Skipped where CUDA is absent (``scripts/gpu_check.sh``
runs these on a GPU machine)."""

from __future__ import annotations

import math

import pytest
import torch

from infinikv.generate import GenerationConfig, Generator
from infinikv.kvpool import KVPool
from infinikv.models import LoadedModel
from infinikv.policies.infinigen import calibration, skewfile
from infinikv.testing import tiny_model
from tests.test_baselines import FULL, IDS, PROMPTS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny_cuda() -> LoadedModel:
    """The tiny Llama of the CPU tests, moved to the GPU (fp32, so greedy choices match dense exactly)."""
    cpu = tiny_model("llama")
    model = cpu.model.to(CUDA)
    return LoadedModel("tiny-llama-cuda", model, cpu.tokenizer, cpu.weights_id, CUDA)


def _pool(tokens: int, batch: int = 2, heads: int = 4, dim: int = 64) -> tuple[KVPool, torch.Tensor]:
    pool = KVPool(1, CUDA)
    k = torch.randn(batch, heads, tokens, dim, device=CUDA)
    pool.append(0, k, -k)
    return pool, k


def test_pool_is_pinned_host_memory():
    pool, k = _pool(300)
    for part in ("keys", "values"):
        arena = pool.blocks.arena(0, part, 4, 64, k.dtype)
        assert arena.segments and all(s.tensor.device.type == "cpu" for s in arena.segments)
        assert all(s.tensor.is_pinned() for s in arena.segments)
    assert torch.equal(pool.keys(0), k.cpu()) and torch.equal(pool.values(0), -k.cpu())
    assert pool.nbytes() == 2 * k.numel() * k.element_size()
    assert pool.counters.bytes_d2h == 2 * k.numel() * k.element_size()
    pool.close()


@pytest.mark.parametrize("tokens", [1 << 16, (1 << 16) - 8], ids=["whole-blocks", "a-partial-block"])
def test_fetch_returns_before_the_copy_and_wait_gives_the_data(tokens):
    pool, k = _pool(tokens)  # 128 MiB per tensor
    # Keep the compute stream busy: the copy stream waits for it, so the copy cannot have finished when
    # fetch returns, whatever the link's speed.
    torch.cuda._sleep(200_000_000)
    transfer = pool.fetch(0)
    assert not transfer.done()
    keys, values = transfer.wait()
    torch.cuda.synchronize()
    assert transfer.done()
    assert keys.device.type == "cuda" and torch.equal(keys, k) and torch.equal(values, -k)
    copy_s, stalled_s = pool.counters.timings[-1].seconds()
    assert copy_s > 0 and stalled_s >= 0
    pool.close()


def test_fetch_of_rows_gathers_the_right_rows_and_counts_their_bytes():
    pool, k = _pool(500)
    index = torch.stack([torch.randperm(500)[:37] for _ in range(2 * 4)]).view(2, 4, 37)
    before = pool.counters.bytes_h2d
    keys, values = pool.fetch(0, index, extra=1).wait()
    torch.cuda.synchronize()
    expected = torch.gather(k, 2, index.to(CUDA)[..., None].expand(-1, -1, -1, k.shape[-1]))
    assert keys.shape == (2, 4, 38, 64)
    assert torch.equal(keys[:, :, :37], expected) and torch.equal(values[:, :, :37], -expected)
    assert pool.counters.bytes_h2d - before == 2 * 2 * 4 * 37 * 64 * k.element_size()
    assert len(pool.counters.timings) == 1 and pool.counters.timings[0].issue_s > 0
    assert pool.device_gather  # the rows were read by a kernel from the pinned store, not staged by the host
    pool.close()


def test_rows_are_gathered_on_the_host_where_the_device_cannot_read_the_pool(monkeypatch):
    pool, k = _pool(300)
    monkeypatch.setattr(KVPool, "_device_view", lambda self, flat: None)
    index = torch.stack([torch.randperm(300)[:21] for _ in range(2 * 4)]).view(2, 4, 21).to(CUDA)
    keys, values = pool.fetch(0, index).wait()
    torch.cuda.synchronize()
    expected = torch.gather(k, 2, index[..., None].expand(-1, -1, -1, k.shape[-1]))
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    pool.close()


def test_full_offload_counts_every_cached_byte(tiny_cuda):
    steps = 6
    config = GenerationConfig(max_new_tokens=steps, prefill_chunk=64)
    result = Generator(tiny_cuda, "offload").generate("Counted bytes on the GPU.", config)[0]
    spec = tiny_cuda.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4  # fp32 K and V, all layers
    prompt = result.stats["prompt_tokens"]
    decoded = result.stats["decode_steps"]
    # Each decode step fetches every layer's whole cache (the prompt and the tokens decoded before it).
    assert result.stats["bytes_h2d"] == per_token * sum(prompt + i for i in range(decoded))
    assert result.stats["kv_bytes_host"] == per_token * (prompt + decoded)


@pytest.fixture(scope="module")
def dense_tokens(tiny_cuda) -> list[list[int]]:
    return _tokens(tiny_cuda, "dense")


def _tokens(loaded: LoadedModel, policy: str, compile: bool = False, **knobs) -> list[list[int]]:
    config = GenerationConfig(max_new_tokens=24, prefill_chunk=64)
    generator = Generator(loaded, policy, compile=compile, **knobs)
    return [r.token_ids for r in generator.generate(PROMPTS, config)]


@pytest.mark.parametrize(("policy", "knobs"), [("offload", {}), *FULL], ids=["offload", *IDS])
def test_full_budget_matches_dense_on_cuda(policy, knobs, tiny_cuda, dense_tokens):
    assert _tokens(tiny_cuda, policy, **knobs) == dense_tokens


def test_infinigen_full_budget_matches_dense_on_cuda(tiny_cuda, dense_tokens, monkeypatch):
    made = calibration.calibrate(tiny_cuda, text="A calibration text of modest length. " * 16, save=False)
    monkeypatch.setattr(skewfile, "cached_skew", lambda spec: made)
    full = _tokens(tiny_cuda, "infinigen", alpha=math.inf, budget=1.0, dense_layers=0)
    assert full == dense_tokens


def test_dummy_model_is_built_on_the_device_in_bf16():
    from infinikv.models import load

    torch.cuda.reset_peak_memory_stats()
    loaded = load("dummy:smollm2-135m", device=CUDA)
    parameters = list(loaded.model.parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in parameters)
    assert all(torch.isfinite(p).all() for p in parameters)
    result = Generator(loaded, "offload").generate("dummy weights", GenerationConfig(max_new_tokens=4))[0]
    assert result.stats["bytes_h2d"] > 0


# Last in the file: the first compiled step compiles (seconds to a minute on a GPU), and the GPU check runs
# this file under one time limit. Two policies: the graphs are the model's, shared by every policy.
@pytest.mark.parametrize(("policy", "knobs"), [("dense", {}), FULL[2]], ids=["dense", IDS[2]])
def test_compiled_decode_steps_with_cuda_graphs_give_the_eager_tokens(policy, knobs, tiny_cuda, dense_tokens):
    """Decode steps under torch.compile with CUDA graphs (the policy's calls eager between them) give the
    eager tokens: dense, and a selective policy at full budget."""
    assert _tokens(tiny_cuda, policy, compile=True, **knobs) == dense_tokens
