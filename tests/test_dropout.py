"""Dropout keyed by position (tpbench.models.dropout), in one process: Megatron's RNG property on a
TP group, the masks of a step, recompute drawing them again, and the refusals. Sharded models
against dense at dropout 0.1 are validated in tests/test_parallel.py's launches (the dropout_* and
misplaced_dropout_* configs)."""

from __future__ import annotations

import copy
import hashlib

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torchrun_checks import run_config
from typer.testing import CliRunner

from tpbench.cli import app
from tpbench.config import ConfigError
from tpbench.experiments.setup import model_config
from tpbench.experiments.throughput import LocalFlopCounter
from tpbench.models.dropout import (
    MASK32,
    PROBS_DIMS,
    STREAM_DIMS,
    DropoutKey,
    PositionalDropout,
    dense_mask_bits,
    dropped_where,
    mix32,
    mix32_int,
    signed32,
)
from tpbench.models.minimind import MiniMindConfig, build_model
from tpbench.parallel.recompute import apply_recompute
from tpbench.parallel.rng import place_dropouts
from tpbench.predict import theory
from tpbench.predict.theory.activations import mask_bits
from tpbench.run.compose import check

S, B, H, N = 32, 4, 64, 8
CFG = MiniMindConfig(hidden_size=H, num_hidden_layers=2, vocab_size=256, flash_attn=False, dropout=0.1)


def masks(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each dropout's mask of dropped elements at the model's current step, on its shard's shape."""
    full = {"seq": S, "batch": B, "hidden": H, "head": N, "query": S, "key": S}
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, PositionalDropout):
            shape = [full[d] // m.splits.get(d, (0, 1))[1] for d in m.dims]
            out[name] = m.dropped(torch.Size(shape), torch.device("cpu"))
    return out


def rank_masks(t: int, tp: int, sp: bool, dp_rank: int = 0, dp: int = 1) -> dict[str, torch.Tensor]:
    model = build_model(CFG)
    place_dropouts(model, t, tp, dp_rank, dp, sp)
    return masks(model)


def test_the_hash_keeps_32_bits_exact_in_int32():
    """lowbias32 on int32 tensors (products wrapping modulo 2^32, the logical shifts made of int16
    halves and masks) equals the same hash on Python's unbounded ints, values near 2^31 and 2^32
    included; and so does the fallback that shifts and masks the 16-bit half too."""
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1, *torch.randint(0, 2**32, (1000,)).tolist()]
    expected = [mix32_int(v) for v in values]
    as_int32 = torch.tensor([signed32(v) for v in values], dtype=torch.int32)
    assert [h & MASK32 for h in mix32(as_int32.clone()).tolist()] == expected
    assert [h & MASK32 for h in mix32(as_int32.clone()[::1].t()).tolist()] == expected
    strided = torch.stack([as_int32, as_int32], 1)[:, 0]  # not contiguous: the shift-and-mask path
    assert [h & MASK32 for h in mix32(strided).tolist()] == expected
    assert len(set(expected)) == len(values)  # a bijection on 32 bits


# The masks of the int64 hash this int32 one replaced (commit a18794b), as a digest of the packed
# mask and the count dropped: (seed, step, site), shape, splits, p -> (sha256[:16], dropped).
PINNED = [
    ((0, 0, 0), (32, 4, 64), ((0, 1), (0, 1), (0, 1)), 0.1, ("408818ab52cc9c8f", 877)),
    ((0, 0, 0), (32, 4, 64), ((0, 1), (0, 1), (0, 1)), 0.5, ("9a75698a003e2f80", 4112)),
    ((7, 3, 5), (2, 4, 16, 16), ((1, 2), (1, 2), (0, 1), (0, 1)), 0.1, ("808d4fe90662e7ad", 202)),
    ((7, 3, 5), (2, 4, 16, 16), ((1, 2), (1, 2), (0, 1), (0, 1)), 0.5, ("9397d5ff74d20661", 1009)),
    ((1234, 99, 2), (8, 3, 33), ((3, 4), (2, 5), (0, 1)), 0.1, ("fde1e3b5d8838670", 79)),
    ((1234, 99, 2), (8, 3, 33), ((3, 4), (2, 5), (0, 1)), 0.5, ("d78406447c70a691", 411)),
]


@pytest.mark.parametrize(("key", "shape", "splits", "p", "digest"), PINNED)
def test_the_masks_are_those_of_the_int64_hash(key, shape, splits, p, digest):
    """Same seed, same masks as before the hash moved to int32: a recorded run's dropout stays."""
    seed, step, site = key
    bits = dense_mask_bits(DropoutKey(seed, step).site(site), shape, splits, torch.device("cpu"))
    mask = dropped_where(bits, round((1 - p) * 2**32)).flatten()
    assert (hashlib.sha256(mask.numpy().tobytes()).hexdigest()[:16], int(mask.sum())) == digest


def test_the_hash_runs_in_int32_with_one_copy():
    """The memory model's mask_bits: an int32 hash and one int32 copy at most while a mask is drawn
    (the int64 hash held 16 bytes an element)."""
    shape = torch.Size([4, 8, 16, 16])
    drop = PositionalDropout(0.1, 0, PROBS_DIMS, DropoutKey(seed=1)).train()
    tracker = MemTracker()
    with tracker:
        drop.dropped(shape, torch.device("cpu"))
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak == mask_bits(shape.numel()) == 8 * shape.numel()


@pytest.mark.parametrize("tp", [2, 4])
def test_megatrons_rng_property_on_a_tp_group(tp):
    """Under plain TP the stream is replicated: its dropouts' masks are identical on every TP rank;
    the attention probabilities are split by heads: each rank's mask is its heads' slice of the dense
    mask (so the ranks' masks differ). Under SP the stream is split along the sequence: each rank's
    mask is its sequence slice of the dense mask, and they differ between ranks."""
    dense = masks(build_model(CFG))
    heads, seq = N // tp, S // tp
    for sp in (False, True):
        ranks = [rank_masks(t, tp, sp) for t in range(tp)]
        for name, mask in dense.items():
            attention = name.endswith("attn_dropout")
            for t, mine in enumerate(ranks):
                if attention:
                    assert torch.equal(mine[name], mask[:, t * heads : (t + 1) * heads]), (sp, name, t)
                elif sp:
                    assert torch.equal(mine[name], mask[t * seq : (t + 1) * seq]), (sp, name, t)
                else:
                    assert torch.equal(mine[name], mask), (sp, name, t)
            if attention or sp:  # sharded: independent masks, as far apart as two random ones
                agree = (ranks[0][name] == ranks[1][name]).float().mean().item()
                assert abs(agree - (0.9**2 + 0.1**2)) < 0.03, (sp, name, agree)


def test_each_dp_rank_draws_its_slice_of_the_global_batchs_masks():
    dense = masks(build_model(CFG))
    for d in (0, 1):
        for name, mine in rank_masks(0, 1, False, d, 2).items():
            batch_dim = 0 if name.endswith("attn_dropout") else 1
            assert torch.equal(mine, dense[name].narrow(batch_dim, d * B // 2, B // 2)), (name, d)


def test_dropout_drops_a_tenth_and_scales_the_rest():
    drop = PositionalDropout(0.1, 7, STREAM_DIMS, DropoutKey(seed=3, step=1))
    x = torch.rand(64, 16, 256) + 0.5  # no zeros of its own
    y = drop(x)
    kept = y != 0
    assert kept.float().mean().item() == pytest.approx(0.9, abs=0.003)
    assert torch.equal(y[kept], x[kept] * (1 / 0.9))
    drop.eval()
    assert drop(x) is x


def test_dropout_changes_the_loss_and_each_step_its_masks():
    """In training mode dropout 0.1 changes the loss of the same batch at every step (the key's step
    advances once per forward); in eval mode the model is the one without dropout, bit for bit."""
    ids = torch.randint(256, (B, S), generator=torch.Generator().manual_seed(1))
    model = build_model(CFG)
    plain = build_model(MiniMindConfig(**{**CFG.__dict__, "dropout": 0.0}))
    first, second = model(ids, ids)[1], model(ids, ids)[1]
    assert model.model.dropout_key.step == 2
    without = plain(ids, ids)[1]
    assert abs(first.item() - without.item()) > 1e-3 and abs(second.item() - first.item()) > 1e-3
    model.eval()
    assert torch.equal(model(ids, ids)[1], without)
    assert model.model.dropout_key.step == 2


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_recomputed_block_draws_its_forwards_masks_again(mode):
    """Recompute runs the block (selective: the SwiGLU and down_proj, then the MLP's dropout) again in
    backward, keyed by the same step: the loss and the gradients are recompute none's, bit for bit."""
    ids = torch.randint(256, (B, S), generator=torch.Generator().manual_seed(2))
    runs = []
    for recompute in ("none", mode):
        model = build_model(CFG)
        apply_recompute(model, recompute)
        for _ in range(2):  # the second step's masks, not the first's
            model.zero_grad()
            loss = model(ids, ids)[1]
            loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = runs
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_full_recompute_with_dropout_runs_down_proj_again_as_predicted():
    """The MLP dropout's mask is a block's last save: full recompute's forward runs again through
    down_proj to draw it (and, on a TP group, through its exit: tests/test_theory.py counts those
    collectives), which tpbench.predict.theory adds to the recompute FLOPs."""
    cfg = run_config(["parallel.tp=1", "model.flash_attn=false", "model.dropout=0.1", "train.seq_len=32"])
    ids = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(4))
    flops = {}
    for recompute in ("none", "full"):
        model = build_model(model_config(cfg))
        apply_recompute(model, recompute)
        with LocalFlopCounter() as counter:
            model(ids, ids)[1].backward()
        flops[recompute] = counter.get_total_flops()
    cfg.train.recompute = "full"
    d = theory.dims(cfg)
    assert flops["full"] - flops["none"] == theory.recompute_flops_per_step(cfg)
    assert theory.recompute_flops_per_step(cfg) > d.L * 2 * d.N * d.H * 3 * d.I  # gate, up and down


def test_a_copy_shares_its_key_among_its_own_dropouts():
    """validate deep-copies the dense model: the copy's dropouts share the copy's key, not the original's."""
    model = build_model(CFG)
    twin = copy.deepcopy(model)
    keys = {id(m.key) for m in twin.modules() if isinstance(m, PositionalDropout)}
    assert keys == {id(twin.model.dropout_key)} and id(model.model.dropout_key) not in keys


REFUSED = {
    "one": (["model.dropout=1.0"], "model.dropout=1.0: accepted are probabilities in [0, 1)"),
    "negative": (["model.dropout=-0.1"], "model.dropout=-0.1: accepted are probabilities"),
    "sdpa": (
        ["model.flash_attn=true", "model.dropout=0.1"],
        "with model.flash_attn=true (SDPA draws its own",
    ),
    "dtensor": (
        ["parallel.engine=dtensor", "model.dropout=0.1"],
        "model.dropout=0.1 with parallel.engine=dtensor",
    ),
    "fault without dropout": (["debug.dropout_fault=no_seq_offset"], "accepted with model.dropout > 0"),
    "unknown fault": (
        ["model.dropout=0.1", "debug.dropout_fault=late"],
        "debug.dropout_fault='late': accepted are '', 'no_seq_offset'",
    ),
}


@pytest.mark.parametrize("overrides, says", REFUSED.values(), ids=REFUSED.keys())
def test_dropout_is_refused_where_a_mask_cannot_be_the_dense_models(overrides, says):
    with pytest.raises(ConfigError) as refused:
        check(run_config(["model.flash_attn=false", *overrides]))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_refusal_is_one_line_and_exit_2_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["run", "kind=validate", "model.dropout=0.1"])  # the tiny model's SDPA
    assert done.exit_code == 2 and done.stdout == "", done.output
    assert len(done.stderr.splitlines()) == 1 and REFUSED["sdpa"][1] in done.stderr, done.stderr
    assert not (tmp_path / "runs").exists()
