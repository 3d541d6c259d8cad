"""The accelerators ``shardline plan`` knows, and the few efficiency constants of each device class.

A device is its datasheet: dense bf16 peak, memory, memory bandwidth, and the per-GPU link
within a node. What a training step achieves of those peaks is a property of the device
*class* (its generation and software stack), kept in :data:`EFFICIENCY` with the source of each
number. ``docs/planning.md`` lists which published run calibrated which constant.

Bandwidths are in gigabits per second (``Gb/s``, what network cards are sold by); NVLink's
"300 GB/s per direction" is 2,400 Gb/s.
"""

from __future__ import annotations

import dataclasses
import enum

from shardline.errors import ConfigurationError

__all__ = ["DEVICES", "EFFICIENCY", "Device", "DeviceClass", "Efficiency", "custom_device", "get_device"]


class DeviceClass(str, enum.Enum):
    """A generation of devices that share efficiency constants."""

    AMPERE = "ampere"
    HOPPER = "hopper"
    ADA = "ada"
    CPU = "cpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """What a training step achieves of a device's peaks (fractions in ``(0, 1]``).

    Attributes:
        compute: Achieved FLOP rate of a whole eager training step (matmuls, attention, and the
            memory-bound operations between them) as a fraction of the dense bf16 peak.
        link: Bus bandwidth that NCCL's ring collectives reach, as a fraction of the link rate.
        memory: Achieved fraction of memory bandwidth in the optimizer step (streaming AdamW).
        overlap: Whether collectives run beside compute (CUDA streams) or take turns with it
            (gloo on CPU reduces in the same cores that compute).
        source: Where each number comes from.
    """

    compute: float
    link: float
    memory: float
    overlap: bool
    source: str

    def __post_init__(self) -> None:
        for name in ("compute", "link", "memory"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ConfigurationError(f"efficiency {name}={value} must be in (0, 1]")


# Note: few constants, each with its source. ``link`` is the same for every GPU class: nccl-tests
# report ring bus bandwidth at about 80% of the NVLink or NIC rate for large messages
# (nccl-tests doc/PERFORMANCE.md defines busbw); it was not fitted to any run below. ``compute``
# is fitted to ONE published run per class and tested on the others (docs/planning.md).
EFFICIENCY: dict[DeviceClass, Efficiency] = {
    DeviceClass.AMPERE: Efficiency(
        compute=0.60,
        link=0.80,
        memory=0.80,
        overlap=True,
        source="compute: fitted to the PyTorch FSDP paper's GPT-175B row at batch 2 per GPU, 128 A100-80GB "
        "(186 TFLOPS); link: nccl-tests bus bandwidth; memory: STREAM-like fraction of HBM bandwidth",
    ),
    DeviceClass.HOPPER: Efficiency(
        compute=0.41,
        link=0.80,
        memory=0.80,
        overlap=True,
        source="compute: fitted to torchtitan's Llama 3.1 8B row on 8 H100 (5,762 tokens/s per GPU, eager, "
        "500 W HBM2e parts); link and memory: as for Ampere",
    ),
    DeviceClass.ADA: Efficiency(
        compute=0.60,
        link=0.80,
        memory=0.80,
        overlap=True,
        source="no published FSDP run: Ampere's constants, unverified",
    ),
    DeviceClass.CPU: Efficiency(
        compute=1.0,
        link=1.0,
        memory=1.0,
        overlap=False,
        source="shardline plan --calibrate: rates measured on this machine are used as they are",
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator's datasheet.

    Attributes:
        name: What ``--gpu`` calls it.
        peak_tflops: Dense bf16 peak (no sparsity), TFLOP/s.
        memory_gib: Memory a process can use, GiB.
        memory_gbps: Memory bandwidth, Gb/s.
        intra_node_gbps: Link to the other devices of its node, per device and direction, Gb/s.
        inter_node_gbps: Default network bandwidth per device across nodes, Gb/s.
        device_class: Whose efficiency constants apply.
        note: The part and where its numbers come from.
        measured_bus_gbps: Bus bandwidth per collective kind (``all_gather``, ``reduce_scatter``,
            ``all_reduce``), Gb/s, measured through shardline's own collectives by ``--calibrate``;
            where given it replaces the link model for that kind.
        host_memory_gbps: Measured by ``--calibrate`` on CPU: copy bandwidth, fill bandwidth and
            the extra cost of touching freshly allocated memory, Gb/s; where given, the engine's
            own copies and allocations are charged (:mod:`.host_traffic`). None on GPUs.
    """

    name: str
    peak_tflops: float
    memory_gib: float
    memory_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    device_class: DeviceClass
    note: str = ""
    measured_bus_gbps: tuple[tuple[str, float], ...] = ()
    host_memory_gbps: tuple[float, float, float] | None = None

    @property
    def efficiency(self) -> Efficiency:
        """The device class's efficiency constants."""
        return EFFICIENCY[self.device_class]


def _gpu(name: str, tflops: float, gib: float, hbm_gbs: float, nvlink_gbs: float, nic_gbps: float,
         cls: DeviceClass, note: str) -> Device:  # fmt: skip
    return Device(
        name=name,
        peak_tflops=tflops,
        memory_gib=gib,
        memory_gbps=hbm_gbs * 8,
        intra_node_gbps=nvlink_gbs * 8,
        inter_node_gbps=nic_gbps,
        device_class=cls,
        note=note,
    )


_GRAND_TETON = (
    "H100 SXM 96GB HBM2e at 500 W (Meta's Grand Teton, where torchtitan benchmarks); peak: the SXM figure, "
    "which torchtitan divides by too (the part's own lies between SXM and NVL)"
)
_GRAND_TETON = (
    "H100 SXM 96GB HBM2e at 500 W (Meta's Grand Teton, where torchtitan benchmarks); peak: the SXM figure, "
    "which torchtitan divides by too (the part's own lies between SXM and NVL)"
)
_AMP, _HOP, _ADA = DeviceClass.AMPERE, DeviceClass.HOPPER, DeviceClass.ADA
# name, dense bf16 TFLOP/s, GiB, HBM GB/s, NVLink GB/s per direction, NIC Gb/s per GPU (datasheets)
DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        _gpu("A100-40GB", 312, 40, 1555, 300, 200, _AMP, "A100 SXM4 40GB, NVLink 3, HDR InfiniBand"),
        _gpu("A100-80GB", 312, 80, 2039, 300, 200, _AMP, "A100 SXM4 80GB, NVLink 3, HDR InfiniBand"),
        _gpu("H100-SXM", 989, 79.6, 3350, 450, 400, _HOP, "H100 SXM5 80GB, NVLink 4, NDR InfiniBand"),
        _gpu("H100-PCIe", 756, 79.6, 2000, 64, 400, _HOP, "H100 PCIe 80GB, PCIe Gen5 x16 between GPUs"),
        _gpu("H100-96GB", 989, 94.5, 2400, 450, 400, _HOP, _GRAND_TETON),
        _gpu("H200", 989, 140.4, 4800, 450, 400, _HOP, "H200 SXM 141GB, NVLink 4, NDR InfiniBand"),
        _gpu("L4", 121, 22.5, 300, 32, 100, _ADA, "L4 24GB, PCIe Gen4 x16 between GPUs"),
        _gpu(
            "RTX-3090",
            71,
            23.5,
            936,
            32,
            100,
            _AMP,
            "GeForce RTX 3090 24GB: bf16 with fp32 accumulate, no NVLink assumed (PCIe Gen4 x16 between GPUs)",
        ),
        _gpu(
            "RTX-4090",
            165.2,
            23.5,
            1008,
            32,
            100,
            _ADA,
            "GeForce RTX 4090 24GB: bf16 with fp32 accumulate, PCIe Gen4 x16 between GPUs",
        ),
    )
}


def get_device(name: str) -> Device:
    """The known device called ``name`` (case-insensitive)."""
    for key, device in DEVICES.items():
        if key.lower() == name.strip().lower():
            return device
    raise ConfigurationError(
        f"unknown device {name!r} for --gpu; choose one of {', '.join(DEVICES)}, or describe it with "
        "--peak-tflops and --memory-gib"
    )


def custom_device(
    *,
    peak_tflops: float,
    memory_gib: float,
    base: Device | None = None,
    memory_gbps: float | None = None,
    intra_node_gbps: float | None = None,
    inter_node_gbps: float | None = None,
) -> Device:
    """A device described by its numbers; what is not given comes from ``base`` (default: an H100 SXM)."""
    base = base or DEVICES["H100-SXM"]
    for name, value in (("--peak-tflops", peak_tflops), ("--memory-gib", memory_gib)):
        if not value > 0:
            raise ConfigurationError(f"{name} must be > 0, got {value}")
    return dataclasses.replace(
        base,
        name=f"custom ({peak_tflops:g} TFLOP/s, {memory_gib:g} GiB)",
        peak_tflops=peak_tflops,
        memory_gib=memory_gib,
        memory_gbps=memory_gbps or base.memory_gbps,
        intra_node_gbps=intra_node_gbps or base.intra_node_gbps,
        inter_node_gbps=inter_node_gbps or base.inter_node_gbps,
        note=f"described on the command line; {base.device_class.value} efficiency constants",
    )
