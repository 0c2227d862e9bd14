"""Hugging Face ``config.json`` ↔ moetrain ``ModelConfig`` for deepseek_v3, qwen3_moe, mixtral and
moetrain_pangu (moetrain's own modeling code, for the MLA models the others cannot compute:
``moetrain.hf.pangu``).

Torch-free, like the rest of the configs. Every field of the reference config that changes the
function the model computes is either mapped or refused with a one-line ``UserError`` naming it;
fields that only matter for serving (cache, token ids, dropout at 0) are ignored.

Training-only settings the reference configs do not carry (the aux-loss-free bias step, the balance
loss of DeepSeek-V3) take the published values (DeepSeek-V3 report §2.1.2 and §4.2: bias update speed
0.001, sequence balance coefficient 0.0001); edit the ``model.yaml`` written by ``moetrain convert`` to
change them.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from moetrain.config.model import GQAConfig, MLAConfig, ModelConfig
from moetrain.errors import UserError, describe_validation_error
from moetrain.hf import pangu

FAMILIES: tuple[str, ...] = ("deepseek_v3", "qwen3_moe", "mixtral", pangu.FAMILY)
ARCHITECTURES: dict[str, str] = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    pangu.FAMILY: pangu.ARCHITECTURE,
}
# DeepSeek-V3's q and kv latent norms are built with a fixed eps of 1e-6 in the reference code; our
# MLA uses the model's norm_eps for them, so only that value is exact.
_MLA_LATENT_NORM_EPS = 1e-6


def _refuse(family: str, field: str, value: Any, why: str) -> UserError:
    return UserError(f"{family} config field {field}={value!r} is not supported: {why}")


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` merged over the older ``rope_scaling`` keys."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def _rope_scaling(hf: dict[str, Any], family: str) -> dict[str, Any] | None:
    """Plain RoPE (None) or YaRN (DeepSeek-V3's long-context config); refuses other scalings."""
    params = _rope_params(hf)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn" or params.get("attention_factor") is not None or params.get("truncate") is False:
        field = "rope_parameters.rope_type" if hf.get("rope_parameters") else "rope_scaling.type"
        raise _refuse(family, field, rope_type, "only plain RoPE and YaRN are implemented")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if factor is None or original is None:
        raise UserError(f"{family} config: YaRN needs rope 'factor' and 'original_max_position_embeddings'")
    return {
        "factor": factor, "original_max_seq_len": original,
        "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
        "mscale": params.get("mscale") or 0.0, "mscale_all_dim": params.get("mscale_all_dim") or 0.0,
    }


def _rope_theta(hf: dict[str, Any], family: str) -> float:
    """rope_theta from transformers-5 ``rope_parameters`` or the older top-level keys."""
    params = _rope_params(hf)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise UserError(f"{family} config has no rope_theta (neither in rope_parameters nor at the top level)")
    return float(theta)


def _check_common(hf: dict[str, Any], family: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _refuse(family, "hidden_act", act, "experts and dense FFNs are SwiGLU (silu) only")
    if hf.get("attention_bias"):
        raise _refuse(family, "attention_bias", True, "attention projections have no bias here")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise _refuse(family, "quantization_config.quant_method", method,
                      "dequantize the checkpoint to bf16/fp32 first")


def _common_fields(hf: dict[str, Any], family: str, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(hf, family),
        "rope_scaling": _rope_scaling(hf, family),
        "max_seq_len": hf.get("max_position_embeddings", 4096),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def _balance_coef(hf: dict[str, Any]) -> float:
    # transformers adds the Switch-style balance loss only when output_router_logits is on.
    return float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0


def _deepseek_v3(hf: dict[str, Any], name: str) -> dict[str, Any]:
    family = "deepseek_v3"
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        raise _refuse(family, "scoring_func", hf["scoring_func"], "DeepSeek-V3 routing is sigmoid")
    if hf.get("moe_layer_freq", 1) != 1:
        raise _refuse(family, "moe_layer_freq", hf["moe_layer_freq"], "every layer after the dense ones is MoE")
    eps = hf.get("rms_norm_eps", 1e-6)
    if eps != _MLA_LATENT_NORM_EPS:
        raise _refuse(family, "rms_norm_eps", eps,
                      f"the reference MLA latent norms use eps {_MLA_LATENT_NORM_EPS}, which must equal it")
    num_layers = hf["num_hidden_layers"]
    num_dense = min(int(hf.get("first_k_dense_replace", 0) or 0), num_layers)
    num_groups = int(hf.get("n_group") or 1)
    top_k = int(hf["num_experts_per_tok"])
    moe = None
    if num_dense < num_layers:
        moe = {
            "num_experts": hf["n_routed_experts"],
            "expert_ffn_hidden": hf["moe_intermediate_size"],
            "num_shared_experts": int(hf.get("n_shared_experts") or 0),
            "router": {
                "score_function": "sigmoid", "top_k": top_k,
                "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
                "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
                "num_groups": num_groups, "num_top_groups": int(hf.get("topk_group") or 1),
                "score_bias": True, "bias_update_rate": 1e-3, "expert_balance_coef": 1e-4,
            },
        }
    return {
        **_common_fields(hf, family, name),
        "num_dense_layers": num_dense if moe is not None else 0,
        "dense_ffn_hidden": hf.get("intermediate_size", 0) if num_dense else 0,
        "attention": {
            "kind": "mla", "num_heads": hf["num_attention_heads"], "q_lora_rank": hf.get("q_lora_rank") or 0,
            "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
            "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"],
        },
        "moe": moe,
    }


def _leading_dense_layers(hf: dict[str, Any], family: str) -> int:
    """Qwen3-MoE may make any layer dense; only a leading block of dense layers is representable."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    if step != 1:
        raise _refuse(family, "decoder_sparse_step", step, "only every layer (1) can be sparse")
    dense = sorted(int(i) for i in (hf.get("mlp_only_layers") or []))
    if dense != list(range(len(dense))):
        raise _refuse(family, "mlp_only_layers", dense, "dense layers must be a leading block 0..k-1")
    return len(dense)


def _qwen3_moe(hf: dict[str, Any], name: str) -> dict[str, Any]:
    family = "qwen3_moe"
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        raise _refuse(family, "sliding_window", hf["sliding_window"], "attention here is full causal")
    num_dense = _leading_dense_layers(hf, family)
    heads = hf["num_attention_heads"]
    return {
        **_common_fields(hf, family, name),
        "num_dense_layers": num_dense,
        "dense_ffn_hidden": hf.get("intermediate_size", 0) if num_dense else 0,
        "attention": {
            "kind": "gqa", "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "qk_norm": True,
        },
        "moe": {
            # transformers 5 writes num_local_experts; earlier versions and the published configs num_experts.
            "num_experts": hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            "expert_ffn_hidden": hf["moe_intermediate_size"],
            "router": {
                "score_function": "softmax", "top_k": hf["num_experts_per_tok"],
                "normalize_top_k": bool(hf.get("norm_topk_prob", False)),
                "expert_balance_coef": _balance_coef(hf),
            },
        },
    }


def _mixtral(hf: dict[str, Any], name: str) -> dict[str, Any]:
    family = "mixtral"
    if hf.get("sliding_window") is not None:
        raise _refuse(family, "sliding_window", hf["sliding_window"], "attention here is full causal; set it to null")
    heads = hf["num_attention_heads"]
    return {
        **_common_fields(hf, family, name),
        "attention": {
            "kind": "gqa", "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "qk_norm": False,
        },
        "moe": {
            "num_experts": hf["num_local_experts"],
            "expert_ffn_hidden": hf["intermediate_size"],
            # Mixtral: softmax over all experts, top-k, renormalised (= softmax over the chosen k).
            "router": {"score_function": "softmax", "top_k": hf["num_experts_per_tok"], "normalize_top_k": True,
                       "expert_balance_coef": _balance_coef(hf)},
        },
    }


_FROM_HF = {"deepseek_v3": _deepseek_v3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
            pangu.FAMILY: pangu.model_fields_from_pangu}


def family_of(hf: dict[str, Any], source: str = "config.json") -> str:
    family = hf.get("model_type")
    if family not in _FROM_HF:
        raise UserError(
            f"{source}: model_type {family!r} is not supported; supported families: {', '.join(FAMILIES)}"
        )
    return family


def model_config_from_hf(hf: dict[str, Any], name: str = "hf-model", source: str = "config.json") -> ModelConfig:
    """The moetrain config computing the same function as the reference model of ``hf`` (config.json)."""
    family = family_of(hf, source)
    _check_common(hf, family)
    try:
        fields = _FROM_HF[family](hf, name)
    except KeyError as exc:
        raise UserError(f"{source}: {family} config lacks the field {exc.args[0]!r}") from None
    try:
        return ModelConfig.model_validate(fields)
    except ValidationError as exc:
        raise UserError(describe_validation_error(source, exc)) from None


# ----- the other way: moetrain → config.json -----

def hf_family_for(cfg: ModelConfig) -> str:
    """The family that computes exactly what ``cfg`` does: a transformers family where one does (so the
    folder needs no code of its own), else moetrain_pangu for MLA models; refuses what none can."""
    if not cfg.gated_ffn:
        raise UserError(f"model {cfg.name}: ffn_act={cfg.ffn_act!r} cannot be exported; only swiglu")
    if isinstance(cfg.attention, MLAConfig):
        router = cfg.moe.router if cfg.moe is not None else None
        deepseek = (cfg.norm_style == "pre" and router is not None and router.score_function == "sigmoid"
                    and cfg.norm_eps == _MLA_LATENT_NORM_EPS)  # its latent norms fix eps at 1e-6
        return "deepseek_v3" if deepseek else pangu.FAMILY
    if cfg.norm_style != "pre":
        raise UserError(f"model {cfg.name}: norm_style={cfg.norm_style!r} with GQA attention has no Hugging Face "
                        "family here; only MLA models export with sandwich norm (as moetrain_pangu)")
    if cfg.moe is None:
        raise UserError(f"model {cfg.name}: dense GQA models (no moe section) cannot be exported to an MoE family")
    router = cfg.moe.router
    family = "qwen3_moe" if cfg.attention.qk_norm else "mixtral"
    problems = []
    if router.score_function != "softmax":
        problems.append(f"score_function={router.score_function!r} (needs softmax)")
    if router.num_groups != 1:
        problems.append(f"num_groups={router.num_groups} (needs 1)")
    if router.scaling_factor != 1.0:
        problems.append(f"scaling_factor={router.scaling_factor} (needs 1)")
    if router.score_bias:
        problems.append("score_bias=true (needs false)")
    if cfg.moe.num_shared_experts:
        problems.append(f"num_shared_experts={cfg.moe.num_shared_experts} (needs 0)")
    if family == "mixtral" and not router.normalize_top_k:
        problems.append("normalize_top_k=false (Mixtral renormalises)")
    if family == "mixtral" and cfg.num_dense_layers:
        problems.append(f"num_dense_layers={cfg.num_dense_layers} (Mixtral has none)")
    if problems:
        raise UserError(f"model {cfg.name} cannot be exported as {family}: " + "; ".join(problems))
    return family


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = cfg.rope_scaling
    return {
        "rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_seq_len, "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow, "mscale": yarn.mscale, "mscale_all_dim": yarn.mscale_all_dim,
    }


def _common_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": _rope_to_hf(cfg),
        "rope_theta": cfg.rope_theta,  # read by transformers 4.x
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "use_cache": True,
    }


def hf_config_from_model(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """config.json for the family ``hf_family_for(cfg)``; ``model_config_from_hf`` inverts it."""
    family = hf_family_for(cfg)
    if family == pangu.FAMILY:
        return pangu.pangu_config_from_model(cfg, dtype_name)
    assert cfg.moe is not None
    router, attn = cfg.moe.router, cfg.attention
    out = {**_common_to_hf(cfg, family), "dtype": dtype_name, "num_experts_per_tok": router.top_k}
    if family == "deepseek_v3":
        assert isinstance(attn, MLAConfig)
        out.update({
            "num_attention_heads": attn.num_heads, "num_key_value_heads": attn.num_heads,
            "q_lora_rank": attn.q_lora_rank or None, "kv_lora_rank": attn.kv_lora_rank,
            "qk_nope_head_dim": attn.qk_nope_head_dim, "qk_rope_head_dim": attn.qk_rope_head_dim,
            "v_head_dim": attn.v_head_dim,
            # Published DeepSeek-V3 weights keep rotary pairs interleaved; save.py permutes to match.
            "rope_interleave": True,
            "n_routed_experts": cfg.moe.num_experts, "moe_intermediate_size": cfg.moe.expert_ffn_hidden,
            "n_shared_experts": cfg.moe.num_shared_experts, "first_k_dense_replace": cfg.num_dense_layers,
            "intermediate_size": cfg.dense_ffn_hidden or cfg.moe.expert_ffn_hidden,
            "n_group": router.num_groups, "topk_group": router.num_top_groups,
            "norm_topk_prob": router.normalize_top_k, "routed_scaling_factor": router.scaling_factor,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            # MTP modules are not exported (see docs/hf.md).
            "num_nextn_predict_layers": 0,
        })
        return out
    assert isinstance(attn, GQAConfig)
    out.update({
        "num_attention_heads": attn.num_heads, "num_key_value_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
        "sliding_window": None, "router_aux_loss_coef": router.expert_balance_coef,
        "output_router_logits": router.expert_balance_coef > 0,
    })
    if family == "qwen3_moe":
        out.update({
            "num_experts": cfg.moe.num_experts, "moe_intermediate_size": cfg.moe.expert_ffn_hidden,
            "intermediate_size": cfg.dense_ffn_hidden or cfg.moe.expert_ffn_hidden,
            "norm_topk_prob": router.normalize_top_k, "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.num_dense_layers)), "use_sliding_window": False,
        })
    else:
        out.update({"num_local_experts": cfg.moe.num_experts, "intermediate_size": cfg.moe.expert_ffn_hidden,
                    "router_jitter_noise": 0.0})
    return out


__all__ = ["ARCHITECTURES", "FAMILIES", "family_of", "hf_config_from_model", "hf_family_for", "model_config_from_hf"]
