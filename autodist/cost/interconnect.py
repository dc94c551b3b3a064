"""Named interconnects for planning without a measured comm model (``autodist plan --interconnect``).

Each preset is the analytic comm model's two numbers (``CommModel.analytic``: ring collectives over
one link per rank): the bandwidth a rank can send in one direction, from the hardware's published
line rate, and a per-collective latency. On one node, pick the link its GPUs share (NVLink or
PCIe); for several nodes, ``autodist plan --nodes`` takes two, the link within a node and the
network between nodes (one NIC per GPU, as in rail-optimised clusters), and prices each collective
on the link it crosses (``CommModel.two_level``).

The bandwidths are line rates from the specifications cited below; what a collective library
achieves is lower (often 70-90% of it for large messages). The latencies are not from a
specification: they are round figures for one small collective over that kind of link (the link's
own latency is 1-2 us or less for NVLink and InfiniBand; a collective adds the library's steps
across ranks, and TCP adds its stack). Where it matters, measure: a job with ``plan="auto"`` on the
real machine sweeps the collectives and caches a fitted model that ``autodist plan`` then uses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Interconnect:
    name: str
    what: str
    bandwidth_gbps: float  # GB/s one rank sends in one direction
    latency_us: float  # per collective, round figure (see the module docstring)
    source: str


INTERCONNECTS: dict[str, Interconnect] = {
    i.name: i
    for i in (
        Interconnect(
            "nvlink4", "NVLink 4 within a node (H100 SXM)", 450.0, 10.0,
            "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions together "
            "(https://www.nvidia.com/en-us/data-center/h100/)",
        ),
        Interconnect(
            "nvlink3", "NVLink 3 within a node (A100 SXM)", 300.0, 10.0,
            "NVIDIA A100 datasheet: NVLink 600 GB/s per GPU, both directions together "
            "(https://www.nvidia.com/en-us/data-center/a100/)",
        ),
        Interconnect(
            "pcie5", "PCIe 5.0 x16 within a node (GPUs without NVLink)", 63.0, 20.0,
            "PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b encoding: 16 lanes carry ~63 GB/s each way",
        ),
        Interconnect(
            "pcie4", "PCIe 4.0 x16 within a node (GPUs without NVLink)", 31.5, 20.0,
            "PCI-SIG PCIe 4.0: 16 GT/s per lane, 128b/130b encoding: 16 lanes carry ~31.5 GB/s each way",
        ),
        Interconnect(
            "ib-ndr", "InfiniBand NDR between nodes, one 400 Gb/s NIC per GPU", 50.0, 20.0,
            "NVIDIA ConnectX-7 user manual: NDR 400 Gb/s per port "
            "(https://docs.nvidia.com/networking/display/ConnectX7VPI/Introduction)",
        ),
        Interconnect(
            "ib-hdr", "InfiniBand HDR between nodes, one 200 Gb/s NIC per GPU", 25.0, 20.0,
            "NVIDIA ConnectX-6 HDR: 200 Gb/s per port "
            "(https://docs.nvidia.com/networking/display/ConnectX6VPIOCP3/Introduction)",
        ),
        Interconnect(
            "roce-400g", "RoCE v2 over 400 GbE between nodes", 50.0, 25.0,
            "IEEE 802.3bs (400 GbE): 400 Gb/s line rate; RDMA over Converged Ethernet runs at it",
        ),
        Interconnect(
            "roce-100g", "RoCE v2 over 100 GbE between nodes", 12.5, 25.0,
            "IEEE 802.3ba/bj (100 GbE): 100 Gb/s line rate; RDMA over Converged Ethernet runs at it",
        ),
        Interconnect(
            "eth-100g", "100 Gb Ethernet between nodes, TCP (gloo, or NCCL's socket transport)", 12.5, 50.0,
            "IEEE 802.3ba/bj (100 GbE): 100 Gb/s line rate",
        ),
        Interconnect(
            "eth-10g", "10 Gb Ethernet between nodes, TCP", 1.25, 50.0,
            "IEEE 802.3ae (10 GbE): 10 Gb/s line rate",
        ),
    )
}


def describe_interconnects() -> str:
    """One line per preset: name, bandwidth, latency, what it is."""
    return "; ".join(f"{i.name} ({i.bandwidth_gbps:g} GB/s, {i.latency_us:g} us: {i.what})" for i in INTERCONNECTS.values())
