"""This machine's matmul rate in a dtype, for a worker of a run: measured by a probe, cached, and
compared with fp32's to tell a dtype with no fast kernel here (tpbench.sizing.estimate turns it
into a run's time).

The rate (`rate`) is timed on a square matmul in the setting a worker of the run gets (on the CPU its
threads: the cores shared by the ranks of the node, or OMP_NUM_THREADS), measured once per device
name, torch version, thread count and dtype within PROBE_BUDGET_S, and cached in
$TPBENCH_CACHE_DIR/rates.json (default ~/.cache/tpbench). An entry that does not parse or does not
match is measured again, never trusted.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from tpbench import machine
from tpbench.config import RunConfig
from tpbench.parallel import emulation

PROBE = "matmul, CPU time"  # how a rate is measured: a figure measured otherwise is measured again
PROBE_BUDGET_S = 0.5  # the most one rate's measurement may cost (CPU time on the CPU)
PROBE_SIZES = (128, 256, 512, 1024, 2048)  # square matmuls, the largest timed within the budget
STEADY_S = 0.05  # one matmul this long is a steady figure: no larger size is timed
TIMED_CALLS = 3  # of the last size, within the budget: the median

# A 16-bit kernel, where there is one, is at least as fast as fp32's (half the bytes; AVX512-BF16 and
# AMX or tensor cores many times faster): below half of fp32's rate the dtype is emulated.
SLOW_KERNEL_RATIO = 0.5
# the CPU flags of a fast 16-bit matmul, as /proc/cpuinfo names them
FAST_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def rate(dtype: str, cfg: RunConfig, threads: int | None) -> float:
    """This machine's matmul FLOP/s in `dtype` for a worker of `cfg`: cached, else measured and cached."""
    key = _key(dtype, cfg, threads)
    device = torch.device(str(key["device"]))
    entries = _read_cache()
    for entry in entries:
        if {k: entry.get(k) for k in key} == key and _valid_rate(entry.get("flops_per_s")):
            return float(entry["flops_per_s"])
    on_cpu = device.type == "cpu"
    measured = probe(getattr(torch, dtype), device, threads) if on_cpu else probe_in_child(dtype)
    kept = [e for e in entries if {k: e.get(k) for k in key} != key]
    now = datetime.now(UTC).isoformat(timespec="seconds")
    _write_cache([*kept, {**key, "flops_per_s": measured, "measured_at": now}])
    return measured


def probe(dtype: torch.dtype, device: torch.device, threads: int | None) -> float:
    """FLOP/s of a square matmul in `dtype` on `device` with `threads` CPU threads: the sizes of
    PROBE_SIZES in turn, each timed once warm, up to one that takes STEADY_S or the largest whose
    predicted cost fits in PROBE_BUDGET_S; the last size's figure, the median of up to TIMED_CALLS
    calls within the budget. On the CPU the time is the process's CPU time over its threads, so that
    other processes on a busy machine do not slow the figure down (measured under a load of 33 on 2
    cores: fp32 115-135 GFLOP/s by CPU time, 0.6-20 by the wall clock); on a GPU the wall clock
    between synchronizes."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        spent, seconds, timed = 0.0, 0.0, None
        for n in PROBE_SIZES:
            if seconds and spent + 2 * seconds * (n / timed[0].shape[0]) ** 3 > PROBE_BUDGET_S:
                break  # a warm call and a timed one of this size would not fit
            a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
            warm = _matmul_seconds(a, b, threads or saved)
            seconds = _matmul_seconds(a, b, threads or saved)
            spent += warm + seconds
            timed = (a, b)
            if seconds >= STEADY_S:
                break
        # the last size timed, again, up to TIMED_CALLS calls in all within the budget: their median
        # (one call of 2048 on the 2-core Xeon read 151, 173 and 186 GFLOP/s in three probes of a day)
        times = [seconds]
        while len(times) < TIMED_CALLS and spent + seconds <= PROBE_BUDGET_S:
            times.append(_matmul_seconds(*timed, threads or saved))
            spent += times[-1]
        return 2.0 * timed[0].shape[0] ** 3 / sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(saved)


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor, threads: int) -> float:
    """One `a @ b`: on a GPU the wall clock between synchronizes, on the CPU the process's CPU time over
    its threads."""
    cuda = a.device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    _sync(a.device)
    start = clock()
    a @ b
    _sync(a.device)
    return max((clock() - start) / (1 if cuda else threads), 1e-9)


def probe_in_child(dtype: str, device: str = "cuda") -> float:
    """`probe` on `device` in a process of its own: a CUDA context made here would hold GPU 0's memory
    for as long as the command runs, beside rank 0's."""
    call = f"rate_probe.probe(torch.{dtype}, torch.device({device!r}), None)"
    code = f"import torch; from tpbench.predict import rate_probe; print({call})"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.split()[-1])


def slow_kernel_line(dtype: str, cfg: RunConfig, threads: int | None) -> str | None:
    """One line where `dtype`'s matmuls run far below fp32's here (emulated: no fast kernel), with the
    figures, the CPU flags that are missing and what to do instead; None where they do not."""
    if dtype not in FAST_FLAGS or cfg.launch.bf16_gemm != "native":  # fp32 or fp64, or GEMMs in fp32
        return None
    slow, fp32 = rate(dtype, cfg, threads), rate("float32", cfg, threads)
    if slow >= SLOW_KERNEL_RATIO * fp32:
        return None
    where = _device_name(cfg)
    missing = [flag for flag in FAST_FLAGS.get(dtype, ()) if flag not in _cpu_flags()]
    if missing and threads:
        where += f", whose /proc/cpuinfo has no {' nor '.join(missing)}"
    return (
        f"{dtype} has no fast matmul kernel here: {slow / 1e9:,.3g} GFLOP/s against float32's "
        f"{fp32 / 1e9:,.3g} ({where}); instead: dtype=float32 (the same run's matmuls "
        f"{fp32 / slow:,.0f}x faster), or launch.emulate=fake, whose memory peaks are byte-equal to a "
        "real run's and which runs no arithmetic"
        + (
            "; to validate bf16: launch.bf16_gemm=fp32_accumulate (a GPU's bf16 GEMM, at fp32's speed)"
            if cfg.kind == "validate" and dtype == "bfloat16"
            else ""
        )
    )


def cache_file() -> Path:
    folder = os.environ.get("TPBENCH_CACHE_DIR") or Path.home() / ".cache" / "tpbench"
    return Path(folder) / "rates.json"


def _key(dtype: str, cfg: RunConfig, threads: int | None) -> dict[str, object]:
    """What a measured rate is valid for."""
    device = "cuda" if threads is None else "cpu"
    return {
        "probe": PROBE,
        "device": device,
        "device_name": _device_name(cfg),
        "torch": torch.__version__,
        "threads": threads,
        "dtype": dtype,
    }


def _device_name(cfg: RunConfig) -> str:
    if cfg.launch.device == "cuda" and not emulation.gpu_emulated(cfg):
        return torch.cuda.get_device_name(0)
    return machine.cpu_name()


def _valid_rate(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _read_cache() -> list[dict]:
    """The cached entries; none where the file is missing, does not parse or is not tpbench's."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("rates") if isinstance(data, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _write_cache(entries: list[dict]) -> None:
    """Written whole and renamed into place: a run started at the same moment reads either file."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({"rates": entries}, indent=1))
        partial.replace(path)
    except OSError:
        pass  # an unwritable cache: measured again next time


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the time model's rates on a CPU (tpbench.predict.steptime) --------------------------------------

TIME_PROBE = "time model v3, CPU time; memory beyond the cache; collectives wall clock between GEMMs"
# the full tensors of the collective probe, alpha then beta: 4 KiB, and DDP's default bucket (25 MiB,
# beyond most CPUs' last-level cache, as a step's gradient buckets and large activations are)
COLLECTIVE_BYTES = (4 * 2**10, 25 * 2**20)
GAP_GEMMS = 16  # [256, 256] GEMMs before each probed collective: about 5 ms of one core's work
# The largest group probed where it outnumbers the cores (8: a node's GPUs, the largest T the tests run
# on 2 cores); a larger group's collectives are that group's scaled by the ring's steps (`probed_group`)
MOST_PROBED = 8


def probed_group(group: int) -> int:
    """The group whose collectives are probed for `group`: itself, up to this machine's cores or
    MOST_PROBED (ranks that outnumber the cores only share them: 32 forked ranks on 2 cores took 35 s
    of wall and 64 CPU s to probe, 8 of them 9.5 s). A larger group's alpha is the probed one's times
    the ring's steps, (group - 1) / (probed - 1) (an all-reduce 2 (n - 1) of them, an all-gather and a
    reduce-scatter n - 1), and its beta, per ring byte, the probed one's (docs/time-model.md#the-rates:
    probed at 8 and at 32 on a 2-core Xeon, the scaled alphas within 30% of the probed ones, the betas
    as far apart as two probes of one group)."""
    return min(group, max(os.cpu_count() or 1, MOST_PROBED))


def time_rates(cfg: RunConfig, threads: int | None, group: int) -> dict[str, float]:
    """This machine's rates for the time model, for a worker of `cfg` with `threads` CPU threads and
    collectives over `group` ranks: cached, else measured (`probe_time_rates`, and the collectives
    in child processes, `probe_collectives`) and cached. The collectives are timed on the wall clock:
    on a busy machine (load average above the cores) they come out slower than the machine is (probed
    while this 2-core VM installed packages, the tiny model's TP+SP step was predicted at 107 ms; its
    steps take about 30 ms), so an entry records the load it was probed at, and one probed busy is
    probed again once the machine is not."""
    probed = probed_group(group)
    key = {**_key("float32", cfg, threads), "probe": TIME_PROBE, "group": probed}
    entries = _read_cache()
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    for entry in entries:
        if {k: entry.get(k) for k in key} == key and all(
            _valid_rate(v) for v in entry.get("rates", {}).values()
        ):
            if entry.get("load", 0.0) > cores >= load:  # probed busy, idle now: again
                break
            return _ring_scaled(dict(entry["rates"]), group, probed)
    measured = probe_time_rates(threads)
    if probed > 1:
        measured |= probe_collectives(probed)
    kept = [e for e in entries if {k: e.get(k) for k in key} != key]
    now = datetime.now(UTC).isoformat(timespec="seconds")
    _write_cache([*kept, {**key, "rates": measured, "measured_at": now, "load": load}])
    return _ring_scaled(measured, group, probed)


def _ring_scaled(rates: dict[str, float], group: int, probed: int) -> dict[str, float]:
    """`probed`'s rates for `group`: each alpha times the ring's steps (`probed_group`)."""
    if group == probed:
        return rates
    steps = (group - 1) / (probed - 1)
    return {k: v * steps if k.startswith("alpha_") else v for k, v in rates.items()}


ACCUMULATE_PROBE = "fp32_accumulate's dispatch mode, CPU time"


def fp32_accumulate_op_s(cfg: RunConfig, threads: int | None) -> float:
    """What one aten op's fixed cost gains under launch.bf16_gemm=fp32_accumulate, whose dispatch
    mode (tpbench.models.gemm) sees every op of the run: the tiny step of `probe_time_rates`
    with and without the mode, per op dispatched; cached, else measured and cached."""
    key = {**_key("float32", cfg, threads), "probe": ACCUMULATE_PROBE}
    entries = _read_cache()
    for entry in entries:
        op_s = entry.get("op_s")
        if {k: entry.get(k) for k in key} == key and (op_s == 0.0 or _valid_rate(op_s)):
            return float(op_s)
    from tpbench.models import gemm

    machine.keep_freed_memory()
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # Python and dispatch: one thread's work
    try:
        step = _tiny_step()
        plain = _cpu_seconds(step, 5, 1)

        def under_mode() -> None:
            with gemm.bf16_gemms("fp32_accumulate"):
                step()

        measured = max(0.0, _cpu_seconds(under_mode, 5, 1) - plain) / _dispatched(step)
    finally:
        torch.set_num_threads(saved)
    kept = [e for e in entries if {k: e.get(k) for k in key} != key]
    now = datetime.now(UTC).isoformat(timespec="seconds")
    _write_cache([*kept, {**key, "op_s": measured, "measured_at": now}])
    return measured


def _cpu_seconds(fn, reps: int, threads: int) -> float:
    """CPU time of one call of `fn` (after a warm one) over `threads` threads, the median of `reps`."""
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) / threads)
    return max(sorted(times)[len(times) // 2], 1e-9)


def probe_time_rates(threads: int | None) -> dict[str, float]:
    """On the CPU with `threads` threads, by CPU time: a skinny GEMM's FLOP/s ([2048, 128] @ [128,
    128]), the flash attention kernel's forward and backward ([1, 4, 512, 64], causal; its FLOPs
    counted over the full S x S, backward 2.5 x forward), an elementwise add's bytes/s from memory
    (`_memory_bandwidth`) and over 3 x 16 MiB (in the cache where the cache holds that: the for-loop
    AdamW's passes over one parameter's tensors, `cache_bandwidth`), and the fixed cost of one op: a
    training step of a MiniMind too small for its arithmetic to count (H 16, 2 layers, 4 tokens:
    Python, dispatch and autograd), over the aten ops it dispatches."""
    machine.keep_freed_memory()  # as a worker runs its steps (tpbench.run.worker)
    saved = torch.get_num_threads()
    n = threads or saved
    torch.set_num_threads(n)
    try:
        a, b = torch.randn(2048, 128), torch.randn(128, 128)
        small = 2.0 * 2048 * 128 * 128 / _cpu_seconds(lambda: a @ b, 20, n)
        q, k, v = (torch.randn(1, 4, 512, 64, requires_grad=True) for _ in range(3))

        def attention() -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        attn = 3.5 * 4.0 * 4 * 512 * 512 * 64 / _cpu_seconds(attention, 5, n)
        bandwidth = _memory_bandwidth(n)
        cached = _add_bandwidth(2**22, 10, n)
        step = _tiny_step()
        torch.set_num_threads(1)  # Python and dispatch: one thread's work (idle threads would spin)
        op_s = _cpu_seconds(step, 5, 1) / _dispatched(step)
        rates = {"gemm_small": small, "attention": attn, "bandwidth": bandwidth, "op_s": op_s}
        return rates | {"cache_bandwidth": cached}
    finally:
        torch.set_num_threads(saved)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache this Linux names (/sys/devices/system/cpu/cpu0/cache), else None."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(index).read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]])
    return max(sizes, default=None)


def _memory_bandwidth(threads: int) -> float:
    """Bytes/s of an elementwise add whose three operands together are twice the last-level cache
    (48 MiB at least, 1.5 GiB at most; 64 MiB of cache where Linux names none): from memory, as a
    training step's kernels read what ops long before them wrote (the saved activations, the
    gradients, the optimizer's moments) once its tensors outgrow the cache. An add over 3 x 16 MiB,
    the first probe, stays in a large cache: 27 GB/s on the 2-core Xeon (480 MiB of L3), where 3 x 256
    MiB runs at 15 GB/s, and H 256's steps were predicted 16-25% short."""
    total = min(max(2 * (last_level_cache_bytes() or 64 * 2**20), 48 * 2**20), 3 * 2**29)
    return _add_bandwidth(total // 3 // 4, 5, threads)


def _add_bandwidth(n: int, reps: int, threads: int) -> float:
    """Bytes/s of `torch.add` over three fp32 tensors of `n` elements (two read, one written), by CPU
    time, the median of `reps` calls."""
    x, y, out = torch.ones(n), torch.ones(n), torch.empty(n)
    return 3 * 4 * n / _cpu_seconds(lambda: torch.add(x, y, out=out), reps, threads)


def _tiny_step():
    """A training step of a MiniMind whose arithmetic is nil: what remains is each op's fixed cost."""
    from tpbench.models.minimind import MiniMindConfig, build_model

    model = build_model(
        MiniMindConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=32
        )
    )
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 32, (1, 4))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(ids, ids)[1].backward()
        optimizer.step()

    return step


def _dispatched(fn) -> int:
    """aten ops `fn` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def probe_collectives(group: int) -> dict[str, float]:
    """gloo's alpha (s) and beta (s per ring byte, as CommCounter counts them) of all_reduce,
    all_gather and reduce_scatter over `group` processes on this machine (the calls tpbench's
    collectives make), by the wall clock, each called as a step calls it: after a few ms of GEMMs
    on every rank, its cost what it adds to a loop of them (docs/time-model.md: on a 2-core VM a
    4 KiB all-reduce costs 0.3 ms right after a barrier and 1.1-2.9 ms after compute)."""
    code = "from tpbench.predict import rate_probe; rate_probe._collectives_main()"
    done = subprocess.run(
        [sys.executable, "-c", code, str(group)], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _collectives_main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    group = int(sys.argv[1])
    with tempfile.TemporaryDirectory() as folder:
        # forked from this process, which has imported torch and started no thread: each rank skips
        # the import that a spawned one pays (a 32-rank probe took 44.5 s spawned, 13.1 s forked,
        # on 2 cores), and runs the same gloo collectives
        mp.start_processes(_collectives_rank, (group, folder), nprocs=group, start_method="fork")
        print(Path(folder, "rates.json").read_text())


def _collectives_rank(rank: int, group: int, folder: str) -> None:
    import statistics

    import torch.distributed as dist

    from tpbench.parallel.instrumentation import ring_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=group)

    def make(kind: str, full: int):
        """(the call, its input) of a collective of `full` bytes (the all-reduced, gathered or
        reduce-scattered tensor's)."""
        whole, shard = torch.ones(full // 4), torch.ones(full // 4 // group)
        if kind == "all_reduce":
            return (lambda x: dist.all_reduce(x)), whole
        if kind == "all_gather":
            return (lambda x: dist.all_gather_into_tensor(whole, x)), shard
        return (lambda x: dist.reduce_scatter_tensor(shard, x)), whole

    machine.keep_freed_memory()  # as a worker runs its steps
    a = torch.randn(256, 256)
    cores = os.cpu_count() or 1
    # more ranks than cores share them: fewer GEMMs each keep the gap a few ms of wall time
    # and a smaller large collective: 25 MiB over 32 ranks on 2 cores takes seconds a call
    gemms, reps = (GAP_GEMMS, 5) if group <= cores else (max(2, GAP_GEMMS * cores // group), 3)
    sizes = COLLECTIVE_BYTES if group <= cores else (COLLECTIVE_BYTES[0], 4 * 2**20)

    def compute() -> None:  # a few ms of GEMMs, as a step runs between its collectives
        for _ in range(gemms):
            a @ a

    def loop(fn, x, n: int) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(n):
            compute()
            if fn is not None:
                fn(x)
        return (time.perf_counter() - start) / n

    rates = {}
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        seconds = []
        for full in sizes:
            fn, x = make(kind, full)
            n = 20 if full < 2**20 else 6
            # each rank's loop with the collective after each compute, less the same loop without:
            # what a collective adds to a step that calls it between GEMMs, interleaved, the median
            seconds.append(statistics.median(loop(fn, x, n) - loop(None, x, n) for _ in range(reps)))
        small, big = (ring_bytes(kind, full, group) for full in sizes)
        beta = max((seconds[1] - seconds[0]) / (big - small), 1e-15)
        rates[f"alpha_{kind}"] = max(seconds[0] - small * beta, 1e-7)
        rates[f"beta_{kind}"] = beta
    if rank == 0:
        Path(folder, "rates.json").write_text(json.dumps(rates))
    dist.destroy_process_group()
