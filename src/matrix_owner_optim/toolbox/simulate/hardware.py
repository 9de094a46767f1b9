"""Stated constants: hardware, presets, the modelled workload and options.

Part of :mod:`matrix_owner_optim.toolbox.simulate`; see its docstring for the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ...planning.cost import MUON_NS_STEPS
from ._units import GB


@dataclass(frozen=True)
class Constant:
    """One number of the cost model, with where it comes from.

    ``source`` is a source class: ``vendor spec`` (datasheet peak), ``typical measured``
    (what NCCL/cuBLAS benchmarks commonly reach), ``assumption`` (a choice the reader may
    dispute; change it with the matching CLI flag), or ``user override``.
    """

    value: float
    unit: str
    source: str
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "unit": self.unit, "source": self.source, "note": self.note}


@dataclass(frozen=True)
class Hardware:
    """Per-GPU compute and the two-level network of one cluster type.

    Bandwidths are per direction. ``intra_bw_gbs`` is per GPU (NVLink/NVSwitch),
    ``inter_bw_gbs`` is per *node* (all its NICs together, rail-optimised).
    """

    name: str
    gpu: str
    peak_tflops: Constant
    ns_efficiency: Constant
    intra_bw_gbs: Constant
    inter_bw_gbs: Constant
    intra_latency_us: Constant
    inter_latency_us: Constant
    hbm_bw_gbs: Constant
    launch_us: Constant
    gpu_memory_gb: Constant

    FIELDS = (
        "peak_tflops",
        "ns_efficiency",
        "intra_bw_gbs",
        "inter_bw_gbs",
        "intra_latency_us",
        "inter_latency_us",
        "hbm_bw_gbs",
        "launch_us",
        "gpu_memory_gb",
    )

    # -- SI views used by the formulas -------------------------------------------------------
    @property
    def ns_flop_rate(self) -> float:
        """Achieved FLOP/s of the NS matmuls: peak x efficiency."""
        return self.peak_tflops.value * 1e12 * self.ns_efficiency.value

    @property
    def beta_intra(self) -> float:
        return self.intra_bw_gbs.value * GB

    @property
    def beta_inter(self) -> float:
        return self.inter_bw_gbs.value * GB

    @property
    def alpha_intra(self) -> float:
        return self.intra_latency_us.value * 1e-6

    @property
    def alpha_inter(self) -> float:
        return self.inter_latency_us.value * 1e-6

    @property
    def hbm_bw(self) -> float:
        return self.hbm_bw_gbs.value * GB

    @property
    def launch_s(self) -> float:
        return self.launch_us.value * 1e-6

    def with_overrides(self, **values: float | None) -> Hardware:
        """A copy with some constants replaced; replaced ones are marked ``user override``."""
        changes: dict[str, Any] = {}
        for key, value in values.items():
            if value is None:
                continue
            if key not in self.FIELDS:
                raise ValueError(f"unknown hardware constant {key!r}; known: {', '.join(self.FIELDS)}")
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"hardware constant {key} must be a positive number, got {value!r}")
            old: Constant = getattr(self, key)
            changes[key] = Constant(
                float(value), old.unit, "user override", f"preset value was {old.value:g} ({old.source})"
            )
        return dataclasses.replace(self, **changes) if changes else self

    def scaled(self, **factors: float) -> Hardware:
        """A copy with constants multiplied by factors (used by the what-if solvers)."""
        changes: dict[str, Any] = {}
        for key, f in factors.items():
            old: Constant = getattr(self, key)
            changes[key] = dataclasses.replace(old, value=old.value * f)
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "gpu": self.gpu, "constants": {k: getattr(self, k).to_json() for k in self.FIELDS}}


_NS_EFF_NOTE = (
    "achieved fraction of bf16 dense peak for the NS chain (X X^T, the k x k Gram square, "
    "B X, plus casts and launch gaps); cuBLAS bf16 GEMMs at n~4k typically reach 0.6-0.75 of "
    "peak, smaller and skinny ones less; 0.5 is the middle of the 0.4-0.6 range"
)

_INTRA_LAT_NOTE = "NCCL small-message step latency over NVLink (5-10 us range, low end)"
_INTER_LAT_NOTE = "NCCL small-message step latency over InfiniBand (10-20 us range, low end)"

A100 = Hardware(
    name="a100",
    gpu="NVIDIA A100 SXM4 80GB (DGX A100-style node)",
    peak_tflops=Constant(312.0, "TFLOP/s", "vendor spec", "A100 bf16 dense Tensor Core peak"),
    ns_efficiency=Constant(0.5, "fraction", "assumption", _NS_EFF_NOTE),
    intra_bw_gbs=Constant(
        300.0,
        "GB/s per GPU per direction",
        "vendor spec",
        "NVLink3 via NVSwitch: 600 GB/s bidirectional = 300 GB/s per direction; "
        "NCCL typically measures ~230-260 GB/s bus bandwidth",
    ),
    inter_bw_gbs=Constant(
        100.0,
        "GB/s per node per direction",
        "vendor spec",
        "4 x 200 Gb/s HDR InfiniBand per node (assumed cluster wiring; the paper "
        "summary does not state the NICs; DGX A100 has up to 8 x 200 Gb/s)",
    ),
    intra_latency_us=Constant(5.0, "us per ring step", "typical measured", _INTRA_LAT_NOTE),
    inter_latency_us=Constant(10.0, "us per ring step", "typical measured", _INTER_LAT_NOTE),
    hbm_bw_gbs=Constant(
        2039.0, "GB/s", "vendor spec", "A100 80GB SXM HBM2e; prices the memory-bound AdamW of non-matrix tensors"
    ),
    launch_us=Constant(
        5.0, "us per kernel", "typical measured", "CUDA kernel launch + PyTorch dispatch per NS kernel (eager mode)"
    ),
    gpu_memory_gb=Constant(80.0, "GB", "vendor spec", "A100 80GB HBM capacity"),
)

H100 = Hardware(
    name="h100",
    gpu="NVIDIA H100 SXM5 80GB (DGX H100-style node)",
    peak_tflops=Constant(989.0, "TFLOP/s", "vendor spec", "H100 SXM bf16 dense Tensor Core peak"),
    ns_efficiency=Constant(0.5, "fraction", "assumption", _NS_EFF_NOTE),
    intra_bw_gbs=Constant(
        450.0,
        "GB/s per GPU per direction",
        "vendor spec",
        "NVLink4 via NVSwitch: 900 GB/s bidirectional = 450 GB/s per direction",
    ),
    inter_bw_gbs=Constant(
        400.0,
        "GB/s per node per direction",
        "vendor spec",
        "8 x 400 Gb/s NDR InfiniBand per node (DGX H100 compute fabric)",
    ),
    intra_latency_us=Constant(5.0, "us per ring step", "typical measured", _INTRA_LAT_NOTE),
    inter_latency_us=Constant(10.0, "us per ring step", "typical measured", _INTER_LAT_NOTE),
    hbm_bw_gbs=Constant(3350.0, "GB/s", "vendor spec", "H100 SXM HBM3"),
    launch_us=Constant(
        5.0, "us per kernel", "typical measured", "CUDA kernel launch + PyTorch dispatch per NS kernel (eager mode)"
    ),
    gpu_memory_gb=Constant(80.0, "GB", "vendor spec", "H100 80GB HBM capacity"),
)


@dataclass(frozen=True)
class Preset:
    """Hardware plus the default topology (and, for ``paper``, the model it implies)."""

    name: str
    hardware: Hardware
    nodes: int
    gpus_per_node: int
    description: str


PRESETS: dict[str, Preset] = {
    "a100": Preset("a100", A100, 8, 8, "A100 nodes: 8 GPUs on NVLink3, 4 x HDR IB per node"),
    "h100": Preset("h100", H100, 8, 8, "H100 nodes: 8 GPUs on NVLink4, 8 x NDR IB per node"),
    "paper": Preset(
        "paper",
        dataclasses.replace(A100, name="paper"),
        8,
        8,
        "the paper's setup: 8 nodes x 8 A100 = 64 GPUs; model 32 layers x 4096 "
        "(the seed code's configuration; the paper summary names sizes up to 32B)",
    ),
}

# Paper / seed model: 32 layers, hidden 4096 (seed code's figure). Vocabulary and context
# are not stated; GPT-2's padded vocabulary and 2048 tokens are assumed (they only size the
# evenly sharded embeddings, which every strategy treats alike).
PAPER_MODEL = {"n_layers": 32, "d_model": 4096, "vocab_size": 50304, "seq_len": 2048, "n_heads": 32}


@dataclass(frozen=True)
class SimOptions:
    """Modelling choices that are not hardware.

    Attributes:
        grad_bytes: bytes per element of the gradient the baselines gather / route (4: FSDP2
            with fp32 parameters and no ``reduce_dtype`` keeps fp32 gradients).
        ns_bytes: bytes per element inside NS (2: torch.optim.Muon casts to bf16); also the
            dtype of the DTensor-propagated collectives.
        kernels_per_matrix: kernel launches per matrix update: 3 per NS iteration plus cast,
            norm, divide, momentum and the two update kernels.
        adamw_bytes_per_elem: HBM bytes the AdamW step of one non-matrix element touches
            (read p, g, m, v; write p, m, v; fp32 = 28).
        agree_factor: a prediction "agrees" with a claim when within this factor either way.
    """

    grad_bytes: int = 4
    ns_bytes: int = 2
    ns_steps: int = MUON_NS_STEPS
    kernels_per_matrix: int = 3 * MUON_NS_STEPS + 6
    adamw_bytes_per_elem: int = 28
    agree_factor: float = 1.5

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
