"""Throughput, latency and bytes-moved benchmark of the KV policies and transformers' own caches, with a
link model that projects the step time of a PCIe-attached GPU (InfiniGen's setting: Lee et al., OSDI 2024,
https://arxiv.org/abs/2406.19707).

``infinikv bench`` runs a grid of batch sizes x context lengths, writes JSON, a Markdown report and plots.
"""

from .cli import register_cli
from .linkmodel import DEVICES, LINKS, Device, Link, StepTraffic, crossover_bandwidth, project
from .runner import BenchConfig, run_bench

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
