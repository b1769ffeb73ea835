"""Checks that need real ranks, run inside one torchrun job; rank 0 writes every rank's results as JSON.

    torchrun --nproc-per-node N tests/torchrun_checks.py OUT.json units
    torchrun --nproc-per-node N tests/torchrun_checks.py OUT.json validate   (configs in TPBENCH_CHECKS)
    torchrun --nproc-per-node N tests/torchrun_checks.py OUT.json validate memory ...   (several suites:
        TPBENCH_CHECKS maps each to its configs; each rank's results map each to its own: `Shared`)

Each check only records numbers, on every rank (a fault on rank 1 alone must show); the assertions
live in the pytest files, which start the job with `torchrun(...)` below and read every rank's.

A config that crashes fails its own tests only (`isolated`): one that raises is recorded as `Crashed`
on the ranks it raised on and the job goes on with the next; one that kills a rank or hangs the job
(a one-rank error leaves the other ranks in a collective) is found from the ranks' progress files and
a shared job is started again without it (`Shared`). Reading a crashed config's results raises
`CrashedConfig` with why, in the test that reads it. `Shared.select` keeps the configs the selected
tests need (`pytest -k NAME` runs NAME's config alone, not the whole job).
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from tpbench.run import collector

with collector.paused():  # each rank imports torch a third quicker (tpbench.run.collector)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from omegaconf import DictConfig, OmegaConf
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    from torch.utils.flop_counter import FlopCounterMode

    from tpbench.config import ParallelConfig, RunConfig
    from tpbench.experiments import dense_side, memory, planted, validate
    from tpbench.experiments.throughput import LocalFlopCounter
    from tpbench.experiments.training import Trainer
    from tpbench.models.minimind import IGNORE_INDEX, MiniMindConfig, build_model
    from tpbench.parallel import collectives, instrumentation, regions, timing
    from tpbench.parallel.checks import resolve_switches
    from tpbench.parallel.context import ParallelContext, exit_now, leave_world
    from tpbench.parallel.cross_entropy import VocabParallelCrossEntropy
    from tpbench.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from tpbench.parallel.plan import parallelize, plan_layouts, shard_state_dict
    from tpbench.parallel.recompute import apply_recompute

# The tiny model of the tests (H 64, L 2, heads 8/4, V 256, S 32): manual attention, short AdamW runs
TINY = ["model.flash_attn=false", "validate.steps=6", "validate.every=3"]
S, B, H, L, D = 32, 2, 64, 2, 8  # its shapes, for the collective arithmetic
TOL_FWD, TOL_GRAD, TOL_PARAM = 1e-5, 1e-5, 1e-3  # the validation tolerances of the core issue
# the families (tests/test_families.py proves each dense model is transformers' own): Llama (no q/k
# norms, untied, theta 1e4), Qwen2.5 (q, k, v biases, head_dim 16 != H / heads 8), Qwen3 (q/k norms,
# head_dim 16); N_kv 2: KV heads (and their biases) sharded at T 2, replicated at T 4
FAMILIES = {
    "llama": [
        "model.qk_norm=false",
        "model.rope_theta=10000",
        "model.rms_norm_eps=1e-5",
        "model.tie_word_embeddings=false",
        "model.num_key_value_heads=2",
    ],
    "qwen25": [
        "model.qk_norm=false",
        "model.attention_bias=true",
        "model.head_dim=16",
        "model.num_key_value_heads=2",
    ],
    "qwen3": ["model.head_dim=16"],
}
# What each planted fault breaks, by the parameters' roles: the gradients that need the skipped sum
# (or every gradient), and no other; the others stay within their bound
BREAKS = {
    "debug.skip_grad_sum=[qk_norm]": r"\.self_attn\.[qk]_norm\.weight$",
    "debug.skip_grad_sum=[sp_norms]": r"(\.input_layernorm|\.post_attention_layernorm|^model\.norm)\.weight$",
    "debug.skip_grad_sum=[kv_replicas]": r"\.self_attn\.[kv]_proj\.weight$",
    "debug.skip_grad_sum=[dp]": r".",  # every gradient is averaged over DP
    "debug.ddp_fault=no_divide": r".",  # every gradient summed, not averaged
    # each SP region's entry hands back this rank's share of its own partial input gradient, not the
    # reduce-scattered sum: the norm before each region and everything below the top region's entry
    # (the top MLP's, at L 2 block 1's) is wrong; the top MLP's weights (their gradients come from
    # above it and its gathered input) and the final norm are not
    "debug.overlap_fault=no_wait": r"^(?!model\.norm\.weight$|model\.layers\.1\.mlp\.)",
    # DDP's bucket 0 left this rank's own, not averaged. The gradients are checked from the second
    # backward on (the first is the forward check's), once DDP has rebuilt its buckets in the order the
    # gradients arrived: the final norm's (256 B) first, then the top down_proj's (64 KiB), past the
    # 0.05 MB cap: those two and no other (the tied embedding's comes last, after its lookup's)
    "debug.ddp_fault=drop_bucket": r"^model\.(norm|layers\.1\.mlp\.down_proj)\.weight$",
    # overlap's DP buckets (T 2, 0.05 MB), each sent at its first gradient: the others of its bucket
    # land in it after the all-reduce read it. In reverse order, per block: [final norm or the block
    # below's q; post-attention norm, input norm, down], [up], [gate, o, v, k], [q]; gate, the lone
    # up and q, the final norm and the late bucket (q/k norms, the tied embedding) are sent whole.
    # (A peer slow enough to read a slot after its copy lets one step pass; not all six.)
    "debug.overlap_fault=early_bucket": r"\.(input_layernorm|post_attention_layernorm|mlp\.down_proj"
    r"|self_attn\.[kvo]_proj)\.weight$",
}
LLAMA31_ROPE = ["model.rope_scaling_factor=8", "model.rope_original_max_position_embeddings=16"]


def _why(stderr: str) -> str:
    """A failed job's stderr for its assertion: the lines that say why a rank ended (a C++ abort's
    "terminate called" and "what():", a Python error, a signal), which the agent's own report at the
    end pushes out of a plain tail, then the tail."""
    said = re.compile(r"terminate called|what\(\)|Error|Exception|Signal|signal|Traceback|enforce fail")
    lines = [line for line in stderr.splitlines() if said.search(line) and "closing signal" not in line]
    return "\n".join(["why:", *lines[:40], "tail:", stderr[-3000:]])


class JobFailed(AssertionError):
    """A torchrun job that did not end OK (a rank's exit code, or past its timeout): why, from stderr."""

    def __init__(self, stderr: str) -> None:
        super().__init__(_why(stderr))
        self.stderr = stderr


def torchrun(
    script: Path,
    nproc: int,
    out: Path,
    *args: str,
    checks: dict | None = None,
    timeout: float = 600,
    alone: bool = False,
) -> list:
    """Run `script OUT ARGS...` as a real torchrun job over gloo and return the JSON rank 0 wrote:
    a list of every rank's results, rank 0's first (`write_every_rank`); a crashed config's results
    are `Crashed` (`isolated`). alone: every validate config beside a dense side of its own
    (`isolated_beside`), as a job started again after a crash runs them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TPBENCH_CHECKS=json.dumps(checks or {}))
    env["TPBENCH_PEAK_STORAGES"] = "1"  # memory.PeakTracker: the live storages at each rank's peak
    if alone:
        env[ALONE] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    try:
        proc = subprocess.run([*cmd, str(script), str(out), *args], env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        said = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
        raise JobFailed(f"{said}\nthe job ran past its {timeout:g} s and was stopped") from None
    if proc.returncode != 0:
        raise JobFailed(proc.stderr)
    return json.loads(Path(out).read_text(), object_hook=_crashed)


class CrashedConfig(AssertionError):
    """Raised where a test reads a config that crashed its job (`Crashed`)."""


class Crashed:
    """What a crashed config left instead of results: anything read of it raises CrashedConfig with
    why, in the test that reads it; two are equal (every rank of a crash reports one)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def _fail(self, *args, **kwargs):
        raise CrashedConfig(f"this config crashed in its job (the others' results stand): {self.why}")

    __getitem__ = __iter__ = __len__ = __contains__ = _fail

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Crashed)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Crashed({self.why[:200]!r})"


CRASHED = "__crashed__"  # the JSON of a Crashed: {CRASHED: why}


def _crashed(obj: dict) -> dict | Crashed:
    return Crashed(obj[CRASHED]) if set(obj) == {CRASHED} else obj


def progress_files(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f"{out.name}.r*.progress"))


def in_flight(out: Path) -> list[tuple[str, str]]:
    """The (suite, config)s some rank of the job behind `out` started and did not end, from the ranks'
    progress files (`isolated` writes them): what was running when the job died or hung."""
    found = []
    for path in progress_files(out):
        started: dict[tuple[str, str], bool] = {}
        for line in path.read_text().splitlines():
            what, suite, name = line.split(" ", 2)
            started[suite, name] = what == "start"
        found += [key for key, running in started.items() if running and key not in found]
    return found


class Shared:
    """One torchrun job of several suites, whose configs test modules add at import, each under its own
    prefix (`add`); it runs once, for the first fixture that needs it (a job beside the tests), and each
    module reads its part (`part`): the launches of several files in one, started once."""

    RELAUNCHES = 3  # a job started again at most this often, each time without the config that killed it
    # a hung job is stopped after this: the world-2 job ran past 600 s once on the 2-core EPYC at load
    # 8-15 (every-step optimizer and DP-reduction checks, compiled dropout configs), and its config then
    # in flight was blamed for a hang (alone: 8 s)
    TIMEOUT_S = 1200
    ALL: list[Shared] = []  # every one made (conftest.py's keep_selected selects in each)

    def __init__(self, nproc: int) -> None:
        Shared.ALL.append(self)
        self.nproc, self.checks = nproc, {}
        self.owners: dict[tuple[str, str], str] = {}  # (suite, prefix) -> the test module that added it
        self.lock, self.ranks, self.error = threading.Lock(), None, None

    def add(self, suite: str, prefix: str, checks: dict[str, list[str]] | None = None) -> None:
        self.checks.setdefault(suite, {}).update({f"{prefix}/{k}": v for k, v in (checks or {}).items()})
        self.owners[suite, prefix] = sys._getframe(1).f_globals["__name__"]

    def names(self, module: str) -> set[str]:
        """The configs (without their prefixes) that `module` added, in every suite."""
        return {
            k[len(prefix) + 1 :]
            for (suite, prefix), owner in self.owners.items()
            if owner == module
            for k in self.checks[suite]
            if k.startswith(f"{prefix}/")
        }

    def select(self, keep: Callable[[str, str], bool]) -> None:
        """Keep the configs the selected tests need: `keep(module, config)` for the module that added
        the config, and its name without the prefix (conftest.py's `keep_selected`)."""
        for (suite, prefix), module in self.owners.items():
            configs = self.checks[suite]
            for k in [k for k in configs if k.startswith(f"{prefix}/")]:
                if not keep(module, k[len(prefix) + 1 :]):
                    del configs[k]

    def _run(self, out: Path) -> list:
        """The job, started again without each config that killed a rank or hung it (`in_flight`):
        those configs' results are Crashed on every rank, with the job's stderr."""
        checks = {suite: dict(configs) for suite, configs in self.checks.items()}
        crashed: dict[str, dict[str, str]] = {}
        if not any(checks.values()):  # every config left out (`select`): nothing to launch
            return [{suite: {} for suite in checks} for _ in range(self.nproc)]
        for attempt in range(self.RELAUNCHES + 1):
            for path in progress_files(out):
                path.unlink()
            try:
                ranks = torchrun(CHECKS, self.nproc, out, SHARED, *checks, checks=checks, alone=attempt > 0,
                                 timeout=self.TIMEOUT_S)  # fmt: skip
                break
            except JobFailed as e:
                # every rank runs the configs in one order: the first one running is where the job broke
                # (a rank torchrun stopped after that may have begun the next one)
                order = [(suite, name) for suite, configs in checks.items() for name in configs]
                running = sorted(order.index(key) for key in in_flight(out) if key in order)
                if not running or attempt == self.RELAUNCHES:
                    raise
                suite, name = order[running[0]]
                del checks[suite][name]
                crashed.setdefault(suite, {})[name] = f"it ended the {self.nproc}-rank job: {e}"
        for rank in ranks:
            for suite, names in crashed.items():
                rank.setdefault(suite, {}).update({name: Crashed(why) for name, why in names.items()})
        return ranks

    def part(self, folder: Path, suite: str, prefix: str = "") -> list:
        """Every rank's results of `suite` under `prefix` (the prefix dropped), rank 0's first."""
        with self.lock:
            if self.ranks is None and self.error is None:
                try:
                    out = folder / f"shared_w{self.nproc}.json"
                    self.ranks = self._run(out)
                except Exception as e:  # every module's fixture fails with it; none launches again
                    self.error = e
            if self.error is not None:
                raise self.error
        if not prefix:
            return [Ran(rank[suite]) for rank in self.ranks]
        mine = f"{prefix}/"
        return [
            Ran({k[len(mine) :]: v for k, v in rank[suite].items() if k.startswith(mine)})
            for rank in self.ranks
        ]


CHECKS = Path(__file__)
SHARED = "--shared"  # first suite argument of a Shared job: its configs and results are keyed by suite
WORLD2, WORLD4 = Shared(2), Shared(4)  # the world-2 and world-4 jobs of test_parallel and others
WORLD8 = Shared(8)  # test_parallel's T 8 validations


# suite -> config -> [this rank's CPU s, wall s] (time.process_time: every thread of the rank, gloo's
# too): written beside the results as OUT.cpu.json (`write_cpu`), where the job's CPU goes per config
CPU: dict[str, dict[str, list[float]]] = {}


def timed(suite: str, checks: dict) -> Iterator[tuple[str, object]]:
    """checks.items(), with each config's CPU and wall seconds on this rank recorded in CPU[suite]."""
    mine = CPU.setdefault(suite, {})
    for name, value in checks.items():
        cpu, wall = time.process_time(), time.perf_counter()
        yield name, value
        mine[name] = [round(time.process_time() - cpu, 3), round(time.perf_counter() - wall, 3)]


PROGRESS: list[Path] = []  # this rank's progress file (`isolated`), set by main()


def isolated(suite: str, checks: dict, check: Callable[[str, object], object]) -> dict:
    """{config: check(config, its value)} over `checks` (timed), each config isolated: one that
    raises leaves {CRASHED: why} on this rank and the next one runs; each start and end is written
    to this rank's progress file first, so that what killed a rank or hung the job is known
    (`in_flight`, `Shared._run`)."""
    results = {}
    for name, value in timed(suite, checks):
        _progress("start", suite, name)
        if name == os.environ.get("TPBENCH_TEST_KILL_RANK1_AT") and dist.get_rank() == 1:
            os._exit(3)  # planted: rank 1 dies in this config (tests/test_crash_isolation.py)
        try:
            results[name] = check(name, value)
        except Exception:
            results[name] = {CRASHED: f"rank {dist.get_rank()}: {traceback.format_exc(limit=-12)}"}
        _progress("end", suite, name)
    return results


def _progress(what: str, suite: str, name: str) -> None:
    for path in PROGRESS:
        with path.open("a") as f:
            f.write(f"{what} {suite} {name}\n")


def write_cpu(out_path: str, started_cpu: float) -> None:
    """Every rank's CPU record (CPU, its imports before the suites, its total): rank 0 writes them as
    OUT.cpu.json, a list in rank order. `scripts/job-cpu.py FOLDER` sums them per config."""
    mine = {"start_cpu_s": round(started_cpu, 3), "total_cpu_s": round(time.process_time(), 3), "suites": CPU}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(out_path).with_suffix(".cpu.json").write_text(json.dumps(ranks))


def write_every_rank(out_path: str, results: object) -> None:
    """Every rank's `results`, gathered: rank 0 writes them as a JSON list, in rank order."""
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(ranks))
    dist.barrier()


class Ran(dict):
    """A job's results by config: a config it did not run says why it may be missing."""

    def __missing__(self, key: str):
        why = "no selected test names it (pytest -k keeps the configs the tests name) or no module added it"
        raise KeyError(f"{key!r} did not run in this job: {why}")


def per_config(ranks: list[dict]) -> dict[str, list]:
    """Every rank's results of a suite keyed by config -> per config, the list of its ranks' results."""
    return Ran({name: [rank[name] for rank in ranks] for name in ranks[0]})


# what each rank measures of itself (its own CPU time): never the same on two ranks, so not compared
PER_RANK = frozenset({"validate_cpu_s"})


def peaks_told(ranks: list[dict]) -> str:
    """Each rank's memory-suite peak, where it fell and its late frees, and the live storages at the
    peak ("<bytes> <category>": count) in which a rank differs from rank 0: a failing comparison of
    peaks says which storage the odd rank held."""
    lines = []
    for i, r in enumerate(ranks):
        mine, first = r.get("storages", {}), ranks[0].get("storages", {})
        diff = sorted((k, mine.get(k, 0) - first.get(k, 0)) for k in {*mine, *first})
        odd = {k: n for k, n in diff if n}
        lines.append(f"rank {i}: {r['peak']:.0f} B at {r['peak_at']}, late frees {r['late_frees']:.0f}, "
                     f"storages against rank 0's {odd}")  # fmt: skip
    return "\n".join(lines)


def agreed(x):
    """x without the figures that are each rank's own (PER_RANK), at any depth."""
    if isinstance(x, dict):
        return {k: agreed(v) for k, v in x.items() if k not in PER_RANK}
    return x


def same_on_every_rank(ranks: list[dict]) -> dict:
    """Rank 0's results, once every other rank reported the same (figures reduced over the job; a
    rank's own CPU time, PER_RANK, aside)."""
    for r, other in enumerate(ranks[1:], 1):
        differs = sorted(k for k in ranks[0] if agreed(other.get(k)) != agreed(ranks[0][k]))
        assert not differs, f"rank {r} reported otherwise than rank 0 for: {differs[:20]}"
    return ranks[0]


def rank0_of_each(ranks: list[dict]) -> dict:
    """A validate suite's results per config: rank 0's, once every rank reported the same metrics and
    collectives (`same_on_every_rank`)."""
    out = {}
    for name, per_rank in per_config(ranks).items():
        same_on_every_rank([{"metrics": r["metrics"], "comm": r["comm"]} for r in per_rank])
        out[name] = per_rank[0]
    return out


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.structured(RunConfig)  # 0.1 s each time: made once, merged into per config


# ZeRO-1 in several buckets at the tests' tiny shapes (H 64: 3 to 4 buckets and the late one; the
# default, Megatron's 40M elements, makes one)
BUCKETS = "parallel.zero_bucket_elements=20000"


def run_config(overrides: list[str]) -> RunConfig:
    merged = OmegaConf.merge(_schema(), OmegaConf.from_dotlist(overrides))
    cfg = OmegaConf.to_object(merged)
    cfg.launch.device = "cpu"
    resolve_switches(cfg)  # train.compile and fused_optimizer: auto is off on a CPU, as compose makes it
    return cfg


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def check_collectives(ctx: ParallelContext) -> dict[str, float]:
    """Each conjugate pair forward and backward against its definition."""
    g, t, r = ctx.tp_group, ctx.tp, ctx.tp_rank
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(4 * t, 3, generator=gen)  # the same on every rank
    mine = full.chunk(t)[r]
    per_rank = [torch.randn(4 * t, 3, generator=gen) for _ in range(t)]  # rank i holds per_rank[i]
    upstream = [torch.randn(4 * t, 3, generator=gen) for _ in range(t)]
    total, up_total = sum(per_rank), sum(upstream)
    out = {}

    def fwd_bwd(fn, x, grad):
        x = x.clone().requires_grad_()
        y = fn(x, g)
        y.backward(grad)
        return y, x.grad

    y, dx = fwd_bwd(regions.copy_to_tp_region, per_rank[r], upstream[r])
    out["f_fwd"], out["f_bwd"] = err(y, per_rank[r]), err(dx, up_total)
    y, dx = fwd_bwd(regions.reduce_from_tp_region, per_rank[r], upstream[r])
    out["fbar_fwd"], out["fbar_bwd"] = err(y, total), err(dx, upstream[r])
    y, dx = fwd_bwd(regions.gather_from_sp_region, mine, upstream[r])
    out["g_fwd"], out["g_bwd"] = err(y, full), err(dx, up_total.chunk(t)[r])
    y, dx = fwd_bwd(regions.reduce_scatter_to_sp_region, per_rank[r], upstream[r].chunk(t)[r])
    gathered_up = torch.cat([u.chunk(t)[i] for i, u in enumerate(upstream)])
    out["gbar_fwd"], out["gbar_bwd"] = err(y, total.chunk(t)[r]), err(dx, gathered_up)
    y, dx = fwd_bwd(regions.scatter_to_sp_region, full, upstream[r].chunk(t)[r])
    out["scatter_fwd"], out["scatter_bwd"] = err(y, mine), err(dx, gathered_up)
    y, dx = fwd_bwd(regions.gather_from_sp_region_replicated, mine, up_total)
    out["gather_rep_fwd"], out["gather_rep_bwd"] = err(y, full), err(dx, up_total.chunk(t)[r])
    return out


def check_layers(ctx: ParallelContext) -> dict[str, float]:
    """f -> column -> row (f-bar) against two nn.Linear with biases, and the SP variant (g, g-bar);
    the vocab-parallel embedding and cross entropy against nn.Embedding and F.cross_entropy."""
    g, t, r = ctx.tp_group, ctx.tp, ctx.tp_rank
    torch.manual_seed(1)
    lin1, lin2 = nn.Linear(16, 8 * t), nn.Linear(8 * t, 16)
    x = torch.randn(4 * t, 2, 16, requires_grad=True)  # [S, B, H]
    dense_y = lin2(F.silu(lin1(x)))
    dense_y.square().sum().backward()
    out = {}
    for sp in (False, True):
        col = ColumnParallelLinear(
            lin1.weight.detach().chunk(t)[r].clone(), lin1.bias.detach().chunk(t)[r].clone()
        )
        row = RowParallelLinear(
            lin2.weight.detach().chunk(t, dim=1)[r].clone(),
            g,
            "reduce_scatter" if sp else "all_reduce",
            lin2.bias.detach().clone(),
        )
        xin = (x.detach().chunk(t)[r] if sp else x.detach()).clone().requires_grad_()
        enter = regions.gather_from_sp_region if sp else regions.copy_to_tp_region
        y = row(F.silu(col(enter(xin, g))))  # [S/T or S, B, 16]
        y.square().sum().backward()  # under SP, the ranks' losses add up to the dense loss
        if sp:  # the row bias is added on each sequence shard: its gradient is summed over ranks
            collectives.all_reduce(row.bias.grad, g, "test")
        tag = "sp" if sp else "tp"
        out[f"{tag}_fwd"] = err(y, dense_y.chunk(t)[r] if sp else dense_y)
        out[f"{tag}_input_grad"] = err(xin.grad, x.grad.chunk(t)[r] if sp else x.grad)
        out[f"{tag}_col_w"] = err(col.weight.grad, lin1.weight.grad.chunk(t)[r])
        out[f"{tag}_col_b"] = err(col.bias.grad, lin1.bias.grad.chunk(t)[r])
        out[f"{tag}_row_w"] = err(row.weight.grad, lin2.weight.grad.chunk(t, dim=1)[r])
        out[f"{tag}_row_b"] = err(row.bias.grad, lin2.bias.grad)

    # vocab-parallel embedding (V = 10 * t rows) and cross entropy with a padded vocab and ignored targets
    emb = nn.Embedding(10 * t, 6)
    ids = torch.randint(10 * t, (8, 2), generator=torch.Generator().manual_seed(2))
    vemb = VocabParallelEmbedding(emb.weight.detach().chunk(t)[r].clone(), r, g)
    e_ref = emb(ids)
    e_ref.sum().backward()
    e = vemb(ids)
    e.sum().backward()
    out["emb_fwd"] = err(e, e_ref)
    out["emb_bwd"] = err(vemb.weight.grad, emb.weight.grad.chunk(t)[r])

    real_v, padded_v = 10 * t - 1, 10 * t  # the last column is padding
    logits = torch.randn(8, 2, padded_v, generator=torch.Generator().manual_seed(3))
    targets = torch.randint(real_v, (8, 2), generator=torch.Generator().manual_seed(4))
    targets[::3, 0] = IGNORE_INDEX
    dense_logits = logits[..., :real_v].clone().requires_grad_()
    ref = F.cross_entropy(dense_logits.reshape(-1, real_v), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    ref.backward()
    local = logits.chunk(t, dim=-1)[r].clone().requires_grad_()
    counter = instrumentation.CommCounter()
    with instrumentation.counting(counter):
        loss = VocabParallelCrossEntropy(real_v, r, g)(local, targets)
        loss.backward()
    out["ce_fwd"] = abs(loss.item() - ref.item())
    dense_grad = torch.cat([dense_logits.grad, torch.zeros(8, 2, 1)], dim=-1).chunk(t, dim=-1)[r]
    out["ce_bwd"] = err(local.grad, dense_grad)
    out["ce_all_reduces"] = sum(row.count for row in counter.rows() if row.op == "all_reduce")
    out["ce_other_collectives"] = sum(row.count for row in counter.rows() if row.op != "all_reduce")
    return out


def check_checkpoints(ctx: ParallelContext) -> dict[str, float]:
    """Dense state dict -> shards of this rank -> gathered dense: bit-exact, real vocab, dense names."""
    out = {}
    cases = {
        "tp": (MiniMindConfig(64, 2, 8, 4, 256), ParallelConfig(tp=ctx.tp)),
        "kv_replicated": (MiniMindConfig(64, 2, 8, 1, 256), ParallelConfig(tp=ctx.tp)),
        "vp_padded_untied": (
            MiniMindConfig(64, 2, 8, 4, 255, tie_word_embeddings=False),
            ParallelConfig(tp=ctx.tp, vp=True, sp=True, vocab_pad_multiple=4),
        ),
        # Qwen2.5: q, k, v biases, one KV head replicated on every rank (its bias with it), head_dim 16
        "qwen25_kv_replicated": (
            MiniMindConfig(64, 2, 8, 1, 256, qk_norm=False, attention_bias=True, head_dim=16),
            ParallelConfig(tp=ctx.tp),
        ),
        "qwen3_sp_vp": (
            MiniMindConfig(64, 2, 8, 4, 256, head_dim=16),
            ParallelConfig(tp=ctx.tp, sp=True, vp=True),
        ),
    }
    for name, (mcfg, pcfg) in cases.items():
        dense = build_model(mcfg, seed=3).state_dict()
        pm = parallelize(build_model(mcfg, seed=99), ctx, pcfg)  # different weights, then load
        pm.module.load_state_dict(
            shard_state_dict(dense, plan_layouts(mcfg, ctx.tp, pcfg), ctx.tp, ctx.tp_rank)
        )
        back = pm.state_dict()
        out[f"{name}_same_names"] = float(set(back) == set(dense))
        out[f"{name}_max_abs"] = max(err(back[n], dense[n]) for n in dense)
        out[f"{name}_shapes_equal"] = float(all(back[n].shape == dense[n].shape for n in dense))
    return out


def check_step_ops(ctx: ParallelContext) -> dict[str, float]:
    """The ops of a training step's forward and backward (TP+SP+VP, a padded vocab), after a first
    step: none copies a value to the host (a GPU sync), none builds the RoPE tables again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    host = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default}

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    mcfg = MiniMindConfig(64, 2, 8, 4, 255)  # V 255: the last rank masks a padded column
    pm = parallelize(build_model(mcfg), ctx, ParallelConfig(tp=ctx.tp, sp=True, vp=True))
    ids = torch.randint(255, (2, 32), generator=torch.Generator().manual_seed(5))
    pm(ids, ids)[1].backward()
    with Ops() as ops:
        pm(ids, ids)[1].backward()
    return {
        "host_syncs": sum(f in host for f in ops.seen),
        "rope_builds": sum(f is aten.cos.default for f in ops.seen),
    }


def check_settling(ctx: ParallelContext) -> dict[str, int]:
    """How often a collective's tensors are still held by gloo's worker thread when the call returns,
    in 300 all-gathers and all-reduces of fresh tensors, without and with instrumentation.settling; and
    how often the clone a reduce-scatter all-reduces, which its wait copies this rank's chunk out of, is still
    alive then, in 300 reduce-scatters; and how often torch's functional all-gather, waited on,
    still holds its input, in 300, without and with a memory run's tracker."""

    def held(overlapped: bool = False) -> int:
        n = 0
        for _ in range(300):
            x = torch.randn(8, 64)
            if overlapped:  # launched, something done meanwhile, then waited on
                gathering = collectives.all_gather_async(x, ctx.tp_group, "test")
                y = collectives.all_reduce_async(torch.randn(8), ctx.tp_group, "test").wait()
                out = gathering.wait()
            else:
                out = collectives.all_gather(x, ctx.tp_group, "test")
                y = collectives.all_reduce(torch.randn(8), ctx.tp_group, "test")
            n += max(out._use_count(), x._use_count(), y._use_count()) > 1
        return n

    def clones_alive() -> int:  # gloo's reduce-scatter all-reduces a clone of its input
        n = 0
        for _ in range(300):
            x = torch.randn(8 * ctx.tp, 64)
            with _Made() as made:
                out = collectives.reduce_scatter(x, ctx.tp_group, "test")
            mine = {x.untyped_storage()._cdata, out.untyped_storage()._cdata}
            n += any((st := ref()) is not None and st._cdata not in mine for ref in made.storages)
        return n

    def functional_held() -> int:  # torch's functional all-gather (the dtensor engine's), issued
        n = 0
        for _ in range(300):
            x = torch.randn(8, 64)
            out = torch.ops._c10d_functional.all_gather_into_tensor(x, ctx.tp, ctx.tp_group.group_name)
            torch.ops._c10d_functional.wait_tensor(out)
            n += x._use_count() > 1
        return n

    def storage_held() -> int:  # gloo's worker holding the gathered storage through its own views
        n, fresh = 0, storage_refs(torch.randn(1))
        for _ in range(5000):
            x = torch.randn(8, 64)
            out = collectives.all_gather(x, ctx.tp_group, "test")
            del x
            n += out._use_count() == 1 and storage_refs(out) > fresh
        return n

    unsettled, clones, functional = held(), clones_alive(), functional_held()
    with memory.PeakTracker():  # a memory run's tracker waits for each as it is issued
        functional_settled = functional_held()
    late_peak, late_frees, _ = released_late(ctx, settled=False)
    with instrumentation.settling():
        settled_peak, settled_late_frees, handed = released_late(ctx, settled=True)
        unstaged_peak, unstaged_late_frees, unstaged_handed = released_late(ctx, settled=True, stage=False)
        return {
            "forced_late_peak": late_peak,
            "forced_late_frees": late_frees,
            "forced_settled_peak": settled_peak,
            "forced_settled_late_frees": settled_late_frees,
            "forced_unstaged_peak": unstaged_peak,
            "forced_unstaged_late_frees": unstaged_late_frees,
            "forced_settled_tracked_handed": handed,  # the worker handed a tensor the tracker counts
            "forced_unstaged_tracked_handed": unstaged_handed,
            "unsettled": unsettled,
            "settled": held(),
            "settled_async": held(overlapped=True),
            "settled_storage": storage_held(),
            "unsettled_clones": clones,
            "settled_clones": clones_alive(),
            "unsettled_functional": functional,
            "settled_functional": functional_settled,
        }


FORCED_NUMEL = 1 << 14  # released_late's all-reduced tensor: 64 KiB in fp32


def released_late(ctx: ParallelContext, settled: bool, stage: bool = True) -> tuple[int, int, int]:
    """gloo's race, forced: a thread standing in for its worker takes a view of the tensor an
    all-reduce runs on as the collective is issued and lets go of it 0.3 s after, long after the
    collective is done. The caller drops its input right after the collective and makes a tensor of the
    same size. Under a memory run's tracker: its peak and its storages freed by another thread outside a
    wait. Unsettled, the stand-in frees the input after the new one exists (two tensors). Settled, the
    worker runs on a staging copy no tracker sees and the caller frees its input itself (one); with
    stage=False (DDP's buckets), the wait lasts until the stand-in lets go (one). Also returned:
    whether the tensor handed to the worker was one the tracker counts (1) or not (0)."""
    tracker, stand_in, handed = memory.PeakTracker(), [], []
    with tracker:
        x = [torch.ones(FORCED_NUMEL)]  # the caller's only reference

        def issue(a: torch.Tensor, _) -> dist.Work:
            handed.append(int(tracker._WINFO.get(a.untyped_storage()) is not None))
            view = [a.view(-1)]  # the worker's reference, through the storage
            stand_in.append(threading.Thread(target=lambda: (time.sleep(0.3), view.clear())))
            stand_in[0].start()
            return dist.all_reduce(a, group=ctx.tp_group, async_op=True)

        collectives._launch(
            "all_reduce", "test", x[0], 4 * FORCED_NUMEL, ctx.tp_group, issue, None, True, stage
        ).wait()
        assert settled == instrumentation.is_settling()
        x.clear()
        y = torch.ones(FORCED_NUMEL)
        del y
        stand_in[0].join()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], tracker.late_frees, handed[0]


def storage_refs(t: torch.Tensor) -> int:
    """The references to t's storage (the tensor's own, its views', a backend's)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Made(TorchDispatchMode):
    """Weak references to the storages of every tensor an op returns while on. The same observer as
    instrumentation.MadeStorages, kept apart on purpose: were that one blind (recording nothing),
    settling would wait for nothing and a check that saw through it would see no clone either, and
    pass."""

    def __enter__(self) -> _Made:
        self.storages = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.storages.append(weakref.ref(t.untyped_storage()))
        return out


def check_async_timing(ctx: ParallelContext) -> dict[str, float]:
    """An async all-reduce waited on only once it is seen complete and 0.1 s more passed, and the same
    one blocking: counted alike; the async one's total runs from its launch to its completion, not to
    its wait, and its exposed time is its wait, the blocking one's all of its time. An async collective
    whose Work has no future is timed from its wait: all exposed, none hidden. Beside the counter's
    figures, the check's own clock around each (`*_window_s`: launch to seen complete; `*_wait_s`:
    the call of wait()), which bound them whatever the load."""
    counter = instrumentation.CommCounter(timed=True)
    works: list[dist.Work] = []

    def issue(fn):
        def launch(*_) -> dist.Work:
            works.append(fn())
            return works[-1]

        return launch

    def waited(pending: collectives.Pending) -> float:
        start = time.perf_counter()
        pending.wait()
        return time.perf_counter() - start

    x = torch.randn(1 << 16)
    with instrumentation.counting(counter):
        begin = time.perf_counter()
        all_reduce = issue(lambda: dist.all_reduce(x, group=ctx.tp_group, async_op=True))
        pending = collectives._launch(
            "all_reduce", "async", x, 4 << 16, ctx.tp_group, all_reduce, None, False
        )
        while not works[0].is_completed():  # done before the wait, whatever the load
            time.sleep(1e-3)
        window = time.perf_counter() - begin
        time.sleep(0.1)  # other work: the wait comes 0.1 s after the completion at least
        wait = waited(pending)
        collectives.all_reduce(torch.randn(1 << 16), ctx.tp_group, "blocking")
        # gloo's reduce_scatter_tensor (an all-reduce inside) has no future to say when it finished
        shard = collectives.reduce_scatter_async(torch.randn(1 << 16), ctx.tp_group, "no_future")
        time.sleep(0.1)
        no_future_wait = waited(shard)
    out = {
        f"{r.purpose}_{field}": getattr(r, field)
        for r in counter.rows()
        for field in ("count", "bytes", "time_s", "exposed_s")
    }
    return out | {"async_window_s": window, "async_wait_s": wait, "no_future_wait_s": no_future_wait}


DDP_HOLD_S = 0.05  # rank 1's last bucket, held back this long after rank 0 began to wait for it


def check_ddp_timing(ctx: ParallelContext) -> list[dict[str, float]]:
    """DDP's bucket all-reduces in a timed step, per rank: counted one per bucket, and timed as our
    async collectives, waited on where DDP waits, at the end of backward. Rank 1 holds back its last
    bucket (the embedding's gradient is the last one ready) until rank 0 has begun its timed wait for
    that bucket (told through the store), then DDP_HOLD_S more: rank 0's wait cannot end before rank 1
    let the bucket go, so its exposed time is at least `released` minus `last_wait_began`, both on the
    host's monotonic clock, one for every process. Were the wait DDP's own or after backward, rank 0
    would not wait in the timed wait while rank 1 holds: rank 1 gives up after 20 s (`signalled` 0)."""
    trainer = Trainer(run_config([*TINY, "parallel.engine=ddp", "parallel.tp=1", "parallel.dp=2",
                                  "parallel.ddp_bucket_mb=0.05"]))  # fmt: skip
    for _ in range(2):  # DDP rebuilds its buckets after the first backward: the second has them all
        trainer.step()
    buckets, store = len(trainer.ddp_state.buckets), dist.distributed_c10d._get_default_store()
    mine: dict[str, float] = {}
    began: list[float] = []
    waiting = timing._WallClockSpan.waiting

    def told(span) -> None:  # rank 0: each bucket's timed wait begins
        waiting(span)
        began.append(span.waiting_at)
        if len(began) == buckets:
            store.set("ddp_timing_last_wait", "1")

    def hold(grad: torch.Tensor) -> None:  # rank 1: the embedding's gradient is ready
        try:
            store.wait(["ddp_timing_last_wait"], timedelta(seconds=20))
            mine["signalled"] = 1
        except dist.DistStoreError:
            mine["signalled"] = 0
        time.sleep(DDP_HOLD_S)
        mine["released"] = time.perf_counter()

    if dist.get_rank() == 1:
        trainer.module.model.embed_tokens.weight.register_hook(hold)
    counter = instrumentation.CommCounter(timed=True)
    timing._WallClockSpan.waiting = told
    try:
        with instrumentation.counting(counter):
            trainer.step()
    finally:
        timing._WallClockSpan.waiting = waiting
    (row,) = counter.rows()
    mine |= {"op": row.op, "purpose": row.purpose, "count": row.count, "time_s": row.time_s,
             "exposed_s": row.exposed_s, "buckets": buckets}  # fmt: skip
    mine["last_wait_began"] = began[-1] if began else -1.0  # -1: rank 0 never waited in a timed wait
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


# parallel.overlap at world 2: TP, SP gathering per region and per linear (each re-gathered), DP buckets
OVERLAP_ORDER = {
    "tp": ["parallel.tp=2"],
    "tp_sp": ["parallel.tp=2", "parallel.sp=true"],
    "tp_sp_linear": ["parallel.tp=2", "parallel.sp=true", "parallel.sp_gather=linear"],
    "dp2": ["parallel.tp=1", "parallel.dp=2", "parallel.ddp_bucket_mb=0.05"],
    "tp_sp_compile": ["parallel.tp=2", "parallel.sp=true", "train.compile=true"],
}


def check_overlap_order(ctx: ParallelContext) -> dict[str, dict[str, list[int]]]:
    """Per config of OVERLAP_ORDER with parallel.overlap=true, each async collective of a training step
    (after a first one), by purpose, in launch order: how many matmuls ran between its launch and its
    wait, the compute it was hidden behind. A collective launched when first needed counts 0."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    log: list = []

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in matmuls:
                log.append("mm")
            return func(*args, **(kwargs or {}))

    launch, backward = collectives._launch, torch.Tensor.backward

    def counted_backward(*args, **kwargs):
        with Matmuls():
            return backward(*args, **kwargs)

    def logged(op, purpose, x, full_bytes, group, fn, out, blocking, stage=True):
        pending = launch(op, purpose, x, full_bytes, group, fn, out, blocking, stage)
        if not blocking:
            start, finish = len(log), pending._finish
            log.append(("launch", purpose))

            def wait() -> None:
                log.append(("wait", start))
                finish()

            pending._finish = wait
        return pending

    results = {}
    for name, overrides in OVERLAP_ORDER.items():
        trainer = Trainer(run_config([*TINY, *overrides, "parallel.overlap=true"]))
        trainer.step()
        log.clear()
        collectives._launch = logged
        # counted in backward only, where every async collective is launched (a compiled forward would
        # not run under a dispatch mode; a DP bucket is waited in finish_grads, with no matmul)
        torch.Tensor.backward = counted_backward
        try:
            trainer.step()
        finally:
            collectives._launch, torch.Tensor.backward = launch, backward
        hidden: dict[str, list[int]] = {}
        for i, event in enumerate(log):
            if isinstance(event, tuple) and event[0] == "launch":
                end = log.index(("wait", i))
                hidden.setdefault(event[1], []).append(log[i:end].count("mm"))
        results[name] = hidden
    return results


def check_regions(ctx: ParallelContext) -> dict:
    """print(model) of tp+sp+vp and tp+sp at L 1 (where each region's collective sits), and the
    wrappers in either order: recompute applied before the plan's entries (and overlap's deferred
    weight gradients) or after them gives the same classes, collectives, loss and gradients, bit
    for bit."""
    cfg = MiniMindConfig(hidden_size=H, num_hidden_layers=1, vocab_size=256, flash_attn=False)
    out: dict = {}
    for name, sp, vp in (("tp_sp_vp", True, True), ("tp_sp", True, False)):
        out[name] = str(parallelize(build_model(cfg), ctx, ParallelConfig(tp=ctx.tp, sp=sp, vp=vp)).module)
    ids = torch.randint(256, (B, S), generator=torch.Generator().manual_seed(3))
    for mode in ("selective", "full"):
        runs = []
        for first in ("recompute", "plan"):
            # under full the plan drops the blocks' re-gather (parallelize): off here for both orders
            pcfg = ParallelConfig(tp=ctx.tp, sp=True, vp=True, overlap=True, sp_regather=mode != "full")
            model = build_model(cfg)
            pm = parallelize(model, ctx, pcfg, recompute=mode if first == "recompute" else "none")
            if first == "plan":
                apply_recompute(model, mode)
            counter = instrumentation.CommCounter()
            with instrumentation.counting(counter):
                _, loss = pm(ids, ids)
                loss.backward()
            classes = [type(m).__mro__[:-1] for m in model.modules()]
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            runs.append((classes, {k: v[:2] for k, v in counter.stats.items()}, loss.detach(), grads))
        (c1, s1, l1, g1), (c2, s2, l2, g2) = runs
        out[f"{mode}_same_classes"] = [[c.__name__ for c in mro] for mro in c1] == [
            [c.__name__ for c in mro] for mro in c2
        ] and c1 == c2
        out[f"{mode}_same_collectives"] = s1 == s2 and bool(s1)
        out[f"{mode}_same_loss"] = bool(torch.equal(l1, l2))
        out[f"{mode}_same_grads"] = g1.keys() == g2.keys() and all(torch.equal(g1[n], g2[n]) for n in g1)
    return out


UNIT_CHECKS = {
    "collectives": check_collectives,
    "layers": check_layers,
    "checkpoints": check_checkpoints,
    "step_ops": check_step_ops,
    "settling": check_settling,
    "async_timing": check_async_timing,
    "ddp_timing": check_ddp_timing,
    "overlap_order": check_overlap_order,
    "regions": check_regions,
}
UNITS = tuple(UNIT_CHECKS)


def suite_units(checks: dict) -> dict:
    ctx = ParallelContext.from_world(dist.get_world_size(), 1, torch.device("cpu"))
    wanted = {name: UNIT_CHECKS[name.rsplit("/", 1)[-1]] for name in checks}  # PREFIX/UNIT: those asked
    return isolated("units", wanted, lambda name, check: check(ctx))


CURVES = (*validate.DRIFT, "step_grad_max_rel_l2", "step_grad_of_bound")


def suite_validate(checks: dict) -> dict:
    """Per config: validate.run's figures, its curves (the logits drift, the gradients' per step), how
    many batches it drew, and per parameter its gradient's relative error and its worst row's beside
    the dense model's own, and their steps (tests/test_validation.py)."""
    draws = []
    next_global = validate.Batches.next_global

    def counted(self):
        draws.append(1)
        return next_global(self)

    validate.Batches.next_global = counted
    scale_grad, written = planted.scale_grad, {}

    def scaled(cfg, pm, dense, step):  # once a model: a planted scale's write lands where the step reads
        if id(pm) not in written:  # every gradient x 2, read back, then restored
            before = {n: g.detach().clone() for n, g in pm.full_gradients().items()}
            pm.write_gradients({n: 2 * g for n, g in before.items()})
            after = pm.full_gradients()
            errors = [(after[n].double() - 2 * g.double()).abs().max().item() for n, g in before.items()]
            written[id(pm)] = max(errors)
            pm.write_gradients(before)
        scale_grad(cfg, pm, dense, step)

    planted.scale_grad = scaled

    def check(names: list[str], cfgs: list[RunConfig]) -> dict:
        draws.clear()
        written.clear()
        results = validate.run_beside(cfgs)
        return {name: figures(r, len(draws), list(written.values())[i] if written else None)
                for i, (name, r) in enumerate(zip(names, results, strict=True))}  # fmt: skip

    def figures(r, drawn: int, write_error: float | None) -> dict:
        curves = {n: [[m.step, m.value] for m in r.measurements if m.name == n] for n in CURVES}
        return {
            "metrics": {m.name: m.value for m in r.measurements if m.step is None},
            "drift": curves["adamw_logits_max_abs"],
            "curves": curves,
            "draws": drawn,  # by the dense side its group shares: as many as a run alone draws
            "comm": [[c.op, c.purpose, c.count, c.bytes] for c in r.comm],
            "semantics": sorted({p.semantics for p in r.params}),
            "params": {p.name: [p.grad_rel_l2, p.grad_ref_rel_l2] for p in r.params},  # rank 0's rows
            "rows": {p.name: [p.grad_row_rel_l2, p.grad_row_ref_rel_l2] for p in r.params},
            "steps": {p.name: [p.grad_step, p.grad_row_step] for p in r.params},
            "failed": r.failed,
            "write_gradients_error": write_error,
            # this rank's: its model's own work and its share of the dense side (validate_cpu_s)
            "cpu_s": round(next(m.value for m in r.measurements if m.name == "validate_cpu_s"), 2),
        }

    return isolated_beside("validate", checks, check)


SHARE_DENSE = 8  # the most configs of a job's validate suite validated beside one dense side
ALONE = "TPBENCH_TEST_ALONE"  # set: each validate config alone (a job started again after a crash)


def isolated_beside(suite: str, checks: dict, check: Callable[[list[str], list[RunConfig]], dict]) -> dict:
    """`isolated` for validate configs, in groups validated beside one dense model and its reference
    (validate.run_beside: each model's figures are those of a run of its own, to the bit,
    tests/test_warm.py): the configs that share a dense side (dense_side.dense_key) run one after
    another, up to SHARE_DENSE of them beside one. A group is one unit: every config of it is in
    flight while it runs (`in_flight`), and one that raises leaves {CRASHED: why} on each of its
    configs; a job started again after a crash (`Shared._run`) runs each config alone, so that the
    one that killed it is found. CPU[suite] gets each config's CPU (validate_cpu_s) and its share
    of the wall."""
    share = 1 if os.environ.get(ALONE) else SHARE_DENSE  # 1: no dense key, every config alone
    cfgs = {name: run_config([*o, f"launch.share_dense={share}"]) for name, o in checks.items()}
    keys = list(dict.fromkeys(dense_side.dense_key(c) for c in cfgs.values()))  # first seen, first run
    order = sorted(cfgs, key=lambda name: keys.index(dense_side.dense_key(cfgs[name])))
    results, mine = {}, CPU.setdefault(suite, {})
    for first, count in dense_side.groups_beside([cfgs[name] for name in order]):
        names = order[first : first + count]
        for name in names:
            _progress("start", suite, name)
        if os.environ.get("TPBENCH_TEST_KILL_RANK1_AT") in names and dist.get_rank() == 1:
            os._exit(3)  # planted: rank 1 dies in this group (tests/test_crash_isolation.py)
        wall = time.perf_counter()
        try:
            results.update(check(names, [cfgs[name] for name in names]))
        except Exception:
            why = {CRASHED: f"rank {dist.get_rank()}: {traceback.format_exc(limit=-12)}"}
            results.update({name: why for name in names})
        for name in names:
            cpu = results[name].get("cpu_s", 0.0)
            mine[name] = [cpu, round((time.perf_counter() - wall) / count, 3)]
            _progress("end", suite, name)
    return {name: results[name] for name in checks}  # in the job's order


def suite_memory(checks: dict) -> dict:
    """The memory experiment per config: this rank's measured peak and counted collectives, measured
    once. Every rank of a config must measure the model's peak on the first try (tests/test_theory.py):
    the late frees that once made one random rank a few KB higher (gloo's worker letting go of a
    collective's tensors, of reduce-scatter's clone, of a gathered storage through its own views, the
    cycle collector) are settled in tpbench (instrumentation.settling, memory.PeakTracker,
    memory._measure's gc), and `late_frees` counts the storages a backend's thread still freed outside a
    collective's wait: none, on every rank."""

    def check(name: str, overrides: list[str]) -> dict:
        r = memory.run(run_config(overrides))
        return {
            "peak": next(m.value for m in r.measurements if m.name == "peak_bytes"),
            "breakdown": {m.name: m.value for m in r.measurements if m.name.startswith("mem_")},
            "comm": sorted([c.op, c.purpose, c.count, c.bytes] for c in r.comm),
            "peak_at": r.peak_at,
            "late_frees": next(m.value for m in r.measurements if m.name == "memory_late_frees"),
            "skipped": next((m.value for m in r.measurements if m.name == "grad_clip_skipped_steps"), None),
            "storages": memory.last_peak_storages,  # the live storages at the peak (TPBENCH_PEAK_STORAGES)
        }

    return isolated("memory", checks, check)


def suite_flops(checks: dict) -> dict:
    """FLOPs of one training step summed over ranks: LocalFlopCounter, and torch's FlopCounterMode."""

    def check(name: str, overrides: list[str]) -> dict:
        trainer = Trainer(run_config(overrides))
        counts = []
        for counter in (LocalFlopCounter(), FlopCounterMode(display=False)):
            with counter:
                trainer.step()
            total = torch.tensor([float(counter.get_total_flops())], dtype=torch.float64)
            dist.all_reduce(total)
            counts.append(total.item())
        return {"local": counts[0], "torch": counts[1]}

    return isolated("flops", checks, check)


def suite_recompute(checks: dict) -> dict:
    """Per config: validation, two training steps with their collectives and FLOPs counted, and the
    largest difference of the losses and parameters against the same mode with train.recompute=none
    (the config named MODE/none, which comes first)."""
    from torch.distributed.tensor import DTensor

    from tpbench.experiments.setup import counting

    reference = {}

    def check(name: str, overrides: list[str]) -> dict:
        cfg = run_config(overrides)
        passed = next(m.value for m in validate.run(cfg).measurements if m.name == "passed")
        trainer = Trainer(cfg)
        loss = trainer.step().item()  # the counted step's loss is compared through the parameters
        counter, flops = instrumentation.CommCounter(), LocalFlopCounter()
        with counting(cfg, counter), flops:  # the engine's: DTensor's functional collectives too
            trainer.step()
        local = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.module.parameters()]
        params = torch.cat([p.detach().float().reshape(-1) for p in local])
        mode, recompute = name.rsplit("/", 1)
        if recompute == "none":
            reference[mode] = (loss, params)
        loss0, params0 = reference[mode]
        diff = torch.tensor([abs(loss - loss0), (params - params0).abs().max().item()])
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        executed = torch.tensor([float(flops.get_total_flops())], dtype=torch.float64)
        dist.all_reduce(executed)
        return {
            "passed": passed,
            "loss_diff": diff[0].item(),
            "param_diff": diff[1].item(),
            "flops": executed.item(),
            "comm": sorted([c.op, c.purpose, c.count, c.bytes] for c in counter.rows()),
        }

    return isolated("recompute", checks, check)


def suite_comm_per_step(checks: dict) -> dict:
    """Per config, one training step's collectives under the DTensor engine and under ours (megatron):
    {engine: {op/purpose: [count, bytes]}}."""
    from tpbench.experiments.setup import Batches, build_parallel, context, counting

    ctx = context(run_config(TINY))

    def check(name: str, overrides: list[str]) -> dict:
        counts = {}
        for engine in ("dtensor", "megatron"):
            cfg = run_config([*overrides, f"parallel.engine={engine}"])
            pm = build_parallel(cfg, ctx)
            ids, labels = Batches(cfg, ctx).next_local()
            counter = instrumentation.CommCounter()
            with counting(cfg, counter):
                pm(ids, labels)[1].backward()
                pm.finish_grads()
            key = "comm_dtensor" if engine == "dtensor" else "comm_ours"
            counts[key] = {f"{r.op}/{r.purpose}": [r.count, r.bytes] for r in counter.rows()}
        return counts

    return isolated("comm_per_step", checks, check)


def suite_optimizer(checks: dict) -> dict:
    """Per config: optimizer_check.updates of the run's sharded optimizer against the dense AdamW, on
    inputs with history (the dense AdamW stepped twice first on seeded gradients, then seeded
    gradients of every scale: every rank draws the same), after one forward and backward of the
    parallel model (what a validation step has done before). A config named *planted_*: that bug in
    the sharded optimizer for the check; *_foreach: AdamW's foreach (tests/test_optimizer_check.py).
    Also the parameters' names and sizes in order (ZeRO-1 flattens them so)."""
    from tpbench.experiments import optimizer_check, setup, training

    def check(name: str, overrides: list[str]) -> dict:
        cfg = run_config(overrides)
        ctx = setup.context(cfg)
        dense = setup.build_dense(cfg)
        if cfg.parallel.engine == "ddp" and cfg.parallel.dp_shard == "none":
            pm = training.DDPModel(cfg, ctx)
        else:
            pm = training.shard_data_parallel(cfg, setup.build_parallel(cfg, ctx, dense), cfg.validate.lr)
        setup.place(dense, ctx.device, setup.param_dtype(cfg))
        opt = training.optimizer(cfg, pm, cfg.validate.lr)
        ids, labels = setup.Batches(cfg, ctx).next_local()
        with setup.precision(cfg, ctx.device):
            loss = pm(ids, labels)[1]
        loss.backward()
        pm.finish_grads()
        dense_opt = torch.optim.AdamW(
            dense.parameters(), lr=cfg.validate.lr, weight_decay=cfg.train.weight_decay
        )
        gen = torch.Generator().manual_seed(5)
        for _ in range(3):  # two steps of history, then the gradients the check steps with
            dense_opt.step()
            for i, p in enumerate(dense.parameters()):
                p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** -(i % 4)).to(p.dtype)
        groups = getattr(opt, "adamw", opt).param_groups  # ZeRO-1's AdamW of its shard, or the run's
        if name.endswith("_foreach"):  # AdamW's foreach, as training.adamw sets it for CUDA tensors
            for group in groups:
                group["foreach"] = True
        if name.endswith("planted_no_decay_on_dp_rank1") and ctx.dp_rank == 1:  # ZeRO-1's 2nd shard
            groups[0]["weight_decay"] = 0.0
        if name.endswith("planted_eps"):  # every rank's AdamW, every parameter
            for group in groups:
                group["eps"] = 1e-3
        rows = optimizer_check.updates(pm, opt, dense, dense_opt)
        return {
            "rows": {r.name: [r.max_abs, r.rel_l2, r.ref_rel_l2, r.moved, r.gathered_max_abs] for r in rows},
            "numels": [[n, p.numel()] for n, p in pm.module.named_parameters()],
            "kind": type(opt).__name__,
            "fused": [g.get("fused") for g in groups],
            "foreach": [g.get("foreach") for g in groups],
        }

    return isolated("optimizer", checks, check)


def suite_zero_accumulation(checks: dict) -> dict:
    """Per config (ZeRO-1 under train.accumulation = K): the fp32 grad buffer after K micro-batches'
    backwards against each micro-batch's gradients taken alone (the buffer emptied between them)
    and summed by hand in fp32, the way the buffer promises to sum them: per parameter, max |diff|."""
    from tpbench.experiments.setup import precision

    def check(name: str, overrides: list[str]) -> dict:
        trainer = Trainer(run_config(overrides))
        cfg, zero, batches = trainer.cfg, trainer.optimizer, trainer.batches
        zero.set_gradient_sync(False)  # the buffer as the backwards leave it: no reduce-scatter launched
        k = cfg.train.accumulation
        ids, labels = batches.next_local()

        def backward(i: int) -> None:
            with precision(cfg, trainer.ctx.device):
                loss = trainer.model(batches.micro(ids, i), batches.micro(labels, i))[1]
            (loss / k).backward()

        by_hand: dict[str, torch.Tensor] = {}
        for i in range(k):
            zero.zero_grad()
            backward(i)
            for n, g in zero.gradients().items():
                by_hand[n] = g.clone() if i == 0 else by_hand[n] + g
        zero.zero_grad()
        for i in range(k):
            backward(i)
        summed = zero.gradients()
        return {
            "dtype": str(zero.grad_buffer.dtype),
            "diff": {n: (summed[n].double() - g.double()).abs().max().item() for n, g in by_hand.items()},
        }

    return isolated("zero_accumulation", checks, check)


SUITES = {
    "units": suite_units,
    "validate": suite_validate,
    "memory": suite_memory,
    "flops": suite_flops,
    "recompute": suite_recompute,
    "comm_per_step": suite_comm_per_step,
    "optimizer": suite_optimizer,
    "zero_accumulation": suite_zero_accumulation,
}


def main() -> None:
    started_cpu = time.process_time()  # this rank's imports (torch, tpbench)
    out_path, suites = sys.argv[1], sys.argv[2:]
    checks = json.loads(os.environ["TPBENCH_CHECKS"])
    dist.init_process_group("gloo")
    PROGRESS.append(Path(f"{out_path}.r{dist.get_rank()}.progress"))
    torch.set_num_threads(1)
    gc.freeze()  # as tpbench.run.worker does: memory.run's gc.collect() then scans only what the run made
    if suites[0] == SHARED:  # keyed by suite however many there are (one when few files are collected)
        write_every_rank(out_path, {suite: SUITES[suite](checks.get(suite, {})) for suite in suites[1:]})
    elif len(suites) == 1:
        write_every_rank(out_path, SUITES[suites[0]](checks))
    else:
        write_every_rank(out_path, {suite: SUITES[suite](checks.get(suite, {})) for suite in suites})
    write_cpu(out_path, started_cpu)
    leave_world()


if __name__ == "__main__":
    main()
    exit_now()
