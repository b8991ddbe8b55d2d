"""A link model: projected GPU decode-step time from measured bytes moved and measured tokens attended.

This is a model, not a measurement. It exists because the benchmark host may have no GPU: it takes what a
run measured per decode step (bytes copied host -> device, copy calls, tokens each layer attended, the
bytes the selector read: InfiniGen's partial keys, Quest's summaries) and turns them into a step time for a
PCIe-attached GPU, the setting of InfiniGen (Lee et al., OSDI 2024, https://arxiv.org/abs/2406.19707) and
FlexGen (https://arxiv.org/abs/2303.06865).

* Link time = bytes / link bandwidth + copy calls x per-copy latency.
* Device time = bytes the step reads from device memory (weights + attended K/V + the selector's reads) /
  device memory bandwidth (single-token decode is memory-bound).
* Policies that prefetch layer i+1 while layer i computes overlap the two, layer by layer: the step takes
  max(link, device) plus one layer's worth of the smaller (the pipeline fill). Others add them. A copy
  started only once its own layer's query exists (``bytes_h2d_on_demand``, measured by the pool: InfiniGen's
  layer 0, and its own-query layers' copies or their corrections) is waited for: its link time is added,
  not overlapped.

Figures are public specification numbers (theoretical peaks), stated with their sources in ``LINKS`` and
``DEVICES``; real transfers reach roughly 80-90 % of them, so projections are optimistic for the link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A host -> device link: bandwidth in bytes/s per direction, latency per copy call in seconds."""

    name: str
    bandwidth: float
    latency: float
    source: str


@dataclass(frozen=True)
class Device:
    """A compute device: memory bandwidth in bytes/s and capacity in bytes."""

    name: str
    bandwidth: float
    memory: float
    source: str


_PCIE_SOURCE = (
    "PCI-SIG base specifications: {gts} GT/s per lane, 128b/130b encoding, x16 -> {gbs} GB/s per direction; "
    "latency: ~10 us per cudaMemcpyAsync call (launch + DMA setup), a typical measured figure, assumed"
)
LINKS: dict[str, Link] = {
    "pcie3": Link("PCIe 3.0 x16", 15.75e9, 10e-6, _PCIE_SOURCE.format(gts=8, gbs=15.75)),
    "pcie4": Link("PCIe 4.0 x16", 31.5e9, 10e-6, _PCIE_SOURCE.format(gts=16, gbs=31.5)),
    "pcie5": Link("PCIe 5.0 x16", 63.0e9, 10e-6, _PCIE_SOURCE.format(gts=32, gbs=63.0)),
}
DEVICES: dict[str, Device] = {
    "a6000": Device("NVIDIA RTX A6000", 768e9, 48e9, "NVIDIA RTX A6000 datasheet: 768 GB/s GDDR6, 48 GB"),
    "h100-pcie": Device(
        "NVIDIA H100 PCIe", 2.0e12, 80e9, "NVIDIA H100 datasheet (PCIe card): 2.0 TB/s HBM2e, 80 GB"
    ),
}


@dataclass(frozen=True)
class StepTraffic:
    """What one decode step moves and reads, from a measurement (all counts per step, whole batch)."""

    bytes_h2d: float  # host -> device copies
    copies: float  # copy calls (each K or V tensor counts once)
    device_read_bytes: float  # weights + attended K/V + side structures read from device memory
    overlapped: bool  # the policy prefetches layer i+1 during layer i
    layers: int
    bytes_on_demand: float = 0.0  # of an overlapped policy's bytes_h2d: copies that wait on their own layer


@dataclass(frozen=True)
class Projection:
    link_s: float
    device_s: float
    step_s: float


def project(traffic: StepTraffic, link: Link, device: Device) -> Projection:
    """Projected step time of ``traffic`` on ``device`` behind ``link`` (see the module docstring)."""
    link_s = traffic.bytes_h2d / link.bandwidth + traffic.copies * link.latency
    device_s = traffic.device_read_bytes / device.bandwidth
    if traffic.overlapped and traffic.layers > 0:
        waiting_s = link_s * traffic.bytes_on_demand / traffic.bytes_h2d if traffic.bytes_h2d else 0.0
        hidden_s = link_s - waiting_s
        step_s = max(hidden_s, device_s) + min(hidden_s, device_s) / traffic.layers + waiting_s
    else:
        step_s = link_s + device_s
    return Projection(link_s, device_s, step_s)


def with_bandwidth(link: Link, bandwidth: float) -> Link:
    return Link(f"{bandwidth / 1e9:.3g} GB/s", bandwidth, link.latency, "swept")


def speedup(fast: StepTraffic, slow: StepTraffic, link: Link, device: Device) -> float:
    """Projected step time of ``slow`` over that of ``fast`` behind ``link`` on ``device``."""
    return project(slow, link, device).step_s / project(fast, link, device).step_s


def crossover_bandwidth(
    fast: StepTraffic,
    slow: StepTraffic,
    device: Device,
    latency: float = 10e-6,
    margin: float = 0.0,
    low: float = 1e8,
    high: float = 1e13,
) -> float | None:
    """The link bandwidth above which ``fast`` no longer beats ``slow`` by more than ``margin`` (0.1 = 10 %);
    None when it always does in [low, high].

    ``fast`` is the policy that moves fewer bytes (InfiniGen), ``slow`` the one that moves more (offload):
    as bandwidth grows the transfer it saves stops mattering and the device work decides.
    """

    def gain(bw: float) -> float:
        return speedup(fast, slow, Link("swept", bw, latency, "swept"), device) - (1 + margin)

    if gain(low) <= 0:
        return low
    if gain(high) > 0:
        return None
    lo, hi = math.log(low), math.log(high)
    for _ in range(60):  # bisection on log-bandwidth; the gain falls monotonically with bandwidth
        mid = (lo + hi) / 2
        if gain(math.exp(mid)) > 0:
            lo = mid
        else:
            hi = mid
    return math.exp(hi)
