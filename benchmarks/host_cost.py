"""What a training step costs the host, on the CPU (issue 57, item 4): at a tiny shape compute is
negligible, so what is left is Python and the dispatch of each op, the part of a GPU step the GPU
cannot hide when the host is the bound. tpbench beside transformers' Llama at the same shape and
dtype (H 64, L 8, heads 4/2, V 256, S 16, micro-batch 1, bf16, T 1; tpbench with model.qk_norm=false,
which makes MiniMind's layer Llama's; transformers with attn_implementation=sdpa, eager, torch's AdamW):

- dispatches: the non-view aten ops one decoder layer dispatches, forward and backward, counted by a
  TorchDispatchMode (`Dispatches`), at T 1 beside transformers' LlamaDecoderLayer, and at T 2 (one
  rank under torch's fake process group: T 1's ops plus the collectives and what wraps them); and
  those of a whole step (forward, backward, AdamW) beside LlamaForCausalLM's;
- host time: the median of many eager steps of each, interleaved in rounds so that the machine's
  drift falls on both alike; tpbench's step with fused AdamW (train.fused_optimizer=true; a CPU run's
  auto is torch's default, the for-loop AdamW) and its compiled step (train.compile: each block
  compiled) beside its eager one; and, with --run, the step time `tpbench run kind=throughput` records;
- where an eager step's host time goes: per phase (forward with the batch and the loss, backward,
  optimizer, the rest; `PhaseClock`), the dispatches and median time of each model's.

A view is an op torch itself calls one: `OpOverload.is_view`, set (torch 2.13, torch/_ops.py) where
some argument's alias annotation in the op's schema is a non-writing alias (`Tensor(a)`: view,
transpose, permute, expand, narrow, split, unbind, detach, alias, as_strided), the rule of
ATen's MathBitsFallback; in-place ops (`Tensor(a!)`) and `_unsafe_view` (no alias annotation: it
follows a copy) count. torch 2.13 has no `torch.Tag.view` (its tags: core, pointwise, inplace_view,
view_copy, ...). Composite ops (reshape, F.rms_norm on the CPU) reach the mode as what they
decompose into: the CPU's counts are not a GPU's, where rms_norm is one fused kernel.

The counts are the suite's guard too (tests/test_host_cost.py); the times are noisy on a shared
machine: the table says the load average beside them. Run from the repository root:
  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_cost.py [--counts] [--steps 200] [--no-compile]
      [--run] [tpbench overrides, e.g. model.fused_ops=false]
(--counts: the layer's dispatches alone, in seconds; the rest takes minutes, compiling included.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from tpbench.experiments.setup import model_config
from tpbench.experiments.training import Trainer
from tpbench.models.minimind import DTYPES
from tpbench.run.compose import expand

# The shape, with MiniMind's layer made Llama's (no q/k norms), eager, on the CPU
SHAPE = ["hidden=64", "layers=8", "heads=4", "kv_heads=2", "vocab=256", "seq=16", "micro_batch=1",
         "dtype=bfloat16", "model.qk_norm=false"]  # fmt: skip
BASE = ["kind=throughput", "mode=tp", "tp=1", "compile=false", "device=cpu", *SHAPE]
COLLECTIVES = "c10d."  # the process group's ops, as the dispatcher names them


class Dispatches(TorchDispatchMode):
    """Counts the non-view aten ops dispatched while it is on, by name (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@dataclass(repr=False)
class LayerCount:
    forward: collections.Counter[str]
    backward: collections.Counter[str]

    def __repr__(self) -> str:
        return f"LayerCount(forward {self.total('forward')} ops, backward {self.total('backward')} ops)"

    def total(self, phase: str, collectives: bool = True) -> int:
        ops = getattr(self, phase)
        return sum(n for op, n in ops.items() if collectives or not op.startswith(COLLECTIVES))

    def collectives(self, phase: str) -> int:
        return self.total(phase) - self.total(phase, collectives=False)


def count_layer(call: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> LayerCount:
    """The dispatches of `call(x)` and of its backward, x a leaf that needs a gradient (as a middle
    layer's input does); the output's gradient is made before counting."""
    x = x.detach().clone().requires_grad_(True)
    with Dispatches() as forward:
        y = call(x)
    grad = torch.randn_like(y)
    with Dispatches() as backward:
        y.backward(grad)
    return LayerCount(forward.ops, backward.ops)


@contextlib.contextmanager
def fake_world(tp: int, rank: int = 0) -> Iterator[None]:
    """A default process group of `tp` ranks in which this process is `rank`: torch's fake backend,
    whose collectives are dispatched as a real one's are but move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        yield
    finally:
        dist.destroy_process_group()


def config(*overrides: str):
    (cfg,) = expand([*BASE, *overrides], single=True, launching=False)
    return cfg


def tpbench_layer(*overrides: str, tp: int = 1) -> LayerCount:
    """One block of the model `tpbench run` trains, on rank 0 of a T-rank world, fed the input its
    first block gets in a forward of the run's batch ([S, B, H]; SP: [S/T, B, H])."""
    cfg = config(f"tp={tp}", *overrides)
    with fake_world(tp):
        trainer = Trainer(cfg)
        block, seen = trainer.module.model.layers[0], []
        hook = block.register_forward_pre_hook(lambda module, args: seen.append(args))
        ids, _ = trainer.batches.next_local()
        with torch.no_grad():
            trainer.module(ids)
        hook.remove()
        x, *rest = seen[0]
        return count_layer(lambda h: block(h, *rest), x)


def llama_config(cfg):
    """transformers' LlamaConfig of tpbench's model `cfg` (Llama's layer: cfg without q/k norms)."""
    m, dense = cfg.model, model_config(cfg)
    return LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=dense.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=dense.head_dim,
        vocab_size=m.vocab_size,
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        attn_implementation="sdpa",
    )


def llama_layer(cfg) -> LayerCount:
    """transformers' LlamaDecoderLayer at `cfg`'s shape and dtype, in training mode, fed [B, S, H] and
    the rotary tables its model computes once per forward for all layers."""
    lc, dtype = llama_config(cfg), DTYPES[cfg.train.dtype]
    layer = LlamaDecoderLayer(lc, 0).to(dtype)
    x = torch.randn(cfg.train.micro_batch, cfg.train.seq_len, lc.hidden_size, dtype=dtype)
    positions = torch.arange(cfg.train.seq_len)[None]
    tables = LlamaRotaryEmbedding(lc)(x, positions)
    return count_layer(lambda h: layer(h, position_embeddings=tables, position_ids=positions), x)


class LlamaStep:
    """LlamaForCausalLM's training step as a plain loop takes it: forward with labels (transformers
    shifts them), backward, torch's AdamW (its default on the CPU), gradients set to None."""

    def __init__(self, cfg):
        torch.manual_seed(cfg.train.seed)
        self.model = LlamaForCausalLM(llama_config(cfg)).to(DTYPES[cfg.train.dtype]).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.train.lr)
        gen = torch.Generator().manual_seed(cfg.train.seed + 1)
        shape = (cfg.train.micro_batch, cfg.train.seq_len)
        self.ids = torch.randint(cfg.model.vocab_size, shape, generator=gen)

    def __call__(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        return loss.detach()


class PhaseClock:
    """A step cut into its phases by hooks, timed and (while `counted` is set) counted: forward (the
    batch, zero_grad, forward and loss: until the model's forward returns), backward (and the gradient
    sums: until the optimizer's step begins), optimizer (its step) and the rest (to the step's end).
    The hooks cost both models alike: the whole step's times are taken without them."""

    PHASES = ("forward", "backward", "optimizer", "rest")

    def __init__(self, step: Callable[[], object], module: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.step = step
        self.counted: Dispatches | None = None
        self.marks: list[tuple[float, int]] = []
        module.register_forward_hook(self._mark)
        optimizer.register_step_pre_hook(self._mark)
        optimizer.register_step_post_hook(self._mark)

    def _mark(self, *args) -> None:
        self.marks.append((time.perf_counter(), self._dispatched()))

    def _dispatched(self) -> int:
        return 0 if self.counted is None else sum(self.counted.ops.values())

    def __call__(self) -> tuple[list[float], list[int]]:
        """One step: each phase's seconds and dispatches (0 unless counted)."""
        self.marks = [(time.perf_counter(), self._dispatched())]
        self.step()
        self._mark()
        if len(self.marks) != len(self.PHASES) + 1:
            raise RuntimeError(f"{len(self.marks) - 2} phase marks in a step, not {len(self.PHASES) - 1}")
        times, counts = zip(*self.marks, strict=True)
        return [b - a for a, b in pairwise(times)], [b - a for a, b in pairwise(counts)]

    def dispatches(self) -> list[int]:
        """Each phase's dispatches in one step, after one to warm up."""
        self()
        with Dispatches() as self.counted:
            _, counts = self()
        self.counted = None
        return counts


def step_dispatches(step: Callable[[], object]) -> int:
    """The non-view dispatches of one step, after one to warm up (AdamW makes its state in its first)."""
    step()
    with Dispatches() as counted:
        step()
    return sum(counted.ops.values())


def step_times(steps: dict[str, Callable[[], object]], n: int, per_round: int = 10) -> dict[str, list[float]]:
    """`n` timed steps of each, in rounds of `per_round` steps of each in turn, after a few to warm up."""
    for step in steps.values():
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(-(-n // per_round)):
        for name, step in steps.items():
            for _ in range(per_round):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return times


def recorded_step(*overrides: str, steps: int = 50) -> float:
    """The median step time `tpbench run kind=throughput` records at this shape (its own launch)."""
    with tempfile.TemporaryDirectory() as folder:
        tpbench = str(Path(sys.executable).with_name("tpbench"))
        command = [tpbench, "run", *BASE, *overrides, f"train.steps={steps}", "--json",
                   f"db.url=sqlite:///{folder}/host-cost.db"]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, check=True).stdout
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return row["metrics"]["step_time_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps of each (default 200)")
    parser.add_argument("--counts", action="store_true", help="the dispatch counts only, no timing")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled step")
    parser.add_argument("--run", action="store_true", help="also `tpbench run kind=throughput`'s step")
    parser.add_argument("overrides", nargs="*", help="tpbench overrides on top of the issue's shape")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core, as a tpbench rank on the CPU runs
    load = [os.getloadavg()]
    layer_table(tuple(args.overrides))
    if not args.counts:
        step_table(tuple(args.overrides), args, load)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{os.cpu_count()} cores, one thread"
    )


def layer_table(extra: tuple[str, ...]) -> None:
    """The dispatches of one layer: Llama's, tpbench's at T 1, and rank 0's at T 2 in TP and TP+SP,
    with what T 2 adds to T 1 op by op."""
    ours, llama = tpbench_layer(*extra), llama_layer(config(*extra))
    tp2 = {mode: tpbench_layer(f"mode={mode}", *extra, tp=2) for mode in ("tp", "tp_sp")}
    print(f"Dispatches of one layer (non-view aten ops; H 64, heads 4/2, S 16, bf16; tpbench "
          f"{' '.join(extra) or 'as it is'})")  # fmt: skip
    rows = [("", "forward", "backward", "of which collectives")]
    rows.append(("transformers LlamaDecoderLayer", llama.total("forward"), llama.total("backward"), "-"))
    rows.append(("tpbench T 1", ours.total("forward"), ours.total("backward"), "-"))
    for mode, c in tp2.items():
        rows.append((f"tpbench T 2 {mode}, rank 0", c.total("forward"), c.total("backward"),
                     f"{c.collectives('forward')} + {c.collectives('backward')}"))  # fmt: skip
    table(rows)
    for phase in ("forward", "backward"):
        print(
            f"  tpbench T 1 {phase} against Llama's: "
            + difference(getattr(ours, phase), getattr(llama, phase))
        )
    for mode, c in tp2.items():
        for phase in ("forward", "backward"):
            print(f"  T 2 {mode} {phase} against T 1: {difference(getattr(c, phase), getattr(ours, phase))}")


def difference(ops: collections.Counter[str], base: collections.Counter[str]) -> str:
    change = collections.Counter(ops)
    change.subtract(base)
    return ", ".join(f"{n:+d} {op}" for op, n in sorted(change.items()) if n) or "the same ops"


def step_table(extra: tuple[str, ...], args: argparse.Namespace, load: list[tuple[float, ...]]) -> None:
    """The dispatches and host time of a whole step: Llama's, tpbench's eager (with its AdamW and
    with the fused one) and compiled; then per phase (phase_table)."""
    cfg = config(*extra)
    with fake_world(1):
        fused = Trainer(config("train.fused_optimizer=true", *extra))
        steps = {"transformers LlamaForCausalLM": LlamaStep(cfg), "tpbench eager": Trainer(cfg).step,
                 "tpbench eager, fused AdamW": fused.step}  # fmt: skip
        counts = {name: step_dispatches(step) for name, step in steps.items()}
        phases = phase_table(cfg, fused.cfg, args.steps)
        compile_s = None
        if not args.no_compile:
            compiled = Trainer(config("compile=true", *extra))
            start = time.perf_counter()
            compiled.step()
            compile_s = time.perf_counter() - start
            steps["tpbench compiled"] = compiled.step
        load.append(os.getloadavg())
        times = step_times(steps, args.steps)
        load.append(os.getloadavg())
    recorded = recorded_step(*extra) if args.run else None
    reference = statistics.median(times["transformers LlamaForCausalLM"])
    eager = statistics.median(times["tpbench eager"])
    print(
        "\nOne training step (L 8, V 256, micro-batch 1: forward, backward, AdamW), "
        f"{args.steps} steps of each"
    )
    rows = [("", "dispatches", "median ms", "p10 ms", "p90 ms", "x Llama", "x tpbench eager")]
    for name, ts in times.items():
        q, median = statistics.quantiles(ts, n=10), statistics.median(ts)
        rows.append((name, counts.get(name, "-"), f"{median * 1e3:.2f}", f"{q[0] * 1e3:.2f}",
                     f"{q[-1] * 1e3:.2f}", f"{median / reference:.2f}", f"{median / eager:.2f}"))  # fmt: skip
    if recorded is not None:
        rows.append(("tpbench run kind=throughput", "-", f"{recorded * 1e3:.2f}", "-", "-",
                     f"{recorded / reference:.2f}", f"{recorded / eager:.2f}"))  # fmt: skip
    table(rows)
    print(phases)
    if compile_s is not None:
        print(f"  the compiled step's first (compile included): {compile_s:.1f} s")
    print(
        "Goals (issue 57): layer dispatches at T 1 <= Llama's; eager step <= 0.8x Llama's; "
        "compiled <= 0.5x eager"
    )
    print(
        "load average (1, 5, 15 min) before, as the timed steps began, after: "
        + "; ".join(" ".join(f"{v:.2f}" for v in avg) for avg in load)
    )


def phase_table(cfg, fused_cfg, n: int) -> str:
    """Where each eager step's host time goes: per phase (PhaseClock) its dispatches and median ms,
    Llama's, tpbench's and tpbench's with fused AdamW, timed in interleaved rounds as step_times does."""
    llama, ours, fused = LlamaStep(cfg), Trainer(cfg), Trainer(fused_cfg)
    clocks = {
        "transformers LlamaForCausalLM": PhaseClock(llama, llama.model, llama.optimizer),
        "tpbench eager": PhaseClock(ours.step, ours.module, ours.optimizer),
        "tpbench eager, fused AdamW": PhaseClock(fused.step, fused.module, fused.optimizer),
    }
    counts = {name: clock.dispatches() for name, clock in clocks.items()}
    seen: dict[str, list[list[float]]] = {name: [] for name in clocks}
    # each step's phase times kept; the hooked steps' whole times are not the table's (taken without)
    step_times({name: lambda c=clock, s=seen[name]: s.append(c()[0]) for name, clock in clocks.items()}, n)
    rows = [("per phase: dispatches / median ms", *PhaseClock.PHASES)]
    for name, steps in seen.items():
        medians = [statistics.median(phase) * 1e3 for phase in zip(*steps[3:], strict=True)]  # 3 warm-ups
        rows.append((name, *(f"{c} / {m:.2f}" for c, m in zip(counts[name], medians, strict=True))))
    lines: list[str] = []
    table(rows, lines)
    return "\n".join(lines)


def table(rows: list[tuple], lines: list[str] | None = None) -> None:
    """Prints `rows` as columns (or appends the lines to `lines`)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        line = "  " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        print(line) if lines is None else lines.append(line)


if __name__ == "__main__":
    main()
