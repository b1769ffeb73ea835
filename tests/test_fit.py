"""`tpbench fit` and the GPU table it reads (tpbench.predict.hardware): the memory the driver reports,
the search over a cluster (T within a node x DP x DP sharding x SP x VP x recompute x micro-batch), its
usable memory and margin, the ranking by predicted tokens/s per GPU, and bad input in one line.
tests/test_fit_checks.py holds the published runs, accumulation and the planted wrong factors."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.experiments.throughput import peak_flops
from tpbench.predict import allocator, hardware
from tpbench.run import compose
from tpbench.sizing import fit as fitting
from tpbench.sizing import search as search_module

runner = CliRunner()
GiB, MiB = 2**30, 2**20


def search(line: str, **kw) -> fitting.Fit:
    request = fitting.parse(line.split())
    (base,) = compose.expand(request.overrides, single=True, launching=False)
    return fitting.solve(request, base, **kw)


# --- the GPU table ------------------------------------------------------------------------------

# name: memory GiB, bf16 dense TFLOP/s, HBM TB/s, NVLink (or other link) GB/s, from the data sheets
SHEETS = {
    "A100-40GB": (40, 312, 1.555, 600),
    "A100-80GB": (80, 312, 2.039, 600),
    "H100-SXM": (80, 989.4, 3.35, 900),
    "H100-PCIe": (80, 756.5, 2.0, 600),
    "H200": (141, 989.4, 4.8, 900),
    "B200": (180, 2250, 8.0, 1800),
    "L40S": (48, 362.05, 0.864, 64),
    "MI300X": (192, 1307.4, 5.3, 896),
}


@pytest.mark.parametrize("name", sorted(SHEETS))
def test_the_table_holds_each_gpu_as_its_data_sheet(name):
    gpu = hardware.gpu(name)
    memory, bf16, hbm, link = SHEETS[name]
    assert gpu.memory_bytes == memory * GiB
    assert gpu.peak_flops("bfloat16") == pytest.approx(bf16 * 1e12)
    assert gpu.hbm_bytes_per_s == pytest.approx(hbm * 1e12)
    assert gpu.interconnect_bytes_per_s == pytest.approx(link * 1e9)
    assert (gpu.interconnect == "PCIe Gen4 x16") == (name == "L40S")  # no NVLink


def test_names_used_before_keep_working():
    assert hardware.gpu("h100-80gb") is hardware.gpu("H100") is hardware.gpu("H100-SXM")
    assert (
        allocator.cublas_workspace_bytes("H100") == allocator.cublas_workspace_bytes("H100-80GB") == 32 * MiB
    )
    assert allocator.cublas_workspace_bytes("A100-40GB") == 8 * MiB + 128 * 2**10
    assert set(compose.CHOICES["launch.emulate_gpu"]) >= {"H100", "H200", "A100", "A10", "L4", "V100", "B200"}
    # the same device names give the same peaks as before, the family and its variants apart
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "float32", tf32=True) == 378e12
    assert peak_flops("NVIDIA L40S", "bfloat16") == 362.05e12
    assert peak_flops("Tesla V100-SXM2-32GB", "bfloat16") is None  # no bf16 tensor cores
    assert "assumed" in hardware.gpu("MI300X").note


def test_reported_memory_is_the_drivers_where_cited_else_the_sheets():
    # nvidia-smi's memory.total (modal-labs/modal-client#2797): H100 81559MiB, A100 80GB 81920MiB
    assert hardware.gpu("H100").reported_bytes == 81559 * MiB  # 79.65 GiB of the sheet's 80
    assert hardware.gpu("A100-80GB").reported_bytes == 81920 * MiB
    assert (
        hardware.gpu("H200").reported_bytes == 141 * GiB
        and "data sheet" in hardware.gpu("H200").reported_source
    )
    mem = fitting.Memory.of(hardware.gpu("H100"), fitting.Overheads())
    assert mem.usable_bytes == 81559 * MiB - 512 * MiB and mem.margin_bytes == int(0.05 * mem.usable_bytes)
    given = fitting.Memory.of(hardware.gpu("H100"), fitting.Overheads(256 * MiB), 95 * GiB, margin=0.1)
    assert (given.usable_bytes, given.margin, given.source) == (
        95 * GiB - 256 * MiB,
        0.1,
        "given (--gpu-memory-gib)",
    )


# --- the search ---------------------------------------------------------------------------------

SMALL = "model=qwen3_0_6b seq=4096 gpu=L4 gpus_per_node=4 nodes=2"  # 16 heads, 8 KV heads


@pytest.fixture(scope="module")
def small() -> fitting.Fit:
    return search(SMALL, max_micro_batch=16)


def test_every_layout_of_the_cluster_is_searched(small):
    seen = {(r.tp, r.dp, r.dp_shard, r.dp_replicate, r.sp, r.vp, r.recompute) for r in small.rows}
    want = set()
    for T in (1, 2, 4):  # within a node of 4, dividing the 16 heads; DP the rest of the 8 GPUs
        dp = 8 // T
        modes = [(False, False)] if T == 1 else [(s, v) for s in (False, True) for v in (False, True)]
        levels = [("none", 1), ("optimizer", 1), ("grads", 1), ("full", 1)]
        levels += [(lvl, 2) for lvl in ("grads", "full") if dp // 2 >= 2]  # HSDP: a replica per node
        want |= {
            (T, dp, lvl, r, sp, vp, rc) for sp, vp in modes for lvl, r in levels for rc in fitting.RECOMPUTE
        }
    assert seen == want
    assert {r.gpus for r in small.rows} == {8}
    assert small.config(next(r for r in small.rows if r.dp_replicate == 2)).parallel.dp_replicate == 2


def test_each_row_is_at_the_largest_micro_batch_that_fits_with_the_margin(small):
    margin = small.memory.margin_bytes
    assert margin == int(0.05 * small.memory.usable_bytes) > 0
    for row in small.fitting:
        assert (
            row.headroom_bytes >= margin and row.headroom_bytes == small.memory.usable_bytes - row.peak_bytes
        )
        if row.capped:
            continue
        bigger = dataclasses.replace(row, micro_batch=row.micro_batch + 1)
        cluster = fitting.Cluster(small.gpu, small.nodes, small.gpus_per_node, small.memory, small.overheads)
        bigger = search_module.evaluate(small.base, cluster, bigger)
        assert bigger.headroom_bytes < margin, row.label()


def test_ranked_by_predicted_tokens_per_second_per_gpu_then_headroom(small):
    order = [(-r.tokens_per_s_per_gpu, -r.headroom_bytes) for r in small.fitting]
    assert order == sorted(order) and len(order) > 10
    for r in small.fitting:
        assert r.tokens_per_s_per_gpu == pytest.approx(r.tokens_per_step / r.step_s / 8)
        assert r.mfu == pytest.approx(r.model_flops_per_step / (r.step_s * 8 * 121e12))  # L4's bf16 peak
    assert all(not r.fits for r in small.not_fitting + small.tight)


LLAMA70 = "model=llama3_70b seq=8192 gpu=H100-80GB gpus_per_node=8"
T8 = ["tp=8", "sp=true", "vp=true"]  # the search kept to T 8 SP VP, to keep these tests cheap


@pytest.mark.parametrize(
    "optimizer, nodes",
    [
        ([], "fits on 2 nodes (16 GPUs) with sharded DP, e.g. T 8 SP VP x FSDP 2"),  # fused, the default
        (
            ["train.fused_optimizer=false"],
            "fits on 4 nodes (32 GPUs) with sharded DP, e.g. T 8 SP VP x FSDP 4",
        ),  # noqa: E501
    ],
)
def test_llama70_in_mixed_precision_needs_more_than_one_node_an_answer_exit_1(optimizer, nodes):
    """On a GPU fit assumes fused AdamW (train.fused_optimizer=auto), as `tpbench run` steps there: its
    optimizer step holds no for-each temporaries, and 70B needs 2 nodes, not 4."""
    done = runner.invoke(app, ["fit", *LLAMA70.split(), *T8, *optimizer])
    assert done.exit_code == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1
    said = done.stderr
    shape = "(L80 H8192 I28672 heads 64/8 head_dim 128 V128256 theta 500000 untied)"
    adamw = "for-each AdamW" if optimizer else "fused AdamW"
    here = f"llama3_70b {shape} at S 8192 (mixed precision, {adamw}) fits no layout with tp=8 sp=true"
    assert f"{here} vp=true on 1 node(s) of 8 H100-SXM" in said, said
    assert nodes in said, said
    done = runner.invoke(app, ["fit", *LLAMA70.split(), *T8, *optimizer, "--json"])  # the rows, and the line
    assert done.exit_code == 1 and json.loads(done.stdout)["nothing_fits"] == said.strip()


def test_llama70_on_more_nodes_answers_with_sharded_multi_node_layouts():
    done = runner.invoke(app, ["fit", *LLAMA70.split(), "nodes=4", "sp=true", "vp=true", "--json"])
    assert done.exit_code == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["assumptions"]["precision"] == "mixed" and data["nodes"] == 4
    best = data["fits"][0]
    assert best["gpus"] == 32 and best["dp_shard"] != "none"
    assert not any(r["dp_shard"] == "none" for r in data["fits"])  # DDP keeps 16 bytes a parameter


def test_pure_precision_and_fused_adamw_stay_options_and_the_title_says_which():
    fused = "train.fused_optimizer=true"
    done = runner.invoke(app, ["fit", *LLAMA70.split(), *T8, fused, "precision=pure", "--rows", "2"])
    assert done.exit_code == 0, done.stderr
    shown = " ".join(done.stdout.split())  # rich wraps a title to its table's width
    assert "pure precision (bf16 weights, gradients and AdamW moments), fused AdamW on 1 x 8" in shown
    assert "assumed: fused AdamW (train.fused_optimizer=true), pure precision" in shown
    done = runner.invoke(app, ["fit", *LLAMA70.split(), *T8, "nodes=4", "--rows", "2"])
    shown = " ".join(done.stdout.split())
    assert "mixed precision (bf16 compute, fp32 master weights and AdamW moments), fused AdamW" in shown
    done = runner.invoke(
        app, ["fit", *LLAMA70.split(), *T8, "nodes=4", "--rows", "2", "train.fused_optimizer=false"]
    )
    shown = " ".join(done.stdout.split())
    assert "mixed precision (bf16 compute, fp32 master weights and AdamW moments), for-each AdamW" in shown


# --- the command --------------------------------------------------------------------------------


def test_json_has_every_row_and_the_assumptions(small):
    args = [
        *SMALL.split(),
        "--json",
        "--cuda-context-mib",
        "1024",
        "--margin",
        "0.1",
        "--max-micro-batch",
        "16",
    ]
    done = runner.invoke(app, ["fit", *args])
    assert done.exit_code == 0, done.stderr
    data = json.loads(done.stdout)
    assert len(data["fits"]) + len(data["tight"]) + len(data["does_not_fit"]) == len(small.rows)
    a = data["assumptions"]
    assert (a["precision"], a["margin"], a["reserve_bytes"]) == ("mixed", 0.1, 1024 * MiB)
    assert a["usable_bytes"] == 23034 * MiB - 1024 * MiB and a["rates"]["peak"] == 121e12
    assert "one DP gradient sync" in a["accumulation"]
    assert all(r["headroom_bytes"] >= 0.1 * a["usable_bytes"] for r in data["fits"])
    assert all(0 <= r["headroom_bytes"] < r["margin_bytes"] for r in data["tight"])


@pytest.mark.parametrize(
    "args, says",
    [
        (["model=tiny", "seq=32", "gpu=H900"], "gpu=H900: accepted are A100-PCIe-40GB"),
        (["model=tiny", "seq=32"], "fit needs gpu=NAME"),
        (["model=minimind", "gpu=H200"], "fit needs seq=LENGTH: model=minimind names no sequence"),
        (["model=qwen3_8b", "seq=65536", "gpu=H200"], "train.seq_len=65536: qwen3_8b allows up to"),
        (
            ["model=tiny", "seq=32", "gpu=H200", "gpus_per_node=4", "tp=8"],
            "parallel.tp=8: fit takes T dividing",
        ),
        (["model=tiny", "seq=32", "gpu=H200", "gpus_per_node=0"], "gpus_per_node=0: accepted"),
        (["model=tiny", "seq=32", "gpu=H200", "nodes=x"], "nodes=x: accepted are integers >= 1"),
        (
            ["model=tiny", "seq=32", "gpu=H200", "dp_shard=half"],
            "dp_shard=half: accepted are none, optimizer",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "tokens_per_step=100"],
            "tokens_per_step=100: accepted are multiples of seq",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "global_batch=4", "tokens_per_step=128"],
            "accepted is one of them",
        ),
        (["model=tiny", "seq=32", "gpu=H200", "kind=validate"], "kind: fit sets it itself"),
        (
            ["model=tiny", "seq=32", "gpu=H200", "nodes=4", "dp_replicate=3"],
            "dp_replicate=3: on 4 node(s) fit takes",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "global_batch=12", "micro_batch=5"],
            "micro_batch=5 with global_batch=12",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "global_batch=3", "tp=2"],
            "global_batch=3: accepted are multiples of DP",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "gpus_per_node=1", "dp_shard=full"],
            "dp_shard=full: nothing to shard",
        ),
        (
            ["model=tiny", "seq=32", "gpu=H200", "--cuda-context-mib", "200000"],
            "--cuda-context-mib=200000: accepted",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(args, says):
    done = runner.invoke(app, ["fit", *args])
    assert done.exit_code == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr


def test_measure_confirms_the_best_row_by_emulation():
    # AdamW's for-each path: an emulated rank measures its step counters on the host, as CUDA keeps them
    args = [
        "model=tiny",
        "seq=32",
        "gpu=H100",
        "train.fused_optimizer=false",
        "precision=pure",
        "dp_shard=none",
    ]
    done = runner.invoke(app, ["fit", *args, "--max-micro-batch", "4", "--measure", "--json"])
    assert done.exit_code == 0, done.stderr
    best = json.loads(done.stdout)["fits"][0]
    measured = best["measured"]
    assert measured["peak_bytes"] == best["live_bytes"]  # the emulated rank's live tensors, to the byte
    assert best["peak_bytes"] == measured["peak_bytes"] + 2 * 32 * MiB + best["overhead_bytes"]
    assert best["headroom_bytes"] == 81559 * MiB - fitting.CUDA_CONTEXT_BYTES - best["peak_bytes"]
    assert measured["max_memory_reserved_bytes"] >= measured["max_memory_allocated_bytes"]
    assert measured["reserved_peak_bytes"] == measured["max_memory_reserved_bytes"] + best["overhead_bytes"]
    assert measured["fits"] is True


def test_measure_gives_a_sharded_row_its_verdict_by_reserved():
    # FSDP2 (dp_shard=full): the replay takes its resizes as frees and its streams apart (issue 59 item
    # 4), so a sharded row gets the verdict an unsharded one does; fit's own figure is the predicted
    # reserve, FSDP2's stream pools over the allocated bytes
    args = ["model=tiny", "seq=32", "gpu=H100", "precision=mixed", "dtype=bfloat16", "dp_shard=full", "tp=1"]
    done = runner.invoke(app, ["fit", *args, "--max-micro-batch", "2", "--measure", "--json", "--rows", "1"])
    assert done.exit_code == 0, done.stderr
    best = json.loads(done.stdout)["fits"][0]
    measured = best["measured"]
    assert best["dp_shard"] == "full" and measured["peak_bytes"] == best["live_bytes"]
    assert best["reserved_bytes"] > best["allocated_bytes"]  # the stream pools
    assert best["peak_bytes"] == best["reserved_bytes"] + best["overhead_bytes"]
    assert measured["fits"] is True and measured["fits_allocated"] is True
    # expandable segments map 20 MiB pages: more than the default's two 32 MiB workspace segments here
    assert measured["max_memory_reserved_expandable_bytes"] >= measured["max_memory_allocated_bytes"]


# --- one set of defaults with `tpbench plan`; pins; nothing fits (issue 54) ----------------------

# (plan's overrides, fit's): the same layout, fit's DP the GPUs over T; plan's gpu= without launch.device
SAME_LAYOUT = [
    (
        "model=llama3_8b tp=8 sp=true vp=true gpu=H100-80GB",
        "model=llama3_8b gpu=H100-80GB tp=8 sp=true vp=true recompute=none micro_batch=1 dp_shard=none",
    ),
    (
        "model=qwen3_0_6b tp=2 dp=4 sp=true vp=true dp_shard=full recompute=selective micro_batch=2 gpu=H200",
        "model=qwen3_0_6b gpu=H200 tp=2 sp=true vp=true dp_shard=full recompute=selective micro_batch=2",
    ),
    (
        "model=qwen3_0_6b seq=2048 tp=1 dp=2 dp_shard=optimizer precision=pure train.fused_optimizer=true "
        "micro_batch=3 gpu=A100-80GB",
        "model=qwen3_0_6b seq=2048 gpu=A100-80GB gpus_per_node=2 tp=1 dp_shard=optimizer precision=pure "
        "train.fused_optimizer=true recompute=none micro_batch=3",
    ),
]


@pytest.mark.parametrize("planned, fitted", SAME_LAYOUT, ids=["llama3_8b T8", "FSDP 4", "ZeRO-1 fused"])
def test_plan_and_fit_give_one_layout_the_same_peak_and_step(planned, fitted):
    done = runner.invoke(app, ["plan", *planned.split(), "--json"])
    assert done.exit_code == 0, done.stderr
    plan = json.loads(done.stdout.splitlines()[0])
    done = runner.invoke(app, ["fit", *fitted.split(), "--json", "--margin", "0"])
    assert done.exit_code == 0, done.stderr
    data = json.loads(done.stdout)
    (row,) = data["fits"] + data["tight"]
    assert row["allocated_bytes"] == plan["max_memory_allocated_bytes"]
    assert row["reserved_bytes"] == plan["max_memory_reserved_bytes"]  # fit's peak adds NCCL's buffers
    assert row["peak_bytes"] == plan["max_memory_reserved_bytes"] + row["overhead_bytes"]
    assert row["step_s"] == pytest.approx(plan["predicted_step_time_s"], rel=1e-12)
    a = data["assumptions"]
    assert plan["assumed"] == {
        "fused_optimizer": a["fused_optimizer"],
        "precision": a["precision"],
        "dtype": a["dtype"],
        "recompute": row["recompute"],
        "micro_batch": row["micro_batch"],
    }


def test_plan_with_gpu_predicts_that_gpus_step_and_says_what_it_assumed():
    done = runner.invoke(app, ["plan", "model=qwen3_0_6b", "tp=2", "gpu=H100"])
    assert done.exit_code == 0, done.stderr
    said = " ".join(done.stdout.split())
    assert "predicted step time on an H100" in said and "this CPU" not in said
    assumed = "assumed: fused AdamW (train.fused_optimizer=true), mixed precision (bf16 compute, fp32"
    assert f"{assumed} master weights and AdamW moments), recompute none, micro-batch 4" in said
    for device in ("launch.device=cpu", "device=cpu"):  # the key, or conf/device's group
        done = runner.invoke(app, ["plan", "model=qwen3_0_6b", "gpu=H100", device])
        assert done.exit_code == 2 and len(done.stderr.splitlines()) == 1
        assert f"gpu=H100 with {device}: gpu= predicts for that GPU; accepted are" in done.stderr


def test_a_presets_seq_is_fits_default_and_seq_overrides_it():
    kept = ["gpu=H100", "tp=2", "sp=true", "vp=true", "dp_shard=full", "recompute=full", "--json"]
    for given, seq in (([], 4096), (["seq=2048"], 2048)):
        done = runner.invoke(app, ["fit", "model=qwen3_0_6b", *given, *kept, "--max-micro-batch", "2"])
        assert done.exit_code == 0, done.stderr
        assert json.loads(done.stdout)["seq"] == seq
    done = runner.invoke(app, ["fit", "model=qwen3_0_6b", "tokens_per_step=65536", *kept])
    data = json.loads(done.stdout)  # 16 sequences of the preset's 4096
    assert done.exit_code == 0 and data["global_batch"] == 16, done.stderr


# S 8704: micro-batch 4 runs tight on 8 H100s (75.75 GiB, 3.40 of headroom under the 3.95 margin)
# S 8192: tight by the predicted reserve (77.09 GiB with FSDP2's stream pools, 2.06 of headroom); at
# S 8704, tight when fit decided by the allocated bytes, it no longer runs
PINNED = "model=llama3_8b seq=8192 gpu=H100-80GB tp=2 sp=true vp=true dp_shard=full recompute=selective"


def test_pinned_choices_stay_in_the_tight_table_and_the_suggestion():
    done = runner.invoke(app, ["fit", *PINNED.split(), "micro_batch=4"])
    assert done.exit_code == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    shown = " ".join(done.stdout.split())
    assert "tight (headroom under the 5% margin)" in shown and "T 2 SP VP x FSDP 4 │ selective │ 4 │" in shown
    said = done.stderr
    assert "fits no layout with tp=2 sp=true vp=true dp_shard=full recompute=selective micro_batch=4" in said
    assert "1 layout runs tight, under the margin (the tight table; --margin 0 fits them)" in said
    suggested = "e.g. T 2 SP VP x FSDP 8, recompute selective, micro-batch 4"  # every pin kept
    assert said.strip().endswith(f"fits on 2 nodes (16 GPUs) with sharded DP, {suggested}")
    done = runner.invoke(app, ["fit", *PINNED.split(), "micro_batch=4", "--margin", "0"])
    assert done.exit_code == 0 and "fits" in done.stdout, done.stderr


def test_pins_that_fit_on_no_cluster_say_so_not_pipeline_parallelism():
    # DDP keeps the whole 70B's AdamW state on every rank: more nodes never help it
    pins = ["tp=8", "sp=true", "vp=true", "dp_shard=none", "recompute=full"]
    done = runner.invoke(app, ["fit", "model=llama3_70b", "gpu=H100", *pins])
    assert done.exit_code == 1 and done.stdout == "", done.stderr
    assert done.stderr.strip().endswith(f"nothing with {' '.join(pins)} fits on up to 4096 nodes")
