"""How tpbench names a run's ranks and data parallelism in what it prints: one label, everywhere (the
CLI's lines and tables, the report, `plan`). Plain values in, so that a stored run's config reads the
same as a composed one; tpbench.config.parallel_label and run_label apply them to a config."""

from __future__ import annotations

# The sharded DP levels (parallel.dp_shard) as `tpbench fit` and `tpbench plan` name them.
LEVEL_NAMES = {"none": "DDP", "optimizer": "ZeRO-1", "grads": "ZeRO-2", "full": "FSDP"}


def dp_level_label(dp_shard: str, dp_replicate: int = 1) -> str:
    """The DP level as `tpbench fit` names it: ZeRO-1, ZeRO-2, FSDP, HSDP's "FSDP (2 replicas)"; "" for
    DDP's replicas, the default, which every other level's label names."""
    if dp_shard == "none":
        return ""
    return LEVEL_NAMES.get(dp_shard, dp_shard) + (f" ({dp_replicate} replicas)" if dp_replicate > 1 else "")


def layout_label(tp: int, dp: int, dp_shard: str = "none", dp_replicate: int = 1) -> str:
    """tp=2 dp=2, tp=2 dp=2 ZeRO-2, tp=1 dp=4 FSDP (2 replicas): the ranks and the DP level."""
    level = dp_level_label(dp_shard, dp_replicate)
    return f"tp={tp} dp={dp}" + (f" {level}" if level else "")


def emulation_label(flat: dict) -> str:
    """How a stored run (its config flattened to dotted keys) was emulated: "" for a real job (a
    validation's bf16 GEMMs fp32-accumulated, launch.bf16_gemm, says so: a GPU's arithmetic here)."""
    flavour = flat.get("launch.emulate", "none")
    if flat.get("launch.bf16_gemm", "native") != "native":
        return "bf16 GEMMs fp32-accumulated"
    if flavour == "none":
        return ""
    rank, world = flat.get("launch.emulate_rank"), flat["parallel.tp"] * flat["parallel.dp"]
    return f"emulated ({flavour} tensors, rank {'busiest' if rank is None else rank} of {world})"
