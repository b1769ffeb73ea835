"""What a rank's peak is made of as the model deepens, the reading of the seed chapter's memory table
(seed 000, section 2.16): what does not grow with depth, F, and what each layer adds, split into a,
the bytes tensor parallelism divides by T (counted whole: a rank holds a/T of them), and r, the bytes
it leaves whole on every rank:

    M(L) = F + L (a/T + r)        DDP (T = 1): F + L (a + r)

so a mode's peak over DDP's tends, as L grows, to the ratio of their slopes: (a/T + r) / (a + r)
where both count the same tensors, which they do not quite (`Limit`).

Derived from the theory's own moments (tpbench.predict.theory.step), never fitted: every moment of the step
is affine in L, so two depths give each moment's line; the peak at depth L is the highest line there.
r is a line's slope with every size TP divides set to zero (`_Unsharded`: this rank's query heads,
KV heads unless one is replicated, MLP columns, and under SP the residual stream's tokens), a/T the
rest of it: the attention and MLP weights, their gradients and AdamW's state, the activations inside
the TP regions; r holds the norms' weights, the region inputs TP gathers whole, the norms' fp32
tensors of the stream (SP shards them, moving them into a), the per-layer RoPE casts. VP shards the
embedding and the logits, which are in F: it leaves a and r as TP's, and so the limit.
docs/theory.md, "The peak over depth", has the seed's shape measured beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tpbench.config import RunConfig, mode_label, world_size
from tpbench.predict.theory.dims import Dims, dims
from tpbench.predict.theory.step import moments

# The modes the seed compares, each as (tp > 1, sp, vp); DDP is the baseline
MODES = {"tp": (False, False), "tp_sp": (True, False), "tp_vp": (False, True), "tp_sp_vp": (True, True)}


@dataclass(frozen=True)
class _Unsharded(Dims):
    """Dims with every size TP divides by T at zero, and what it leaves whole as it is: the slope of a
    moment under it is r, what a layer adds to every rank whatever T. A KV head replicated on every
    rank (T does not divide Nkv) is left whole."""

    @property
    def Nq_l(self) -> int:
        return 0

    @property
    def Nkv_l(self) -> int:
        return 0 if self.Nkv % self.T == 0 else 1

    @property
    def I_l(self) -> int:
        return 0

    @property
    def Ns(self) -> int:
        return 0 if self.sp else self.N


@dataclass(frozen=True)
class Line:
    """One moment's bytes as a function of depth: F + L * slope."""

    moment: str
    F: int
    slope: int

    def at(self, layers: int) -> int:
        return self.F + layers * self.slope


def lines(d: Dims) -> list[Line]:
    """Every moment of the step as a line in L, in the step's order: its bytes at two depths (from 2,
    where the moments are the same list at every depth), checked at a third."""
    at = [moments(dataclasses.replace(d, L=layers)) for layers in (2, 3, 4)]
    own = [m.name for m in moments(d)]
    names = own if len(own) == len(at[0]) else [m.name for m in at[0]]  # L 1: one recomputed block
    out = []
    for name, two, three, four in zip(names, *at, strict=True):
        slope = three.total - two.total
        if four.total - three.total != slope:  # every moment's bytes are affine in L
            raise AssertionError(f"moment {name}: not affine in the layer count")
        out.append(Line(name, two.total - 2 * slope, slope))
    return out


@dataclass(frozen=True)
class DepthSplit:
    """A config's peak at depth `layers`: the peak moment's line, its slope split into a and r."""

    mode: str
    T: int
    layers: int
    moment: str  # the moment the peak falls at, at `layers`
    F: int  # bytes that do not grow with L
    a: int  # per layer: the bytes TP divides, counted whole (a rank holds a / T)
    r: int  # per layer: the bytes TP leaves whole on every rank
    steepest: Line  # the moment with the largest slope: the peak's as L grows
    steepest_from: int  # the depth from which the steepest moment is the peak

    @property
    def per_layer(self) -> int:
        """What one layer adds to this rank's peak: a / T + r."""
        return self.a // self.T + self.r

    def peak(self, layers: int) -> int:
        return self.F + layers * self.per_layer

    @property
    def own_limit(self) -> float:
        """(a/T + r) / (a + r): this mode's peak over its own unsharded one (T = 1) as L grows."""
        return self.per_layer / (self.a + self.r)


def split(cfg: RunConfig, moment: str | None = None) -> DepthSplit:
    """The split of `cfg`'s predicted peak at its depth, or of the line of the moment named."""
    d = dims(cfg)
    mine, probe = lines(d), lines(_Unsharded(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}))
    if moment is None:
        line = max(mine, key=lambda line: line.at(d.L))  # the first of equal peaks
    else:
        line = next(line for line in mine if line.moment == moment)
    steep = max(mine, key=lambda line: (line.slope, line.F))
    (r,) = [p.slope for p in probe if p.moment == line.moment]  # the same moment, every size shown
    a = d.T * (line.slope - r)
    return DepthSplit(
        mode_label(cfg.parallel), d.T, d.L, line.moment, line.F, a, r, steep, overtakes(steep, mine)
    )


def overtakes(steep: Line, lines: list[Line]) -> int:
    """The least depth (>= 1) from which `steep` is the highest of `lines`."""
    ahead = [line for line in lines if line.slope < steep.slope and line.F > steep.F]
    return max([1] + [-(-(line.F - steep.F) // (steep.slope - line.slope)) for line in ahead])


def mode_configs(cfg: RunConfig) -> dict[str, RunConfig]:
    """`cfg` in DDP and each TP mode of the seed's comparison at the same world size, TP over `cfg`'s
    T (over the whole world where `cfg` has none), and `cfg`'s own mode where it is none of those."""
    W = world_size(cfg)
    T = cfg.parallel.tp if cfg.parallel.tp > 1 else W
    p = cfg.parallel
    engine = "megatron" if p.engine == "ddp" else p.engine
    ddp = dataclasses.replace(p, engine="ddp", tp=1, dp=W, sp=False, vp=False, overlap=False)
    out = {"ddp": dataclasses.replace(ddp, sp_gather="region")}  # where SP gathers: no SP, no choice
    if T > 1:
        for name, (sp, vp) in MODES.items():  # on cfg's engine: DTensor's modes are its own
            out[f"dtensor_{name}" if engine == "dtensor" else name] = dataclasses.replace(
                p, engine=engine, tp=T, dp=W // T, sp=sp, vp=vp, sp_gather="region"
            )
    configs = {name: dataclasses.replace(cfg, parallel=par) for name, par in out.items()}
    return configs | {mode_label(p): cfg}


@dataclass(frozen=True)
class Limit:
    """A mode's peak over DDP's in the same world as L grows: the ratio of their steepest moments'
    slopes. The seed's (a/T + r) / (a + r) takes DDP's layer to be the mode's own unsharded one; it
    is not quite: DDP's gradient buckets are alive at every moment (w bytes per parameter more)."""

    mode: str
    split: DepthSplit
    vs_ddp: float  # lim M_mode(L) / M_ddp(L)


def limits(configs: dict[str, RunConfig]) -> list[Limit]:
    """Each mode's split and limit against configs["ddp"]."""
    splits = {name: split(c) for name, c in configs.items()}
    ddp = splits["ddp"].steepest.slope
    return [Limit(name, s, s.steepest.slope / ddp) for name, s in splits.items()]
