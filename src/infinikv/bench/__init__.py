"""Throughput, latency and bytes-moved benchmark of the KV policies and transformers' own caches, with a
link model that projects the step time of a PCIe-attached GPU (InfiniGen's setting: Lee et al., OSDI 2024,
https://arxiv.org/abs/2406.19707).

``infinikv bench`` runs a grid of batch sizes x context lengths, writes JSON, a Markdown report and plots.
Modules by job: ``prompts`` (token ids), ``measure`` (one timed run through the model driver, shared
prefill), ``grid`` (the cells), ``summary`` (rows, ratios, crossovers), ``linkmodel`` (GPU projection),
``peers`` (transformers' caches), ``report`` (Markdown and plots), ``cli``.
"""

from .cli import register_cli
from .grid import BenchConfig, run_bench
from .linkmodel import DEVICES, LINKS, Device, Link, StepTraffic, crossover_bandwidth, project

__all__ = [
    "DEVICES",
    "LINKS",
    "BenchConfig",
    "Device",
    "Link",
    "StepTraffic",
    "crossover_bandwidth",
    "project",
    "register_cli",
    "run_bench",
]
