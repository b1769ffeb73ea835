"""Per-rank peak memory of a training step, after warm-up, beside the analytic prediction.

`peak_bytes` is torch's MemTracker peak on every device: the live tensors, attributed to parameters,
buffers, gradients, activations, temporaries or optimizer state, as the analytic model counts them.
On a GPU the caching allocator's own peaks are stored beside it, after reset_peak_memory_stats:
`max_memory_allocated_bytes` (blocks handed out, rounded up) and `max_memory_reserved_bytes`.
"""

from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tpbench import theory
from tpbench.config import RunConfig
from tpbench.experiments.training import Trainer
from tpbench.results import RankResult

# MemTracker's categories -> tpbench's measurement names
CATEGORIES = {
    "Parameter": "mem_params_bytes",
    "Gradient": "mem_grads_bytes",
    "Optstate": "mem_optimizer_bytes",
    "Activation": "mem_activations_bytes",
    "Temp": "mem_temporaries_bytes",
    "Buffer": "mem_buffers_bytes",
    "Other": "mem_other_bytes",
}


def run(cfg: RunConfig) -> RankResult:
    trainer = Trainer(cfg)
    result = RankResult(rank=trainer.ctx.rank)
    for _ in range(cfg.train.warmup):
        trainer.step()
    result.comm = trainer.counted_step()
    result.add("comm_bytes_per_step", sum(r.bytes for r in result.comm), "B")

    on_gpu = trainer.ctx.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tracker = MemTracker()
    tracker.track_external(trainer.module, trainer.optimizer)
    with tracker:
        for _ in range(cfg.train.steps):
            trainer.step()
            tracker.reset_mod_stats()  # per-module stats are per iteration; the peak is kept
    peak = tracker.get_tracker_snapshot("peak")[trainer.ctx.device]
    for category, name in CATEGORIES.items():
        result.add(name, peak.get(category, 0), "B")
    result.add("peak_bytes", peak["Total"], "B")
    if on_gpu:
        result.add("max_memory_allocated_bytes", torch.cuda.max_memory_allocated(), "B")
        result.add("max_memory_reserved_bytes", torch.cuda.max_memory_reserved(), "B")

    predicted = theory.predict(cfg)
    result.add("predicted_peak_bytes", predicted.peak_bytes, "B")
    for name, value in predicted.breakdown().items():
        result.add(f"predicted_{name}", value, "B")
    result.add("predicted_comm_bytes_per_step", predicted.comm_bytes_per_step, "B")
    return result
