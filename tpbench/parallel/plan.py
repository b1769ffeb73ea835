"""The plan that turns a dense MiniMind into its TP / SP / VP form, in place.

Like torchtitan, the dense model knows nothing of parallelism: one table, {module path: style}
(`tp_styles`, which the DTensor engine reads too), says what each module becomes; `apply_styles`
swaps the sharded layers in (slicing the dense weights, so every tp starts from the same model) and
puts each region's entry op in front of it as a module of its own (tpbench.parallel.wrappers), where
print(model) shows it. Each dense parameter gets a `Layout` that says how it is sharded, how the
shards are put back together, and whether its gradient must be summed.

With `parallel.overlap` (tpbench.parallel.overlap) each region's entry backward overlaps its collective
with the region's column-parallel weight gradients, SP's re-gather is started early, and the DP
gradient average goes bucket by bucket during backward.

Region entries and exits per block (T = tp):
  tp:      attn/mlp entry f (copy)            exit f-bar (all-reduce)      stream [S, B, H]
  tp+sp:   attn/mlp entry g (all-gather)      exit g-bar (reduce-scatter)  stream [S/T, B, H]
  vp:      embedding exit f-bar / g-bar; LM head entry f / g; loss on sharded logits
With parallel.sp_gather=linear, g moves from the region's entry into each of its column linears
(q, k, v; gate, up): 5 all-gathers per block instead of 2, each linear saving its own gathered input
(or, with the re-gather, its shard), as minimind-tron's ColumnParallelLinear does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tpbench.config import ParallelConfig
from tpbench.models.minimind import MiniMindConfig, MiniMindForCausalLM
from tpbench.parallel import collectives, regions
from tpbench.parallel.context import ParallelContext
from tpbench.parallel.cross_entropy import VocabParallelCrossEntropy
from tpbench.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tpbench.parallel.overlap import DeferredWeightGrads, DPGradBuckets, defer_weight_grads
from tpbench.parallel.recompute import apply_recompute
from tpbench.parallel.rng import place_dropouts
from tpbench.parallel.wrappers import (
    PerLinearGathers,
    SPGather,
    SPGatherReplicated,
    SPScatter,
    TPCopy,
    set_entry,
    set_exit,
)


@dataclass(frozen=True)
class Layout:
    """How one dense parameter lives on the TP ranks.

    semantics: column | row | replicated | replicated_sum | kv_replicated | vocab.
    A sharded tensor is cut into `num_shards` chunks along `dim`; rank t holds chunk
    t // (tp / num_shards), so with num_shards < tp (KV heads replicated) several ranks hold one.
    `padded_rows` pads dim 0 with zero rows before cutting (a vocab not divisible by tp).
    """

    semantics: str
    dim: int | None = None
    num_shards: int = 1
    padded_rows: int | None = None
    grad_sum: str | None = None  # the checks.GRAD_SUMS entry that sums this gradient, if any

    def shard(self, dense: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        if self.dim is None:
            return dense.detach().clone()
        if self.padded_rows is not None and self.padded_rows > dense.shape[0]:
            pad = dense.new_zeros(self.padded_rows - dense.shape[0], *dense.shape[1:])
            dense = torch.cat([dense.detach(), pad])
        # chunk(num_shards)[i] as one narrow view: the other shards are not made (at T 64 under fake
        # tensors, making all of them was most of the model's set-up)
        i, length = tp_rank // (tp // self.num_shards), dense.shape[self.dim]
        size = -(-length // self.num_shards)
        return dense.detach().narrow(self.dim, i * size, min(size, length - i * size)).clone()

    def span(self, length: int, tp: int, tp_rank: int) -> tuple[int, int]:
        """The dense indices along `dim` that rank `tp_rank`'s shard holds, of a dense dim of `length`
        (as `shard` cuts it; padded rows are no dense index)."""
        i = tp_rank // (tp // self.num_shards)
        size = -(-max(length, self.padded_rows or 0) // self.num_shards)
        return min(i * size, length), min((i + 1) * size, length)

    def unshard(self, shards: list[torch.Tensor], real_rows: int | None = None) -> torch.Tensor:
        """Inverse of shard, from the shards of all TP ranks in rank order; drops padded rows."""
        if self.dim is None:
            return shards[0]
        step = len(shards) // self.num_shards
        full = torch.cat(shards[::step], dim=self.dim)
        return full[:real_rows] if self.padded_rows is not None else full


def padded_vocab(vocab_size: int, tp: int, multiple: int = 1) -> int:
    m = tp * multiple
    return -(-vocab_size // m) * m


def plan_layouts(cfg: MiniMindConfig, tp: int, pcfg: ParallelConfig) -> dict[str, Layout]:
    """The layout of every parameter name of the dense model under this parallel config.

    The q/k/v biases (model.attention_bias) are column parallel with their weights: cut with the
    heads, a replicated KV head's bias replicated with it and its gradient summed over the replicas.
    o_proj and down_proj have no bias (a row bias would be added once, after the reduction:
    RowParallelLinear). With model.qk_norm off there are no q/k norms, so no gradient sum for them."""
    kv = cfg.num_key_value_heads
    kv_layout = (
        Layout("column", 0, tp) if kv % tp == 0 else Layout("kv_replicated", 0, kv, grad_sum="kv_replicas")
    )
    norm = Layout("replicated_sum", grad_sum="sp_norms") if pcfg.sp else Layout("replicated")
    vocab = (
        Layout("vocab", 0, tp, padded_rows=padded_vocab(cfg.vocab_size, tp, pcfg.vocab_pad_multiple))
        if pcfg.vp
        else Layout("replicated")
    )
    layouts = {"model.embed_tokens.weight": vocab, "lm_head.weight": vocab, "model.norm.weight": norm}
    column, head_norm = Layout("column", 0, tp), Layout("replicated_sum", grad_sum="qk_norm")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        attn = {p + "q_proj.weight": column, p + "k_proj.weight": kv_layout, p + "v_proj.weight": kv_layout}
        if cfg.attention_bias:
            attn |= {p + "q_proj.bias": column, p + "k_proj.bias": kv_layout, p + "v_proj.bias": kv_layout}
        attn[p + "o_proj.weight"] = Layout("row", 1, tp)
        if cfg.qk_norm:
            attn |= {p + "q_norm.weight": head_norm, p + "k_norm.weight": head_norm}
        p = f"model.layers.{i}."
        layouts |= attn | {
            p + "mlp.gate_proj.weight": column,
            p + "mlp.up_proj.weight": column,
            p + "mlp.down_proj.weight": Layout("row", 1, tp),
            p + "input_layernorm.weight": norm,
            p + "post_attention_layernorm.weight": norm,
        }
    if tp == 1:  # nothing is sharded; keep the names, drop the sums
        layouts = {n: Layout("replicated") for n in layouts}
    return layouts


# The styles of the module table (`tp_styles`), read by both engines: ours (below) and the DTensor
# engine's (tpbench.parallel.dtensor.tp_plan, which makes each a ParallelStyle).
STYLES = {
    "entry": "a region's entry: f (copy) under TP, g (all-gather) under SP",
    "column": "column parallel: weight rows (output features) split",
    "row": "row parallel: weight columns split; ends its region (f-bar: all-reduce, g-bar: reduce-scatter)",
    "vocab_embedding": "vocab rows split; partial lookups summed (all-reduce) or reduce-scattered",
    "vocab_head": "the LM head split over the vocab (column parallel), entered like a region",
    "sp_split": "SP with a replicated vocab: the embedding's output split into the sequence shard",
    "sp_gather": "SP with a replicated vocab: the final norm's output gathered for the whole LM head",
    "sp_norm": "a norm on the sequence shard: weight replicated, gradient summed (sp_norms)",
    "head_norm": "a q/k norm on this rank's heads: weight replicated, gradient summed (qk_norm)",
}


def tp_styles(num_layers: int, sp: bool, vp: bool, qk_norm: bool = True) -> dict[str, str]:
    """{module path: style} (STYLES) of the TP / SP / VP plan, in the order the modules run; a module
    not named stays replicated. Both engines read it."""
    table: dict[str, str] = {}
    if vp:
        table["model.embed_tokens"] = "vocab_embedding"
    elif sp:
        table["model.embed_tokens"] = "sp_split"
    for i in range(num_layers):
        p = f"model.layers.{i}."
        if sp:
            table[p + "input_layernorm"] = "sp_norm"
        table[p + "self_attn"] = "entry"  # one per region: q, k, v share it, so backward reduces once
        table |= {p + f"self_attn.{name}": "column" for name in ("q_proj", "k_proj", "v_proj")}
        table |= {p + f"self_attn.{name}": "head_norm" for name in ("q_norm", "k_norm") if qk_norm}
        table[p + "self_attn.o_proj"] = "row"
        if sp:
            table[p + "post_attention_layernorm"] = "sp_norm"
        table[p + "mlp"] = "entry"
        table |= {p + "mlp.gate_proj": "column", p + "mlp.up_proj": "column", p + "mlp.down_proj": "row"}
    if sp:
        table["model.norm"] = "sp_norm" if vp else "sp_gather"
    if vp:
        table["lm_head"] = "vocab_head"
    return table


@dataclass
class GradSum:
    name: str
    group: collectives.Group
    params: list[str]  # parameter names: the sum follows a parameter that is replaced (moved, cast)
    average: bool = False


@dataclass
class ParallelModel:
    """A sharded model plus what training needs to know about it."""

    module: MiniMindForCausalLM
    ctx: ParallelContext
    config: ParallelConfig
    layouts: dict[str, Layout]
    fault: str = ""  # debug.overlap_fault
    grad_sums: list[GradSum] = field(default_factory=list)
    deferred: list[DeferredWeightGrads] = field(default_factory=list)  # overlap: one per region
    dp_buckets: DPGradBuckets | None = None  # overlap with dp > 1: made at the first call
    # debug.low_precision_reduce under mixed precision: the DP sum's dtype (bf16), not its fp32 grads'
    dp_reduce_dtype: torch.dtype | None = None

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        if self.config.overlap and self.dp_buckets is None:
            self.dp_buckets = self._dp_buckets()
        return self.module(input_ids, labels)

    def finish_grads(self) -> None:
        """The gradient sums the shards need before an optimizer step (and the DP average)."""
        params = dict(self.module.named_parameters())
        for gs in self.grad_sums:
            if gs.name == "dp" and self.dp_buckets is not None:
                self.dp_buckets.finish()  # after the TP sums, which its last bucket must see
                continue
            grads = [params[name].grad for name in gs.params if params[name].grad is not None]
            dp = gs.name == "dp"
            purpose, dtype = ("dp_grads", self.dp_reduce_dtype) if dp else ("grad_sum", None)
            collectives.all_reduce_coalesced(grads, gs.group, purpose, gs.average, dtype)

    def _dp_buckets(self) -> DPGradBuckets | None:
        """Made once the parameters are final (placed on their device and dtype): its hooks sit on them.
        None without a DP gradient sum."""
        dp = next((gs for gs in self.grad_sums if gs.name == "dp"), None)
        if dp is None:
            return None
        params = dict(self.module.named_parameters())
        late = self.late_params()
        buckets = DPGradBuckets(
            params, late, dp.group, self.config.ddp_bucket_mb * 2**20, self.fault == "early_bucket",
            self.dp_reduce_dtype,
        )  # fmt: skip
        names = {id(p): n for n, p in params.items()}
        for name, p in params.items():  # a deferred weight is not in autograd's graph: its hook stays quiet
            p.register_post_accumulate_grad_hook(lambda p, name=name: buckets.ready(name))
        for deferred in self.deferred:
            deferred.on_ready = lambda p: buckets.ready(names[id(p)])
        return buckets

    def late_params(self) -> set[str]:
        """The parameters whose DP reduction must wait for the step's end: those with a TP gradient sum
        (q/k norms, SP norms, KV replicas), which must see it first, and a weight that gets gradients
        from two places (the LM head tied to the embedding). DPGradBuckets' and ZeRO-1's last bucket."""
        params = dict(self.module.named_parameters())
        late = {n for n in params if self.layouts[n].grad_sum}
        model = self.module
        if model.lm_head.weight is model.model.embed_tokens.weight:
            late.add(next(n for n, p in params.items() if p is model.lm_head.weight))
        return late

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient on this rank (TP-local: a sharded DP level gathers its DP shards)."""
        return {n: p.grad for n, p in self.module.named_parameters()}

    def write_gradients(self, grads: dict[str, torch.Tensor]) -> None:
        write_in_place(self.full_gradients(), grads)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Each parameter on this rank (TP-local), as full_gradients."""
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def semantics(self, name: str) -> str:
        return self.layouts[name].semantics

    def shard_like(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """This rank's part of a dense tensor (a weight or its gradient) of parameter `name`."""
        return self.layouts[name].shard(dense, self.ctx.tp, self.ctx.tp_rank)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One dense state dict with the dense names (collective over the TP group)."""
        return gather_state_dict(self)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, S, V/T] vocab-sharded logits -> [B, S, V], for checks only (never in training)."""
        if not self.config.vp or self.ctx.tp == 1:
            return logits.narrow(-1, 0, self.module.config.vocab_size)
        shards = logits.detach().movedim(-1, 0).contiguous()  # [V/T, S, B]
        gathered = collectives.all_gather(shards, self.ctx.tp_group, "check").movedim(0, -1)
        return gathered.narrow(-1, 0, self.module.config.vocab_size)


# --- the plan ----------------------------------------------------------------------------------


def parallelize(
    model: MiniMindForCausalLM,
    ctx: ParallelContext,
    pcfg: ParallelConfig,
    skip_grad_sum: tuple[str, ...] = (),
    recompute: str = "none",
    overlap_fault: str = "",
    dropout_fault: str = "",
) -> ParallelModel:
    """Shard `model` in place for ctx.tp ranks and return it with its layouts and gradient sums.

    skip_grad_sum names entries of GRAD_SUMS (tpbench.parallel.checks) to leave out: only to prove
    that each one is needed;
    overlap_fault (debug.overlap_fault) breaks parallel.overlap for the same reason, and
    dropout_fault (debug.dropout_fault) the dropouts' offsets (tpbench.parallel.rng).
    recompute (train.recompute) is applied first; under `full` the blocks keep no gathered input and
    under `op` the gathered input itself, so
    SP's re-gather applies to the LM head only.
    """
    cfg = model.config
    apply_recompute(model, recompute)
    if ctx.tp > 1:
        ctx.setup_kv_replicas(cfg.num_key_value_heads)
    layouts = plan_layouts(cfg, ctx.tp, pcfg)
    deferred: list[DeferredWeightGrads] = []
    if ctx.tp > 1:
        wait = overlap_fault != "no_wait"
        entry = _Entry(ctx.tp_group, pcfg.sp, pcfg.sp_regather, pcfg.overlap, wait, deferred)
        styles = tp_styles(cfg.num_hidden_layers, pcfg.sp, pcfg.vp, cfg.qk_norm)
        apply_styles(model, ctx, layouts, styles, entry, pcfg.sp and pcfg.sp_gather == "linear", recompute)
    place_dropouts(model, ctx.tp_rank, ctx.tp, ctx.dp_rank, ctx.dp, pcfg.sp and ctx.tp > 1, dropout_fault)
    pm = ParallelModel(model, ctx, pcfg, layouts, overlap_fault, deferred=deferred)
    pm.grad_sums = _grad_sums(model, ctx, layouts, skip_grad_sum)
    return pm


def apply_styles(
    model: MiniMindForCausalLM,
    ctx: ParallelContext,
    layouts: dict[str, Layout],
    styles: dict[str, str],
    entry: _Entry,
    per_linear: bool = False,
    recompute: str = "none",
) -> None:
    """The table's styles on `model`, in two passes: first the sharded layers swapped in (column,
    row, vocab), then the regions' entries and the SP edges' exits put in front of and behind them
    (an entry needs its region's column layers in place: overlap defers their weight gradients).
    `per_linear` (SP only): each column linear all-gathers its own input instead of its region.
    Norms need no module of their own here: their layouts sum their gradients."""
    reduce = "reduce_scatter" if entry.sp else "all_reduce"
    for path, style in styles.items():
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        dense = getattr(owner, name)
        if style == "column":
            setattr(owner, name, _column(dense, layouts[path + ".weight"], ctx))
        elif style == "row":
            setattr(owner, name, _row(dense, layouts[path + ".weight"], ctx, reduce))
        elif style == "vocab_embedding":
            layout = layouts[path + ".weight"]
            shard = layout.shard(dense.weight, ctx.tp, ctx.tp_rank)
            setattr(owner, name, VocabParallelEmbedding(shard, ctx.tp_rank, ctx.tp_group, reduce))
        elif style == "vocab_head":
            if model.config.tie_word_embeddings:  # the embedding's shard, swapped in above
                model.lm_head = ColumnParallelLinear(model.model.embed_tokens.weight)
            else:
                model.lm_head = _column(dense, layouts[path + ".weight"], ctx)
            model.loss_fn = VocabParallelCrossEntropy(model.config.vocab_size, ctx.tp_rank, ctx.tp_group)
    # under full recompute the blocks keep no gathered input, under op the gathered input itself (the
    # all-gather's output, kept by its policy): SP's re-gather for the LM head only
    block_entry = entry.but(regather=entry.regather and recompute not in ("full", "op"))
    for path, style in styles.items():
        module = model.get_submodule(path)
        if style == "entry" and per_linear:
            columns = tuple(
                p.rpartition(".")[2] for p, s in styles.items() if s == "column" and p.startswith(path + ".")
            )
            block_entry.apply_per_linear(module, columns)
        elif style == "entry":
            block_entry.apply(module)
        elif style == "vocab_head":
            entry.apply(module)
        elif style == "sp_split":
            set_exit(module, SPScatter(ctx.tp_group))
        elif style == "sp_gather":  # the decoder's final hidden states are whole, as minimind-tron's
            set_exit(module, SPGatherReplicated(ctx.tp_group))


# --- pieces ------------------------------------------------------------------------------------


def _column(dense: nn.Linear, layout: Layout, ctx: ParallelContext) -> ColumnParallelLinear:
    bias = None if dense.bias is None else layout.shard(dense.bias, ctx.tp, ctx.tp_rank)
    return ColumnParallelLinear(layout.shard(dense.weight, ctx.tp, ctx.tp_rank), bias)


def _row(dense: nn.Linear, layout: Layout, ctx: ParallelContext, reduce: str) -> RowParallelLinear:
    bias = None if dense.bias is None else dense.bias.detach().clone()
    return RowParallelLinear(layout.shard(dense.weight, ctx.tp, ctx.tp_rank), ctx.tp_group, reduce, bias)


@dataclass(frozen=True)
class _Entry:
    """How a region (or, under sp_gather=linear, a column linear) is entered: f under TP; g under SP,
    saving only the shard when `regather`. With `overlap`, its column layers defer their weight
    gradients to its entry backward (one queue per entry, kept in `deferred`) and SP's re-gather
    starts at the region's exit backward."""

    group: collectives.Group
    sp: bool
    regather: bool
    overlap: bool
    wait: bool  # False: debug.overlap_fault=no_wait
    deferred: list[DeferredWeightGrads]

    def but(self, regather: bool) -> _Entry:
        return dataclasses.replace(self, regather=regather)

    def apply(
        self, module: nn.Module, regathers: list[regions.Regather] | None = None, site: str = ""
    ) -> None:
        """Put `module`'s entry op in front of it (its `entry` child). `regathers` (a column linear of
        a per-linear region): each forward's re-gather is appended there, for the region to prefetch;
        `site` (its name) keeps its all-gather apart from its siblings' under torch.compile."""
        meanwhile = None
        if self.overlap:
            meanwhile = defer_weight_grads(module, self.wait)
            self.deferred.append(meanwhile)
        if not self.sp:
            set_entry(module, TPCopy(self.group, meanwhile))
            return
        # a block region starts its re-gather at its exit backward; the LM head has no exit
        prefetch = regathers is None and not isinstance(module, ColumnParallelLinear)
        set_entry(module, SPGather(self.group, self.regather, meanwhile, regathers, prefetch, site))

    def apply_per_linear(self, region: nn.Module, columns: tuple[str, ...]) -> None:
        """SP gathering per column linear: the region casts its input once (its linears gather the
        same shard) and each linear gets its own entry; with overlap and the re-gather, the region
        starts all its linears' re-gathers at its exit backward."""
        regathers: list[regions.Regather] = []
        for name in columns:
            self.apply(getattr(region, name), regathers if self.overlap and self.regather else None, name)
        set_entry(region, PerLinearGathers(regathers))


def _grad_sums(
    model: nn.Module, ctx: ParallelContext, layouts: dict[str, Layout], skip: tuple[str, ...]
) -> list[GradSum]:
    params = dict(model.named_parameters())  # tied weights appear once
    by_sum: dict[str, list[str]] = {}
    for name in params:
        if layouts[name].grad_sum:
            by_sum.setdefault(layouts[name].grad_sum, []).append(name)
    groups = {"qk_norm": ctx.tp_group, "sp_norms": ctx.tp_group, "kv_replicas": ctx.kv_replica_group}
    sums: list[GradSum] = []
    for name, ps in by_sum.items():  # sums over the same group share one all-reduce
        if name in skip:
            continue
        same = next((gs for gs in sums if gs.group is groups[name]), None)
        if same is None:
            sums.append(GradSum(name, groups[name], ps))
        else:
            same.name, same.params = f"{same.name}+{name}", same.params + ps
    if ctx.dp > 1 and "dp" not in skip:
        sums.append(GradSum("dp", ctx.dp_group, list(params), average=True))
    return sums


# --- checkpoints -------------------------------------------------------------------------------


def shard_state_dict(
    dense: dict[str, torch.Tensor], layouts: dict[str, Layout], tp: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """A dense (MiniMind-named) state dict -> this TP rank's shards, under the same names."""
    return {n: layouts[n].shard(t, tp, tp_rank) for n, t in dense.items()}


def gather_state_dict(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """The TP shards of every rank -> one dense state dict with the dense names and the real vocab.
    Collective over the TP group; every rank gets the result."""
    out = {}
    for name, local in pm.module.state_dict().items():
        local = local.detach().contiguous()
        if pm.ctx.tp == 1:
            shards = [local]
        else:
            shards = [torch.empty_like(local) for _ in range(pm.ctx.tp)]
            dist.all_gather(shards, local, group=pm.ctx.tp_group)
        out[name] = pm.layouts[name].unshard(shards, pm.module.config.vocab_size)
    return out


def write_in_place(own: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    """`grads` into `own`: full_gradients where they are the tensors the optimizer steps."""
    with torch.no_grad():
        for name, grad in grads.items():
            own[name].copy_(grad)
