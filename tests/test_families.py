"""The dense model is each family's own: with transformers' weights, tpbench's dense model gives
LlamaForCausalLM's, Qwen2ForCausalLM's and Qwen3ForCausalLM's logits, loss and gradients (fp32,
within 1e-5), at tiny shapes with head_dim != H / heads, N_kv < N_q, and Llama-3.1's RoPE scaling.

The HF models are built in-process from their config classes (no download); tpbench's dense model
loads their state dict by name, strictly: the names are the same."""

from __future__ import annotations

import inspect

import pytest
import torch

from tpbench.models.minimind import MiniMindConfig, MiniMindForCausalLM

transformers = pytest.importorskip(
    "transformers", minversion="4.51", reason="transformers >= 4.51 (Qwen3): pip install -e '.[hf]'"
)

TOL = 1e-5
V, H, L, S, B = 256, 64, 2, 32, 2
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
CONTEXT = 64  # original_max_position_embeddings: with D 16 and theta 1e4, the three bands are all used


def rope_kwargs(theta: float, llama3: bool = False) -> dict:
    """RoPE as the installed transformers takes it: rope_parameters (5.x) or rope_theta, rope_scaling."""
    scaling = (
        {"rope_type": "llama3", **LLAMA3_SCALING, "original_max_position_embeddings": CONTEXT}
        if llama3
        else None
    )
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta} | (scaling or {})}
    return {"rope_theta": theta, "rope_scaling": scaling}


def common(theta: float, llama3: bool = False, **kwargs) -> dict:
    return dict(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=L,
        intermediate_size=192,
        max_position_embeddings=256,
        attn_implementation="eager",
        **rope_kwargs(theta, llama3),
        **kwargs,
    )


# name -> (HF model class name, its config, tpbench's MiniMindConfig for the same model)
FAMILIES = {
    "llama": (
        "LlamaForCausalLM",
        common(
            1e4, num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False
        ),
        dict(qk_norm=False, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False),
    ),
    "llama31_rope_scaling": (  # Llama-3.1: rope_type llama3, head_dim 16 != H / heads 8
        "LlamaForCausalLM",
        common(
            1e4,
            llama3=True,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        ),
        dict(
            qk_norm=False,
            head_dim=16,
            rope_theta=1e4,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_scaling_factor=LLAMA3_SCALING["factor"],
            rope_low_freq_factor=LLAMA3_SCALING["low_freq_factor"],
            rope_high_freq_factor=LLAMA3_SCALING["high_freq_factor"],
            rope_original_max_position_embeddings=CONTEXT,
        ),
    ),
    "qwen2": (  # Qwen2.5: q, k, v with biases; head_dim 16 (read by Qwen2Attention as an attribute)
        "Qwen2ForCausalLM",
        common(1e6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        dict(qk_norm=False, attention_bias=True, head_dim=16, rope_theta=1e6),
    ),
    "qwen3": (  # Qwen3: q/k norms, head_dim 16 with heads 8 (q_proj [128, 64])
        "Qwen3ForCausalLM",
        common(1e6, num_attention_heads=8, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False),
        dict(qk_norm=True, head_dim=16, rope_theta=1e6, tie_word_embeddings=False),
    ),
    "minimind": (  # MiniMind's defaults (tied, head_dim = H / heads) are a Qwen3
        "Qwen3ForCausalLM",
        common(1e6, num_attention_heads=8, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True),
        dict(),
    ),
}


def tpbench_config(hf: dict, overrides: dict, flash: bool) -> MiniMindConfig:
    """tpbench's config of the model transformers builds from `hf` (its head counts), with the
    family's switches in `overrides`."""
    return MiniMindConfig(
        hidden_size=H,
        num_hidden_layers=L,
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf["num_key_value_heads"],
        vocab_size=V,
        intermediate_size=192,
        flash_attn=flash,
        **overrides,
    )


def pair(name: str, flash: bool) -> tuple[torch.nn.Module, MiniMindForCausalLM]:
    cls_name, hf_kwargs, ours = FAMILIES[name]
    torch.manual_seed(0)
    hf_cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**hf_kwargs)
    hf = getattr(transformers, cls_name)(hf_cfg).float()
    with torch.no_grad():  # HF starts biases at zero and norms at one: random, so that each one shows
        for n, p in hf.named_parameters():
            if n.endswith(("bias", "norm.weight")):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if n.endswith("norm.weight") else 0.0))
    model = MiniMindForCausalLM(tpbench_config(hf_kwargs, ours, flash))
    model.load_state_dict(hf.state_dict(), strict=True)  # the same names, the same shapes
    return hf, model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(V, (B, S), generator=gen)
    labels = ids.clone()
    labels[:, 3::7] = -100
    return ids, labels


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("flash", [False, True], ids=["manual", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_dense_model_is_transformers_own(name, flash):
    hf, model = pair(name, flash)
    ids, labels = batch()
    ref = hf(input_ids=ids, labels=labels)
    logits, loss = model(ids, labels)
    assert (logits - ref.logits).abs().max().item() <= TOL
    assert abs(loss.item() - ref.loss.item()) <= TOL
    ref.loss.backward()
    loss.backward()
    theirs = dict(hf.named_parameters())
    for n, p in model.named_parameters():
        assert (p.grad - theirs[n].grad).abs().max().item() <= TOL, n
        assert rel_l2(p.grad, theirs[n].grad) <= TOL, n


def test_each_switch_has_the_parameters_of_its_family():
    """Shapes as transformers has them: Qwen3's q_proj [N_q D, H] with D independent of H / heads,
    q/k norms [D] only with qk_norm, biases on q, k, v only with attention_bias (never o_proj)."""
    shapes = {n: tuple(p.shape) for n, p in pair("qwen3", False)[1].named_parameters()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8 * 16, H)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4 * 16, H)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (H, 8 * 16)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert not any("bias" in n for n in shapes)
    names = {n for n, _ in pair("qwen2", False)[1].named_parameters()}
    assert not any("q_norm" in n or "k_norm" in n for n in names)
    assert {n.split(".")[-2] for n in names if n.endswith("bias")} == {"q_proj", "k_proj", "v_proj"}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_config_loader_reads_each_family_into_the_same_model(name, tmp_path):
    """tpbench.models.hf_config (model.hf_config=PATH) on the family's config.json gives the model that
    matches transformers' (its logits within 1e-5), the fields this file sets by hand included."""
    import dataclasses

    from tpbench.models.hf_config import model_fields

    hf, _ = pair(name, False)
    hf.config.to_json_file(tmp_path / "config.json")
    fields = model_fields(str(tmp_path / "config.json"))
    known = {f.name for f in dataclasses.fields(MiniMindConfig)}
    loaded = MiniMindConfig(**{k: v for k, v in fields.items() if k in known}, flash_attn=False)
    model = MiniMindForCausalLM(loaded)
    model.load_state_dict(hf.state_dict(), strict=True)
    ids, labels = batch()
    assert (model(ids, labels)[0] - hf(input_ids=ids, labels=labels).logits).abs().max().item() <= TOL
    _, hand_written, ours = FAMILIES[name]
    for key, value in ours.items():
        assert getattr(loaded, key) == value, key
