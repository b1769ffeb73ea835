"""`tpbench report` renders every kind of run a database can hold: every mode (both engines of TP and
torch's DDP) x every DP level (DDP's replicas, ZeRO-1, ZeRO-2, FSDP, HSDP) x each kind, in one
database, as html and md; each run's DP level in its rows and in the charts' labels. Precision and
recompute are rotated over those rows (`SETTINGS`), not multiplied in: each mode holds every precision
and recompute, and each setting every DP level of every kind, in 138 runs rather than 636.

The runs are recorded through tpbench's own database layer (ResultsDB.record) with what real ranks
measured: tests/data/report_rank_results.json holds the rank results of a real tiny run of each kind
(tp=2 on CPU), handed in for every rank of each config. The diagrams are real: the report traces the
latest run of each TP mode on fake tensors, and the runs are recorded so that those latest runs are at
every DP level in turn.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest
from browser import chromium

from tpbench.config import ConfigError, RunConfig, dp_level_label, mode_label
from tpbench.db import ResultsDB
from tpbench.parallel.checks import resolve_switches
from tpbench.report import charts, html, markdown, sections, write
from tpbench.report.data import Selection, load
from tpbench.report.sections import communication, memory, throughput
from tpbench.report.sections.diagrams import DRAWN_MODES
from tpbench.results import CommRow, Environment, Measurement, Outcome, ParamRow, RankResult, Status
from tpbench.run import compose

TEMPLATES = Path(__file__).parent / "data" / "report_rank_results.json"
MODES = ("ddp", "tp", "tp_sp", "tp_sp_linear", "tp_vp", "tp_sp_vp")
MODES += tuple(f"dtensor_{m}" for m in ("tp", "tp_sp", "tp_vp", "tp_sp_vp"))
LEVELS = (("none", 1), ("optimizer", 1), ("grads", 1), ("full", 1), ("full", 2))  # the last: HSDP
PRECISIONS = (("pure", "float32"), ("mixed", "bfloat16"))
RECOMPUTES = ("none", "selective", "full")
KINDS = ("validate", "memory", "throughput")
SETTINGS = [(pr, rc) for pr in PRECISIONS for rc in RECOMPUTES]  # rotated over the rows (configs)
pytestmark = pytest.mark.not_quick  # 138 runs' report: its charts take seconds

WORLD = 8  # TP 2 x DP 4 (HSDP: 2 replicas of 2 shards), DDP over 8
CPU = "Intel(R) Xeon(R) Processor"
LOADED = 3.8  # the load average of a loaded run, on 2 cores


def configs() -> list[RunConfig]:
    """Every mode x DP level x kind that tpbench would launch (compose.check refuses the rest, e.g.
    ZeRO-1 or HSDP on the dtensor engine), each at one setting (precision, recompute): the row's own
    in the rotation `SETTINGS[(mode + level) % 6]`, or the next one check accepts. Over its 5 levels
    a mode meets 5 of the 6 settings (every precision and recompute); over the 6 modes of the manual
    engine a level meets all 6. In an order that ends each drawn TP mode on its own DP level."""
    bases = {mode: compose.expand([f"mode={mode}", "kind=memory"], launching=False)[0] for mode in MODES}
    out = []
    for m, base in enumerate(bases.values()):
        for (level, (shard, replicas)), kind in ((lk, k) for lk in enumerate(LEVELS) for k in KINDS):
            for s in range(len(SETTINGS)):
                (precision, dtype), recompute = SETTINGS[(m + level + s) % len(SETTINGS)]
                cfg = copy.deepcopy(base)
                p, t = cfg.parallel, cfg.train
                p.dp, p.dp_shard, p.dp_replicate = WORLD // p.tp, shard, replicas
                t.precision, t.dtype, t.recompute = precision, dtype, recompute
                cfg.kind = kind
                # The base's auto switches were resolved for its own kind and recompute none
                # (lean_rmsnorm false, which check refuses with recompute): back to auto, resolved
                # after check as expand does.
                cfg.model.lean_rmsnorm = t.compile = t.fused_optimizer = "auto"
                try:
                    compose.check(cfg)
                except ConfigError:
                    continue
                resolve_switches(cfg)
                out.append(cfg)
                break
    return sorted(out, key=last_level_first)


def last_level_first(cfg: RunConfig) -> tuple[int, bool]:
    """Each drawn mode's runs at the DP level it is drawn at (`drawn_level`) last."""
    mode = mode_label(cfg.parallel)
    level = (cfg.parallel.dp_shard, cfg.parallel.dp_replicate)
    return MODES.index(mode), mode in DRAWN_MODES and level == drawn_level(mode)


def drawn_level(mode: str) -> tuple[str, int]:
    """The DP level of the latest run of a drawn mode: every level drawn by one mode or another."""
    return LEVELS[DRAWN_MODES.index(mode) % len(LEVELS)]


def outcome(cfg: RunConfig, templates: dict, run: int) -> Outcome:
    """Every rank's results of a real tiny run of the kind, each figure moved a little per run so that
    no two bars are equal; the throughput runs with selective recompute timed on a loaded machine."""
    scale = 1 + (run % 7) / 10
    results = []
    for rank in range(WORLD):
        raw = templates[cfg.kind][rank % 2]
        result = RankResult(
            rank=rank,
            measurements=[Measurement(**m) for m in raw["measurements"]],
            params=[ParamRow(**p) for p in raw["params"]],
            comm=[CommRow(**c) for c in raw["comm"]],
        )
        for m in result.measurements:
            if m.name == "load_before_job":
                m.value = LOADED if cfg.train.recompute == "selective" else 0.4
            elif m.name not in ("passed", "timing_cuda_events", "cpu_cores"):
                m.value *= scale
        results.append(result)
    now = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    env = Environment("host", "cpu", CPU, 2, "gloo", "2.13.0", None, None, None)
    return Outcome(Status.OK, now, now, env, results)


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory) -> tuple[ResultsDB, list[RunConfig]]:
    folder = tmp_path_factory.mktemp("every-kind")
    db = ResultsDB(f"sqlite:///{folder / 'tpbench.db'}")
    templates = json.loads(TEMPLATES.read_text())
    cfgs = configs()
    for i, cfg in enumerate(cfgs):
        db.record(cfg, outcome(cfg, templates, i))
    return db, cfgs


def test_the_database_holds_every_kind(every_kind):
    db, cfgs = every_kind
    runs = db.runs()
    assert len(runs) == len(cfgs)
    data = load(db, Selection())
    held = set(zip(data.runs["mode"], data.runs["dp_shard"], data.runs["dp_replicate"], strict=True))
    assert {m for m, *_ in held} == set(MODES)
    assert {(s, r) for _, s, r in held} == set(LEVELS)
    assert ("tp_sp_vp", "full", 2) in held and ("ddp", "optimizer", 1) in held
    assert ("dtensor_tp", "optimizer", 1) not in held  # refused by compose.check: ZeRO-1 is not built there
    per_mode = data.runs.groupby("mode")[["precision", "recompute", "kind"]].nunique()
    assert (per_mode["recompute"] == len(RECOMPUTES)).all()  # every engine, dtensor's too
    assert (per_mode[["precision", "kind"]] == [len(PRECISIONS), len(KINDS)]).all().all()
    levels = data.runs.assign(level=data.runs["dp_shard"] + data.runs["dp_replicate"].astype(str))
    per_setting = levels.groupby(["kind", "precision", "recompute"])["level"].nunique()  # the rotation's
    assert len(per_setting) == len(KINDS) * len(SETTINGS) and (per_setting == len(LEVELS)).all()


def md_tables(text: str) -> dict[str, pd.DataFrame]:
    """Each table of a Markdown report under its `### title` (a title met twice: the rows of both)."""
    tables: dict[str, list[pd.DataFrame]] = {}
    for title, body in re.findall(r"^### (.+)\n\n((?:\|.*\n)+)", text, flags=re.M):
        lines = [line for line in body.splitlines() if not line.startswith("|---")]
        cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
        tables.setdefault(title, []).append(pd.DataFrame(cells[1:], columns=cells[0]))
    return {title: pd.concat(frames, ignore_index=True) for title, frames in tables.items()}


def rows_of(tables: dict[str, pd.DataFrame], prefix: str) -> pd.DataFrame:
    return pd.concat([t for title, t in tables.items() if title.startswith(prefix)], ignore_index=True)


@pytest.fixture(scope="module")
def reports(every_kind, tmp_path_factory) -> dict[str, Path]:
    """The html and md reports of the whole database, as `tpbench report` renders them
    (tpbench.report.render), from one build of the sections (each format would build them again)."""
    db, _ = every_kind
    folder = tmp_path_factory.mktemp("every-kind-report")
    built = sections.build(load(db, Selection()))
    out = {"html": folder / "report.html", "md": folder / "report.md"}
    out["html"].write_text(html.render(built), encoding="utf-8")
    out["md"].write_text(markdown.render(built, out["md"]), encoding="utf-8")
    return out


def test_every_run_is_a_row_with_its_dp_level(every_kind, reports):
    """Each run is a row of its kind's table, named by its mode and DP level (tp_sp FSDP (2 replicas))
    and its layout (tp=2 dp=4 FSDP (2 replicas)), in both formats; each setting's titles name its levels."""
    db, _ = every_kind
    data = load(db, Selection())
    tables = md_tables(reports["md"].read_text())
    page = reports["html"].read_text()
    for kind, prefix, run_column in (
        ("memory", "Peak per rank: ", "run"),
        ("throughput", "Throughput: ", "run"),
        ("validate", "Checks against dense", "run"),
    ):
        shown = rows_of(tables, prefix)
        runs = data.runs[data.runs["kind"] == kind]
        assert sorted(shown[run_column].astype(int)) == sorted(runs["id"]), kind
        by_run = shown.set_index(shown[run_column].astype(int))
        for run in runs.itertuples():
            level = dp_level_label(run.dp_shard, run.dp_replicate)
            assert by_run.at[run.id, "mode"] == f"{run.mode} {level}".strip()
            assert by_run.at[run.id, "layout"] == run.layout and level in run.layout
    assert "tp_sp_vp FSDP (2 replicas)" in page and "tp=2 dp=4 ZeRO-1" in page and "ddp ZeRO-2" in page
    levels = " · DP levels: replicas, ZeRO-1, ZeRO-2, FSDP, FSDP (2 replicas)"  # every setting holds them all
    per_setting = (
        "Peak per rank: ",
        "Breakdown of the peak",
        "Throughput: ",
        "Collectives per step: ",
        "AdamW drift",
    )
    titled = [title for title in tables if title.startswith(per_setting)]
    assert len(titled) >= 6 * len(per_setting) and all(title.endswith(levels) for title in titled)


def test_a_diagram_of_each_tp_mode_from_runs_at_every_dp_level(reports):
    """The latest run of each drawn mode is at another DP level (FSDP's and ZeRO-1's config once made
    the trace fail: 'FSDPModel' object has no attribute 'layouts'); each is traced as one TP group."""
    md = reports["md"].read_text()
    for mode in DRAWN_MODES:
        assert f"report_charts/diagram-{mode}.svg" in md
        svg = (reports["md"].parent / "report_charts" / f"diagram-{mode}.svg").read_text()
        assert svg.lstrip().startswith("<?xml") and "collectives" in svg
        shard, replicas = drawn_level(mode)
        layout = re.search(
            r"config of run \d+ \((tp=2 dp=4[^)]*\)?)\), one layer", md[md.index(f"diagram-{mode}") :]
        )
        assert layout and layout[1] == f"tp=2 dp=4 {dp_level_label(shard, replicas)}".strip(), mode
    assert reports["html"].read_text().count("<svg") == len(DRAWN_MODES)


def test_csv_and_json_rows_name_the_dp_level(every_kind, tmp_path):
    db, cfgs = every_kind
    rows = pd.read_csv(write(db, Selection(), "csv", tmp_path / "r.csv"))
    records = json.loads(write(db, Selection(), "json", tmp_path / "r.json").read_text())
    for frame in (rows, pd.DataFrame(records)):
        assert len(frame) == len(cfgs)
        want = {(c.parallel.dp_shard, c.parallel.dp_replicate) for c in cfgs}
        assert set(zip(frame["dp_shard"], frame["dp_replicate"], strict=True)) == want
        assert frame["layout"].str.startswith(("tp=2 dp=4", "tp=1 dp=8")).all()


def test_every_chart_names_each_runs_dp_level(every_kind, monkeypatch):
    """Each bar of the memory, throughput and collectives charts of a setting is labelled with its run's
    mode and DP level (tp_sp ZeRO-1 L2 under the bar; the peak's legend: tp_sp ZeRO-1)."""
    db, _ = every_kind
    data = load(db, Selection.parse(where=["train.recompute=none", "train.precision=pure"]))
    drawn = []
    monkeypatch.setattr(charts, "_png", lambda fig: drawn.append(fig) or b"")
    for part in (memory, throughput, communication):  # the sections of those charts, not the diagrams
        part.section(data)
    labels = {kind: set(data.ok.loc[data.ok["kind"] == kind, "label"]) for kind in KINDS}
    assert len(labels["memory"]) == len(data.ok[data.ok["kind"] == "memory"])  # one label a run
    found = {}
    for fig in drawn:
        for ax in fig.axes:
            ticks = {t.get_text() for t in ax.get_xticklabels()}
            found[ax.get_xlabel(), ax.get_ylabel()] = ticks | set(ax.get_legend_handles_labels()[1])
    under_bar = {f"{label} L2" for label in labels["memory"]}
    assert found["layers", "peak per rank (MiB)"] == {*labels["memory"], "2"}  # the legend, the layers
    assert found["", "peak per rank (MiB)"] >= under_bar  # measured vs predicted
    assert found["", "MiB at the peak (busiest rank)"] >= under_bar  # and the legend of the parts
    assert found["", "tokens/s"] == {f"{label} L2" for label in labels["throughput"]}
    assert found["", "KiB per rank per step"] >= under_bar


def test_a_run_timed_on_a_loaded_machine_is_marked(every_kind, reports):
    """Throughput runs recorded with a load average above the cores are marked in the table (the load
    and the rule) and under their bar."""
    db, _ = every_kind
    data = load(db, Selection(kind="throughput"))
    tables = md_tables(reports["md"].read_text())
    shown = rows_of(tables, "Throughput: ").set_index("run")
    loaded = data.runs["load_before_job"] > data.runs["cpu_cores"]
    assert 0 < loaded.sum() < len(data.runs)
    for run in data.runs.itertuples():
        load_text = shown.at[str(run.id), "load before the job"]
        assert load_text == (f"loaded: {LOADED} on 2 cores" if run.load_before_job > 2 else "0.4 on 2 cores")
    md = reports["md"].read_text()
    assert "more runnable work than cores" in md


def test_the_browser_shows_every_chart_and_diagram(reports, tmp_path):
    """Headless chromium loads the page without an error, every chart decoded and every diagram inline."""
    probed = tmp_path / "probed.html"
    probe = (
        "<script>window.addEventListener('load', () => { document.body.dataset.images = "
        "[...document.images].filter(i => i.complete && i.naturalWidth > 300).length + '/' + "
        "document.images.length; document.body.dataset.svgs = document.querySelectorAll('svg').length; });"
        "</script></body>"
    )
    probed.write_text(reports["html"].read_text().replace("</body>", probe))
    dom, console = chromium("--dump-dom", page=probed, profile=tmp_path / "profile")
    assert console == []
    shown, images = re.search(r'data-images="(\d+)/(\d+)"', dom).groups()
    assert shown == images and int(images) >= 30
    assert f'data-svgs="{len(DRAWN_MODES)}"' in dom
