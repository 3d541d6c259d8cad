"""CPU offload: a unit's shards, their gradients and the optimizer state in host memory.

Note: what lives where, and every copy between the two. With :class:`CPUOffload` a unit's
master buffer (the flat fp32 shard the optimizer updates) is allocated in host memory -- pinned
when the compute device is CUDA, so copies run asynchronously -- and so are the reduced
gradients the optimizer reads and, because torch optimizers create their state like the
parameter, the optimizer state. The device holds only what the step needs at that moment:

* before a unit's all-gather its shard is copied host -> device into a staging buffer
  (``non_blocking`` on CUDA; stream order makes the gather wait for it), which is freed once the
  gather has sent it;
* after the reduction lands, each gradient shard is copied device -> host (blocking: the
  optimizer, on the host, reads it next);
* the optimizer step runs on host tensors; clipping takes the norm of the host gradients.

On a CPU-only machine host and device are the same memory, but the copies are still made into
distinct buffers, so the path that runs on a GPU is the path the CPU tests exercise (a skipped
copy leaves the gathered parameters stale, and parity fails). :class:`HostCopies` is the only
place the copies are made; it counts them (:class:`TransferStats`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffload", "HostCopies", "OffloadPolicy", "TransferStats"]

HOST = torch.device("cpu")


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a unit keeps its sharded state between uses; this base policy: on the compute device (no offload)."""


@dataclass(frozen=True)
class CPUOffload(OffloadPolicy):
    """Keep a unit's sharded parameters, their gradients and the optimizer state in host memory.

    Each step copies the unit's shard to the device for its all-gather and the reduced gradient
    shard back to the host; the optimizer steps on the host. Training is unchanged: on a CPU the
    losses are bit-identical to training without it.

    Attributes:
        pin_memory: Allocate the host buffers in page-locked memory when the compute device is
            CUDA, so host -> device copies are asynchronous. Ignored on a CPU.
    """

    pin_memory: bool = True


@dataclass
class TransferStats:
    """Copies between host and device that offloaded units made (counts and bytes)."""

    host_to_device: int = 0
    host_to_device_bytes: int = 0
    device_to_host: int = 0
    device_to_host_bytes: int = 0

    def add(self, other: TransferStats) -> None:
        """Add ``other``'s counts to these."""
        self.host_to_device += other.host_to_device
        self.host_to_device_bytes += other.host_to_device_bytes
        self.device_to_host += other.device_to_host
        self.device_to_host_bytes += other.device_to_host_bytes


class HostCopies:
    """The host side of one offloaded flat group: allocates host buffers, copies both ways, counts.

    Args:
        policy: The unit's :class:`CPUOffload`.
        device: The compute device (where gathers and reductions run).
    """

    def __init__(self, policy: CPUOffload, device: torch.device) -> None:
        self.policy = policy
        self.stats = TransferStats()
        self.device = device

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return self._device

    @device.setter
    def device(self, device: torch.device) -> None:
        self._device = device
        # Pinned pages only help copies to a CUDA device, and need a CUDA runtime to allocate.
        self.pin = self.policy.pin_memory and device.type == "cuda" and torch.cuda.is_available()
        self.non_blocking = device.type == "cuda"

    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D host buffer (pinned when the policy and the device allow)."""
        return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=self.pin)

    def to_device(self, host: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy ``host`` into ``out`` (default: a new device buffer of its shape and dtype); returns it."""
        if out is None:
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=self.non_blocking)
        self.stats.host_to_device += 1
        self.stats.host_to_device_bytes += host.numel() * host.element_size()
        return out

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding ``tensor``'s values (a real copy even when ``tensor`` is on the CPU)."""
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=HOST, pin_memory=self.pin)
        out.copy_(tensor)  # blocking: the optimizer reads it on the host next
        self.stats.device_to_host += 1
        self.stats.device_to_host_bytes += tensor.numel() * tensor.element_size()
        return out
