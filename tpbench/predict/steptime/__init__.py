"""The time model: a training step's time predicted from its ops and collectives, as the memory model
predicts its bytes (docs/time-model.md says what it counts and how it is checked).

  ops     each op of a step on one rank (GEMMs, attention, norms, SwiGLU, RoPE, the loss, AdamW): its
          class, FLOPs, bytes and kernels, from the memory model's `Dims`
  rates   what they run at: a CPU's probed and cached (tpbench.predict.rate_probe), a GPU's from the
          hardware table's peaks x published achievable fractions
  model   roofline + fixed per-op cost per op, alpha-beta per collective, overlap where the
          implementation has it: the step's time split into compute, exposed communication by
          purpose and the optimizer; tokens/s; MFU

What it adds to torch's RuntimeEstimator (torch.distributed._tools.runtime_estimator, whose
roofline mode needs a CUDA device and whose per-op FLOPs and bytes come from running the step under
FakeTensorMode): no step is run (the ops come from the config, for any size, in microseconds); the
collectives and their overlap; recompute; the CPU's probed rates and fixed per-op cost; the GPU
table's rates for a GPU that is not here.
"""

from __future__ import annotations

from tpbench.config import RunConfig, local_batch, local_world_size
from tpbench.predict import hardware
from tpbench.predict.steptime.model import TimePrediction, predict_ops
from tpbench.predict.steptime.rates import HOST_OP_S, KINDS, Rates, gpu_rates
from tpbench.predict.theory import comm_rows, dims, model_flops_per_step

__all__ = ["Rates", "TimePrediction", "cpu_rates", "gpu_rates", "predict_ops", "predict_time", "rates_for"]


def predict_time(cfg: RunConfig, rates: Rates) -> TimePrediction:
    """One training step of `cfg` on one rank at `rates`, with its tokens/s and MFU."""
    d = dims(cfg)
    out = predict_ops(d, comm_rows(cfg), rates)
    out.tokens = local_batch(cfg) * cfg.parallel.dp * cfg.train.seq_len
    out.model_flops = model_flops_per_step(cfg)
    out.devices = cfg.parallel.dp * cfg.parallel.tp
    out.peak = rates.peak
    return out


def cpu_rates(cfg: RunConfig, threads: int | None, ranks: int | None = None) -> Rates:
    """This CPU's rates for a worker of `cfg` (probed once, cached: tpbench.predict.rate_probe). The
    probes time one process's threads by CPU time; where the node's ranks run more threads than it has
    cores (T 4 on 2 cores), each rank computes on its share of them, cores / threads, and its ops take
    that much longer on the wall clock (the collectives are probed over the group, wall clock: as
    they are). `ranks`: the processes computing at once on this node, where they are not `cfg`'s own
    (validate's dense model, which every rank of the run steps). A collective overlaps nothing when
    the ranks' threads fill the cores: gloo's threads then take the compute's."""
    import os

    from tpbench.predict import rate_probe

    dtype = cfg.train.dtype
    group = max(cfg.parallel.tp, cfg.parallel.dp)
    r = rate_probe.time_rates(cfg, threads, group)
    fp32 = rate_probe.rate("float32", cfg, threads)
    slow = 1.0 if dtype == "float32" else rate_probe.rate(dtype, cfg, threads) / fp32
    # launch.bf16_gemm=fp32_accumulate (validate in bf16): each GEMM an fp32 one, its casts counted
    # (Rates.widen); the flash attention kernel keeps its bf16 arithmetic (tpbench.models.gemm)
    accumulate = dtype == "bfloat16" and cfg.kind == "validate" and cfg.launch.bf16_gemm != "native"
    gemm_slow = 1.0 if accumulate else slow
    large = fp32 * gemm_slow
    op_s = r["op_s"] + (rate_probe.fp32_accumulate_op_s(cfg, threads) if accumulate else 0.0)
    busy, cores = (ranks or local_world_size(cfg)) * (threads or 1), os.cpu_count() or 1
    share = min(1.0, cores / busy)
    shared = f"; {busy} threads on {cores} cores: a rank computes on {share:.2g}" if share < 1 else ""
    shared += "; bf16 GEMMs fp32-accumulated" if accumulate else ""
    probed = rate_probe.probed_group(group)
    gloo = group if probed == group else f"{probed}, its alphas scaled to {group} by the ring's steps"
    return Rates(
        gemm={"large": large * share, "small": r["gemm_small"] * gemm_slow * share},
        attention=r["attention"] * slow * share,
        bandwidth=r["bandwidth"] * share,
        cache_bandwidth=r.get("cache_bandwidth", r["bandwidth"]) * share,
        op_s=op_s / share,
        alpha={k: r.get(f"alpha_{k}", 0.0) for k in KINDS},
        beta={k: r.get(f"beta_{k}", 0.0) for k in KINDS},
        source=f"probed on {rate_probe.machine.cpu_name()}, {threads} thread(s), gloo over {gloo}{shared}",
        overlap=busy < cores,
        peak=large,
        widen=3.0 if accumulate else 0.0,
    )


def host_op_s(row: hardware.GPU) -> float:
    """The host's issue cost per op for a step on `row`: probed where this machine has that GPU
    (host_probe.cuda_host_op_s), else the sourced figure (rates.HOST_OP_S)."""
    import torch

    if not torch.cuda.is_available() or hardware.of_device(torch.cuda.get_device_name(0)) != row:
        return HOST_OP_S
    from tpbench.predict import host_probe

    return host_probe.cuda_host_op_s()


def rates_for(
    cfg: RunConfig, gpu: str | None = None, threads: int | None = None, ranks: int | None = None
) -> Rates:
    """The rates of `cfg`'s device: a GPU's from the table (`gpu` names its row; else the one
    launch.emulate_gpu names), the CPU's probed (`cpu_rates`: `threads`, `ranks`)."""
    if cfg.launch.device == "cuda":
        row = hardware.gpu(gpu or cfg.launch.emulate_gpu or "H100-SXM")
        if row is None:
            raise ValueError(f"gpu={gpu!r}: accepted are {', '.join(hardware.names())}")
        return gpu_rates(row, cfg.train.dtype, host_op_s=host_op_s(row))
    return cpu_rates(cfg, threads, ranks)
