"""The analytic model: per-rank memory and communication of one training step, and its FLOPs, for any
config, without running it (`predict`). docs/theory.md says what it counts, where each term comes from
and how it is checked.

Memory is what torch's MemTracker sees on one rank: the bytes of live tensor storages. A step is
  zero_grad(set_to_none) -> forward -> loss -> backward -> gradient sums -> AdamW step,
so the peak is the largest of a few moments (`Prediction.moments`). Communication is what
tpbench.parallel.instrumentation.CommCounter counts: per-rank ring bytes per step. The modules
follow the step:
  dims         the model's sizes seen from one rank, derived from the config (and the notation)
  weights      parameters, their gradients and AdamW's state; DDP's buckets
  activations  what the forward saves for backward, per block and outside the blocks
  moments      a moment's bytes by category (`Moment`), and what the loss holds at its moments
  blocks       the moments inside the model: the top block's softmax in forward, the backward from
               the final norm down through the top block, the recomputed blocks
  entries      parallel.overlap's MLP entry backward, the deferred weight gradients made there
  step         the moments of a step in order: the loss's, the head's, the blocks', the embedding's,
               the gradient sums' and the optimizer's
  collectives  each collective's count and ring bytes per step
  flops        the model's FLOPs and what full recompute adds
  sharding     sharded DP (parallel.dp_shard): ZeRO-1, ZeRO-2, FSDP's state, moments and DP collectives
  accumulation gradient accumulation (train.accumulation): which collectives run per micro-batch
  depth        the peak as a line in the depth, F + L (a/T + r), per mode, and its limit against DDP
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpbench.config import RunConfig
from tpbench.predict.allocator import CUBLAS_HANDLES, cublas_workspace_bytes
from tpbench.predict.theory import sharding
from tpbench.predict.theory.accumulation import accumulated, step_moments, top_input_norm_backward
from tpbench.predict.theory.activations import layer_activations, model_activations
from tpbench.predict.theory.collectives import comm_rows
from tpbench.predict.theory.dims import BYTES, FP32, INT64, Dims, dims
from tpbench.predict.theory.flops import model_flops_per_step, recompute_flops_per_step
from tpbench.predict.theory.moments import Moment
from tpbench.predict.theory.step import moments
from tpbench.predict.theory.weights import ddp_buckets, grad_ready_order, params
from tpbench.results import CommRow

__all__ = [
    "BYTES",
    "FP32",
    "INT64",
    "Dims",
    "Moment",
    "Prediction",
    "comm_rows",
    "ddp_buckets",
    "dims",
    "grad_ready_order",
    "layer_activations",
    "model_activations",
    "model_flops_per_step",
    "moments",
    "params",
    "predict",
    "recompute_flops_per_step",
]


@dataclass
class Prediction:
    """What `predict` says of a config: its sizes, the moments of its step and its collectives."""

    dims: Dims
    moments: list[Moment]
    rows: list[CommRow]
    activation_terms: dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> Moment:
        return max(self.moments, key=lambda m: m.total)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    @property
    def comm_bytes_per_step(self) -> int:
        return sum(r.bytes for r in self.rows)

    def breakdown(self) -> dict[str, int]:
        """The peak by MemTracker's categories, under tpbench's measurement names."""
        m = self.peak
        return {
            "mem_params_bytes": m.params,
            "mem_grads_bytes": m.grads,
            "mem_optimizer_bytes": m.optimizer,
            "mem_activations_bytes": m.activations,
            "mem_temporaries_bytes": m.temporaries,
        }

    def comm_rows(self) -> list[CommRow]:
        return list(self.rows)

    def max_memory_allocated_bytes(self, gpu: str) -> int:
        """What `torch.cuda.max_memory_allocated` would say on `gpu`: the live tensors at the peak and
        the cuBLAS workspaces, allocator blocks that hold no tensor (tpbench.predict.allocator). Left out: the
        allocator's 512-B rounding and blocks handed out whole (a split would leave <= 1 MiB), which
        add 0.5-1.8% more on the seed's presets (README, "The seed's GPU table")."""
        return self.peak_bytes + CUBLAS_HANDLES * cublas_workspace_bytes(gpu)


def predict(cfg: RunConfig) -> Prediction:
    """Per-rank peak memory and collective bytes of one training step under `cfg`."""
    s = sharding.sharding(cfg)
    rows = accumulated(cfg, comm_rows(cfg))  # a step of train.accumulation micro-batches
    k = cfg.train.accumulation  # the moments of a step of k micro-batches (accumulation.step_moments)
    if s.sharded:  # ZeRO-1, ZeRO-2, FSDP: the unsharded step's moments, their weights and gradients sharded
        d, step = sharding.level_dims(cfg), sharding.compute_dims(cfg)
        base = moments(step)
        later = sharding.moments(d, s, base, accumulating=True) if k > 1 and s.fsdp else None
        later = later and [*later, *top_input_norm_backward(d, s, later)]
        out = step_moments(d, k, sharding.moments(d, s, base), later)
        return Prediction(d, out, rows, layer_activations(step))
    d = dims(cfg)
    return Prediction(d, step_moments(d, k, moments(d)), rows, layer_activations(d))
