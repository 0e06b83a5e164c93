"""Accelerator presets: peak dense FLOP/s, HBM bandwidth and capacity, intra- and inter-node links.

Every figure is a vendor peak (the planner's time figures are lower bounds, so a peak is the right
number: no real kernel beats it). Link figures are stored as the vendor quotes them, *bidirectional
totals*; the planner uses the per-direction half, which is what one device can send (or receive)
per second and what nccl-tests' bus bandwidth compares against (NVIDIA/nccl-tests
doc/PERFORMANCE.md). Sparse FLOP/s (2x dense) are kept only for reference and never used.

Sources (vendor datasheets; where the PDF was not at hand, the secondary reproductions named in
``tests/data/planner_cases.json``, cases ``hw_*``):

- A100: NVIDIA A100 Tensor Core GPU datasheet (2021) and "NVIDIA A100 Tensor Core GPU
  Architecture" whitepaper (2020): BF16 312 TFLOP/s dense, TF32 156; HBM2e 1,555 GB/s (40 GB
  SXM), 2,039 GB/s (80 GB SXM), 1,935 GB/s (80 GB PCIe); NVLink3 600 GB/s; PCIe Gen4 x16 64 GB/s.
  DGX A100 user guide: 8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand (25 GB/s per GPU).
- H100: NVIDIA H100 Tensor Core GPU datasheet (2023) and Hopper architecture whitepaper: SXM5
  BF16 989.4 TFLOP/s dense, TF32 494.7, HBM3 3.35 TB/s, NVLink4 900 GB/s; PCIe card BF16 756,
  TF32 378, HBM2e 2.0 TB/s, NVLink bridge 600 GB/s (pairs), PCIe Gen5 x16 128 GB/s.
  DGX H100 user guide: 8 x 400 Gb/s NDR InfiniBand (50 GB/s per GPU).
- H200: NVIDIA H200 Tensor Core GPU datasheet (2024): same compute as H100 SXM, 141 GB HBM3e at
  4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s; DGX H200: 8 x 400 Gb/s per node.
- V100 (DGX-2H): NVIDIA DGX-2H datasheet (2018): 16 V100 SXM3 32 GB at 2.1 PFLOP/s fp16 tensor
  (130 TFLOP/s each; V100 has no bf16, its fp16 peak stands in), HBM2 at 900 GB/s (V100
  datasheet), six NVLink2 links per GPU through NVSwitch (300 GB/s bidirectional), eight 100 Gb/s
  EDR InfiniBand ports per 16 GPUs (6.25 GB/s per GPU).
- TPU v4: Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 4: 275 TFLOP/s
  bf16, 32 GiB HBM at 1,200 GB/s, 270 GB/s ICI (taken per direction, the larger reading, so that
  bounds stay true); 4 chips per host.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator model and the links around it. Bandwidths in bytes/s, FLOP/s, bytes.

    ``links`` maps a link name to its vendor bidirectional total per device; ``intra_node_link``
    names the one devices in a node talk over; ``inter_node_bytes_per_s`` is per device and per
    direction (one NIC's line rate for each device).
    """

    name: str
    peak_dense_bf16_flops: float
    hbm_bytes_per_s: float
    mem_bytes: float
    links: dict = field(default_factory=dict)
    intra_node_link: str = "nvlink"
    inter_node_bytes_per_s: float = 25 * GB
    devices_per_node: int = 8
    peak_dense_tf32_flops: float | None = None
    peak_sparse_bf16_flops: float | None = None
    aliases: tuple = ()
    source: str = ""

    def __post_init__(self):
        for name in ("peak_dense_bf16_flops", "hbm_bytes_per_s", "mem_bytes", "inter_node_bytes_per_s"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.devices_per_node, int) or self.devices_per_node < 1:
            raise ValueError(f"devices_per_node ({self.devices_per_node!r}) must be a positive integer")
        if self.intra_node_link not in self.links:
            raise ValueError(f"intra_node_link ({self.intra_node_link!r}) must be one of this "
                             f"device's links: {', '.join(sorted(self.links)) or 'none given'}")

    @property
    def intra_node_bytes_per_s(self) -> float:
        """Per-direction bandwidth of the intra-node link: half the vendor bidirectional total."""
        return self.links[self.intra_node_link] / 2

    @property
    def nvlink_total_bidirectional_bytes_per_s(self) -> float | None:
        return self.links.get("nvlink")

    @property
    def pcie_x16_bidirectional_bytes_per_s(self) -> float | None:
        return self.links.get("pcie")

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for matmuls in ``dtype``: TF32 tensor cores for fp32 when known, else the
        bf16/fp16 peak (the fastest rate of the device, so a time bound built on it stays true)."""
        if dtype == "fp32" and self.peak_dense_tf32_flops:
            return self.peak_dense_tf32_flops
        return self.peak_dense_bf16_flops

    def ridge_flops_per_byte(self) -> float:
        """Roofline ridge point, peak FLOP/s over HBM bytes/s (Williams et al. 2009, CACM 52(4))."""
        return self.peak_dense_bf16_flops / self.hbm_bytes_per_s

    def with_overrides(self, **changes) -> "Hardware":
        """A copy with some figures replaced (custom values from the command line)."""
        changes = {k: v for k, v in changes.items() if v is not None}
        if "intra_node_bytes_per_s" in changes:  # a custom per-direction figure becomes a link
            bw = changes.pop("intra_node_bytes_per_s")
            _check_positive("intra_node_bytes_per_s", bw)
            changes["links"] = {**self.links, "custom": 2 * bw}
            changes["intra_node_link"] = "custom"
        if changes:
            changes.setdefault("name", f"{self.name} (custom)")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "peak_dense_bf16_flops": self.peak_dense_bf16_flops,
            "peak_dense_tf32_flops": self.peak_dense_tf32_flops,
            "hbm_bytes_per_s": self.hbm_bytes_per_s, "mem_bytes": self.mem_bytes,
            "links_bidirectional_bytes_per_s": dict(self.links),
            "intra_node_link": self.intra_node_link,
            "intra_node_bytes_per_s_per_direction": self.intra_node_bytes_per_s,
            "inter_node_bytes_per_s_per_device": self.inter_node_bytes_per_s,
            "devices_per_node": self.devices_per_node,
        }


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} ({value!r}) must be a positive finite number")


def _a100(name: str, hbm_gbps: float, mem_gb: float, *, aliases: tuple, intra_node_link: str = "nvlink") -> Hardware:
    """The A100 variants: the same compute, NVLink3 and 200 Gb/s NICs; other HBM and host link."""
    return Hardware(name=name, peak_dense_bf16_flops=312e12, peak_dense_tf32_flops=156e12,
                    peak_sparse_bf16_flops=624e12, hbm_bytes_per_s=hbm_gbps * GB, mem_bytes=mem_gb * GB,
                    links={"nvlink": 600 * GB, "pcie": 64 * GB}, intra_node_link=intra_node_link,
                    inter_node_bytes_per_s=25 * GB, aliases=aliases,
                    source="NVIDIA A100 datasheet / whitepaper; DGX A100 user guide")


def _hopper_sxm(name: str, hbm_gbps: float, mem_gb: float, *, aliases: tuple, source: str) -> Hardware:
    """H100 SXM5 and H200: the same compute, NVLink4 and 400 Gb/s NICs; other HBM."""
    return Hardware(name=name, peak_dense_bf16_flops=989.4e12, peak_dense_tf32_flops=494.7e12,
                    peak_sparse_bf16_flops=1978.9e12, hbm_bytes_per_s=hbm_gbps * GB, mem_bytes=mem_gb * GB,
                    links={"nvlink": 900 * GB, "pcie": 128 * GB}, inter_node_bytes_per_s=50 * GB,
                    aliases=aliases, source=source)


_H100_SRC = "NVIDIA H100 datasheet / Hopper whitepaper; DGX H100 user guide"

PRESETS: dict[str, Hardware] = {h.name: h for h in (
    _a100("a100-40gb", 1555, 40, aliases=("A100-SXM4-40GB", "a100-sxm4-40gb")),
    _a100("a100-80gb", 2039, 80, aliases=("A100-SXM4-80GB", "a100", "a100-sxm4-80gb")),
    _a100("a100-pcie-80gb", 1935, 80, aliases=("A100-PCIe-80GB",), intra_node_link="pcie"),
    _hopper_sxm("h100-sxm", 3350, 80, aliases=("H100-SXM5-80GB", "h100", "h100-sxm5-80gb"), source=_H100_SRC),
    Hardware(name="h100-pcie", peak_dense_bf16_flops=756e12, peak_dense_tf32_flops=378e12,
             peak_sparse_bf16_flops=1513e12, hbm_bytes_per_s=2000 * GB, mem_bytes=80 * GB,
             links={"nvlink": 600 * GB, "pcie": 128 * GB}, intra_node_link="pcie",
             inter_node_bytes_per_s=50 * GB, aliases=("H100-PCIe-80GB",), source=_H100_SRC),
    _hopper_sxm("h200", 4800, 141, aliases=("H200-SXM-141GB", "h200-sxm"), source="NVIDIA H200 datasheet; DGX H200"),
    Hardware(name="v100-dgx2h", peak_dense_bf16_flops=130e12, hbm_bytes_per_s=900 * GB, mem_bytes=32 * GB,
             links={"nvlink": 300 * GB, "pcie": 32 * GB}, inter_node_bytes_per_s=6.25 * GB, devices_per_node=16,
             aliases=("V100-SXM3-32GB (DGX-2H)", "V100-SXM3-32GB", "v100"), source="NVIDIA DGX-2H datasheet; V100 datasheet"),
    Hardware(name="tpu-v4", peak_dense_bf16_flops=275e12, hbm_bytes_per_s=1200 * GB,
             mem_bytes=32 * 2**30, links={"ici": 540 * GB}, intra_node_link="ici",
             inter_node_bytes_per_s=270 * GB, devices_per_node=4, aliases=("TPU-v4",),
             source="Pope et al. 2022 Sec. 4"),
)}


def get_hardware(name: str) -> Hardware:
    """The preset called ``name`` (or one of its aliases, case-insensitive)."""
    key = str(name).strip().lower()
    for preset in PRESETS.values():
        if key == preset.name or key in (a.lower() for a in preset.aliases):
            return preset
    raise ValueError(f"unknown hardware {name!r}; valid: {', '.join(PRESETS)}")


def custom_hardware(*, peak_tflops: float, hbm_gbps: float, memory_gb: float, intra_node_gbps: float,
                    inter_node_gbps: float, devices_per_node: int = 8, name: str = "custom") -> Hardware:
    """A device given by its figures (TFLOP/s, GB/s per direction, GB; 1 GB = 1e9 bytes)."""
    for label, value in (("peak_tflops", peak_tflops), ("hbm_gbps", hbm_gbps), ("memory_gb", memory_gb),
                         ("intra_node_gbps", intra_node_gbps), ("inter_node_gbps", inter_node_gbps)):
        _check_positive(label, value)
    return Hardware(name=name, peak_dense_bf16_flops=peak_tflops * 1e12, hbm_bytes_per_s=hbm_gbps * GB,
                    mem_bytes=memory_gb * GB, links={"custom": 2 * intra_node_gbps * GB},
                    intra_node_link="custom", inter_node_bytes_per_s=inter_node_gbps * GB,
                    devices_per_node=devices_per_node)
