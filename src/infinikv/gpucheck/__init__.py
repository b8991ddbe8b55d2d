"""The GPU check: everything a GPU machine should confirm, in one run that fits a few minutes.

``python -m infinikv.gpucheck OUTDIR`` (``scripts/gpu_check.sh OUTDIR`` sets it up) does, in order:

1. **preflight** (:mod:`.preflight`): Python, package versions, every infinikv module imports, the CUDA
   device, and the measured pinned host -> device copy bandwidth (one 1 GiB copy). Anything missing fails
   here, loudly.
2. **tests** (:mod:`.tests`): the tests marked ``cuda`` (tests/test_cuda.py) in a subprocess, JUnit XML kept.
   They ship with the source checkout, not with the package: run from an installed package, the check says
   so in one line and goes on.
3. **benchmark** (:mod:`.child`): a model of a real size with random weights (``dummy:llama-3-8b``, see
   ``infinikv.dummy``; every figure is labelled "dummy weights") over batch x context cells, each context in
   its own subprocess with a timeout. Each context is prefilled once at batch 1 and every policy ingests that
   prompt's K/V into each row of the batch (the benchmark's shared prefill, ``infinikv.bench.measure``; each
   row a sequence of its own on the engine's decode step), then decodes a few greedy steps. Per policy:
   decode tok/s, TPOT, bytes host -> device, the copy streams' time per step (every row's, summed)
   and how much of it the compute stream waited for (CUDA events: hidden = copy - stalled), the host
   time spent issuing fetches (the row gather into pinned memory), peak device memory, peak pinned host
   memory, and the link model's projection of the same step (``infinikv.bench.linkmodel``) beside the
   measurement.
4. **report** (:mod:`.report`): ``gpu_check.json`` and ``gpu_check.md`` in OUTDIR, rewritten after every
   context, and ``rows.jsonl``, appended after every policy run, so a run cut short still leaves its results.

:mod:`.cli` runs the steps in order and holds the command line; :mod:`.plan` the sizes of a full and a tiny
check.

InfiniGen runs with ``alpha=inf`` (the budget alone sets how many rows move: random weights do not have the
peaked attention that makes alpha meaningful), the paper's 20 % of the key columns (random weights give no
share of columns worth calibrating either) and a skew calibrated on random tokens.

``--tiny`` runs the same path on a tiny dummy model, tiny contexts and a few steps (on CPU when there is no
GPU): the test suite runs it so the check cannot rot.
"""
