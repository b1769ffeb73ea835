"""model.fused_ops (issue 57, item 1): torch's fused ops where they are MiniMind's math, fewer host
dispatches. Each fused op against MiniMind's own, computed by its own ops; the dispatches a layer
makes, counted by op."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpbench.models.minimind import (
    CausalLMLoss,
    MiniMindConfig,
    RMSNorm,
    apply_fused_rope,
    apply_rope,
    build_model,
    fused_rope_tables,
    rope_tables,
    shift_labels,
)

DTYPES = [torch.float32, torch.bfloat16]


class OpCounter(TorchDispatchMode):
    """The non-view aten ops dispatched, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def tiny(layers: int = 1, **kw) -> MiniMindConfig:
    return MiniMindConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        **kw,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_tables_made_once_rotate_as_minimind_does_bit_for_bit(dtype):
    cfg = tiny()
    x = torch.randn(16, 2, 4, cfg.head_dim).to(dtype)
    cos, sin = rope_tables(cfg, 16)
    assert torch.equal(apply_fused_rope(x, *fused_rope_tables(cos, sin, dtype)), apply_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rmsnorm_is_miniminds_bit_for_bit(dtype):
    x = torch.randn(16, 2, 96).to(dtype)
    norm, fused = RMSNorm(96).to(dtype), RMSNorm(96, fused=True).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        fused.weight.copy_(norm.weight)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi) for m, xi in zip((norm, fused), xs, strict=True)]
    assert torch.equal(outs[0], outs[1])
    g = torch.randn_like(outs[0])
    for out in outs:
        out.backward(g)
    assert torch.equal(xs[0].grad, xs[1].grad)
    torch.testing.assert_close(
        fused.weight.grad, norm.weight.grad, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_upcast_inside_is_the_copys_bit_for_bit(dtype):
    logits = (torch.randn(16, 2, 300) * 4).to(dtype)
    targets = shift_labels(torch.randint(0, 300, (2, 16)))
    grads, losses = [], []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        loss = CausalLMLoss(fused)(x, targets)
        loss.backward()
        losses.append(loss)
        grads.append(x.grad)
    assert losses[0].dtype == torch.float32 and torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])


def test_labels_shift_left_with_the_last_ignored():
    labels = torch.arange(10).view(2, 5)
    assert shift_labels(labels).tolist() == [[1, 6], [2, 7], [3, 8], [4, 9], [-100, -100]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flash", [True, False])
def test_fused_model_trains_as_minimind_does(dtype, flash):
    """The same forward bit for bit; the gradients as close as bf16 rounds (GQA inside SDPA sums the
    query heads' k and v gradients in its own order, where repeat_kv's backward sums them in p)."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for fused in (False, True):
        model = build_model(tiny(2, fused_ops=fused, flash_attn=flash), seed=1).to(dtype)
        logits, loss = model(ids, ids)
        loss.backward()
        runs.append((logits, loss, {n: p.grad.float() for n, p in model.named_parameters()}))
    (logits, loss, grads), (f_logits, f_loss, f_grads) = runs
    assert torch.equal(logits, f_logits) and torch.equal(loss, f_loss)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, grad in grads.items():
        torch.testing.assert_close(
            f_grads[name], grad, rtol=tol, atol=tol * grad.abs().max().item(), msg=name
        )


def layer_ops(backward: bool, **kw) -> Counter[str]:
    """The ops of one layer (2 layers' less 1 layer's), bf16, S 16, heads 4/2, T 1, in its forward or
    its backward."""
    counts = []
    for layers in (1, 2):
        model = build_model(tiny(layers, **kw)).to(torch.bfloat16)
        ids = torch.randint(0, 256, (1, 16))
        model(ids, ids)[1].backward()  # the RoPE tables made
        counter = OpCounter()
        if backward:
            loss = model(ids, ids)[1]
            with counter:
                loss.backward()
        else:
            with counter:
                model(ids, ids)
        counts.append(counter.ops)
    return counts[1] - counts[0]


@pytest.mark.parametrize("qk_norm", [True, False])
def test_a_fused_layer_dispatches_no_per_call_cast_kv_copy_or_concatenation(qk_norm):
    """RoPE's tables cast once per run, not at each call; SDPA takes the KV heads without repeat_kv's
    copy (nor its sum in backward); rotate_half's neg and cat one flip. The _to_copy left are each
    norm's fp32 copy and its cast back."""
    norms = 4 if qk_norm else 2
    fwd, seed_fwd = layer_ops(False, qk_norm=qk_norm), layer_ops(False, qk_norm=qk_norm, fused_ops=False)
    seen = (seed_fwd["_to_copy"], seed_fwd["clone"], seed_fwd["cat"])
    assert seen == (2 * norms + 4, 2, 2)  # MiniMind's per-call casts, repeat_kv's copies, rotate_half's cats
    assert fwd["_to_copy"] == 2 * norms
    assert fwd["clone"] == fwd["cat"] == fwd["neg"] == 0
    bwd, seed_bwd = layer_ops(True, qk_norm=qk_norm), layer_ops(True, qk_norm=qk_norm, fused_ops=False)
    assert bwd["sum"] == seed_bwd["sum"] - 2  # k's and v's gradients summed over their query heads
    assert bwd["cat"] == bwd["neg"] == 0
    assert sum(fwd.values()) < sum(seed_fwd.values()) and sum(bwd.values()) < sum(seed_bwd.values())
