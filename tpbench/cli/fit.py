"""`tpbench fit`: the command (tpbench.sizing.fit is the search), registered on the app by tpbench.cli."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tpbench.cli.arguments import EXIT_FAILED, Overrides, one_line, usage
from tpbench.cli.output import out

EPILOG = (
    "Examples:\n\n"
    "tpbench fit model=llama3_70b seq=8192 gpu=H100-80GB nodes=4\n\n"
    "tpbench fit model=qwen3_8b seq=4096 gpu=H200 global_batch=64 --json\n\n"
    "tpbench fit model=llama3_8b gpu=H100-80GB tp=2 sp=true dp_shard=full recompute=selective  (pinned; "
    "the preset's seq)\n\n"
    "tpbench fit model=llama3_8b seq=8192 gpu=H100 global_batch=16 --gpu-memory-gib 95.58\n\n"
    "tpbench fit model.hf_config=path/to/config.json seq=2048 gpu=A100-80GB tp=8 precision=pure --measure"
)


def fit(
    overrides: Overrides = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Confirm the best rows (--top) by emulating their busiest rank with fake tensors: the "
            "live-tensor peak and the caching allocator model's reserved memory.",
        ),
    ] = False,
    top: Annotated[int, typer.Option(help="How many of the best rows --measure emulates.", min=1)] = 1,
    rows: Annotated[int, typer.Option(help="Rows shown per table (--json has every row).", min=1)] = 10,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print every row and the assumptions as JSON.")
    ] = False,
    gpu_memory_gib: Annotated[
        float | None,
        typer.Option(
            help="The GPU's memory as the driver reports it, GiB, instead of the table's (a part the "
            "table has no row for, such as a 96 GB H100).",
            min=1,
        ),
    ] = None,
    margin: Annotated[
        float,
        typer.Option(
            help="Headroom below this fraction of usable memory is 'tight', not 'fits'.", min=0, max=0.5
        ),
    ] = 0.05,
    cuda_context_mib: Annotated[
        float,
        typer.Option(
            help="The runtime reserve: CUDA context per GPU, MiB (an assumption: tpbench.sizing.layouts).",
            min=0,
        ),
    ] = 512.0,
    nccl_mib: Annotated[
        float,
        typer.Option(
            help="NCCL buffers per communicator, MiB (an assumption: tpbench.sizing.layouts).", min=0
        ),
    ] = 128.0,
    network_gbps: Annotated[
        float,
        typer.Option(
            help="Between nodes: Gb/s per GPU (DP's collectives across nodes; 80% of it reached).", min=1
        ),
    ] = 400.0,
    max_micro_batch: Annotated[
        int, typer.Option(help="The largest micro-batch searched (without global_batch).", min=1)
    ] = 256,
) -> None:
    """Rank every layout of a model on a cluster by predicted tokens/s per GPU: T within a node
    (gpus_per_node=, default 8) dividing the heads x DP over the rest of nodes= (default 1) x DP sharding
    (none, optimizer, grads, full; HSDP replicas across nodes) x SP x VP x recompute, each at the largest
    micro-batch that fits the usable memory with a margin; global_batch= (sequences) or tokens_per_step=
    adds gradient accumulation. A searched choice given (tp=, sp=, dp_shard=, recompute=, micro_batch=,
    ...) is pinned: every row and every suggestion keeps it. Defaults, as `tpbench plan` assumes them:
    the model preset's seq (seq= sets it) and precision (bf16 mixed for the published models),
    fused AdamW on a GPU (train.fused_optimizer=false: for-each). Exit code 0 when a layout fits, 1
    when none does (one line saying so, after the tight table if any row runs with less than the
    margin), 2 for bad input."""
    from tpbench.config import ConfigError
    from tpbench.run import sweep as sweeping
    from tpbench.sizing import defaults
    from tpbench.sizing import fit as fitting

    overheads = fitting.Overheads(int(cuda_context_mib * 2**20), int(nccl_mib * 2**20))
    try:
        request = fitting.parse(overrides or [])
        (base,) = sweeping.configs(request.overrides, single=True, launching=False)
    except (fitting.FitError, ConfigError) as e:
        usage(str(e))
    reported = None if gpu_memory_gib is None else int(gpu_memory_gib * 2**30)
    nothing = None
    try:
        result = fitting.solve(
            request, base, overheads, reported, margin, max_micro_batch, True, network_gbps
        )
    except fitting.FitError as e:
        usage(str(e))
    except fitting.NothingFits as e:
        result, nothing = e.fit, e.line
    if measure and nothing is None:
        fitting.measure(result, top)
    if as_json:
        print(json.dumps(result.as_dict() | ({"nothing_fits": nothing} if nothing else {})))
    else:
        for table in fitting.tables(result, rows, tight_only=nothing is not None):
            out.print(table)
        if nothing is None or result.tight:
            out.print(defaults.assumed(result.base, searched=True))
            out.print(f"accumulation: {fitting.ACCUMULATION}")
            if request.gpu.note:
                out.print(f"{request.gpu.name}: {request.gpu.note}")
    if nothing is not None:
        one_line(nothing)
        raise typer.Exit(EXIT_FAILED)
