"""`tpbench diagram`: the trace of a real step (every TP rank emulated on torch's fake process group)
against the drawn picture, the analytic model's collective bytes, and a real headless browser."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from browser import chromium, need
from typer.testing import CliRunner

from tpbench import diagram
from tpbench.cli import app
from tpbench.diagram.trace import Trace
from tpbench.predict import theory

SVG_NS = "{http://www.w3.org/2000/svg}"
OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter"}
CONFIGS = {
    "tp_gqa": ["tp=4", "kv_heads=2"],  # each KV head on 2 ranks
    "tp_sp_gqa": ["tp=4", "sp=true", "kv_heads=2"],
    "tp_sp_linear": ["mode=tp_sp_linear", "tp=4", "kv_heads=2"],  # SP gathering in each column linear
    "tp_sp_vp": ["tp=4", "sp=true", "vp=true"],
    "tp_vp_bf16": ["tp=2", "vp=true", "dtype=bfloat16", "model.tie_word_embeddings=false"],
    # Qwen2.5: q, k, v biases cut with their weights (each KV head's on 2 ranks), no q/k norms, D 16
    "qwen25_tp_sp_gqa": [
        "tp=4",
        "sp=true",
        "kv_heads=2",
        "model.qk_norm=false",
        "model.attention_bias=true",
        "model.head_dim=16",
    ],
}
runner = CliRunner()


@pytest.fixture(scope="module")
def drawn() -> dict[str, tuple[Trace, str]]:
    need("dot", "graphviz")
    out = {}
    for name, overrides in CONFIGS.items():
        (cfg,) = diagram.configs(overrides)
        tr = diagram.trace(cfg)
        out[name] = tr, diagram.render([tr], "svg").decode()
    return out


# -- reading the picture -----------------------------------------------------------------------------


@dataclass
class Shown:
    """One collective as the picture shows it: a row '#n | phase | op | shapes | group | bytes'."""

    index: int
    phase: str
    op: str
    purpose: str
    group: str
    bytes: int
    y: float  # SVG y of the row: larger is lower on the page
    box: str  # the Graphviz node it is drawn in


def texts_by_box(svg: str) -> dict[str, list[tuple[float, str]]]:
    """Each Graphviz node of the SVG: its texts as (y, text), in document order."""
    boxes = {}
    for g in ET.fromstring(svg).iter(SVG_NS + "g"):
        if g.get("class") == "node":
            title = g.find(SVG_NS + "title").text
            boxes[title] = [
                (float(t.get("y")), " ".join("".join(t.itertext()).split())) for t in g.iter(SVG_NS + "text")
            ]
    return boxes


def pictured(svg: str) -> list[Shown]:
    shown = []
    for box, texts in texts_by_box(svg).items():
        for i, (y, text) in enumerate(texts):
            if re.fullmatch(r"#\d+", text):
                phase, what, _shapes, group, size = (t for _, t in texts[i + 1 : i + 6])
                op, _, purpose = what.partition(" (")
                purpose = purpose.rstrip(")") or ("grad_sum" if phase == "gradient sums" else "activation")
                size_b = int(size.removesuffix(" B").replace(",", ""))
                shown.append(Shown(int(text[1:]), phase, OPS[op], purpose, group, size_b, y, box))
    return sorted(shown, key=lambda s: s.index)


def check_picture(tr: Trace, svg: str) -> None:
    """Every collective rank 0 issued is in the picture once, as traced, in the order of the step."""
    events = tr.ranks[0].collectives
    shown = pictured(svg)
    assert [s.index for s in shown] == list(range(len(events))), "a collective is missing or drawn twice"
    for s, c in zip(shown, events, strict=True):
        assert (s.phase, s.op, s.purpose, s.bytes) == (c.phase, c.event.op, c.event.purpose, c.event.bytes)
        groups = {r.collectives[c.index].event.ranks for r in tr.ranks}
        assert all("{" + ",".join(map(str, g)) + "}" in s.group for g in groups), (s.group, groups)
    forward = [s for s in shown if s.phase == "forward"]
    backward = [s for s in shown if s.phase == "backward"]
    sums = [s for s in shown if s.phase == "gradient sums"]
    # the forward runs down the page, the backward back up it, the gradient sums come last, at the bottom;
    # parallel branches sit side by side (sp_gather=linear: q, k and v each gather, at one height)
    heights = [(s.index, s.y) for s in shown]
    assert all(a.y <= b.y for a, b in zip(forward, forward[1:], strict=False)), heights
    assert all(a.box == b.box or b.y <= a.y for a, b in zip(backward, backward[1:], strict=False))
    assert all(s.y > max(o.y for o in forward + backward) for s in sums)


def totals(shown: list[Shown]) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for s in shown:
        n, b = out.get((s.op, s.purpose), (0, 0))
        out[(s.op, s.purpose)] = (n + 1, b + s.bytes)
    return out


# -- the picture against the trace and the analytic model ---------------------------------------------


@pytest.mark.parametrize("name", CONFIGS)
def test_every_collective_of_the_step_is_drawn_in_order_with_its_bytes(drawn, name):
    tr, svg = drawn[name]
    check_picture(tr, svg)
    predicted = {(r.op, r.purpose): (r.count, r.bytes) for r in theory.comm_rows(tr.cfg)}
    assert totals(pictured(svg)) == predicted
    # every rank issued the same collectives (SPMD), each in its own group
    for r in tr.ranks[1:]:
        assert [(c.event.op, c.event.shape, c.event.bytes) for c in r.collectives] == [
            (c.event.op, c.event.shape, c.event.bytes) for c in tr.ranks[0].collectives
        ]


def test_the_picture_check_fails_on_a_missing_or_wrong_collective(drawn):
    tr, svg = drawn["tp_sp_gqa"]
    with pytest.raises(AssertionError):
        check_picture(tr, svg.replace(">#3<", ">#x<", 1))
    row = next(s for s in pictured(svg) if s.index == 3)
    with pytest.raises(AssertionError):
        check_picture(tr, svg.replace(f">{row.bytes:,} B<", f">{row.bytes + 1:,} B<", 1))
    forward = [s for s in pictured(svg) if s.phase == "forward"]
    first, second = forward[0], forward[1]
    swapped = svg.replace(f">#{first.index}<", ">#TMP<").replace(f">#{second.index}<", f">#{first.index}<")
    with pytest.raises(AssertionError):  # two forward collectives drawn in the wrong order
        check_picture(tr, swapped.replace(">#TMP<", f">#{second.index}<"))


def box_text(svg: str, title_part: str) -> str:
    (texts,) = [t for title, t in texts_by_box(svg).items() if title_part == title]
    return " | ".join(text for _, text in texts)


def node_of(tr: Trace, name: str) -> str:
    return "m0_" + str(next(c.id for c in tr.ranks[0].calls if c.name == name))


def test_shards_in_both_views_and_the_kv_heads_each_rank_shares(drawn):
    tr, svg = drawn["tp_gqa"]  # tiny: H 64, D 8, heads 8/2, I 256, T 4
    q = box_text(svg, node_of(tr, "model.layers.0.self_attn.q_proj"))
    # column parallel: W [in, out] split on its columns = weight [out, in] split on dim 0
    assert "1 | W[:, 16:32] [64, 16] | weight[16:32, :] [16, 64]" in q
    o = box_text(svg, node_of(tr, "model.layers.0.self_attn.o_proj"))
    assert "1 | W[16:32, :] [16, 64] | weight[:, 16:32] [64, 16]" in o  # row parallel: dim 1
    k = box_text(svg, node_of(tr, "model.layers.0.self_attn.k_proj"))
    # 2 KV heads on 4 ranks: ranks 0, 1 hold head 0 (rows 0:8), ranks 2, 3 head 1, gradients summed in pairs
    assert "1 | W[:, 0:8] [64, 8] | weight[0:8, :] [8, 64]" in k
    assert "2 | W[:, 8:16] [64, 8] | weight[8:16, :] [8, 64]" in k
    assert re.search(r"∑ gradient summed by #\d+ over ranks \{0,1\} and \{2,3\} \(kv_replicas\)", k)
    attention = box_text(svg, node_of(tr, "model.layers.0.self_attn.attention"))
    assert "0 | 0-1 | 0 | 1 | 2-3 | 0 | 2 | 4-5 | 1 | 3 | 6-7 | 1" in attention  # rank | q heads | KV head
    qn = box_text(svg, node_of(tr, "model.layers.0.self_attn.q_norm"))
    assert re.search(r"∑ gradient summed by #\d+ over TP \{0,1,2,3\} \(qk_norm\)", qn)
    norm = box_text(svg, node_of(tr, "model.layers.0.input_layernorm"))
    assert "out [S, B, H] = [32, 2, 64]" in norm and "∑" not in norm  # TP: the stream is whole


def test_a_column_bias_is_cut_with_its_weight_and_a_kv_bias_summed_with_its_replicas(drawn):
    """Qwen2.5 at T 4 (heads 8/2, D 16): q's bias cut in 4 with q's rows; each KV head's bias on 2
    ranks, its gradient summed with the KV weights' over each pair; no q/k norms to draw."""
    tr, svg = drawn["qwen25_tp_sp_gqa"]
    q = box_text(svg, node_of(tr, "model.layers.0.self_attn.q_proj"))
    assert "column: bias [out] = [Nq·D] = [128], cut with its weight's rows" in q
    assert "1 | b[32:64] [32] | bias[32:64]" in q
    k = box_text(svg, node_of(tr, "model.layers.0.self_attn.k_proj"))
    assert "kv_replicated: bias [out] = [Nkv·D] = [32], cut with its weight's rows" in k
    assert "1 | b[0:16] [16] | bias[0:16]" in k and "2 | b[16:32] [16] | bias[16:32]" in k
    assert (
        len(re.findall(r"∑ gradient summed by #\d+ over ranks \{0,1\} and \{2,3\} \(kv_replicas\)", k)) == 2
    )
    assert not any(c.name.endswith(("q_norm", "k_norm")) for c in tr.ranks[0].calls)


def test_sp_shrinks_the_stream_to_a_sequence_shard_and_sums_the_norms(drawn):
    tr, svg = drawn["tp_sp_gqa"]
    norm = box_text(svg, node_of(tr, "model.layers.0.input_layernorm"))
    assert "out [S/T, B, H] = [8, 2, 64]" in norm
    assert re.search(r"∑ gradient summed by #\d+ over TP \{0,1,2,3\} \(sp_norms\)", norm)
    q = box_text(svg, node_of(tr, "model.layers.0.self_attn.q_proj"))
    assert "in [S, B, H] = [32, 2, 64]" in q  # gathered inside the region
    heads = [texts[0][1] for texts in texts_by_box(svg).values()]
    assert "g: all-gather / reduce-scatter (enter the TP region) at the entry of self_attn" in heads


def test_sp_gathering_per_linear_draws_one_g_at_each_column_linear(drawn):
    """parallel.sp_gather=linear: q, k, v, gate and up each all-gather their own input (and re-gather
    it in their own backward); the regions' entries issue nothing."""
    tr, svg = drawn["tp_sp_linear"]
    heads = [texts[0][1] for texts in texts_by_box(svg).values()]
    g = "g: all-gather / reduce-scatter (enter the TP region) at the entry of "
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
    assert sorted(h.removeprefix(g) for h in heads if h.startswith(g)) == sorted(linears)
    q = box_text(svg, node_of(tr, "model.layers.0.self_attn.q_proj"))
    assert "in [S/T, B, H] = [8, 2, 64]" in q  # the shard goes in; the gather is the linear's own
    regather = [c for c in tr.ranks[0].collectives if c.event.purpose == "regather"]
    assert sorted(c.module.removeprefix("model.layers.0.") for c in regather) == sorted(linears)


# -- the command line ---------------------------------------------------------------------------------


def test_cli_writes_svg_and_png(tmp_path):
    need("dot", "graphviz")
    svg = tmp_path / "out" / "block.svg"
    done = runner.invoke(app, ["diagram", "tp=2", "sp=true", "--out", str(svg)])
    assert done.exit_code == 0, done.output
    assert done.output.strip() == str(svg) and "<svg" in svg.read_text()
    png = tmp_path / "block.png"
    done = runner.invoke(app, ["diagram", "tp=2", "--compare", "--format", "png", "--out", str(png)])
    assert done.exit_code == 0, done.output
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tp=3"], "parallel.tp=3 does not divide model.num_attention_heads=8"),
        (["tp=4", "--format", "jpg"], "--format jpg: accepted are svg, png"),
        (["tp=4", "--out", "/dev/null/x.svg"], "--out /dev/null/x.svg: lies under /dev/null, which is not"),
        (["tp=4", "--out", "/proc/block.svg"], "--out /proc/block.svg: cannot be written"),
        (["tp=4", "--out", "/tmp"], "--out /tmp: is a folder"),
        (["tp=4", "seq=30", "--compare"], "train.seq_len=30 is not divisible by parallel.tp=4"),
        (["tp=2", "dp=2"], "parallel.dp=2: the diagram draws one TP group"),
        (["mode=dtensor_tp"], "parallel.engine=dtensor: the diagram traces tpbench's own collectives"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = runner.invoke(app, ["diagram", *args])
    assert done.exit_code == 2, done.output
    assert len(done.output.strip().splitlines()) == 1 and message in done.output


# -- the real browser ---------------------------------------------------------------------------------

# On load: every non-empty <text> of the SVG, its rendered box, and every pair of boxes that overlap.
PROBE = """<script>
window.addEventListener('load', () => {
  const texts = [...document.querySelectorAll('svg text')].filter(t => t.textContent.trim());
  const boxes = texts.map(t => t.getBoundingClientRect());
  const overlaps = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (w > 0.5 && h > 0.5) overlaps.push([texts[i].textContent, texts[j].textContent]);
  }
  const svg = document.querySelector('svg').getBoundingClientRect();
  document.body.dataset.result = JSON.stringify({
    texts: texts.length, empty: boxes.filter(b => b.width < 1 || b.height < 1).length,
    overlaps: overlaps.slice(0, 10), width: svg.width, height: svg.height});
});
</script>"""


def page(svg: str, path: Path, probe: bool) -> Path:
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><style>body{margin:0}</style></head><body>"
        + diagram.inline_svg(svg.encode())
        + (PROBE if probe else "")
        + "</body></html>"
    )
    return path


def probe(svg: str, tmp_path: Path) -> dict:
    probed = page(svg, tmp_path / "probe.html", True)
    dom, console = chromium("--dump-dom", page=probed, profile=tmp_path / "profile")
    assert console == []
    found = re.search(r'data-result="([^"]*)"', dom)
    assert found, dom[-2000:]
    return json.loads(found[1].replace("&quot;", '"').replace("&amp;", "&"))


def test_browser_renders_the_diagram_without_overlapping_labels(drawn, tmp_path):
    svg = drawn["tp_sp_gqa"][1]
    result = probe(svg, tmp_path)
    assert result["texts"] > 250 and result["empty"] == 0
    assert result["overlaps"] == [], result["overlaps"]
    width, height = int(result["width"]) + 1, int(result["height"]) + 1
    shot = tmp_path.parent / "diagram-screenshot.png"
    chromium(
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        f"--screenshot={shot}",
        page=page(svg, tmp_path / "shot.html", False),
        profile=tmp_path / "shot-profile",
    )
    pixels = matplotlib.image.imread(shot)[..., :3]
    ink = (pixels < 0.9).any(axis=-1).mean()
    rgb = (pixels * 255).astype(np.uint32)
    colours = len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))  # as one int: 0.1 s, not 10
    assert 0.02 < ink < 0.6 and colours > 50, (ink, colours)  # drawn, not blank, not a solid block
    print(f"screenshot: {shot}")


def test_browser_overlap_probe_can_fail(tmp_path):
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg" width="200" height="50">'
        '<text x="10" y="20">all-gather</text><text x="14" y="22">reduce-scatter</text></svg>'
    )
    result = probe(svg, tmp_path)
    assert result["overlaps"] == [["all-gather", "reduce-scatter"]]


def test_the_step_is_traced_on_fake_tensors(monkeypatch):
    """Shapes and collectives, not values: the traced step's parameters are fake tensors, so a
    report's diagram of a big run costs no real step at its shape."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensor

    tracing = importlib.import_module("tpbench.diagram.trace")  # the module, not the function

    made = []

    class Spy(tracing.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(tracing, "Trainer", Spy)
    (cfg,) = diagram.configs(["tp=2", "sp=true"])
    tr = diagram.trace(cfg)
    assert len(made) == 2 and len(tr.ranks) == 2
    assert all(isinstance(p, FakeTensor) for t in made for p in t.module.parameters())
