"""`tpbench report` from a database of real runs (torchrun jobs of the tiny model on CPU), and the HTML
opened in a real headless browser (Debian's chromium: missing, the browser tests skip, and fail under CI).

One module fixture fills the database: memory of DDP and TP, throughput of DDP and TP at fixed_global
(TP also with full activation recompute), validate of TP+SP+VP and one run that fails on purpose. A
sweep name and the failed run's error hold a `<script>` that must reach the reader as text.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
from html import unescape
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from beside import beside
from browser import chromium
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.config import mode_label, public_config
from tpbench.db import ResultsDB
from tpbench.report import charts, published, render, sections
from tpbench.report.blocks import Table
from tpbench.report.data import ReportData, Selection, load
from tpbench.report.labels import mode_rank, model_label, setting_label
from tpbench.run import compose

TPBENCH = str(Path(sys.executable).with_name("tpbench"))
PAYLOAD = "<script>document.body.dataset.pwned = 'yes'</script>"
SWEEP = f"checks {PAYLOAD}"
QUICK = ["train.steps=2", "train.warmup=1"]
runner = CliRunner()


class Filled:
    def __init__(self, path: Path):
        self.path = path
        self.db = path / "runs" / "tpbench.db"
        self.url = f"sqlite:///{self.db}"

    def env(self) -> dict[str, str]:
        (self.path / "jobs").mkdir(exist_ok=True)
        return dict(os.environ, TMPDIR=str(self.path / "jobs"), OMP_NUM_THREADS="1")

    def tpbench(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [TPBENCH, *args], cwd=self.path, env=self.env(), capture_output=True, text=True, timeout=900
        )

    def query(self, sql: str, *params: object) -> list[tuple]:
        with sqlite3.connect(self.db) as conn:
            return conn.execute(sql, params).fetchall()

    def report(self, *args: str):
        return runner.invoke(app, ["report", "--db", self.url, *args])


@beside
def filled(folder: Path) -> Filled:
    """Two chains of real runs side by side (SQLite in WAL mode takes both writers)."""
    work = Filled(folder)
    chains = [
        [
            ["sweep", "kind=memory", "mode=ddp,tp", *QUICK],
            ["run", "kind=memory", "mode=tp", "recompute=full", *QUICK],
            ["run", "kind=throughput", "mode=tp", "recompute=full", "batch=fixed_global", *QUICK],
        ],
        [
            ["sweep", "kind=throughput", "mode=ddp,tp", "batch=fixed_global", *QUICK],
            [
                "sweep",
                "kind=validate",
                "mode=tp_sp_vp",
                "validate.steps=3",
                "validate.every=1",
                "--name",
                SWEEP,
            ],
            ["sweep", "kind=validate", "+fault=raise_on_rank1", "validate.steps=1", "--name", SWEEP],
        ],
    ]
    done: list[subprocess.CompletedProcess] = []
    threads = [threading.Thread(target=lambda c=c: done.extend(work.tpbench(*a) for a in c)) for c in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = work.query("SELECT kind, mode, status FROM runs ORDER BY kind, mode, status")
    assert statuses == [
        ("memory", "ddp", "OK"),
        ("memory", "tp", "OK"),
        ("memory", "tp", "OK"),
        ("throughput", "ddp", "OK"),
        ("throughput", "tp", "OK"),
        ("throughput", "tp", "OK"),
        ("validate", "tp", "FAILED"),
        ("validate", "tp_sp_vp", "OK"),
    ], "\n".join(d.stderr[-2000:] for d in done)
    # No fault's message holds markup: append some to the real failure's error.
    work.query("UPDATE runs SET error = error || ? WHERE status = 'FAILED'", f"\n{PAYLOAD}")
    return work


@pytest.fixture(scope="module")
def html_report(filled) -> Path:
    """The default command: runs/report.html under the working folder, its path printed last."""
    done = filled.tpbench("report", "--db", filled.url)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "runs/report.html"
    return filled.path / "runs" / "report.html"


def run_values(filled: Filled, kind: str, name: str) -> dict[str, float]:
    """mode -> the metric's max over ranks, straight from the database."""
    rows = filled.query(
        "SELECT r.mode, MAX(m.value) FROM runs r JOIN measurements m ON m.run_id = r.id "
        "WHERE r.kind = ? AND m.name = ? AND m.step IS NULL GROUP BY r.mode",
        kind,
        name,
    )
    return dict(rows)


def expected_charts(filled: Filled) -> list[str]:
    """The chart titles of the full report, in order (every memory run records its predicted peak:
    measured vs predicted in each memory setting, then sharded DP's prediction). TP with full
    recompute is a setting of its own (memory, throughput, collectives), beside the default one."""
    per_setting = ["Peak per rank", "Breakdown of the peak"]
    return [
        *per_setting,
        *per_setting,
        *["Measured vs predicted peak"] * 2,
        *["Sharded DP, predicted"] * 2,  # DDP, ZeRO-1, ZeRO-2, FSDP against DP at each setting's TP
        *["Recompute"] * 2,  # memory at fixed_per_rank, throughput at fixed_global
        *["Throughput"] * 2,
        *["Collectives per step"] * 4,  # memory's two settings and throughput's two
        "AdamW drift",
    ]


# -- content -----------------------------------------------------------------------------------------


def test_html_has_every_section_with_figures_from_the_database(filled, html_report):
    html = html_report.read_text()
    for heading in ("Memory", "Throughput", "Communication", "Validation", "Runs that did not end OK (1)"):
        assert heading in html
    peak = run_values(filled, "memory", "peak_bytes")
    assert f"{peak['tp'] / 2**20:,.1f} MiB" in html and f"{peak['ddp'] / 2**20:,.1f} MiB" in html
    assert f"{peak['tp'] / peak['ddp'] - 1:+.1%}" in html  # the change against DDP
    tokens = run_values(filled, "throughput", "tokens_per_s")
    assert f"{tokens['tp']:,.0f} tokens/s" in html
    step = run_values(filled, "throughput", "step_time_s")
    assert f"{step['tp'] * 1e3:,.2f} ms" in html
    assert run_values(filled, "throughput", "timing_cuda_events")["tp"] == 0  # gloo: the wall clock
    throughput = html[html.index('<section id="throughput">') : html.index('<section id="communication">')]
    assert ">wall clock</td>" in throughput  # how the run took its times
    fwd = run_values(filled, "validate", "fwd_logits_max_abs")
    assert f"{fwd['tp_sp_vp']:.2e}" in html
    assert "injected fault raise_on_rank1" in html
    assert re.search(r">\s*all_reduce\s*<", html)
    titles = re.findall(r'<img src="data:image/png;base64,[^"]+" alt="([^"]+)"', html)
    assert [t.split(":")[0] for t in titles] == expected_charts(filled)
    assert published.SEED not in html  # the tiny model is not the seed's config


def test_the_header_names_the_hardware_every_run_ran_on(filled, html_report):
    """All on this machine: one kind, named in the header and in each setting, and not said to be mixed.
    Each rank wrote the name of its device into the job folder (the failed run's is kept), and the run
    recorded what its ranks saw."""
    from tpbench import machine

    here = f"{machine.cpu_name()} · {os.cpu_count()} CPU cores per node · 1 node"
    assert {h for (h,) in filled.query("SELECT hardware FROM runs")} == {here}
    ((log_dir,),) = filled.query("SELECT log_dir FROM runs WHERE status = 'FAILED'")
    seen = {p.name: p.read_text() for p in (Path(log_dir) / "devices").iterdir()}
    assert seen == {"rank0.txt": machine.cpu_name(), "rank1.txt": machine.cpu_name()}
    html = unescape(html_report.read_text())
    header = html[: html.index('<section id="memory">')]
    assert re.search(rf"<td[^>]*>\s*hardware\s*</td>\s*<td[^>]*>\s*{re.escape(here)}\s*</td>", header)
    assert "Mixed hardware" not in header
    assert f"fixed_per_rank float32 pure · 2 ranks · {here}" in html  # the settings name it


def test_html_carries_the_diagram_of_each_tp_mode_inline(html_report):
    html = html_report.read_text()
    # the OK runs of tpbench's TP modes: memory and throughput of tp, validate of tp_sp_vp (DDP: none)
    assert re.findall(r"<figcaption>(\w+) at T = (\d+)", html) == [("tp", "2"), ("tp_sp_vp", "2")]
    assert html.count("<svg") == 2 and "<?xml" not in html and "<!DOCTYPE svg" not in html
    # drawn from each run's config: f / f-bar for tp; SP's g and VP's three loss all-reduces for tp_sp_vp
    text = unescape(html)  # Graphviz writes "-" as &#45;
    assert "f: identity / all-reduce (enter the TP region)" in text
    assert "g: all-gather / reduce-scatter (enter the TP region)" in text
    assert text.count("all-reduce (loss)") == 3


def test_recompute_is_its_own_axis(filled, html_report):
    """TP's peak and step time with full recompute, beside recompute none and as a ratio to it."""
    rows = filled.query(
        "SELECT r.kind, json_extract(r.config, '$.train.recompute'), MAX(m.value) FROM runs r "
        "JOIN measurements m ON m.run_id = r.id WHERE r.mode = 'tp' AND m.step IS NULL "
        "AND m.name IN ('peak_bytes', 'step_time_s') AND r.status = 'OK' GROUP BY r.id"
    )
    value = {(kind, recompute): v for kind, recompute, v in rows}
    html = html_report.read_text()
    section = html[html.index('<section id="recompute">') : html.index('<section id="throughput">')]
    full, none = value[("memory", "full")], value[("memory", "none")]
    assert full < none
    for figure in (f"{full / 2**20:,.1f} MiB", f"{none / 2**20:,.1f} MiB", f"{full / none:.1%}"):
        assert figure in section
    assert f"{value[('throughput', 'full')] * 1e3:,.2f} ms" in section


def section_tables(data: ReportData, part) -> dict[str, object]:
    return {block.title: block for block in part.section(data).blocks if isinstance(block, Table)}


def test_throughput_compares_the_modes_at_one_global_batch(filled, html_report):
    """At fixed_global DDP and TP train the same tokens per step: the table shows them, and each mode's
    tokens/s against DDP's, from the database's figures."""
    rows = filled.query(
        "SELECT r.mode, m.name, MAX(m.value) FROM runs r JOIN measurements m ON m.run_id = r.id "
        "WHERE r.kind = 'throughput' AND json_extract(r.config, '$.train.recompute') = 'none' "
        "AND m.step IS NULL AND m.name IN ('tokens_per_s', 'tokens_per_step', 'step_time_s', "
        "'predicted_step_time_s') GROUP BY r.id, m.name"
    )
    db = {(mode, name): value for mode, name, value in rows}
    assert db[("ddp", "tokens_per_step")] == db[("tp", "tokens_per_step")] == 4 * 32  # global batch 4, S 32
    data = load(ResultsDB(filled.url), Selection(kind="throughput"))
    (table,) = [
        t for title, t in section_tables(data, sections.throughput).items() if "recompute" not in title
    ]
    frame = table.frame.set_index("mode")
    assert frame["tokens / step"].to_dict() == {"ddp": 128, "tp": 128}
    assert frame.at["tp", "tokens/s"] == db[("tp", "tokens_per_s")]
    assert frame["vs DDP"].to_dict() == {
        "ddp": 1.0,
        "tp": db[("tp", "tokens_per_s")] / db[("ddp", "tokens_per_s")],
    }
    # the time model's step, recorded with each run, beside the measured one with its error
    assert frame.at["tp", "predicted step"] == db[("tp", "predicted_step_time_s")] > 0
    error = db[("tp", "predicted_step_time_s")] / db[("tp", "step_time_s")] - 1
    assert frame.at["tp", "error"] == pytest.approx(error)
    html = unescape(html_report.read_text())
    part = html[html.index('<section id="throughput">') : html.index('<section id="communication">')]
    assert f"{frame.at['tp', 'vs DDP']:.1%}" in part and re.search(r">\s*128\s*<", part)
    assert published.TRON not in html  # the tiny model is not minimind-tron's config


def test_a_throughput_run_records_the_load_before_its_job(filled):
    """Each throughput run, alone (`run`) or on a sweep's warm workers, has rank 0 record the machine's
    load average before its job started and its cores; no other kind does. The report shows them."""
    rows = filled.query(
        "SELECT r.kind, m.rank, m.name, m.value FROM runs r JOIN measurements m ON m.run_id = r.id "
        "WHERE r.status = 'OK' AND m.name IN ('load_before_job', 'cpu_cores') ORDER BY r.id"
    )
    throughput = filled.query("SELECT COUNT(*) FROM runs WHERE kind = 'throughput'")[0][0]
    assert {(kind, rank) for kind, rank, *_ in rows} == {("throughput", 0)}
    assert len(rows) == 2 * throughput == 6
    assert all(value == os.cpu_count() for _, _, name, value in rows if name == "cpu_cores")
    assert all(value >= 0 for _, _, name, value in rows if name == "load_before_job")
    data = load(ResultsDB(filled.url), Selection(kind="throughput"))
    shown = pd.concat([t.display() for t in section_tables(data, sections.throughput).values()])
    assert shown["load before the job"].str.fullmatch(rf"(loaded: )?\d+\.\d on {os.cpu_count()} cores").all()


def test_the_drift_table_holds_each_compared_steps_figures(filled, html_report):
    """validate tp_sp_vp, 3 fresh-batch AdamW steps compared at each: per step the logits' mean and max
    |diff| and relative L2 against dense (each the worst over ranks), and each one's worst; the
    gradients checked at every step (at the same weights) in a table of their own, not the drift's."""
    rows = filled.query(
        "SELECT m.step, m.name, MAX(m.value) FROM runs r JOIN measurements m ON m.run_id = r.id "
        "WHERE r.kind = 'validate' AND r.status = 'OK' AND m.step IS NOT NULL GROUP BY m.step, m.name"
    )
    db = {(int(step), name): value for step, name, value in rows}
    drift = {"adamw_logits_mean_abs", "adamw_logits_max_abs", "adamw_logits_rel_l2"}
    assert {name for _, name in db} == drift | {"step_grad_max_rel_l2", "step_grad_of_bound"}
    data = load(ResultsDB(filled.url), Selection(kind="validate"))
    tables = section_tables(data, sections.validation)
    (table,) = [t for title, t in tables.items() if "drift" in title]
    assert table.title.startswith("AdamW drift against dense (fresh batch): tiny: H64 S32")
    assert table.frame["step"].tolist() == [1, 2, 3, "worst"]
    assert not any("of bound" in str(c) for c in table.frame.columns)  # the gradient curves: not here
    for name, what in (("mean_abs", "mean"), ("max_abs", "max"), ("rel_l2", "rel L2")):
        column = table.frame[f"tp_sp_vp {what}"].tolist()
        assert column == [*(db[(step, f"adamw_logits_{name}")] for step in (1, 2, 3)), max(column[:3])]
    (grads,) = [t for title, t in tables.items() if title.startswith("Gradients against dense at every step")]
    steps = sorted(step for step, name in db if name == "step_grad_of_bound")
    assert grads.frame["step"].tolist() == [*steps, "worst"]
    for name, what in (("max_rel_l2", "rel L2"), ("of_bound", "of bound")):
        column = grads.frame[f"tp_sp_vp {what}"].tolist()
        assert column == [*(db[(step, f"step_grad_{name}")] for step in steps), max(column[:-1])]
    html = html_report.read_text()
    assert (
        f"{db[(2, 'adamw_logits_rel_l2')]:.2e}" in html and "AdamW drift against dense (fresh batch)" in html
    )
    assert "Gradients against dense at every step" in html


def test_html_is_self_contained_and_escapes_what_runs_hold(html_report):
    html = html_report.read_text()
    tags = Tags()
    tags.feed(html)
    assert tags.names.isdisjoint({"script", "link", "iframe", "object", "embed", "base"})
    assert tags.images and all(src.startswith("data:image/png;base64,") for src in tags.images)
    assert not tags.urls  # no href/src to anything but the page itself and data URIs
    assert "url(" not in html and "@import" not in html
    escaped = "&lt;script&gt;document.body.dataset.pwned = &#39;yes&#39;&lt;/script&gt;"
    assert html.count(escaped) >= 2  # the sweep name and the error message
    assert PAYLOAD not in html


class Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.images: list[str] = []
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.names.add(tag)
        for key, value in attrs:
            if tag == "img" and key == "src":
                self.images.append(value)
            elif key in ("src", "href", "action", "poster") and not (value or "").startswith("#"):
                self.urls.append(value)


# -- the browser -------------------------------------------------------------------------------------

# Appended to a copy of the report: on load, each image is drawn on a canvas and its size and number of
# distinct colours written into the DOM, which --dump-dom then shows.
PROBE = """<script>
window.addEventListener('load', () => {
  for (const img of document.images) {
    const canvas = document.createElement('canvas');
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    const ctx = canvas.getContext('2d');
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    const colours = new Set();
    for (let i = 0; i < px.length && colours.size < 64; i += 4) colours.add(px.slice(i, i + 4).join());
    img.dataset.probe = `${img.complete} ${img.naturalWidth} ${img.naturalHeight} ${colours.size}`;
  }
  document.body.dataset.probed = document.images.length;
  document.body.dataset.shown = document.body.innerText.includes("<script>document.body.dataset.pwned");
});
</script>"""


def probe(page: Path, tmp_path: Path) -> tuple[str, list[str]]:
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    return chromium("--dump-dom", page=probed, profile=tmp_path / "profile")


def test_browser_loads_the_report_and_every_chart_decodes(filled, html_report, tmp_path):
    dom, console = probe(html_report, tmp_path)
    assert console == []
    images = re.findall(r'<img [^>]*data-probe="([^"]+)"', dom)
    assert f'data-probed="{len(images)}"' in dom and len(images) == len(expected_charts(filled))
    for found in images:
        complete, width, height, colours = found.split()
        assert complete == "true" and int(width) > 300 and int(height) > 200, found
        assert int(colours) >= 8, f"a chart of {colours} colours is blank: {found}"
    assert 'data-shown="true"' in dom  # the <script> of the error is text on the page
    assert "data-pwned" not in dom  # and did not run


def test_browser_screenshot(html_report, tmp_path_factory):
    shot = tmp_path_factory.getbasetemp() / "report-screenshot.png"
    chromium(
        "--hide-scrollbars",
        "--window-size=1280,6000",
        f"--screenshot={shot}",
        page=html_report,
        profile=tmp_path_factory.mktemp("shot-profile"),
    )
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 50_000
    print(f"screenshot: {shot}")


def test_browser_checks_catch_errors_and_blank_charts(tmp_path):
    """The probe would see a blank chart and a console error: these checks can fail."""
    blank = base64.b64encode(_blank_png()).decode()
    page = tmp_path / "broken.html"
    page.write_text(
        f'<html><body><img src="data:image/png;base64,{blank}" alt="blank">'
        "<script>console.error('boom')</script></body></html>"
    )
    dom, console = probe(page, tmp_path)
    assert any("boom" in line for line in console)
    colours = re.search(r'data-probe="true \d+ \d+ (\d+)"', dom)
    assert colours and int(colours[1]) == 1


def _blank_png() -> bytes:
    buf = io.BytesIO()
    Figure(figsize=(4, 3)).savefig(buf, format="png")
    return buf.getvalue()


# -- other formats and the filters -------------------------------------------------------------------


def test_markdown_has_the_tables_and_png_charts_beside_it(filled, tmp_path):
    out = tmp_path / "notes" / "report.md"
    done = filled.report("--format", "md", "--out", str(out))
    assert done.exit_code == 0, done.output
    text = out.read_text()
    assert "| layers | mode | layout | run | peak / rank |" in text
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    charts = [link for link in links if link.endswith(".png")]
    diagrams = [link for link in links if link.endswith(".svg")]
    assert len(charts) == len(expected_charts(filled)) and len(links) == len(charts) + len(diagrams)
    for link in charts:
        assert (out.parent / link).read_bytes().startswith(b"\x89PNG")
    assert [Path(link).stem for link in diagrams] == ["diagram-tp", "diagram-tp_sp_vp"]
    for link in diagrams:
        assert "<svg" in (out.parent / link).read_text()
    assert "&lt;script&gt;" in text and "<script>" not in text


def test_csv_and_json_hold_the_raw_rows(filled, tmp_path):
    assert filled.report("--format", "csv", "--out", str(tmp_path / "r.csv")).exit_code == 0
    assert filled.report("--format", "json", "--out", str(tmp_path / "r.json")).exit_code == 0
    table = pd.read_csv(tmp_path / "r.csv")
    records = json.loads((tmp_path / "r.json").read_text())
    ids = [row[0] for row in filled.query("SELECT id FROM runs ORDER BY id")]
    assert table["id"].tolist() == ids and [r["id"] for r in records] == ids
    peak = filled.query(
        "SELECT MAX(m.value) FROM runs r JOIN measurements m ON m.run_id = r.id WHERE r.kind = 'memory' "
        "AND m.name = 'peak_bytes' AND m.step IS NULL GROUP BY r.id"
    )
    assert sorted(table["peak_bytes"].dropna()) == sorted(v for (v,) in peak)
    failed = next(r for r in records if r["status"] == "FAILED")
    assert failed["error"].endswith(PAYLOAD)  # raw data stays raw


def test_filters_select_runs(filled, tmp_path):
    out = tmp_path / "memory.html"
    assert filled.report("--kind", "memory", "--out", str(out)).exit_code == 0
    html = out.read_text()
    assert "No OK validate runs in this selection" in html and "No OK throughput runs" in html
    # not throughput's charts (2), its recompute (1) and collectives (2), nor the drift
    assert html.count("<img") == len(expected_charts(filled)) - 6
    done = filled.report(
        "--format", "csv", "--where", "mode=tp", "--where", "sp=false", "--out", str(tmp_path / "tp.csv")
    )
    assert done.exit_code == 0, done.output
    assert set(pd.read_csv(tmp_path / "tp.csv")["mode"]) == {"tp"}
    done = filled.report("--format", "csv", "--sweep", SWEEP, "--out", str(tmp_path / "sweep.csv"))
    assert sorted(pd.read_csv(tmp_path / "sweep.csv")["status"]) == ["FAILED", "OK"]
    done = filled.report(
        "--format", "csv", "--where", "validate.steps=3", "--out", str(tmp_path / "steps.csv")
    )
    assert pd.read_csv(tmp_path / "steps.csv")["mode"].tolist() == ["tp_sp_vp"]


def test_empty_selection_says_so_and_writes_nothing(filled, tmp_path):
    out = tmp_path / "none.html"
    done = filled.report("--where", "layers=99", "--out", str(out))
    assert done.exit_code == 0
    assert "no runs match layers=99" in done.output and "nothing to report" in done.output
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--where", "colour=red"], "--where colour=...: neither a run column"),
        (["--where", "layers"], "--where layers: expected key=value"),
        (["--since", "yesterday"], "--since=yesterday: accepted are"),
        (["--format", "pdf"], "--format pdf: accepted are html, md, csv, json"),
    ],
)
def test_bad_filters_are_usage_errors(filled, tmp_path, args, message):
    done = filled.report(*args, "--out", str(tmp_path / "x"))
    assert done.exit_code == 2 and message in done.output
    assert not (tmp_path / "x").exists()


# -- published figures -------------------------------------------------------------------------------


def seed_runs(batch: str = "fixed") -> ReportData:
    """Runs of the seed's and minimind-tron's configs, as `load` would return them (no such run fits a
    CPU test): memory DDP and TP at 8 layers, a TP validate of the numerical check (its AdamW steps on
    `batch`), and tron's throughput comparison, DDP and TP."""
    base = {
        "status": "OK", "error": "", "sweep": "seed", "precision": "pure", "device": "cuda",
        "device_name": "H200", "device_count": 1, "backend": "nccl", "torch_version": "2.13",
        "cuda_version": "12.8", "git_commit": None, "git_dirty": None, "host": "gpu", "log_dir": None,
        "failed_rank": None, "started_at": pd.Timestamp("2026-11-30"), "ended_at": pd.Timestamp("2026-11-30"),
        "global_batch": 4, "world_size": 2, "hardware": "NVIDIA H200 · 2 GPUs per node · 1 node",
    }  # fmt: skip
    memory = dict(base, kind="memory", layers=8, **published.SEED_MEMORY_SETTING)
    check = {
        k: v for k, v in published.SEED_CHECK_SETTING.items() if k not in ("adamw_steps", "validate_batch")
    }
    speed = dict(
        base, kind="throughput", global_batch=8, tokens_per_step=16384, **published.TRON_THROUGHPUT_SETTING
    )
    runs = pd.DataFrame(
        [
            dict(memory, id=1, mode="ddp", tp=1, dp=2, peak_bytes=2400 * 2**20),
            dict(memory, id=2, mode="tp", tp=2, dp=1, peak_bytes=1500 * 2**20),
            dict(speed, id=3, mode="ddp", tp=1, dp=2, tokens_per_s=2e5, step_time_s=0.08),
            dict(speed, id=4, mode="tp", tp=2, dp=1, tokens_per_s=5e4, step_time_s=0.32),
            dict(base, id=5, kind="validate", mode="tp", batch_policy="fixed_per_rank", micro_batch=2,
                 fwd_logits_max_abs=1e-7, passed=1.0, **check),
        ]
    )  # fmt: skip
    runs["config_hash"] = runs["id"].astype(str)
    runs["setting"] = runs.apply(setting_label, axis=1)
    runs["mode_rank"] = runs["mode"].map(mode_rank)
    per_rank = pd.DataFrame(
        [{"run_id": i, "rank": r, "name": "peak_bytes", "value": runs.at[i - 1, "peak_bytes"]} for i in (1, 2)
         for r in (0, 1)]
    )  # fmt: skip
    curves = pd.DataFrame(
        [{"run_id": 5, "name": f"adamw_logits_{name}", "step": step, "value": value * step / 200}
         for step in (20, 200) for name, value in (("mean_abs", 1e-4), ("max_abs", 1e-3), ("rel_l2", 1e-5))]
    )  # fmt: skip
    comm = pd.DataFrame(columns=["run_id", "rank", "op", "purpose", "count", "bytes", "time_s"])
    configs = {5: {"validate.steps": 200, "validate.batch": batch}}  # the TP run the diagram draws
    return ReportData("sqlite://", Selection(), runs, curves, per_rank, comm, configs)


def test_published_figures_are_drawn_beside_runs_of_their_config():
    html = render(seed_runs(), "html", Path("unused"))
    assert html.count(published.SEED) >= 5  # memory chart legend and table, the checks, the drift, notes
    assert "1,509.5 MiB" in html and "2,377.7 MiB" in html  # the seed's TP and DDP peaks at 8 layers
    assert "6.60e-07" in html  # the seed's forward max |logits diff|
    (drift,) = [
        t for title, t in section_tables(seed_runs(), sections.validation).items() if "drift" in title
    ]
    assert drift.frame["tp max"].tolist() == [1e-4, 1e-3, 1e-3]  # steps 20, 200, worst
    assert "max |logits diff| <= 1.3e-03 over the run" in drift.note and "T 2, H 128, L 6" in drift.note
    (speed,) = section_tables(seed_runs(), sections.throughput).values()
    tron = speed.frame[speed.frame["run"] == published.TRON].set_index("mode")
    assert tron["tokens/s"].to_dict() == {"ddp": 179.1e3, "tp": 63.4e3}
    assert tron.at["tp", "vs DDP"] == pytest.approx(63.4 / 179.1) and "RTX 4090D" in speed.note
    assert speed.frame.set_index("run").at[4, "vs DDP"] == 0.25
    assert "179,100 tokens/s" in html and "35.4%" in html and "25.0%" in html


def test_a_fresh_batch_run_of_the_check_is_not_the_seeds_check():
    """The seed's AdamW figures hold on one fixed batch: a fresh-batch run of its config gets none."""
    validation = section_tables(seed_runs(batch="fresh"), sections.validation)
    assert all(published.SEED not in t.note for t in validation.values())
    assert published.SEED not in validation["Checks against dense"].frame["run"].tolist()


def test_published_figures_join_only_their_own_config():
    seed = dict(published.SEED_MEMORY_SETTING, setting="seed", layers=8)
    other = dict(seed, seq=256, setting="cpu")
    peaks = pd.DataFrame([dict(seed, mode="tp"), dict(other, mode="tp")])
    ref = published.seed_memory(peaks)
    assert ref[["setting", "layers", "mode"]].values.tolist() == [["seed", 8, "ddp"], ["seed", 8, "tp"]]
    assert ref["peak_bytes"].tolist() == [2377.65 * 2**20, 1509.53 * 2**20]


def test_two_models_of_one_shape_are_two_settings():
    """Llama and Qwen3 presets cut to the same H, S, V and heads are compared apart, each named."""
    run = {
        "hidden": 64, "seq": 32, "vocab": 256, "heads": 8, "kv_heads": 4, "micro_batch": 2, "global_batch": 4,
        "batch_policy": "fixed_per_rank", "dtype": "float32", "precision": "pure", "world_size": 2,
        "hardware": "a CPU · 2 CPU cores per node · 1 node",
    }  # fmt: skip
    llama = model_label({"model.name": "llama3_8b", "model.qk_norm": False})
    qwen3 = model_label({"model.name": "qwen3_0_6b", "model.qk_norm": True, "model.head_dim": 16})
    assert (llama, qwen3) == ("llama3_8b · no q/k norm", "qwen3_0_6b · head_dim 16")
    labels = {setting_label(pd.Series(dict(run, model=m))) for m in (llama, qwen3)}
    assert len(labels) == 2 and all(label.startswith(("llama3_8b", "qwen3_0_6b")) for label in labels)


@pytest.mark.parametrize(("level", "named"), [("full", "FSDP"), ("optimizer", "ZeRO-1")])
def test_the_diagram_of_a_sharded_dp_run_is_one_tp_group(level, named):
    """A run of FSDP or ZeRO-1 is drawn as its TP group (its config once failed the trace: 'FSDPModel'
    object has no attribute 'layouts', and `tpbench report` with it), its layout named beside."""
    cfg = compose.expand(["kind=validate", "mode=tp_sp", "dp=2", f"dp_shard={level}"], launching=False)[0]
    flat = pd.json_normalize(public_config(cfg), sep=".").iloc[0].to_dict()  # as ReportData keeps it
    runs = pd.DataFrame([{"id": 7, "kind": "validate", "mode": "tp_sp", "tp": 2, "dp": 2, "status": "OK"}])
    data = ReportData(
        "sqlite://", Selection(), runs, pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), {7: flat}
    )
    (drawn,) = sections.diagrams.section(data).blocks
    assert drawn.title == "tp_sp at T = 2" and b"<svg" in drawn.svg
    assert f"config of run 7 (tp=2 dp=2 {named})" in drawn.note


def test_a_run_timed_on_a_loaded_machine_is_marked(monkeypatch):
    """Load before the job above the cores: marked loaded in its row, under its bar and in the note."""
    run = {
        "status": "OK", "kind": "throughput", "tp": 2, "dp": 1, "layers": 2, "setting": "tiny",
        "hardware": "a CPU", "tokens_per_s": 3000.0, "step_time_s": 0.02, "cpu_cores": 2.0,
    }  # fmt: skip
    runs = pd.DataFrame(
        [
            dict(run, id=1, config_hash="a", mode="tp", load_before_job=3.8),
            dict(run, id=2, config_hash="b", mode="tp_sp", load_before_job=0.4),
        ]
    )
    empty = pd.DataFrame()
    data = ReportData("sqlite://", Selection(), runs, empty, empty, empty, {})
    drawn = []
    monkeypatch.setattr(charts, "_png", lambda fig: drawn.append(fig) or b"")
    (table,) = section_tables(data, sections.throughput).values()
    assert table.display()["load before the job"].tolist() == ["loaded: 3.8 on 2 cores", "0.4 on 2 cores"]
    assert table.note.startswith("A run marked loaded was timed on a machine with more runnable work than")
    assert "was above its cores" in table.note and "here run(s) 1." in table.note
    ticks = [t.get_text() for t in drawn[0].axes[0].get_xticklabels()]
    assert ticks == ["tp L2 · loaded", "tp_sp L2"]


def test_a_cuda_run_shows_its_hosts_issue_time_and_whether_it_was_host_bound(monkeypatch):
    """step_issue_s and host_bound (CUDA runs only: issue 57) are columns beside the step time; a CPU
    run's table has neither."""
    run = {
        "status": "OK", "kind": "throughput", "tp": 1, "dp": 1, "layers": 8, "setting": "gpu",
        "hardware": "NVIDIA H200", "tokens_per_s": 3e5, "step_time_s": 0.08, "timing_cuda_events": 1.0,
    }  # fmt: skip
    runs = pd.DataFrame(
        [
            dict(run, id=1, config_hash="a", mode="tp", step_issue_s=0.075, host_bound=1.0),
            dict(run, id=2, config_hash="b", mode="tp_sp", step_issue_s=0.02, host_bound=0.0),
        ]
    )
    empty = pd.DataFrame()
    monkeypatch.setattr(charts, "_png", lambda fig: b"")
    data = ReportData("sqlite://", Selection(), runs, empty, empty, empty, {})
    (table,) = section_tables(data, sections.throughput).values()
    shown = table.display()
    assert shown["step issue (host)"].tolist() == ["75.00 ms", "20.00 ms"]
    assert shown["host-bound"].tolist() == ["yes", "no"]
    on_cpu = runs.drop(columns=["step_issue_s", "host_bound"])
    cpu = ReportData("sqlite://", Selection(), on_cpu, empty, empty, empty, {})
    (table,) = section_tables(cpu, sections.throughput).values()
    assert "host-bound" not in table.display() and "step issue (host)" not in table.display()


@pytest.mark.parametrize("chart", ["throughput", "recompute"])  # collectives' subplots have no titles
def test_a_charts_suptitle_stands_above_its_subplots_titles(chart):
    """The setting's line over titled subplots (throughput, recompute) clears their titles (it overlapped
    them: the figures are laid out constrained now)."""
    frame = pd.DataFrame(
        {
            "mode": ["ddp", "tp"], "label": ["ddp", "tp"], "dp_shard": "none", "layers": 2,
            "mode_rank": [0, 1], "level_rank": 1001, "tokens_per_s": [3e3, 2e3], "step_time_s": [0.02, 0.03],
            "op": "all_reduce", "bytes": [2**20, 2**19], "count": [4, 8], "recompute": ["none", "full"],
            "peak_bytes": [2**20, 2**19],
        }
    )  # fmt: skip
    drawn = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(charts, "_png", lambda fig: drawn.append(fig) or b"")
        getattr(charts, chart)(frame, "tiny: H64 S32 V256 heads 8/4 " * 6)  # a setting of two lines
    (fig,) = drawn
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # laid out as savefig lays it out
    suptitle = fig._suptitle.get_window_extent(renderer)
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    assert titles and all(suptitle.y0 >= title.y1 for title in titles)


def test_the_quick_starts_sweep_puts_the_five_modes_side_by_side():
    """The README's main job ends with `tpbench sweep +preset=tiny_modes` and `tpbench report`: DDP,
    TP, TP+SP, TP+VP and TP+SP+VP of the tiny model, memory and throughput, one global batch (one
    setting a kind, so one chart of five bars), all on one torchrun job's warm workers."""
    from tpbench.run.batch import batch_key

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    main_job = next(line for line in readme.splitlines() if line.endswith("# the main job"))
    assert "tpbench run && .venv/bin/tpbench sweep +preset=tiny_modes && .venv/bin/tpbench report" in main_job
    runs = compose.expand(["+preset=tiny_modes"], launching=False)
    modes = ["ddp", "tp", "tp_sp", "tp_vp", "tp_sp_vp"]
    assert [(c.kind, mode_label(c.parallel)) for c in runs] == [
        (k, m) for k in ("memory", "throughput") for m in modes
    ]
    assert {
        (c.model.name, c.train.batch, c.train.global_batch, c.parallel.tp * c.parallel.dp) for c in runs
    } == {("tiny", "fixed_global", 4, 2)}
    assert len({batch_key(c) for c in runs}) == 1 and batch_key(runs[0]) is not None


def test_each_row_names_its_runs_dp_level(tmp_path):
    """Two memory runs of one mode and setting, DDP's replicas and FSDP: two rows told apart by the mode
    (tp_sp, tp_sp FSDP) and the layout, in the table, its title and csv; DDP's reference is DDP's
    replicas'."""
    overrides = ["mode=tp_sp dp=2", "mode=tp_sp dp=2 dp_shard=full", "mode=ddp dp=4 dp_shard=optimizer"]
    configs = [compose.expand(["kind=memory", *o.split()], launching=False)[0] for o in overrides]
    flat = {
        i: pd.json_normalize(public_config(c), sep=".").iloc[0].to_dict() for i, c in enumerate(configs, 1)
    }
    run = {"status": "OK", "kind": "memory", "layers": 2, "setting": "tiny", "hardware": "a CPU"}
    runs = pd.DataFrame(
        [
            dict(run, id=1, config_hash="a", mode="tp_sp", tp=2, dp=2, peak_bytes=3 * 2**20),
            dict(run, id=2, config_hash="b", mode="tp_sp", tp=2, dp=2, peak_bytes=2 * 2**20),
            dict(run, id=3, config_hash="c", mode="ddp", tp=1, dp=4, peak_bytes=4 * 2**20),
        ]
    )
    per_rank = runs.rename(columns={"id": "run_id", "peak_bytes": "value"}).assign(rank=0, name="peak_bytes")
    empty = pd.DataFrame()
    data = ReportData("sqlite://", Selection(), runs, empty, per_rank, empty, flat)
    (peaks,) = [t for title, t in section_tables(data, sections.memory).items() if title.startswith("Peak")]
    assert peaks.title == "Peak per rank: tiny · DP levels: replicas, ZeRO-1, FSDP"
    shown = peaks.display().set_index("run")
    assert shown["mode"].to_dict() == {"3": "ddp ZeRO-1", "1": "tp_sp", "2": "tp_sp FSDP"}
    assert shown["layout"].to_dict() == {"3": "tp=1 dp=4 ZeRO-1", "1": "tp=2 dp=2", "2": "tp=2 dp=2 FSDP"}
    assert shown["of DDP"].eq("—").all()  # ZeRO-1 is not DDP's replicas: no DDP reference here
    rows = pd.read_csv(io.StringIO(render(data, "csv", tmp_path / "r.csv"))).set_index("id")
    assert rows.loc[2, ["dp_shard", "dp_replicate", "dp_level", "layout", "label"]].tolist() == [
        "full",
        1,
        "FSDP",
        "tp=2 dp=2 FSDP",
        "tp_sp FSDP",
    ]
