"""The time model (tpbench.predict.steptime): its arithmetic on hand-computed cases, every collective
of the memory model's comm_rows timed at its own kind's rates, recompute's extra forward, overlap
only where the collective outlasts its work, the GPU table's rates, and the ops' kernels against
the aten ops the dense model really dispatches. In process, no run."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tpbench.config import lean_rmsnorm
from tpbench.experiments.setup import build_dense
from tpbench.models.gemm import MODES
from tpbench.models.minimind import MiniMindConfig, build_model
from tpbench.parallel.recompute import apply_recompute
from tpbench.predict import hardware, rate_probe
from tpbench.predict.steptime import Rates, gpu_rates, model, predict_time
from tpbench.predict.steptime import ops as O
from tpbench.predict.theory import comm_rows, dims
from tpbench.run import compose

KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@functools.cache
def config(line: str):
    (cfg,) = compose.expand(["kind=throughput", *line.split()])
    return cfg


def rates(**changes) -> Rates:
    """Round figures, each collective kind's distinct, so that a kind timed at another's shows."""
    base = Rates(
        gemm={"large": 1e10, "small": 1e9},
        attention=5e9,
        bandwidth=1e10,
        op_s=1e-5,
        alpha={"all_reduce": 1e-4, "all_gather": 2e-4, "reduce_scatter": 3e-4},
        beta={"all_reduce": 1e-9, "all_gather": 2e-9, "reduce_scatter": 4e-9},
        overlap=False,
        peak=1e10,
    )
    return replace(base, **changes)


def test_op_time_is_the_roofline_plus_the_fixed_cost_on_a_cpu_and_the_larger_on_a_gpu():
    """On a CPU a GEMM's (and attention's) arithmetic and its operands' traffic add up (one core moves
    what the cache no longer holds beside little arithmetic); on a GPU the larger counts. An
    elementwise op is its bytes at the bandwidth either way."""
    r = rates()
    big = O.gemm("w", 1024, 1024, 1024, 4)  # 2 x 2^30 FLOPs, 12 MiB
    assert big.flops == 2 * 2**30 and big.bytes == 4 * 3 * 2**20 and big.kernels == 4
    assert model.op_time(big, r) == pytest.approx((2 * 2**30 / 1e10 + 12 * 2**20 / 1e10, 4e-5))
    assert model.op_time(big, replace(r, gpu=True))[0] == pytest.approx(2 * 2**30 / 1e10)  # the larger
    skinny = O.gemm("w", 4096, 64, 64, 4)  # a side of 64: the small class, 1e9
    operands = 4 * (4096 * 64 + 64 * 64 + 4096 * 64)  # [4096, 64] x [64, 64] -> [4096, 64], fp32: 2,113,536 B
    assert model.op_time(skinny, r)[0] == pytest.approx(2 * 4096 * 64 * 64 / 1e9 + operands / 1e10)
    attention = O.Op("a", O.ATTENTION, 5e9, 1e8, 16)
    assert model.op_time(attention, r)[0] == pytest.approx(1.0 + 0.01)
    assert model.op_time(attention, replace(r, gpu=True))[0] == pytest.approx(1.0)
    norm = O.rmsnorm("n", 1000, 100, 4)  # memory-bound: 2 x 4 + 5 x 4 bytes per element
    assert model.op_time(norm, r) == pytest.approx((1e5 * 28 / 1e10, 7e-5))
    gpu = replace(r, gpu=True)
    assert model.op_time(norm, gpu) == pytest.approx((2.8e-4, 0.0))  # longer than its launches
    tiny = O.rmsnorm("n", 1, 10, 4)
    assert sum(model.op_time(tiny, gpu)) == pytest.approx(7e-5)  # its launches


def test_megatrons_fused_norm_softmax_and_dropout_are_one_launch_each_and_read_once():
    """Megatron's kernels (Korthikanti et al.'s): one fused kernel each (apex's LayerNorm, the scaled
    masked softmax, dropout), the input read and the output written, launched once (backward: the
    norm twice, the others once); tpbench's own pay every aten op's launch and their fp32 passes."""
    gpu = replace(rates(), gpu=True, op_s=1e-3)  # launches outlast the traffic: what they count shows
    fused = O.Implementation((), fused_dropout=True, fused_softmax=True, fused_norm=True)
    d = dims(config("mode=tp model.dropout=0.1 model.flash_attn=false"))
    for impl, launches in ((fused, 1), (O.TPBENCH, None)):
        forward = {op.name: op for op in O.layer_forward(d, impl)}
        for name, elements in (("input norm", d.Ns * d.H), ("softmax", d.B * d.Nq_l * d.S**2)):
            op = forward[name]
            assert (op.kernels == launches) if launches else op.kernels > 1
            assert (op.bytes == 2 * d.p * elements) if launches else op.bytes > 2 * d.p * elements
        for name in ("o_proj dropout", "mlp dropout", "attention dropout"):
            assert (forward[name].kernels == 1) if launches else forward[name].kernels > 1
        if launches:
            assert sum(model.op_time(forward["mlp dropout"], gpu)) == pytest.approx(1e-3)


def test_an_elementwise_gradient_moves_what_it_reads_and_writes():
    """The residual add's gradient is one add where the stream's two gradients meet (3 tensors, as
    forward); dropout's reads the gradient and the 1-byte mask and writes one (no mask made again);
    Megatron's fused norm and softmax read two tensors and write one; an op that says nothing moves
    twice its forward's bytes."""
    d = dims(config("mode=tp model.dropout=0.1 model.flash_attn=false"))
    fused = O.Implementation((), fused_dropout=True, fused_softmax=True, fused_norm=True)
    for impl in (O.TPBENCH, fused):
        forward = {op.name: op for op in O.layer_forward(d, impl)}
        back = {name: O.backward_of(op).bytes for name, op in forward.items()}
        stream = d.Ns * d.H
        assert back["residual add"] == forward["residual add"].bytes == 3 * d.s * stream
        assert back["mlp dropout"] == (2 * d.p + 1) * stream
        assert back["swiglu"] == 2 * forward["swiglu"].bytes
        norm, softmax = (3 * d.p, 3 * d.p) if impl is fused else (None, None)
        for name, per in (("input norm", norm), ("softmax", softmax)):
            want = 2 * forward[name].bytes if per is None else per * forward[name].flops
            assert back[name] == want, name
    assert O.backward_of(forward["mlp dropout"].times(3)).bytes == 3 * back["mlp dropout"]


def test_the_for_loop_adamw_moves_its_tensors_from_memory_once_its_other_passes_in_the_cache():
    """The for-loop AdamW runs its ~13 passes a parameter at a time over that parameter's four
    tensors: from memory, what the fused kernel moves (each read once; the parameter and the moments
    written: 7 x w a parameter), its 24 x w at the cache's rate, whichever takes longer. Every pass
    at the memory's rate (the rule before) or only the fused kernel's bytes fails."""
    d = dims(config("mode=ddp"))
    n = sum(count for _, count in O.params(d))
    adamw = O.optimizer(d)
    assert (adamw.bytes, adamw.memory_bytes) == (24 * d.w * n, 7 * d.w * n)
    roof = model.op_time(adamw, rates(bandwidth=1e10, cache_bandwidth=4e10))[0]
    assert roof == pytest.approx(7 * d.w * n / 1e10)  # 7 / 1e10 > 24 / 4e10: memory-bound
    roof = model.op_time(adamw, rates(bandwidth=1e10, cache_bandwidth=2e10))[0]
    assert roof == pytest.approx(24 * d.w * n / 2e10)  # the cache's passes take longer
    no_cache = model.op_time(adamw, rates(bandwidth=1e10))[0]  # a GPU's: the one bandwidth
    assert no_cache == pytest.approx(24 * d.w * n / 1e10)
    fused = O.optimizer(dims(config("mode=ddp train.fused_optimizer=true")))
    assert fused.memory_bytes is None and fused.bytes == 7 * d.w * n


def test_the_dp_average_copies_each_gradient_as_its_engine_does_and_a_tied_table_adds_its_two():
    """On the compute's thread: DDP's reducer copies each gradient into its bucket as backward makes
    it and averages each bucket in place (4 passes over the gradients; parallel.overlap's flat
    buckets the same); the blocking average concatenates, averages, copies back (6); ZeRO-1 zeroes
    its grad buffer, adds each gradient in, averages its shard; FSDP2 copies each unit's gradients
    into its reduce-scatter input, averages the shard, and casts in and copies out each gather. TP
    alone has none. Under ZeRO-1 and FSDP2 AdamW steps this rank's shard (ZeRO-1's one flat tensor).
    The embedding's gradient is its whole table, zeroed and written, and tied to the head the two
    gradients of the one weight are added (3 passes more)."""

    def copies(line: str) -> list[O.Op]:
        return [op for op in O.step_ops(dims(config(line))) if op.name == "dp copies"]

    d = dims(config("mode=tp tp=2 dp=2"))
    tensors = O.params(d)
    n, w, p = sum(count for _, count in tensors), d.w, d.p
    for line in ("mode=tp tp=2 dp=2 parallel.overlap=true", "mode=ddp tp=1 dp=2"):
        (op,) = copies(line)
        mine = O.params(dims(config(line)))
        want = (4 * w * sum(count for _, count in mine), len(mine) + 1, O.BACKWARD)
        assert (op.bytes, op.kernels, op.phase) == want, line
    assert [op.bytes for op in copies("mode=tp tp=2 dp=2")] == [6 * w * n]
    assert [op.bytes for op in copies("mode=tp tp=2 dp=2 parallel.dp_shard=optimizer")] == [4 * w * n + w * n]
    for level, gathers in (("grads", 1), ("full", 2)):
        (fsdp,) = copies(f"mode=tp tp=2 dp=2 parallel.dp_shard={level}")
        assert fsdp.bytes == 2 * w * n + w * n + gathers * ((w + p) * n / 2 + 2 * p * n), level
    assert copies("mode=tp") == []
    zero = O.optimizer(dims(config("mode=tp tp=2 dp=2 parallel.dp_shard=optimizer")))
    assert (zero.bytes, zero.kernels, zero.memory_bytes) == (24 * w * -(-n // 2), 13 * 2, None)  # 2 pieces
    fsdp = O.optimizer(dims(config("mode=tp tp=2 dp=2 parallel.dp_shard=full")))
    assert (fsdp.bytes, fsdp.kernels) == (24 * w * -(-n // 2), 13 * len(tensors))
    for line, tied in (("mode=tp_vp", True), ("mode=tp_vp model.tie_word_embeddings=false", False)):
        d = dims(config(line))
        assert d.tied is tied
        table = d.V_l * d.H * d.w
        (embedding,) = [O.backward_of(op) for op in O.outside_forward(d) if op.name == "embedding"]
        assert embedding.bytes == table + d.N * d.H * (d.s + 2 * d.w) + (3 * table if tied else 0)


def test_a_collective_costs_alpha_per_call_plus_beta_per_ring_byte_of_its_kind():
    r = rates()
    assert r.collective_s("all_reduce", 3, 1e6) == pytest.approx(3e-4 + 1e-3)
    assert r.collective_s("reduce_scatter", 3, 1e6) == pytest.approx(9e-4 + 4e-3)


@pytest.mark.parametrize("line", ["mode=tp", "mode=tp_sp", "mode=tp_vp", "mode=tp_sp_vp", "mode=ddp"])
def test_every_collective_is_timed_at_its_own_kinds_rates(line):
    """The exposed communication (nothing overlaps here) is sum over comm_rows of count x alpha +
    bytes x beta of the row's own kind: an all-reduce timed at the reduce-scatter's cost, or a row
    lost or counted twice between the blocks and the rest, fails."""
    cfg = config(line)
    r = rates()
    expected: dict[str, float] = {}
    for row in comm_rows(cfg):
        seconds = row.count * r.alpha[row.op] + row.bytes * r.beta[row.op]
        expected[row.purpose] = expected.get(row.purpose, 0.0) + seconds
    got = predict_time(cfg, r)
    assert got.comm_exposed == pytest.approx(expected)
    assert got.comm_total_s == pytest.approx(sum(expected.values()))


@pytest.mark.parametrize(
    "line", ["mode=tp", "mode=tp_sp", "mode=tp_sp_vp recompute=full", "mode=tp_sp linear=true"]
)
def test_the_blocks_collectives_and_the_rest_keep_comm_rows_totals(line):
    cfg = config(line.replace("linear=true", "parallel.sp_gather=linear"))
    d = dims(cfg)
    totals: dict[tuple[str, str], list[float]] = {}
    for c in model.step_collectives(d, comm_rows(cfg)):
        row = totals.setdefault((c.op, c.purpose), [0, 0])
        row[0] += c.count
        row[1] += c.bytes
    assert totals == {
        (r.op, r.purpose): [pytest.approx(r.count), pytest.approx(r.bytes)] for r in comm_rows(cfg)
    }


def matmul_flops(cfg, mode: str) -> int:
    """FLOPs torch's FlopCounterMode counts in a real forward and backward of the dense model (T 1,
    manual attention: every FLOP a matmul) with train.recompute=`mode` applied."""
    net = build_dense(cfg)
    apply_recompute(net, mode)
    d = dims(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (d.B, d.S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        net(ids, ids)[1].backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_recomputes_extra_compute_is_the_matmuls_a_recomputing_step_runs_again(mode):
    """At a rate of 1 FLOP/s for every matmul and attention and no cost for anything else, the time
    model's extra compute under recompute is the extra FLOPs it predicts: those a real step runs again,
    counted by torch (full: each block's forward up to down_proj's input; selective: the SwiGLU,
    elementwise, none; op: k_proj, o_proj and up_proj, the even matmuls of its policy, its batched
    attention matmuls kept). A model that forgot the recomputed forward, or recomputed down_proj, fails."""
    unit = rates(gemm={"large": 1.0, "small": 1.0}, attention=1.0, bandwidth=1e300, op_s=0.0)
    base = "mode=ddp parallel.dp=1 model.flash_attn=false train.compile=false"
    plain, again = config(base), config(f"{base} recompute={mode}")
    extra = predict_time(again, unit).compute_s - predict_time(plain, unit).compute_s
    assert extra == matmul_flops(again, mode) - matmul_flops(plain, "none")
    assert (extra > 0) == (mode in ("full", "op"))


def test_overlap_hides_only_what_outlasts_the_work_behind_it():
    """parallel.overlap: each backward entry all-reduce hides behind its region's column weight
    gradients; exposed = max(0, collective - that work). At 1 FLOP/s for matmuls, nothing else costing
    and collectives that outlast everything, the hidden time is those weight gradients' FLOPs: each
    as many as its linear's forward, which torch counts in a real forward of the dense model (q, k, v,
    gate and up of every block), the rank's share of them at T 2."""
    cfg = config("mode=tp parallel.overlap=true model.flash_attn=false train.compile=false")
    unit = {"gemm": {"large": 1.0, "small": 1.0}, "attention": 1.0, "bandwidth": 1e300, "op_s": 0.0}
    slow = rates(overlap=True, alpha=dict.fromkeys(KINDS, 1e12), **unit)  # outlasts everything
    fast = rates(overlap=True, alpha=dict.fromkeys(KINDS, 0.0), beta=dict.fromkeys(KINDS, 0.0))
    none = rates(alpha=dict.fromkeys(KINDS, 1e12), **unit)
    d = dims(cfg)
    ids = torch.randint(0, cfg.model.vocab_size, (d.B, d.S), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        build_dense(cfg)(ids, ids)
    columns = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    flops = sum(sum(f.values()) for m, f in counter.get_flop_counts().items() if m.endswith(columns))
    hidden = predict_time(cfg, none).comm_s - predict_time(cfg, slow).comm_s
    assert hidden == flops / 2 > 0
    assert predict_time(cfg, fast).comm_s == 0.0
    # no cores to spare (Rates.overlap false): nothing hides
    assert predict_time(cfg, replace(slow, overlap=False)).comm_s == predict_time(cfg, none).comm_s


def test_mfu_is_model_flops_over_step_time_devices_and_peak():
    """The model FLOPs of MFU are those torch counts in a real step of the dense model (manual
    attention: all matmuls), over the predicted step, the 2 ranks and their 1e10 peak."""
    cfg = config("mode=tp model.flash_attn=false train.compile=false")
    got = predict_time(cfg, rates())
    assert got.mfu == pytest.approx(matmul_flops(cfg, "none") / (got.step_s * 2 * 1e10))
    assert got.step_s == pytest.approx(got.compute_s + got.comm_s + got.optimizer_s)
    assert got.fields()["predicted_step_time_s"] == got.step_s


def test_a_gpus_rates_are_its_data_sheet_times_the_cited_fractions_and_settable():
    a100 = hardware.gpu("A100-80GB")
    r = gpu_rates(a100, "bfloat16")
    assert r.gemm["large"] == pytest.approx(312e12 * 0.859)
    assert r.bandwidth == pytest.approx(2.039e12 * 0.85)
    assert r.beta["all_reduce"] == pytest.approx(1 / 200e9)
    assert gpu_rates(a100, "bfloat16", gemm=0.5).gemm["large"] == pytest.approx(156e12)


def test_the_ops_kernels_are_the_aten_ops_the_dense_model_dispatches():
    """Each op's kernel count (what pays the fixed per-op cost) against a dispatch mode's count of
    the dense tiny model's real step: forward, backward and AdamW within 3%. On MiniMind's own ops
    (model.fused_ops=false, its norms checkpointed): the kernels of the fused ops, the default since
    f09ed63, are not counted by the time model yet (227 dispatched forward against its 209: issue 60's
    dispatch count from the ops the step runs)."""
    cfg = config("mode=ddp parallel.dp=1 model.fused_ops=false model.lean_rmsnorm=true")
    d = dims(cfg)
    m = cfg.model
    net = build_model(
        MiniMindConfig(
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_hidden_layers,
            num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads,
            vocab_size=m.vocab_size,
            fused_ops=m.fused_ops,  # the ops the run's config runs: lean norms only where it asks
            lean_rmsnorm=lean_rmsnorm(m.lean_rmsnorm, cfg.train.recompute),
        )
    )
    opt = torch.optim.AdamW(net.parameters())
    ids = torch.randint(0, m.vocab_size, (d.B, d.S))
    loss = {}
    forward = rate_probe._dispatched(lambda: loss.setdefault("x", net(ids, ids)[1]))
    backward = rate_probe._dispatched(lambda: loss["x"].backward())
    adam = rate_probe._dispatched(opt.step)
    predicted: dict[str, int] = {}
    for op in O.step_ops(d):
        if op.name != "dp copies":  # DDP's, which the bare model has not
            predicted[op.phase] = predicted.get(op.phase, 0) + op.kernels
    assert predicted[O.FORWARD] == pytest.approx(forward, rel=0.03)
    assert predicted[O.BACKWARD] == pytest.approx(backward, rel=0.03)
    assert predicted[O.STEP] == pytest.approx(adam, rel=0.03)


def test_plan_prints_the_predicted_step_its_split_and_mfu_on_the_given_gpu():
    """On a machine without the GPUs, as the issue asks it (`launch.device=cuda gpu=NAME`): a plan runs
    nothing; `tpbench run` of the same line is refused before anything starts."""
    import json

    from typer.testing import CliRunner

    from tpbench.cli import app

    line = "tp=8 sp=true model=seed_memory launch.device=cuda"
    done = CliRunner().invoke(app, ["plan", *line.split(), "gpu=A100-80GB", "--json"])
    assert done.exit_code == 0, done.output
    said = json.loads(done.output.splitlines()[0])
    # kind=all: memory first
    cfg = compose.expand([*line.split(), "launch.emulate_gpu=A100-80GB"], launching=False)[0]
    expected = predict_time(cfg, gpu_rates(hardware.gpu("A100-80GB"), cfg.train.dtype))
    assert said["predicted_step_time_s"] == pytest.approx(expected.step_s)
    assert said["predicted_mfu"] == pytest.approx(expected.mfu)
    done = CliRunner().invoke(app, ["plan", *line.split(), "gpu=A100-80GB"])
    assert "predicted step time on an A100-80GB: " in done.output and "predicted MFU: " in done.output
    if not torch.cuda.is_available():
        done = CliRunner().invoke(app, ["run", *line.split(), "kind=memory"])
        assert done.exit_code == 2 and "launch.device=cuda: 8 ranks on a node need 8 GPUs" in done.output


def test_ranks_that_outnumber_the_cores_compute_on_their_share_of_them(monkeypatch):
    """The probes time one process's threads by CPU time; 4 ranks of 1 thread on 2 cores each get half
    a core, so each op takes twice as long on the wall clock (the design card's T 4 validate runs
    took 2.2x their estimate before); the collectives, probed over the group, stay as probed."""
    import os

    from tpbench.predict.steptime import cpu_rates

    probed = {"gemm_small": 4e9, "attention": 3e9, "bandwidth": 1e10, "cache_bandwidth": 3e10, "op_s": 1e-5}
    probed |= {f"{p}_{k}": 1e-4 for k in KINDS for p in ("alpha", "beta")}
    monkeypatch.setattr(rate_probe, "rate", lambda dtype, cfg, threads: 1e10)
    monkeypatch.setattr(rate_probe, "time_rates", lambda cfg, threads, group: probed)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    two, four = (cpu_rates(config(f"mode=tp tp={t}"), threads=1) for t in (2, 4))
    assert (two.gemm, two.op_s, two.overlap) == ({"large": 1e10, "small": 4e9}, 1e-5, False)
    assert four.gemm == {"large": 5e9, "small": 2e9} and four.attention == 1.5e9
    assert (four.bandwidth, four.op_s, four.alpha, four.beta) == (5e9, 2e-5, two.alpha, two.beta)
    assert (two.cached, four.cached) == (3e10, 1.5e10)
    assert "4 threads on 2 cores" in four.source
    dense = cpu_rates(config("mode=tp tp=1"), threads=1, ranks=4)  # validate's, on each of the 4 ranks
    assert (dense.gemm, dense.bandwidth) == (four.gemm, four.bandwidth)
    one_each = cpu_rates(config("mode=tp tp=2"), threads=None)
    assert one_each.gemm == two.gemm and one_each.overlap is False


def test_bf16_gemms_fp32_accumulated_run_at_fp32s_rate_with_their_casts(monkeypatch):
    """launch.bf16_gemm=fp32_accumulate (tpbench.models.gemm): each bf16 GEMM is the fp32 GEMM of
    its inputs widened, its output rounded (three casts moving 3 x its bf16 bytes), and the dispatch
    mode adds its own cost to every op (probed); the flash kernel keeps bf16's rate. Native bf16 keeps
    bf16's probed rate: on a CPU with AVX512-BF16 faster than fp32, which the runs are not."""
    from tpbench.predict.steptime import cpu_rates

    probed = {"gemm_small": 4e9, "attention": 3e9, "bandwidth": 1e10, "cache_bandwidth": 3e10, "op_s": 1e-5}
    probed |= {f"{p}_{k}": 1e-4 for k in KINDS for p in ("alpha", "beta")}
    monkeypatch.setattr(rate_probe, "rate", lambda dtype, cfg, threads: {"float32": 1e10}.get(dtype, 2e10))
    monkeypatch.setattr(rate_probe, "time_rates", lambda cfg, threads, group: probed)
    monkeypatch.setattr(rate_probe, "fp32_accumulate_op_s", lambda cfg, threads: 3e-6)
    line = "kind=validate mode=tp dtype=bfloat16"
    native, wide = (cpu_rates(config(f"{line} launch.bf16_gemm={g}"), threads=1) for g in MODES)
    assert (native.gemm, native.attention, native.op_s, native.widen) == (
        {"large": 2e10, "small": 8e9},
        6e9,
        1e-5,
        0,
    )
    assert (wide.gemm, wide.attention, wide.widen) == ({"large": 1e10, "small": 4e9}, 6e9, 3)
    assert wide.op_s == pytest.approx(1.3e-5)
    assert "fp32-accumulated" in wide.source
    mm = O.gemm("w", 1024, 1024, 1024, 2)
    # its arithmetic at fp32's rate, its own traffic (a CPU's GEMM: the sum) and its casts' 3 x its bytes
    assert model.op_time(mm, wide) == pytest.approx((2 * 2**30 / 1e10 + 4 * mm.bytes / 1e10, 7 * 1.3e-5))
    backward = replace(mm, phase=O.BACKWARD, kernels=8)
    assert model.op_time(backward, wide)[1] == pytest.approx((8 + 6) * 1.3e-5)  # two GEMMs' casts
    assert model.op_time(mm, native) == pytest.approx((2 * 2**30 / 2e10 + mm.bytes / 1e10, 4e-5))
