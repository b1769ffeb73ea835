"""What `tpbench fit` prints: its ranked rows, the tight ones and the nearest that do not fit, and
`--measure`'s emulated confirmation of the best rows."""

from __future__ import annotations

from rich.table import Table

from tpbench.models.shapes import model_name, shape_label
from tpbench.sizing import defaults
from tpbench.sizing.layouts import Fit, GiB, MiB, Row

SHOWN = 10  # rows per table unless --rows says otherwise; --json has every row


def title(fit: Fit) -> str:
    m, t, gpu, mem = fit.base.model, fit.base.train, fit.gpu, fit.memory
    batch = (
        f", global batch {fit.global_batch} ({fit.global_batch * t.seq_len:,} tokens)"
        if fit.global_batch
        else ""
    )
    words = defaults.precision_words(t.precision, t.dtype)
    return (
        f"{model_name(m)} ({shape_label(m)}) S {t.seq_len}, {t.precision} precision ({words}), "
        f"{defaults.optimizer_words(fit.base)}{batch} on "
        f"{fit.nodes} x {fit.gpus_per_node} {gpu.name} ({mem.usable_bytes / GiB:.1f} GiB usable, margin "
        f"{mem.margin:.0%})"
    )


def caption(fit: Fit) -> str:
    mem, o = fit.memory, fit.overheads
    return (
        f"usable: {mem.reported_bytes / GiB:.2f} GiB reported ({mem.source}) less a "
        f"{mem.reserve_bytes / MiB:.0f} MiB CUDA context; live: theory's live tensors; reserved: those + 2 "
        f"cuBLAS workspaces + FSDP2's stream pools (the predicted max reserved) + NCCL "
        f"{o.nccl_bytes_per_communicator / MiB:.0f} MiB per communicator, what fit decides by; time: the "
        "time model's, per optimizer step (micro-steps x accumulation + one DP sync + AdamW), the host's "
        "issue time where it is longer (step s marked host: predicted host-bound); micro-batch n+: the "
        "largest searched"
    )


def tables(fit: Fit, shown: int = SHOWN, tight_only: bool = False) -> list[Table]:
    """The ranked table of what fits, then what is tight, then the nearest of what does not fit;
    `tight_only` (nothing fits: its line says the rest) the tight one."""
    out = []
    parts = (
        (fit.fitting, "fits", True),
        (fit.tight, f"tight (headroom under the {fit.memory.margin:.0%} margin)", False),
        (fit.not_fitting, "does not fit", False),
    )
    parts = parts[1:2] if tight_only else parts
    for rows, what, ranked in parts:
        if not rows:
            continue
        more = f" ({shown} of {len(rows)}: --json has all)" if len(rows) > shown else ""
        table = Table(title=f"{title(fit)}: {what}{more}", caption=caption(fit) if ranked else None)
        columns = ["#", "layout", "recompute", "micro-batch", "accum", "live GiB", "reserved GiB"]
        columns += ["headroom GiB"]
        columns += ["step s", "tokens/s/GPU", "MFU", "comm GiB/micro-step"]
        columns += ["measured"] if any(r.measured for r in rows) else []
        for c in columns:
            table.add_column(c, justify="left" if c in ("layout", "recompute", "measured") else "right")
        for i, r in enumerate(rows[:shown], 1):
            if r.reason:
                table.add_row("", r.layout(), r.recompute, *[""] * (len(columns) - 4), r.reason)
                continue
            cells = [
                str(i) if ranked else "",
                r.layout(),
                r.recompute,
                f"{r.micro_batch}" + ("+" if r.capped else ""),
                str(r.accumulation),
                f"{r.live_bytes / GiB:,.2f}",
                f"{r.peak_bytes / GiB:,.2f}",
                f"{r.headroom_bytes / GiB:,.2f}",
                f"{r.step_s:,.3g}" + (" host" if r.host_bound else ""),
                f"{r.tokens_per_s_per_gpu:,.0f}",
                f"{r.mfu:.1%}",
                f"{r.comm_bytes_per_step / GiB:,.2f}",
            ]
            table.add_row(*cells, *([measured_text(r)] if "measured" in columns else []))
        out.append(table)
    return out


def measure(fit: Fit, top: int) -> None:
    """--measure: the `top` best fitting rows confirmed by emulating their busiest rank on fake tensors
    (tpbench.experiments.memory), the allocator model's reserved memory (its replay of the step's
    allocations, FSDP2's streams and storage resizes included) plus the same NCCL buffers against the
    usable memory, every level alike; each row's `measured`. A row whose reserve would not fit but
    whose allocated bytes do can still run: at a failed cudaMalloc the allocator releases its cached
    unused segments and retries (slower), which the verdict says."""
    from tpbench.experiments import memory  # the model's step runs only for --measure

    for row in fit.fitting[:top]:
        measured, seconds = memory.measure_busiest(fit.config(row))
        reserved = measured["modelled_max_memory_reserved_bytes"] + row.overhead_bytes
        allocated = measured["modelled_max_memory_allocated_bytes"] + row.overhead_bytes
        row.measured = {
            "peak_bytes": measured["peak_bytes"],
            "max_memory_allocated_bytes": measured["modelled_max_memory_allocated_bytes"],
            "max_memory_reserved_bytes": measured["modelled_max_memory_reserved_bytes"],
            "max_memory_reserved_expandable_bytes": measured["modelled_max_memory_reserved_expandable_bytes"],
            "reserved_peak_bytes": reserved,
            "fits": reserved <= fit.memory.usable_bytes,
            "fits_allocated": allocated <= fit.memory.usable_bytes,
            "seconds": seconds,
        }


def measured_text(row: Row) -> str:
    """--measure's figures: the emulated rank's live tensors beside theory's, and the allocator model's
    reserved memory with the same NCCL buffers, against the usable memory."""
    m = row.measured
    if not m:
        return ""
    if m["fits"]:
        verdict = "fits"
    elif m["fits_allocated"]:
        verdict = "fits only by the allocator releasing its cache (cudaMalloc retries)"
    else:
        verdict = "DOES NOT FIT"
    return (
        f"live {m['peak_bytes'] / GiB:,.2f} GiB (theory {row.live_bytes / GiB:,.2f}); reserved + NCCL "
        f"{m['reserved_peak_bytes'] / GiB:,.2f} GiB (predicted {row.peak_bytes / GiB:,.2f}; expandable "
        f"segments {(m['max_memory_reserved_expandable_bytes'] + row.overhead_bytes) / GiB:,.2f}): "
        f"{verdict} ({m['seconds']:.0f} s)"
    )
