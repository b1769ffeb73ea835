"""Validation's sign rule: where rounding decides the sign of a gradient element, the parallel model
steps it with the dense model's gradient (tpbench.experiments.criterion: why; `mend_rounded_signs`:
how). Called at every AdamW step of a validation, after the gradient sums, before the step."""

from __future__ import annotations

from typing import Any

import torch

from tpbench.config import RunConfig


def mend_rounded_signs(
    cfg: RunConfig,
    pm: Any,  # a ParallelModel, DDPModel, ZeroModel or FSDP model: the interface validate checks
    dense: torch.nn.Module,
    reference: torch.nn.Module,
    rounded: dict[str, torch.Tensor],
) -> None:
    """The sign rule, at every AdamW step before the parallel model's: each element whose sign rounding
    decides (the dense model's gradient within that element's rounding of 0: k x `_rounding_scale` of
    the dense gradient's error against the reference + the gradient floor's share, tol_grad_rel x
    ||dense|| / sqrt(n), n the elements the step touched) and whose gradient differs from the dense
    one, by no more than the same allowance, steps with the dense model's gradient, and is marked in
    `rounded` (counted: adamw_rounded_signs). A flip within rounding is such an element; so is one of
    the same sign whose size rounding set near AdamW's eps (1e-8): AdamW's first step moves an element
    by lr x g / (|g| + eps), so a gradient rounded to 1.2e-8 moves 0.54 lr where the dense model's
    1.3e-5 moves 1 lr (the tiny model's layer-0 q_norm, precision=mixed at T 2 with the SP gather
    in the linear, seed 0, on a Xeon whose bf16 GEMMs run on AMX: 1.64 of its bound, a false failure).

    AdamW steps each element by about lr x sign(its gradient) while the gradient is small against its
    history (m / sqrt(v)), so an element whose gradient is within rounding of 0 moves by lr one way in
    one model and the other way in the other: a difference of 2 lr a step that rounding, not a bug,
    decides, and its momentum carries it on. Left to run it dominates the checks after it: the q/k
    norm weights of the tiny model hold 8 elements (head_dim), so one such element is a third of
    ||dense - initial|| (0.36 under precision=mixed); in the embedding, a row no later batch holds has
    a zero gradient, and AdamW's momentum moves it on for about 10 steps, ~5 lr in all (issue 34's
    Llama shape at T 4, fp32, seed 8: one element of token 485's row flipped at step 5, off by 2.6e-3
    when the token came back at step 11, the gradients of steps 11-20 off by 1.7e-4 to 3.7e-3 and the
    logits' drift at 1.3 of its bound). The dense model against its reference is one draw of the same
    chance (it flipped none there), so it cannot bound it. Stepping such an element with the dense
    gradient keeps both models on the same side of a decision rounding made, and hides no bug: the
    two gradients agree there within rounding, and the gradient check covers them; a bug's gradient
    differs by more than rounding, so its elements step with their own."""
    dense_params, ref_params = dict(dense.named_parameters()), dict(reference.named_parameters())
    v = cfg.validate
    mended = {}
    for name, grad in pm.full_gradients().items():
        g = grad.detach().double()
        want = pm.shard_like(name, dense_params[name].grad).double()
        exact = pm.shard_like(name, ref_params[name].grad).double()
        touched = max(int(((want != 0) | (g != 0)).sum()), 1)  # a row no token reached: 0 in all
        allowed = v.k * _rounding_scale(want - exact, touched) + v.tol_grad_rel * want.norm() / touched**0.5
        decided = (want.abs() <= allowed) & ((g - want).abs() <= allowed) & (g != want)
        if decided.any():
            rounded[name] |= decided
            mended[name] = torch.where(decided, want, g).to(grad.dtype)
    if mended:
        pm.write_gradients(mended)


def _rounding_scale(error: torch.Tensor, touched: int) -> torch.Tensor:
    """Each element's expected rounding error, from one gradient's error against the reference
    (`error`, a parameter's shape). A weight's gradient element (o, i) sums dy[t, o] x[t, i] over the
    tokens, so its error scales with its row's and its column's: the rms of its row times its
    column's rms over the whole's (row o's own rms for an embedding, whose rows are the tokens a
    batch held, each its own scale: token 485's row above carried 30x the shard's rms gradient). A
    vector's (a norm's weight): its rms over the `touched` elements."""
    if error.dim() < 2:
        return (error.norm() / touched**0.5).expand_as(error)
    flat = error.reshape(error.shape[0], -1)
    rows = flat.pow(2).mean(1, keepdim=True).sqrt()  # [out, 1]
    columns = flat.pow(2).mean(0, keepdim=True).sqrt()  # [1, in]
    whole = flat.pow(2).mean().sqrt().clamp(min=1e-300)
    return (rows * columns / whole).reshape(error.shape)
