"""`tpbench fit` and the GPU table it reads (tpbench.predict.hardware): every T dividing the GPUs per node and
the heads, crossed with SP, VP and recompute, each at its largest micro-batch that fits, ranked; the
per-rank peak is the analytic model's on that GPU plus the stated constants; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.experiments.throughput import peak_flops
from tpbench.predict import allocator, hardware, theory
from tpbench.run import compose
from tpbench.sizing import fit as fitting

runner = CliRunner()
GiB, MiB = 2**30, 2**20


def search(line: str, **kw) -> fitting.Fit:
    request = fitting.parse(line.split())
    (base,) = compose.expand(request.overrides, single=True)
    return fitting.search(base, request.gpu, request.gpus_per_node, request.given, request.global_batch, **kw)


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


# --- the search ---------------------------------------------------------------------------------

LLAMA70 = "model=llama3_70b seq=8192 gpu=H100-80GB gpus_per_node=8"


@pytest.fixture(scope="module")
def llama70() -> fitting.Fit:
    return search(LLAMA70)


def test_every_t_dividing_the_node_and_the_heads_with_sp_vp_and_recompute(llama70):
    seen = {(r.tp, r.sp, r.vp, r.recompute) for r in llama70.rows}
    want = {(1, False, False, rc) for rc in fitting.RECOMPUTE}
    want |= {(T, sp, vp, rc) for T in (2, 4, 8) for sp in (0, 1) for vp in (0, 1) for rc in fitting.RECOMPUTE}
    assert seen == want
    qwen = search("model=qwen2_5_7b seq=2048 gpu=H200")  # 28 heads: T 8 does not divide them
    assert {r.tp for r in qwen.rows} == {1, 2, 4}


def test_each_row_is_at_the_largest_micro_batch_that_fits(llama70):
    for row in llama70.fitting:
        bigger = dataclasses.replace(row, micro_batch=row.micro_batch + 1)
        bigger = fitting._evaluate(llama70.base, llama70.gpu, bigger, None, llama70.overheads)
        assert row.headroom_bytes >= 0 > bigger.headroom_bytes, row.label()
    assert max(r.micro_batch for r in llama70.fitting) > 1


def test_ranked_by_gpus_then_recompute_then_communication(llama70):
    order = [(r.tp, fitting.RECOMPUTE.index(r.recompute), r.comm_bytes_per_token) for r in llama70.fitting]
    assert order == sorted(order) and len(order) == 4
    best = llama70.fitting[0]
    assert (best.tp, best.sp, best.vp, best.recompute) == (8, True, True, "none")
    assert all(not r.fits for r in llama70.not_fitting) and llama70.not_fitting[0].tp == 1


def test_global_batch_makes_dp_replicas_of_divisors():
    fit = search("model=qwen3_0_6b seq=4096 gpu=L4 global_batch=32 gpus_per_node=4")
    assert fit.fitting and all(32 % r.micro_batch == 0 and r.dp * r.micro_batch == 32 for r in fit.rows)
    row = next(r for r in fit.fitting if r.dp > 1 and r.tp > 1)
    assert fitting.communicators(fit.config(row)) == 3  # the world's, TP's and DP's (8 KV heads, T <= 4)
    cfg = fit.config(row)
    assert (cfg.train.batch, cfg.train.global_batch, cfg.parallel.dp) == ("fixed_global", 32, row.dp)
    assert any(m.name == "gradient sums" for m in theory.predict(cfg).moments)  # DP's flat copy counted


def test_the_analytic_search_is_fast():
    request = fitting.parse(LLAMA70.split())
    (base,) = compose.expand(request.overrides, single=True)
    start = time.process_time()
    fitting.search(base, request.gpu, request.gpus_per_node, request.given)
    assert time.process_time() - start < 2.0  # 39 layouts, ~0.1 s here


# --- the command --------------------------------------------------------------------------------


def test_json_has_every_row_and_the_constants():
    done = runner.invoke(app, ["fit", *LLAMA70.split(), "--json", "--cuda-context-mib", "1024"])
    assert done.exit_code == 0, done.stderr
    data = json.loads(done.stdout)
    assert len(data["fits"]) + len(data["does_not_fit"]) == 39
    assert data["overheads"]["cuda_context_bytes"] == 1024 * MiB and data["gpu"]["name"] == "H100-SXM"
    assert all(row["fits"] and row["headroom_bytes"] >= 0 for row in data["fits"])


def test_the_table_names_the_gpu_and_each_layout():
    done = runner.invoke(app, ["fit", *LLAMA70.split()])
    assert done.exit_code == 0, done.stderr
    assert "on H100-SXM (80 GiB), 8 per node: fits" in done.stdout and "T 8 SP VP" in done.stdout


@pytest.mark.parametrize(
    "args, says",
    [
        (["model=tiny", "seq=32", "gpu=H900"], "gpu=H900: accepted are A100-PCIe-40GB"),
        (["model=tiny", "seq=32"], "fit needs gpu=NAME"),
        (["model=tiny", "gpu=H200"], "fit needs seq=LENGTH"),
        (["model=qwen3_8b", "seq=65536", "gpu=H200"], "train.seq_len=65536: qwen3_8b allows up to"),
        (["model=llama3_405b", "seq=8192", "gpu=H100-80GB"], "llama3_405b at S 8192 fits no T on H100-SXM"),
        (
            ["model=tiny", "seq=32", "gpu=H200", "gpus_per_node=4", "tp=8"],
            "parallel.tp=8: fit takes T dividing",
        ),
        (["model=tiny", "seq=32", "gpu=H200", "gpus_per_node=0"], "gpus_per_node=0: accepted"),
        (["model=tiny", "seq=32", "gpu=H200", "kind=validate"], "kind: fit sets it itself"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(args, says):
    done = runner.invoke(app, ["fit", *args])
    assert done.exit_code == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and says in done.stderr, done.stderr


def test_measure_confirms_the_best_row_by_emulation():
    # AdamW's for-each path: an emulated rank measures its step counters on the host, as CUDA keeps them
    args = ["model=tiny", "seq=32", "gpu=H100", "train.fused_optimizer=false", "--max-micro-batch", "4"]
    done = runner.invoke(app, ["fit", *args, "--measure", "--json"])
    assert done.exit_code == 0, done.stderr
    best = json.loads(done.stdout)["fits"][0]
    measured = best["measured"]
    assert measured["peak_bytes"] == best["live_bytes"]  # the emulated rank's live tensors, to the byte
    # the row's per-rank peak: those live tensors, two cuBLAS workspaces (H100) and the CUDA context
    # (one GPU: no NCCL communicator)
    assert (best["tp"], best["dp"], best["overhead_bytes"]) == (1, 1, fitting.CUDA_CONTEXT_BYTES)
    assert best["peak_bytes"] == measured["peak_bytes"] + 2 * 32 * MiB + fitting.CUDA_CONTEXT_BYTES
    assert best["headroom_bytes"] == 80 * GiB - best["peak_bytes"]
    assert measured["max_memory_reserved_bytes"] >= measured["max_memory_allocated_bytes"]
    assert measured["reserved_peak_bytes"] == measured["max_memory_reserved_bytes"] + best["overhead_bytes"]
    assert measured["fits"] is True
