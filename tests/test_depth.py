"""The peak over depth (tpbench.predict.theory.depth): M(L) = F + L (a/T + r), the seed chapter's reading of
its memory table, set against the peaks measured (fake tensors, the busiest rank, in this process) at
several depths and two T; the report's fit over depth, on peaks of a known line."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pandas as pd
import pytest
from torchrun_checks import run_config
from typer.testing import CliRunner

from tpbench.config import RunConfig, mode_label, public_config
from tpbench.experiments import memory
from tpbench.predict.theory import depth
from tpbench.report import published
from tpbench.report.data import ReportData, Selection, memory_peaks, mode_rank, setting_label
from tpbench.report.data import _flatten as flatten
from tpbench.report.sections.diagrams import run_config as run_config_of
from tpbench.report.sections.memory import depth_table

SMALL = ["kind=memory", "model.hidden_size=64", "model.vocab_size=256", "train.seq_len=128"]
MODES = {
    "ddp": ["parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2"],
    "tp": [],
    "tp_sp": ["parallel.sp=true"],
    "tp_vp": ["parallel.vp=true"],
    "tp_sp_vp": ["parallel.sp=true", "parallel.vp=true"],
}


def deeper(cfg: RunConfig, layers: int) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_hidden_layers=layers))


def with_heads(cfg: RunConfig) -> RunConfig:
    """16 query and 8 KV heads (head dim as before): each rank repeats its KV heads at T 2 and at T 4
    alike. With 8/4, a rank of T 4 has one KV head, which repeat_kv expands as a view instead of a
    copy, so the k and v attention saves are narrower than a quarter of T 1's: not of the form a/T."""
    heads = 16 * cfg.model.hidden_size // 64
    D = cfg.model.head_dim or cfg.model.hidden_size // cfg.model.num_attention_heads
    model = dataclasses.replace(
        cfg.model, num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=D
    )
    return dataclasses.replace(cfg, model=model)


def at_t(cfg: RunConfig, tp: int) -> RunConfig:
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=tp))


def measured_peaks(cfg: RunConfig, depths: tuple[int, ...]) -> list[int]:
    return [int(memory.measure_busiest(deeper(cfg, L))[0]["peak_bytes"]) for L in depths]


MEASURED_DEPTHS = (1, 2, 3)
MEASURED = [
    *SMALL,
    "model.hidden_size=128",
    "train.seq_len=128",
    "model.vocab_size=512",
    "launch.emulate=fake",
]


def test_measured_peaks_are_the_split_line_in_every_mode_and_approach_the_limit():
    """Each mode's busiest rank, measured at L 1, 2 and 3 (fake tensors): its peaks lie on a line to the
    byte, whose F and slope are the split's F and a/T + r; the ratio to DDP's approaches the limit."""
    configs = {mode: run_config([*MEASURED, *overrides]) for mode, overrides in MODES.items()}
    peaks = {mode: measured_peaks(c, MEASURED_DEPTHS) for mode, c in configs.items()}
    limits = {
        lim.mode: lim for lim in depth.limits({m: deeper(c, MEASURED_DEPTHS[-1]) for m, c in configs.items()})
    }
    for mode, measured in peaks.items():
        (l1, l2, l3), (m1, m2, m3) = MEASURED_DEPTHS, measured
        slope = Fraction(m3 - m2, l3 - l2)
        assert slope == Fraction(m2 - m1, l2 - l1), f"{mode}: not a line over depth: {measured}"
        s = limits[mode].split
        assert (m1 - slope * l1, slope) == (s.F, s.per_layer), mode
        ratios = [m / d for m, d in zip(measured, peaks["ddp"], strict=True)]
        misses = [abs(ratio - limits[mode].vs_ddp) for ratio in ratios]
        assert misses == sorted(misses, reverse=True), (mode, ratios, limits[mode].vs_ddp)
    # VP shards what does not grow with depth only: its slope is TP's, SP's below it
    slopes = {mode: m[1] - m[0] for mode, m in peaks.items()}
    assert slopes["tp_vp"] == slopes["tp"] > slopes["tp_sp"] == slopes["tp_sp_vp"]


def test_measured_slopes_at_two_t_give_the_split_a_and_r():
    """The slope at T 2 is a/2 + r, at T 4 a/4 + r: measured at both, they give a and r themselves."""
    for mode in ("tp", "tp_sp"):
        cfg = with_heads(run_config([*MEASURED, *MODES[mode]]))
        slopes = {}
        for tp in (2, 4):
            m1, m2 = measured_peaks(at_t(cfg, tp), (1, 2))
            slopes[tp] = m2 - m1
        a, r = 4 * (slopes[2] - slopes[4]), 2 * slopes[4] - slopes[2]
        s = depth.split(deeper(cfg, 2))
        assert (a, r) == (s.a, s.r), mode


def test_plan_prints_every_mode_s_split_and_limit():
    from tpbench.cli import app

    result = CliRunner().invoke(app, ["plan", "model=seed_memory", "tp=2", "kind=memory"])
    assert result.exit_code == 0, result.output
    (cfg,) = _expanded(["model=seed_memory", "tp=2", "kind=memory"])
    limits = {lim.mode: lim for lim in depth.limits(depth.mode_configs(cfg))}
    lines = {line.split("│")[1].strip(): line for line in result.output.splitlines() if line.count("│") > 5}
    for mode in ("ddp", "tp", "tp_sp", "tp_vp", "tp_sp_vp"):
        s = limits[mode].split
        for value in (s.F, s.a, s.r, s.per_layer):
            assert f"{value / 2**20:,.2f}" in lines[mode], (mode, lines[mode])
        assert f"{limits[mode].vs_ddp:.2%}" in lines[mode]


def _expanded(overrides: list[str]) -> list[RunConfig]:
    from tpbench.run.compose import expand

    return expand(overrides)


# Peaks on a line of their own (F, bytes a layer), not the theory's: the report's fit must find them
LINES = {"ddp": (3 * 2**30, 200 * 2**20), "tp": (2 * 2**30, 120 * 2**20)}


def seed_depth_runs() -> ReportData:
    """Memory runs of the seed's config at L 8..64, DDP and TP, their peaks on LINES (no such run fits
    a CPU test): what `load` would return for them, with their configs."""
    from tpbench.run.compose import expand

    base = {
        "status": "OK", "error": "", "sweep": "seed", "kind": "memory", "precision": "pure",
        "hardware": "NVIDIA H200 · 2 GPUs per node · 1 node", "global_batch": 4, "world_size": 2,
        **published.SEED_MEMORY_SETTING,
    }  # fmt: skip
    rows, configs = [], {}
    for run_id, cfg in enumerate(expand(["+preset=seed_tp_memory", "mode=ddp,tp", "launch.device=cpu"]), 1):
        mode, layers = mode_label(cfg.parallel), cfg.model.num_hidden_layers
        peak = LINES[mode][0] + layers * LINES[mode][1]
        rows.append(dict(base, id=run_id, mode=mode, layers=layers, tp=cfg.parallel.tp, peak_bytes=peak))
        configs[run_id] = flatten(public_config(cfg))
    runs = pd.DataFrame(rows)
    runs["config_hash"] = runs["id"].astype(str)
    runs["setting"] = runs.apply(setting_label, axis=1)
    runs["mode_rank"] = runs["mode"].map(mode_rank)
    per_rank = pd.DataFrame(
        {"run_id": runs["id"], "rank": 0, "name": "peak_bytes", "value": runs["peak_bytes"]}
    )
    none = pd.DataFrame(columns=["run_id", "name", "step", "value"])
    comm = pd.DataFrame(columns=["run_id", "rank", "op", "purpose", "count", "bytes", "time_s"])
    return ReportData("sqlite://", Selection(), runs, none, per_rank, comm, configs)


def test_the_report_fits_each_mode_over_depth_beside_the_split_and_the_seed():
    data = seed_depth_runs()
    peaks = memory_peaks(data)
    table = depth_table(peaks, published.seed_memory(peaks), data.configs, "seed")
    rows = table.frame.set_index("mode")
    for mode in ("ddp", "tp"):
        run_ids = data.runs.loc[data.runs["mode"] == mode, "id"]
        s = depth.split(run_config_of(data.configs[run_ids.max()]))
        row = rows.loc[mode]
        assert row["F (fit)"] == pytest.approx(LINES[mode][0], rel=1e-9)
        assert (
            row["per layer (fit)"] == pytest.approx(LINES[mode][1], rel=1e-12) and row["largest miss"] < 1e-12
        )
        assert row["F"] == s.F and row["a/T + r"] == s.per_layer  # the predicted columns: the split's
    assert rows.loc["tp", "slope / DDP's (fit)"] == pytest.approx(LINES["tp"][1] / LINES["ddp"][1])
    seed = rows.loc[f"tp: {published.SEED}"]
    assert seed["of DDP, L8"] == pytest.approx(1509.53 / 2377.65) and seed["of DDP, L64"] == pytest.approx(
        9956.83 / 16766.42
    )
    for layers in published.SEED_MEMORY_MIB:  # each depth's ratio: the runs' own
        (ddp, tp) = (f + layers * k for f, k in (LINES["ddp"], LINES["tp"]))
        assert rows.loc["tp", f"of DDP, L{layers}"] == pytest.approx(tp / ddp, rel=1e-12)


# The seed's depth table at its documented L (README's seed chapter, docs/theory.md "The seed's depth
# table": `tpbench plan +preset=seed_tp_memory layers=8 mode=tp launch.device=cuda launch.emulate=fake`)
SEED_LIMITS = {"ddp": "100.00%", "tp": "59.34%", "tp_sp": "47.53%", "tp_vp": "59.34%", "tp_sp_vp": "47.53%"}


@pytest.mark.not_quick
def test_the_seeds_depth_ratios_at_l8_are_the_documented_ones_and_the_measured_slopes():
    """At L 8, the seed's step (H 768, S 2048, bf16, T 2) heads for 59.34% of DDP's peak under TP and
    47.53% under TP+SP (analytic, as `tpbench plan` prints it); the same ratios come out of the peaks
    emulated at L 1 and 2 (fake tensors, the busiest rank; about 2 s of CPU each), whose slopes are
    the split's per-layer bytes to the byte."""
    (cfg,) = _expanded(
        ["+preset=seed_tp_memory", "layers=8", "mode=tp", "launch.device=cuda", "launch.emulate=fake"]
    )
    configs = depth.mode_configs(cfg)
    limits = {lim.mode: lim for lim in depth.limits(configs)}
    assert {mode: f"{lim.vs_ddp:.2%}" for mode, lim in limits.items()} == SEED_LIMITS
    slopes = {}
    for mode in ("ddp", "tp", "tp_sp"):
        m1, m2 = measured_peaks(configs[mode], (1, 2))
        slopes[mode] = m2 - m1
        assert slopes[mode] == limits[mode].split.steepest.slope, mode
    for mode in ("tp", "tp_sp"):
        assert f"{slopes[mode] / slopes['ddp']:.2%}" == SEED_LIMITS[mode], (mode, slopes)
