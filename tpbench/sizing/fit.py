"""`tpbench fit`: how one model can train on a cluster of one GPU type, every layout ranked by its
predicted speed.

For a model, a sequence length and a GPU of tpbench.predict.hardware, on `nodes` nodes of
`gpus_per_node` GPUs: every T within a node that divides the heads, DP the rest of the GPUs, crossed with
DP's sharding (none, optimizer, grads, full; for grads and full also HSDP's replicas across nodes), SP,
VP and recompute (none, selective, op, full), each at the largest micro-batch that fits
(tpbench.sizing.search).
With global_batch=B sequences (or tokens_per_step=, B x seq), the micro-batch b divides B / DP and the
rest is gradient accumulation, B / (DP x b) micro-steps. The sequence, the precision and the optimizer
are the config's, as `tpbench plan` reads them (tpbench.sizing.defaults): a published model's preset
trains at its seq in bf16 mixed precision (fp32 master weights and AdamW moments), with fused AdamW
(train.fused_optimizer=auto: fused on CUDA, as `tpbench run` steps it there; false: for-each). A
searched choice the overrides give (tp=, sp=, recompute=, ...) is pinned: every row, and the nodes the
nothing-fits line names, keep it.

Nothing runs: each row is the analytic models' (tpbench.predict.theory, tpbench.predict.steptime), as
`tpbench plan` prints them, on that GPU:

  per-rank peak  the predicted max reserved (tpbench.predict.theory.reserved: theory's live-tensor peak,
                 2 cuBLAS workspaces and, under FSDP2, its streams' pools, which the default stream
                 cannot reuse) + NCCL's buffers, one set per process group the rank talks in (the
                 world's, TP's, DP's, HSDP's replicas', the KV replicas')
  usable         what the driver reports (the hardware table's, or --gpu-memory-gib) less the runtime
                 reserve (the CUDA context); the reserve and NCCL's buffers are constants stated in
                 tpbench.sizing.layouts, settable, never fitted to anything
  headroom       usable less the peak: "fits" with at least the margin (5% of usable, settable) left,
                 "tight" below it, "does not fit" below 0
  step time      the time model's micro-step x the accumulation steps + one DP gradient sync + the
                 optimizer (layouts.ACCUMULATION says how), at the GPU's rates, DP's collectives between
                 nodes at the network's (search.NETWORK_GBPS); tokens/s per GPU and MFU from it

Not counted: the default stream's rounding and fragmentation, which `--measure` replays from an
emulated step of the chosen rows (tpbench.parallel.emulation, fake tensors) with its verdict.
Ranked: predicted tokens/s per GPU among the rows that fit, headroom breaking ties. Where none
fits, the answer is one line (search.NothingFits; the command exits 1, not bad input's 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpbench.config import ConfigError
from tpbench.predict import hardware
from tpbench.predict.hardware import GPU
from tpbench.run import compose
from tpbench.sizing import defaults
from tpbench.sizing import search as search_module
from tpbench.sizing.layouts import (
    ACCUMULATION,
    CUDA_CONTEXT_BYTES,
    MARGIN,
    NCCL_BYTES_PER_COMMUNICATOR,
    RECOMPUTE,
    Fit,
    FitError,
    GiB,
    Memory,
    MiB,
    Overheads,
    Row,
    configure,
)
from tpbench.sizing.search import (
    MAX_MICRO_BATCH,
    NETWORK_GBPS,
    Cluster,
    NothingFits,
    communicators,
    search,
)
from tpbench.sizing.tables import measure, measured_text, tables

__all__ = [
    "ACCUMULATION",
    "CUDA_CONTEXT_BYTES",
    "MARGIN",
    "MAX_MICRO_BATCH",
    "NCCL_BYTES_PER_COMMUNICATOR",
    "RECOMPUTE",
    "Cluster",
    "Fit",
    "FitError",
    "GiB",
    "Memory",
    "MiB",
    "NothingFits",
    "Overheads",
    "Request",
    "Row",
    "communicators",
    "configure",
    "measure",
    "measured_text",
    "parse",
    "search",
    "search_module",
    "solve",
    "tables",
]
# what fit searches itself: an override of one of these keeps the search to its value
SEARCHED = (
    "parallel.tp",
    "parallel.sp",
    "parallel.vp",
    "parallel.dp_shard",
    "parallel.dp_replicate",
    "train.recompute",
    "train.micro_batch",
)
DEFAULT_OVERHEADS = Overheads()
OWN = ("gpu", "gpus_per_node", "nodes", "tokens_per_step")
SHARDING = ("parallel.dp_shard", "parallel.dp_replicate")  # fit's own: applied per row, not composed


@dataclass
class Request:
    """What `tpbench fit` was asked: the GPU, the cluster's shape, the overrides its config is composed
    from (the user's and fit's own), which searched keys the user fixed, and the global batch if any."""

    gpu: GPU
    gpus_per_node: int
    overrides: list[str]
    given: set[str]
    global_batch: int | None
    nodes: int = 1
    sharding: dict[str, str] | None = None
    keys: set[str] = field(default_factory=set)  # every config key the overrides give
    tokens_per_step: int | None = None

    def batch(self, base) -> int | None:
        """The global batch in sequences: global_batch=, or tokens_per_step= over the config's seq."""
        if self.tokens_per_step is None:
            return self.global_batch
        seq = base.train.seq_len
        if self.tokens_per_step % seq:
            raise FitError(f"tokens_per_step={self.tokens_per_step}: accepted are multiples of seq ({seq})")
        return self.tokens_per_step // seq

    def cluster(
        self,
        overheads: Overheads,
        reported_bytes: int | None = None,
        margin: float = MARGIN,
        network_gbps: float = NETWORK_GBPS,
    ) -> Cluster:
        memory = Memory.of(self.gpu, overheads, reported_bytes, margin)
        return Cluster(self.gpu, self.nodes, self.gpus_per_node, memory, overheads, network_gbps)

    def base(self, base):
        """The composed config with the user's dp_shard / dp_replicate (kept apart from compose, which
        refuses a sharded memory run the model has not been measured against), and model.lean_rmsnorm
        left at auto where neither the user nor a preset set it (each row has its own recompute)."""
        import dataclasses

        from tpbench.config import lean_rmsnorm

        m = base.model
        auto = lean_rmsnorm("auto", base.train.recompute)
        if "model.lean_rmsnorm" not in self.keys and m.lean_rmsnorm == auto:
            # model.lean_rmsnorm=auto again, resolved per row with the row's recompute (theory.dims)
            base = dataclasses.replace(base, model=dataclasses.replace(m, lean_rmsnorm="auto"))
        if not self.sharding:
            return base
        par = base.parallel
        if "parallel.dp_shard" in self.sharding:
            par = dataclasses.replace(par, dp_shard=self.sharding["parallel.dp_shard"])
        if "parallel.dp_replicate" in self.sharding:
            par = dataclasses.replace(par, dp_replicate=int(self.sharding["parallel.dp_replicate"]))
        return dataclasses.replace(base, parallel=par)


def _count(key: str, value: str) -> int:
    if not value.isdecimal() or int(value) < 1:
        raise FitError(f"{key}={value}: accepted are integers >= 1")
    return int(value)


def parse(overrides: list[str]) -> Request:
    """Split fit's own keys (gpu=, gpus_per_node=, nodes=, tokens_per_step=) and DP's sharding from the
    config's overrides and add fit's own: a memory experiment on an emulated GPU of that kind, T 1 to
    start from. The rest is the config's, as `plan` reads it (tpbench.sizing.defaults)."""
    own, rest, keyed, sharding = {}, [], {}, {}
    for o in overrides:
        key, _, value = o.partition("=")
        full = compose.SHORT_NAMES.get(key.lstrip("+~"), key.lstrip("+~"))
        if key in OWN:
            own[key] = value
        elif full in SHARDING:
            sharding[full] = value
            keyed[full] = o
        else:
            rest.append(o)
            keyed[full] = o
    name = own.get("gpu", "")
    gpu = hardware.gpu(name)
    if gpu is None:
        what = f"gpu={name}" if name else "fit needs gpu=NAME"
        raise FitError(f"{what}: accepted are {', '.join(hardware.names())}")
    per_node = _count("gpus_per_node", own.get("gpus_per_node", "8"))
    nodes = _count("nodes", own.get("nodes", "1"))
    if sharding.get("parallel.dp_shard", "none") not in compose.CHOICES["parallel.dp_shard"]:
        accepted = ", ".join(compose.CHOICES["parallel.dp_shard"])
        raise FitError(f"{keyed['parallel.dp_shard']}: accepted are {accepted}")
    if "parallel.dp_replicate" in sharding:
        _count("parallel.dp_replicate", sharding["parallel.dp_replicate"])
    keys = set(keyed)
    for key in ("kind", "launch.device", "launch.emulate", "launch.emulate_gpu", "train.batch"):
        if key in keys:
            raise FitError(f"{key}: fit sets it itself (a memory experiment on an emulated {gpu.name})")
    if "parallel.dp" in keys:
        raise FitError(
            f"{keyed['parallel.dp']}: fit sets DP itself (the GPUs, nodes x gpus_per_node, over T); "
            "accepted are nodes=N and gpus_per_node=N"
        )
    given = keys & set(SEARCHED)
    if "mode" in keys:  # a mode fixes the layout's switches; T stays searched unless tp= is given
        mode = keyed["mode"].partition("=")[2]
        if mode == "ddp" or "," in mode:
            raise FitError(f"{keyed['mode']}: fit takes one tensor-parallel mode (T 1 is DDP's row)")
        given |= {"parallel.sp", "parallel.vp"}
    # a memory experiment on an emulated GPU of that kind, from T 1; the rest as `plan` assumes it
    added = ["kind=memory", "launch.device=cuda", "launch.emulate=fake", f"launch.emulate_gpu={gpu.name}"]
    added += [] if "parallel.tp" in keys else ["parallel.tp=1"]
    global_batch, tokens = _global_batch(keyed, own)
    if "train.global_batch" in keys:
        rest.remove(keyed["train.global_batch"])
    return Request(gpu, per_node, [*rest, *added], given, global_batch, nodes, sharding, keys, tokens)


def _global_batch(keyed: dict[str, str], own: dict[str, str]) -> tuple[int | None, int | None]:
    """global_batch= in sequences, or tokens_per_step= (made sequences by `Request.batch` once the
    config's seq is known)."""
    if "train.global_batch" in keyed and "tokens_per_step" in own:
        raise FitError(
            f"{keyed['train.global_batch']} with tokens_per_step={own['tokens_per_step']}: accepted is "
            "one of them"
        )
    if "tokens_per_step" in own:
        return None, _count("tokens_per_step", own["tokens_per_step"])
    if "train.global_batch" in keyed:
        key, _, value = keyed["train.global_batch"].partition("=")
        return _count(key, value), None
    return None, None


def solve(
    request: Request,
    base,
    overheads: Overheads = DEFAULT_OVERHEADS,
    reported_bytes: int | None = None,
    margin: float = MARGIN,
    max_micro_batch: int = MAX_MICRO_BATCH,
    explain: bool = True,
    network_gbps: float = NETWORK_GBPS,
) -> Fit:
    """The search a request asks for, on its composed config `base`."""
    try:
        defaults.check_seq(base, request.keys)
    except ConfigError as e:
        raise FitError(str(e)) from None
    cluster = request.cluster(overheads, reported_bytes, margin, network_gbps)
    if cluster.memory.usable_bytes <= 0:
        raise FitError(
            f"--cuda-context-mib={overheads.cuda_context_bytes / MiB:g}: accepted is less than the GPU's "
            f"{cluster.memory.reported_bytes / MiB:,.0f} MiB"
        )
    given, batch = request.given, request.batch(base)
    return search(request.base(base), cluster, given, batch, max_micro_batch, explain)
