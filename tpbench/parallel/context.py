"""Who talks to whom: a world of dp x tp ranks on a DeviceMesh.

TP groups are adjacent ranks (rank = d * tp + t), so on one node they share the fastest links;
DP groups run across them. With GQA and tp > N_kv, each KV head lives on tp / N_kv ranks of a TP
group; those ranks form a KV-replica group whose k/v gradients are summed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass
class ParallelContext:
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    device: torch.device
    tp_group: dist.ProcessGroup | None  # None: a single process, every collective is the identity
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh | None = None
    kv_replica_group: dist.ProcessGroup | None = None  # set by setup_kv_replicas when tp > N_kv

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp + self.tp_rank

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelContext:
        """The context of a dense, single-process run."""
        return cls(1, 1, 0, 0, torch.device(device), None, None)

    @classmethod
    def from_world(cls, tp: int, dp: int, device: torch.device) -> ParallelContext:
        """Build the mesh from an initialised default process group of dp * tp ranks, whose tensors
        live on `device` (the worker has made it the current CUDA device)."""
        world = dist.get_world_size()
        if world != tp * dp:
            raise ValueError(f"world size {world} != dp {dp} x tp {tp}")
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        rank = dist.get_rank()
        return cls(
            tp=tp,
            dp=dp,
            tp_rank=rank % tp,
            dp_rank=rank // tp,
            device=device,
            tp_group=mesh.get_group("tp"),
            dp_group=mesh.get_group("dp"),
            mesh=mesh,
        )

    def setup_kv_replicas(self, num_kv_heads: int) -> None:
        """Create the groups of TP ranks sharing one KV head (collective: every rank must call)."""
        if self.tp <= num_kv_heads or self.tp_group is None:
            return
        replicas = self.tp // num_kv_heads
        for d in range(self.dp):
            for head in range(num_kv_heads):
                ranks = [d * self.tp + head * replicas + r for r in range(replicas)]
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.kv_replica_group = group
