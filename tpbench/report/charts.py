"""The report's figures: seaborn's look on plain matplotlib Figures, each returned as PNG bytes.

No pyplot: every figure is a `Figure` of its own, drawn and saved without a GUI backend or global
state. A mode keeps its colour in every chart; published figures take their mode's colour, hatched.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import matplotlib
import pandas as pd
import seaborn as sns
from matplotlib import image as mpl_image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import MaxNLocator

from tpbench.report import units
from tpbench.report.labels import MODE_ORDER, mode_rank
from tpbench.report.published import SEED

DPI = 100


@contextmanager
def _style() -> Iterator[None]:
    # axes.titley fixed: a title where matplotlib's automatic placement puts it here (no axis on top),
    # without measuring every tick label of the axes at each draw to find that out
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.85):
        with matplotlib.rc_context({"axes.titley": 1.0}):
            yield


def _png(fig: Figure) -> bytes:
    """The figure as PNG. A constrained layout already fits every artist in the figure: drawn once
    (savefig would draw it twice, once to lay it out and once more to crop it to what it drew); any
    other layout cropped to what it drew, its legend outside the axes included ("tight")."""
    buf = io.BytesIO()
    if isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine):
        fig.set_dpi(DPI)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        mpl_image.imsave(buf, canvas.buffer_rgba(), format="png", dpi=DPI)
    else:
        fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return buf.getvalue()


def _wrapped(title: str, width: int = 100) -> str:
    """A setting's long line (its hardware last) over lines of at most `width` characters."""
    return textwrap.fill(title, width, break_long_words=False)


def mode_color(mode: str) -> tuple[float, float, float]:
    palette = sns.color_palette("deep", 2 * len(MODE_ORDER) + 1)
    return palette[mode_rank(mode)]


# a sharded DP level's bars keep their mode's colour, hatched (parallel.dp_shard)
LEVEL_HATCH = {"optimizer": "..", "grads": "//", "full": "xx"}


def _bar_style(mode: str, dp_shard: str) -> dict:
    hatch = LEVEL_HATCH.get(dp_shard)
    return {"color": mode_color(mode), **({"hatch": hatch, "edgecolor": "white"} if hatch else {})}


def _grouped_bars(ax, groups: list, series: list[dict]) -> None:
    """Bars side by side per group. Each series: label, values {group: height}, texts {group: str},
    and matplotlib bar keywords in `style`."""
    width = 0.8 / len(series)
    for i, s in enumerate(series):
        present = [g for g in groups if g in s["values"] and pd.notna(s["values"][g])]
        xs = [groups.index(g) + (i - (len(series) - 1) / 2) * width for g in present]
        bars = ax.bar(xs, [s["values"][g] for g in present], width, label=s["label"], **s.get("style", {}))
        texts = [s.get("texts", {}).get(g, "") for g in present]
        ax.bar_label(bars, labels=texts, fontsize=7, padding=2, rotation=90 if len(series) > 3 else 0)
    ax.set_xticks(range(len(groups)), [str(g) for g in groups])
    ax.margins(y=0.15)


def _legend_outside(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


def _saving(ratio: float) -> str:
    return "" if pd.isna(ratio) else f"{ratio - 1:+.0%}"


def memory_peaks(peaks: pd.DataFrame, published: pd.DataFrame, title: str) -> bytes:
    """Per-rank peak (MiB) by layer count, one bar per mode, the change against DDP on each bar."""
    layers = sorted(peaks["layers"].unique())
    series = []
    for label, runs in peaks.sort_values(["mode_rank", "level_rank"]).groupby("label", sort=False):
        by_layers = runs.set_index("layers")
        first = runs.iloc[0]
        series.append(
            {
                "label": label,
                "values": (by_layers["peak_bytes"] / units.MIB).to_dict(),
                "texts": {} if label == "ddp" else by_layers["of_ddp"].map(_saving).to_dict(),
                "style": _bar_style(first["mode"], first["dp_shard"]),
            }
        )
    if not published.empty:
        ddp = published[published["mode"] == "ddp"].set_index("layers")["peak_bytes"]
        for mode, rows in published.groupby("mode", sort=False):
            by_layers = rows.set_index("layers")["peak_bytes"]
            texts = {} if mode == "ddp" else (by_layers / ddp).map(_saving).to_dict()
            series.append(
                {
                    "label": f"{mode} · {SEED}",
                    "values": (by_layers / units.MIB).to_dict(),
                    "texts": texts,
                    "style": {"color": "white", "edgecolor": mode_color(mode), "hatch": "///"},
                }
            )
    with _style():
        fig = Figure(figsize=(max(6.5, 1.1 * len(layers) * len(series) / 2 + 3), 4.2))
        ax = fig.subplots()
        _grouped_bars(ax, layers, series)
        ax.set(xlabel="layers", ylabel="peak per rank (MiB)", title=_wrapped(title))
        _legend_outside(ax)
        return _png(fig)


def memory_breakdown(parts: pd.DataFrame, title: str) -> bytes:
    """Stacked parts of the peak (parameters, gradients, optimizer, activations, ...) per mode."""
    parts = parts.sort_values(["layers", "mode_rank", "level_rank"])
    parts = parts.assign(bar=parts["label"] + " L" + parts["layers"].astype(str))
    wide = parts.pivot_table(index="bar", columns="part", values="measured_bytes", sort=False) / units.MIB
    order = [p for p in parts["part"].drop_duplicates() if p in wide]
    with _style():
        fig = Figure(figsize=(max(6.5, 0.7 * len(wide) + 2.5), 4.2))
        ax = fig.subplots()
        bottom = pd.Series(0.0, index=wide.index)
        for part, color in zip(order, sns.color_palette("muted", len(order)), strict=True):
            values = wide[part].fillna(0)
            ax.bar(range(len(wide)), values, bottom=bottom, label=part, color=color)
            bottom += values
        ax.set_xticks(range(len(wide)), wide.index, rotation=30, ha="right")
        ax.set(ylabel="MiB at the peak (busiest rank)", title=_wrapped(title))
        _legend_outside(ax)
        return _png(fig)


def measured_vs_predicted(
    frame: pd.DataFrame, measured: str, predicted: str, ylabel: str, title: str
) -> bytes:
    """Measured beside predicted per config, the prediction's error written on its bar."""
    frame = frame.assign(bar=frame["label"] + " L" + frame["layers"].astype(str))
    bars = frame["bar"].tolist()
    error = frame[predicted] / frame[measured] - 1
    series = [
        {
            "label": "measured",
            "values": dict(zip(bars, frame[measured] / units.MIB, strict=True)),
            "style": {"color": sns.color_palette("deep")[0]},
        },
        {
            "label": "predicted",
            "values": dict(zip(bars, frame[predicted] / units.MIB, strict=True)),
            "texts": dict(zip(bars, error.map(lambda e: f"{e:+.1%}"), strict=True)),
            "style": {"color": sns.color_palette("deep")[1]},
        },
    ]
    with _style():
        fig = Figure(figsize=(max(6.5, 0.8 * len(bars) + 2.5), 4.0))
        ax = fig.subplots()
        _grouped_bars(ax, bars, series)
        ax.tick_params(axis="x", rotation=30)
        ax.set(ylabel=ylabel, title=_wrapped(title))
        ax.legend(fontsize=7)
        return _png(fig)


def throughput(runs: pd.DataFrame, title: str) -> bytes:
    """tokens/s and step time (median, p10-p90 whiskers; the time model's prediction a black tick) per
    mode; MFU beside them when measured. A run measured on a loaded machine (its column `loaded`,
    tpbench.report.data.throughput) says so under its bar."""
    runs = runs.sort_values(
        ["layers", "mode_rank", "level_rank", *(["switches"] if "switches" in runs else [])]
    )
    labels = (runs["label"] + " L" + runs["layers"].astype(str)).tolist()
    if "switches" in runs:
        labels = [f"{a} {b}".strip() for a, b in zip(labels, runs["switches"], strict=True)]
    if "loaded" in runs:
        labels = [f"{a} · loaded" if b else a for a, b in zip(labels, runs["loaded"], strict=True)]
    styles = [_bar_style(m, s) for m, s in zip(runs["mode"], runs["dp_shard"], strict=True)]
    colors = [s["color"] for s in styles]
    has_mfu = "mfu" in runs and runs["mfu"].notna().any()
    with _style():
        fig = Figure(figsize=(4.2 * (3 if has_mfu else 2) + 1, 4.0), layout="constrained")
        axes = fig.subplots(1, 3 if has_mfu else 2)
        xs = range(len(runs))
        bars = axes[0].bar(xs, runs["tokens_per_s"], color=colors)
        axes[0].bar_label(bars, labels=[f"{v:,.0f}" for v in runs["tokens_per_s"]], fontsize=7, padding=2)
        axes[0].set(ylabel="tokens/s", title="throughput")
        step_ms = runs["step_time_s"] * 1e3
        low = (step_ms - runs.get("step_time_p10_s", runs["step_time_s"]) * 1e3).clip(lower=0)
        high = (runs.get("step_time_p90_s", runs["step_time_s"]) * 1e3 - step_ms).clip(lower=0)
        # arrays, not Series: matplotlib 3.8 and 3.9 call float() on a one-row Series (a pandas FutureWarning)
        whiskers = [low.fillna(0).to_numpy(), high.fillna(0).to_numpy()]
        bars = [*bars, *axes[1].bar(xs, step_ms, color=colors, yerr=whiskers, capsize=3)]
        axes[1].set(ylabel="step time (ms), p10-p90", title="step time")
        if "predicted_step_time_s" in runs and runs["predicted_step_time_s"].notna().any():
            predicted = (runs["predicted_step_time_s"] * 1e3).to_numpy()
            axes[1].scatter(xs, predicted, marker="_", s=400, color="black", zorder=3, label="predicted")
            axes[1].legend(fontsize=7)
        if has_mfu:
            bars = [*bars, *axes[2].bar(xs, runs["mfu"] * 100, color=colors)]
            axes[2].set(ylabel="MFU (%)", title="model FLOPs utilisation")
        for bar, style in zip(bars, styles * len(axes), strict=True):
            if "hatch" in style:
                bar.set(hatch=style["hatch"], edgecolor=style["edgecolor"])
        for ax in axes:
            ax.set_xticks(xs, labels, rotation=30, ha="right")
            ax.margins(y=0.15)
        fig.suptitle(_wrapped(title), fontsize=9)
        return _png(fig)


def recompute(frame: pd.DataFrame, title: str) -> bytes:
    """Per mode and layer count, one bar per recompute setting: the per-rank peak (its ratio to none
    on the bar) and the median step time (likewise), where measured."""
    groups = list(dict.fromkeys(frame["label"] + " L" + frame["layers"].astype(str)))
    shades = sns.color_palette("Blues", 4)[1:]
    with _style():
        fig = Figure(figsize=(max(6.0, 1.6 * len(groups)) * 2 + 1, 4.0), layout="constrained")
        axes = fig.subplots(1, 2)
        panels = (("peak_bytes", "peak_of_none", units.MIB, "peak per rank (MiB)"),
                  ("step_time_s", "step_of_none", 1e-3, "step time (ms)"))  # fmt: skip
        for ax, (column, ratio, scale, label) in zip(axes, panels, strict=True):
            series = []
            for i, (setting, rows) in enumerate(frame.groupby("recompute", sort=False)):
                keyed = rows.assign(group=rows["label"] + " L" + rows["layers"].astype(str)).set_index(
                    "group"
                )
                values = (keyed[column] / scale).to_dict() if column in keyed else {}
                texts = (
                    keyed[ratio].map(lambda v: "" if pd.isna(v) else f"{v:.2f}x").to_dict()
                    if ratio in keyed
                    else {}
                )
                series.append({"label": setting, "values": values, "texts": texts,
                               "style": {"color": shades[i % len(shades)]}})  # fmt: skip
            _grouped_bars(ax, groups, series)
            ax.set(ylabel=label, title=label.split(" (")[0])
        _legend_outside(axes[1])
        fig.suptitle(_wrapped(title), fontsize=9)
        return _png(fig)


def collectives(frame: pd.DataFrame, title: str) -> bytes:
    """Bytes on the wire and calls per step for each collective type, per mode."""
    frame = frame.assign(bar=frame["label"] + " L" + frame["layers"].astype(str))
    per_op = frame.groupby(["bar", "op"], sort=False, as_index=False)[["bytes", "count"]].sum()
    bars = frame["bar"].drop_duplicates().tolist()
    ops = sorted(per_op["op"].unique())
    colors = dict(zip(ops, sns.color_palette("colorblind", len(ops)), strict=True))
    with _style():
        fig = Figure(figsize=(max(9.0, 1.2 * len(bars) * 2 + 2), 4.0), layout="constrained")
        axes = fig.subplots(1, 2)
        for ax, column, ylabel in (
            (axes[0], "bytes", "KiB per rank per step"),
            (axes[1], "count", "calls per step"),
        ):
            series = []
            for op in ops:
                rows = per_op[per_op["op"] == op].set_index("bar")[column]
                values = rows / 2**10 if column == "bytes" else rows
                texts = values.map(lambda v: f"{v:,.0f}") if column == "count" else {}
                series.append(
                    {
                        "label": op,
                        "values": values.to_dict(),
                        "texts": dict(texts),
                        "style": {"color": colors[op]},
                    }
                )
            _grouped_bars(ax, bars, series)
            ax.tick_params(axis="x", rotation=30)
            ax.set(ylabel=ylabel)
            ax.legend(fontsize=7)
        fig.suptitle(_wrapped(title), fontsize=9)
        return _png(fig)


def drift(curves: pd.DataFrame, title: str) -> bytes:
    """AdamW logits drift (max |logits diff| on a fixed batch) against the step, one line per run."""
    curves = curves.assign(
        run=curves["label"] + " L" + curves["layers"].astype(str) + " #" + curves["run_id"].astype(str)
    )
    runs = curves.drop_duplicates("run")
    one_per_mode = runs["mode"].is_unique  # then each line takes its mode's colour
    palette = dict(zip(runs["run"], runs["mode"].map(mode_color), strict=True)) if one_per_mode else None
    with _style():
        fig = Figure(figsize=(7.0, 4.0))
        ax = fig.subplots()
        sns.lineplot(curves, x="step", y="value", hue="run", palette=palette, marker="o", ax=ax)
        if (curves["value"] > 0).all():
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="AdamW step", ylabel="max |logits diff| vs dense", title=_wrapped(title))
        ax.legend(fontsize=7)
        return _png(fig)


def sharded_peaks(frame: pd.DataFrame, title: str) -> bytes:
    """Predicted per-rank peak against DP, one line per sharded DP level (DDP, ZeRO-1, ZeRO-2, FSDP)."""
    with _style():
        fig = Figure(figsize=(6.5, 4.0))
        ax = fig.subplots()
        palette = sns.color_palette("deep", 4)
        for color, (level, group) in zip(palette, frame.groupby("level", sort=False), strict=False):
            ax.plot(group["dp"], group["peak_bytes"] / units.MIB, marker="o", label=level, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(frame["dp"].unique()), [str(d) for d in sorted(frame["dp"].unique())])
        ax.set(xlabel="DP ranks", ylabel="predicted peak per rank (MiB)", title=_wrapped(title))
        _legend_outside(ax)
        return _png(fig)
