"""Diagrams: one transformer block of each mode run, as `tpbench diagram` draws it."""

from __future__ import annotations

from omegaconf import OmegaConf

from tpbench.config import RunConfig
from tpbench.report.blocks import Diagram, Section
from tpbench.report.data import ReportData
from tpbench.report.labels import mode_rank

DRAWN_MODES = ("tp", "tp_sp", "tp_sp_linear", "tp_vp", "tp_sp_vp")


def section(data: ReportData) -> Section:
    """One block of each of tpbench's TP modes shown, from the latest OK run of the mode: its config
    traced for one step with one layer and one TP group (its DP, sharded or not, left out: the block's
    TP collectives are the same at every DP level), every rank emulated in this process."""
    from tpbench import diagram  # torch and graphviz load only when a report draws one

    section = Section(
        "diagrams",
        "Diagrams",
        intro="One transformer block of each mode, drawn by `tpbench diagram` from a traced training step "
        "of the run's config: each rank's weight shards (math view W [in, out], nn.Linear view weight "
        "[out, in]), the per-rank activation shapes, and every collective (#n in issue order, forward in "
        "blue, backward in red) with its type, group and bytes.",
    )
    ok = data.ok[data.ok["mode"].isin(DRAWN_MODES) & (data.ok["tp"] > 1)]
    for mode in sorted(ok["mode"].unique(), key=mode_rank):
        run = ok[ok["mode"] == mode].sort_values("id").iloc[-1]
        cfg = one_tp_group(run_config(data.configs[int(run["id"])]))
        traced = diagram.trace(diagram.traceable(cfg))
        section.blocks.append(
            Diagram(
                f"{mode} at T = {cfg.parallel.tp}",
                diagram.render([traced], "svg"),
                f"diagram-{mode}",
                f"config of run {run['id']} ({run['layout']}), one layer, one TP group (DP's collectives "
                f"are not drawn); `tpbench diagram` with the run's overrides, dp=1, draws the same",
            )
        )
    if not section.blocks:
        section.empty = "No OK run of tp, tp_sp, tp_vp or tp_sp_vp with tp > 1 in this selection."
    return section


def one_tp_group(cfg: RunConfig) -> RunConfig:
    """The config of one TP group: no DP, so no DP level (parallel.dp_shard, dp_replicate) either, nor
    a fault planted in one."""
    cfg.parallel.dp, cfg.parallel.dp_shard, cfg.parallel.dp_replicate = 1, "none", 1
    cfg.debug.shard_fault = ""
    return cfg


def run_config(flat: dict) -> RunConfig:
    """A stored run's config (flattened, as ReportData keeps it) as a typed RunConfig."""
    nested: dict = {}
    for key, value in flat.items():
        *parents, name = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), nested))  # type: ignore[return-value]
