"""Lay a Trace out as a Graphviz graph: one block at TP = T, every shard and every collective.

Boxes are the calls of the traced forward (modules and the functional ops between them), joined as
the tensors flowed. Each box lists what every rank holds of its weights, in the math view W [in, out]
(Y = X W) and in nn.Linear's view weight [out, in] (W = weight^T: W's columns are weight's rows), and
the per-rank shapes in and out. Between the boxes sit the collectives, at the region boundary where
they were issued (the entry of a TP region, the exit of a row-parallel layer, ...), forward and
backward in one box with their issue number (#n on rank 0), type, group and per-rank ring bytes.
Gradient sums, issued after backward, are boxes of their own and marked on the weights they sum.
Several traces (TP and TP+SP) become clusters side by side. dot does the layout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from html import escape

import graphviz

from tpbench.config import mode_label
from tpbench.diagram.trace import Call, Collective, RankTrace, Shard, Trace
from tpbench.experiments.setup import model_config

FONT = "DejaVu Sans"
GAP = 12  # points between the columns of a box
COLOURS = {"forward": "#1f5fbf", "backward": "#b4361f", "gradient sums": "#6a3d9a"}
OP_NAMES = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
LINEAR_KINDS = ("Linear", "ColumnParallelLinear", "RowParallelLinear")
# The dense shape of each MiniMind weight, by name suffix, as (symbol, dims-key) pairs
DENSE = {
    "q_proj.weight": ("Nq·D", "H"),
    "q_proj.bias": ("Nq·D",),
    "k_proj.bias": ("Nkv·D",),
    "v_proj.bias": ("Nkv·D",),
    "k_proj.weight": ("Nkv·D", "H"),
    "v_proj.weight": ("Nkv·D", "H"),
    "o_proj.weight": ("H", "Nq·D"),
    "gate_proj.weight": ("I", "H"),
    "up_proj.weight": ("I", "H"),
    "down_proj.weight": ("H", "I"),
    "embed_tokens.weight": ("V", "H"),
    "lm_head.weight": ("V", "H"),
    "q_norm.weight": ("D",),
    "k_norm.weight": ("D",),
    "norm.weight": ("H",),
    "layernorm.weight": ("H",),
}
# (forward ops, backward ops) of the activation collectives at one boundary -> the paper's name
PAIRS = {
    (("all_gather",), ("reduce_scatter",)): "g: all-gather / reduce-scatter (enter the TP region)",
    ((), ("all_reduce",)): "f: identity / all-reduce (enter the TP region)",
    (("all_reduce",), ()): "f-bar: all-reduce / identity (leave the TP region)",
    (("reduce_scatter",), ("all_gather",)): "g-bar: reduce-scatter / all-gather (leave into SP)",
    ((), ("all_gather",)): "split / all-gather (replicated into SP)",
    (("all_gather",), ()): "all-gather / split (SP into a replicated layer)",
}
ENTRY_NODES = ("_CopyToTPBackward", "_GatherFromSPBackward")


def title(tr: Trace) -> str:
    c = tr.cfg
    m, p, t = c.model, c.parallel, c.train
    mode = mode_label(p).upper().replace("_", "+")
    return (
        f"{mode} at T = {p.tp}: one block of {m.name} (H {m.hidden_size}, S {t.seq_len}, B {t.micro_batch}, "
        f"heads {m.num_attention_heads}/{m.num_key_value_heads}, V {m.vocab_size}, {t.dtype})"
    )


def draw(traces: list[Trace]) -> graphviz.Digraph:
    """One graph, one cluster per trace, side by side."""
    g = graphviz.Digraph("tpbench", engine="dot")
    g.attr(rankdir="TB", newrank="true", nodesep="0.3", ranksep="0.28", fontname=FONT, bgcolor="white")
    g.attr("node", fontname=FONT, fontsize="10", shape="plain")
    g.attr("edge", fontname=FONT, arrowsize="0.6", color="#555555")
    for i, tr in enumerate(traces):
        with g.subgraph(name=f"cluster_{i}") as sub:
            sub.attr(label=escape(title(tr)), labelloc="t", fontsize="13", style="rounded", color="#999999")
            _Mode(sub, tr, f"m{i}_").draw()
    return g


@dataclass
class Point:
    """A boundary where collectives happen: the entry or the exit of a module."""

    module: str
    side: str  # entry | exit
    collectives: list[Collective]


class _Mode:
    def __init__(self, g: graphviz.Digraph, tr: Trace, prefix: str):
        self.g, self.tr, self.prefix = g, tr, prefix
        self.rank0: RankTrace = tr.ranks[0]
        self.calls = self.rank0.calls
        self.tp = tr.cfg.parallel.tp
        self.sym = _Symbols(tr)
        self.points = self._points()

    # -- where each collective goes ------------------------------------------------------------

    def _points(self) -> dict[tuple[str, str], Point]:
        points: dict[tuple[str, str], Point] = {}
        entries = {
            c.module for c in self.rank0.collectives if c.phase == "forward" and c.event.op == "all_gather"
        }
        for c in self.rank0.collectives:
            if c.phase == "gradient sums":
                continue
            module, side = c.module, "exit"
            if c.event.purpose == "regather":  # the region whose entry gathered what is gathered again
                module = next(m for m in _ancestors(c.module) if m in entries)
                side = "entry"
            elif c.phase == "forward" and c.event.op == "all_gather" or c.node in ENTRY_NODES:
                side = "entry"
            points.setdefault((module, side), Point(module, side, [])).collectives.append(c)
        return points

    def _through(self, src: Call, dst: Call) -> list[Point]:
        """The points an edge src -> dst crosses: exits of src's modules, then entries of dst's."""
        a, b = _ancestors(src.name), _ancestors(dst.name)
        exits = [self.points[(m, "exit")] for m in a if m not in b and (m, "exit") in self.points]
        entries = [
            self.points[(m, "entry")] for m in reversed(b) if m not in a and (m, "entry") in self.points
        ]
        return exits + entries

    # -- the graph --------------------------------------------------------------------------------

    def draw(self) -> None:
        p = self.prefix
        first = self.calls[0]
        ids_shape = self.sym.shape((self.tr.cfg.train.micro_batch, self.tr.cfg.train.seq_len), ("B", "S"))
        self.g.node(p + "ids", _box("input ids", [[f"every rank: {ids_shape}"]], "#eeeeee"))
        self.g.edge(p + "ids", p + str(first.id))
        for call in self.calls:
            self.g.node(p + str(call.id), self._call_label(call))
        for point in self.points.values():
            self.g.node(self._point_id(point), self._point_label(point))
        drawn: set[tuple[str, str]] = set()
        for dst in self.calls:
            for s in dst.sources:
                chain = [p + str(s), *(self._point_id(pt) for pt in self._through(self.calls[s], dst))]
                chain.append(p + str(dst.id))
                for a, b in zip(chain, chain[1:], strict=False):
                    if (a, b) not in drawn:
                        drawn.add((a, b))
                        self.g.edge(a, b)
        last = self.calls[-1]
        loss_points = [pt for pt in self.points.values() if pt.module == last.name]
        tail = p + str(last.id)
        for pt in loss_points:
            self.g.edge(tail, self._point_id(pt))
            tail = self._point_id(pt)
        sums = [c for c in self.rank0.collectives if c.phase == "gradient sums"]
        if sums:
            self.g.node(p + "sums", self._sums_label(sums))
            self.g.edge(tail, p + "sums", style="dashed", label=" after backward", fontsize="9")
            tail = p + "sums"
        self.g.node(p + "total", self._total_label())
        self.g.edge(tail, p + "total", style="invis")

    def _point_id(self, point: Point) -> str:
        return (
            f"{self.prefix}{point.module}:{point.side}".replace(".", "_").replace(" ", "_").replace(":", "__")
        )

    # -- labels -----------------------------------------------------------------------------------

    def _call_label(self, call: Call) -> str:
        rows: list[list[str]] = []
        name = call.name.replace("model.layers.0.", "block 0 · ").replace("model.", "")
        head = f"{name}  ({call.kind})"
        if call.inputs:
            rows.append([f"in  {self.sym.activation(call, call.inputs[0], True)}"])
        rows.append([f"out {self.sym.activation(call, call.output, False)}  per rank"])
        if call.kind in ("attention", "softmax"):
            rows += self._heads()
        for shard in call.shards:
            rows += self._shard_rows(call, shard)
        return _box(head, rows, "#ffffff")

    def _heads(self) -> list[list[str]]:
        """Which query heads and which KV head each rank attends with, read off its q/k shards."""
        d = model_config(self.tr.cfg).head_dim
        rows = [["rank", "query heads", "KV heads"]]
        for r in self.tr.ranks:
            q = next(s for c in r.calls for s in c.shards if s.name.endswith("q_proj.weight"))
            k = next(s for c in r.calls for s in c.shards if s.name.endswith("k_proj.weight"))
            rows.append([str(r.rank), _span(q.start // d, q.stop // d), _span(k.start // d, k.stop // d)])
        return rows

    def _shard_rows(self, call: Call, shard: Shard) -> list[list[str]]:
        rows: list[list[str]] = []
        dense = self.sym.dense(shard)
        linear = call.kind in LINEAR_KINDS
        if shard.dim is None:
            whole = f"every rank: the whole weight {dense[0]}"
            rows.append([f"{whole}  ({shard.semantics})"])
        elif linear and shard.name.endswith(".bias"):  # a column bias: cut with its weight's rows
            rows.append([f"{shard.semantics}: bias [out] = {dense[0]}, cut with its weight's rows"])
            rows.append(["rank", "b (math view)", "bias (nn view)"])
            for r in self.tr.ranks:
                s = next(s for c in r.calls for s in c.shards if s.name == shard.name)
                rows.append(
                    [str(r.rank), f"b[{s.start}:{s.stop}] {_shape(s.shape)}", f"bias[{s.start}:{s.stop}]"]
                )
        else:
            cut = "rows" if shard.dim == 0 else "columns"
            weight = "weight [out, in]" if linear else "weight (a lookup table)"
            rows.append([f"{shard.semantics}: {weight} = {dense[0]}, cut on dim {shard.dim} (its {cut})"])
            if linear:
                other = "columns" if shard.dim == 0 else "rows"
                rows.append([f"math view: W = weight^T [in, out] = {dense[1]}, cut on its {other}"])
            rows.append(["rank", "W (math view)" if linear else "E (table)", "weight (nn view)"])
            for r in self.tr.ranks:
                s = next(s for c in r.calls for s in c.shards if s.name == shard.name)
                rows.append([str(r.rank), *self.sym.slices(s, linear)])
        if shard.grad_sum:
            c = self._sum_of(shard.name)
            where = f" by #{c.index} over {self._groups(c)}" if c else " (skipped)"
            rows.append([f"∑ gradient summed{where} ({shard.grad_sum})"])
        return rows

    def _sum_of(self, name: str) -> Collective | None:
        return next((c for c in self.rank0.collectives if name in c.summed), None)

    def _groups(self, c: Collective) -> str:
        """The group of collective #index on every rank: one set, or the distinct ones."""
        groups = sorted({r.collectives[c.index].event.ranks for r in self.tr.ranks})
        label = " and ".join("{" + ",".join(map(str, g)) + "}" for g in groups)
        if groups == [tuple(range(self.tp))]:
            return f"TP {label}"
        return f"ranks {label}"

    def _event_row(self, c: Collective) -> list[str]:
        e = c.event
        out = _out_shape(e.op, e.shape, len(e.ranks))
        what = f"{OP_NAMES[e.op]}" + (
            f" ({e.purpose})" if e.purpose not in ("activation", "grad_sum") else ""
        )
        return [
            f"#{c.index}",
            c.phase,
            what,
            f"{_shape(e.shape)} -> {_shape(out)} {e.dtype.removeprefix('torch.')}",
            self._groups(c),
            f"{e.bytes:,} B",
        ]

    def _point_label(self, point: Point) -> str:
        acts = [c for c in point.collectives if c.event.purpose == "activation"]
        key = (
            tuple(c.event.op for c in acts if c.phase == "forward"),
            tuple(c.event.op for c in acts if c.phase == "backward"),
        )
        name = point.module.replace("model.layers.0.", "").replace("model.", "")
        head = PAIRS.get(key, "collectives") + f"  at the {point.side} of {name}"
        ordered = sorted(point.collectives, key=lambda c: c.index)
        rows = [self._event_row(c) for c in ordered]
        return _box(head, rows, "#fff7e6", colour_rows=[c.phase for c in ordered])

    def _sums_label(self, sums: list[Collective]) -> str:
        rows = []
        for c in sums:
            rows.append(self._event_row(c))
            names = sorted({n.replace("model.layers.0.", "").replace("model.", "") for n in c.summed})
            rows.append([f"  {c.sum_name}: " + ", ".join(names)])
        return _box("gradient sums after backward (before the optimizer step)", rows, "#f3ecfa")

    def _total_label(self) -> str:
        by: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for c in self.rank0.collectives:
            entry = by[(c.phase, OP_NAMES[c.event.op])]
            entry[0] += 1
            entry[1] += c.event.bytes
        rows = [[phase, f"{n} × {op}", f"{b:,} B"] for (phase, op), (n, b) in by.items()]
        total = sum(c.event.bytes for c in self.rank0.collectives)
        rows.append(["total", f"{len(self.rank0.collectives)} collectives", f"{total:,} B"])
        return _box("per rank, this step", rows, "#eeeeee")


class _Symbols:
    """Shapes as symbols and numbers, e.g. [S/T, B, H] = [8, 2, 64]: the symbols only where each
    evaluates to the traced number."""

    def __init__(self, tr: Trace):
        m = model_config(tr.cfg)
        t = tr.cfg.parallel.tp
        self.T = t
        self.v = {
            "S": tr.cfg.train.seq_len,
            "B": tr.cfg.train.micro_batch,
            "H": m.hidden_size,
            "D": m.head_dim,
            "Nq·D": m.num_attention_heads * m.head_dim,
            "Nkv·D": m.num_key_value_heads * m.head_dim,
            "I": m.intermediate_size,
            "V": m.vocab_size,
            "Nq": m.num_attention_heads,
            "Nkv": m.num_key_value_heads,
        }

    def shape(self, numbers: tuple[int, ...], names: tuple[str, ...]) -> str:
        if len(numbers) == len(names) and all(
            self._value(n) == x for n, x in zip(names, numbers, strict=True)
        ):
            return f"[{', '.join(names)}] = {_shape(numbers)}"
        return _shape(numbers)

    def _value(self, name: str) -> int | None:
        base, _, div = name.partition("/")
        if base not in self.v:
            return int(base) if base.isdigit() else None
        value = self.v[base]
        return value // self.T if div == "T" else value

    def dense(self, shard: Shard) -> tuple[str, str]:
        """(weight's dense shape, the math view's dense shape) as symbols = numbers."""
        names = next((v for k, v in DENSE.items() if shard.name.endswith(k)), None)
        nn_view = self.shape(shard.dense_shape, names) if names else _shape(shard.dense_shape)
        if len(shard.dense_shape) != 2:
            return nn_view, nn_view
        flipped = (
            self.shape(shard.dense_shape[::-1], names[::-1]) if names else _shape(shard.dense_shape[::-1])
        )
        return nn_view, flipped

    def slices(self, s: Shard, linear: bool) -> list[str]:
        """This rank's slice in the math view and in the nn view, with the shapes."""
        cut = f"{s.start}:{s.stop}"
        nn_index = f"[{cut}, :]" if s.dim == 0 else f"[:, {cut}]"
        nn_shape = _shape(s.shape)
        if not linear:
            return [f"E{nn_index} {nn_shape}", f"weight{nn_index} {nn_shape}"]
        math_index = f"[:, {cut}]" if s.dim == 0 else f"[{cut}, :]"
        return [f"W{math_index} {_shape(s.shape[::-1])}", f"weight{nn_index} {nn_shape}"]

    def activation(self, call: Call, numbers: tuple[int, ...], is_input: bool) -> str:
        if not numbers:
            return "a scalar"
        s = "S" if numbers[0] == self.v["S"] else "S/T"
        if call.kind in ("attention", "softmax") and len(numbers) == 4:
            return self.shape(numbers, ("B", "Nq/T", "S", "D"))
        if len(numbers) == 4:
            heads = "Nq/T" if "q_norm" in call.name else "Nkv/T" if self._value("Nkv/T") else "1"
            return self.shape(numbers, (s, "B", heads, "D"))
        if len(numbers) == 3:
            last = "H"
            if not is_input and call.shards and call.kind in LINEAR_KINDS:
                shard = call.shards[0]
                names = next((v for k, v in DENSE.items() if shard.name.endswith(k)), ("H",))
                last = "D" if shard.semantics == "kv_replicated" else names[0]
                last += "/T" if shard.dim == 0 and shard.semantics != "kv_replicated" else ""
            elif call.kind in ("silu", "multiply") or (is_input and "down_proj" in call.name):
                last = "I/T"
            elif is_input and "o_proj" in call.name:
                last = "Nq·D/T"
            elif is_input and call.kind.endswith("CrossEntropy"):
                last = "V/T"
            elif is_input and call.kind == "CausalLMLoss":
                last = "V"
            return self.shape(numbers, (s, "B", last))
        return _shape(numbers)


def _box(head: str, rows: list[list[str]], fill: str, colour_rows: list[str] | None = None) -> str:
    """An HTML-like Graphviz label: a bold head over a table of rows (cells escaped). Columns are kept
    apart by empty cells: a browser may set a line a few percent wider than Graphviz measured it."""
    cells_max = max((len(r) for r in rows), default=1)
    width = 2 * cells_max  # each cell followed by a gap, the last one too
    out = [
        f'<<table border="1" cellborder="0" cellspacing="0" cellpadding="2" bgcolor="{fill}" '
        'color="#777777">',
        f'<tr><td colspan="{width - 1}" align="left"><b>{escape(head)}</b></td><td width="{GAP}"></td></tr>',
    ]
    for i, row in enumerate(rows):
        colour = COLOURS.get(colour_rows[i]) if colour_rows and i < len(colour_rows) else None
        cells = []
        for j, cell in enumerate(row):
            last = j == len(row) - 1
            span = f' colspan="{width - 1 - 2 * j}"' if last and len(row) < cells_max else ""
            text = escape(cell)
            if colour:
                text = f'<font color="{colour}">{text}</font>'
            cells.append(f'<td align="left"{span}>{text}</td><td width="{GAP}"></td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>>")
    return "".join(out)


def _ancestors(name: str) -> list[str]:
    """The module itself and its enclosing modules, innermost first ('a.b.c' -> a.b.c, a.b, a)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _out_shape(op: str, shape: tuple[int, ...], world: int) -> tuple[int, ...]:
    if op == "all_gather":
        return (shape[0] * world, *shape[1:])
    if op == "reduce_scatter":
        return (shape[0] // world, *shape[1:])
    return shape


def _shape(numbers: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, numbers)) + "]"


def _span(start: int, stop: int) -> str:
    return str(start) if stop - start == 1 else f"{start}-{stop - 1}"
