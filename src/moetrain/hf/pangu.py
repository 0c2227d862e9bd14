"""``moetrain_pangu``: the Hugging Face family of moetrain's own modeling code, for the MLA models that
no transformers family computes (Pangu's sandwich norm, a norm eps other than DeepSeek-V3's fixed 1e-6,
softmax routing over MLA, dense MLA models).

An exported folder carries ``configuration_moetrain_pangu.py`` and ``modeling_moetrain_pangu.py``
(``moetrain.hf.remote_code``) and an ``auto_map`` in ``config.json``, so transformers loads it with
``trust_remote_code=True``, as released Pangu checkpoints are loaded. The multi-token-prediction modules
travel too (``model.mtp_layers.{j}``), and ``moetrain_training`` keeps the training-only settings (balance
losses, bias update rate, init), so ``moetrain convert --from-hf`` gets back the very model config.

Torch-free: the config mapping only; the tensor names are in ``moetrain.hf.weights``.
"""

from __future__ import annotations

from typing import Any

from moetrain.config.model import MLAConfig, ModelConfig

FAMILY = "moetrain_pangu"
ARCHITECTURE = "MoetrainPanguForCausalLM"
REMOTE_CODE_FILES = ("configuration_moetrain_pangu.py", "modeling_moetrain_pangu.py")
AUTO_MAP = {
    "AutoConfig": "configuration_moetrain_pangu.MoetrainPanguConfig",
    "AutoModelForCausalLM": "modeling_moetrain_pangu.MoetrainPanguForCausalLM",
}
_TRAINING_ROUTER_FIELDS = ("bias_update_rate", "expert_balance_coef", "device_balance_coef", "num_device_groups",
                           "z_loss_coef")
_TRAINING_MODEL_FIELDS = ("post_norm_gain", "init", "init_std", "mtp_loss_weight")


def _yarn_to_hf(cfg: ModelConfig) -> dict[str, Any] | None:
    yarn = cfg.rope_scaling
    if yarn is None:
        return None
    return {"factor": yarn.factor, "original_max_position_embeddings": yarn.original_max_seq_len,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow, "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim}


def pangu_config_from_model(cfg: ModelConfig, dtype_name: str) -> dict[str, Any]:
    """config.json of ``cfg`` in the moetrain_pangu family (``model_fields_from_pangu`` inverts it)."""
    attn = cfg.attention
    assert isinstance(attn, MLAConfig)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE], "model_type": FAMILY, "auto_map": dict(AUTO_MAP), "dtype": dtype_name,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "first_k_dense_replace": cfg.num_dense_layers if cfg.moe is not None else cfg.num_layers,
        "intermediate_size": cfg.dense_ffn_hidden, "hidden_act": "silu",
        "num_attention_heads": attn.num_heads, "q_lora_rank": attn.q_lora_rank, "kv_lora_rank": attn.kv_lora_rank,
        "qk_nope_head_dim": attn.qk_nope_head_dim, "qk_rope_head_dim": attn.qk_rope_head_dim,
        "v_head_dim": attn.v_head_dim, "rotary_base": cfg.rope_theta, "rotary_yarn": _yarn_to_hf(cfg),
        "max_position_embeddings": cfg.max_seq_len, "sandwich_norm": cfg.norm_style == "sandwich",
        "rms_norm_eps": cfg.norm_eps, "num_nextn_predict_layers": cfg.num_mtp_layers,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std, "use_cache": False,
        "moetrain_training": {field: getattr(cfg, field) for field in _TRAINING_MODEL_FIELDS},
    }
    moe = cfg.moe
    if moe is None:
        out.update({"n_routed_experts": 0, "moe_intermediate_size": 0, "n_shared_experts": 0,
                    "num_experts_per_tok": 1})
        return out
    router = moe.router
    out.update({
        "n_routed_experts": moe.num_experts, "moe_intermediate_size": moe.expert_ffn_hidden,
        "n_shared_experts": moe.num_shared_experts, "num_experts_per_tok": router.top_k,
        "scoring_func": router.score_function, "norm_topk_prob": router.normalize_top_k,
        "routed_scaling_factor": router.scaling_factor, "n_group": router.num_groups,
        "topk_group": router.num_top_groups, "use_score_bias": router.score_bias,
    })
    out["moetrain_training"].update({f"router_{field}": getattr(router, field) for field in _TRAINING_ROUTER_FIELDS})
    return out


def model_fields_from_pangu(hf: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a moetrain_pangu config.json."""
    training = hf.get("moetrain_training") or {}
    num_layers = hf["num_hidden_layers"]
    num_dense = min(int(hf.get("first_k_dense_replace") or 0), num_layers)
    yarn = hf.get("rotary_yarn")
    fields: dict[str, Any] = {
        "name": name, "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": num_layers,
        "dense_ffn_hidden": hf.get("intermediate_size") or 0,
        "attention": {"kind": "mla", "num_heads": hf["num_attention_heads"], "q_lora_rank": hf.get("q_lora_rank") or 0,
                      "kv_lora_rank": hf["kv_lora_rank"], "qk_nope_head_dim": hf["qk_nope_head_dim"],
                      "qk_rope_head_dim": hf["qk_rope_head_dim"], "v_head_dim": hf["v_head_dim"]},
        "norm_style": "sandwich" if hf.get("sandwich_norm") else "pre", "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": float(hf.get("rotary_base", 10000.0)),
        "rope_scaling": None if not yarn else {
            "factor": yarn["factor"], "original_max_seq_len": yarn["original_max_position_embeddings"],
            "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
            "mscale_all_dim": yarn["mscale_all_dim"]},
        "max_seq_len": hf.get("max_position_embeddings", 4096),
        "num_mtp_layers": int(hf.get("num_nextn_predict_layers") or 0),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **{field: training[field] for field in _TRAINING_MODEL_FIELDS if field in training},
    }
    if not hf.get("n_routed_experts") or num_dense >= num_layers:
        return {**fields, "num_dense_layers": 0, "moe": None}
    router = {
        "score_function": hf.get("scoring_func", "sigmoid"), "top_k": hf["num_experts_per_tok"],
        "normalize_top_k": bool(hf.get("norm_topk_prob", True)),
        "scaling_factor": float(hf.get("routed_scaling_factor", 1.0)), "num_groups": int(hf.get("n_group") or 1),
        "num_top_groups": int(hf.get("topk_group") or 1), "score_bias": bool(hf.get("use_score_bias", False)),
        **{field: training[f"router_{field}"] for field in _TRAINING_ROUTER_FIELDS if f"router_{field}" in training},
    }
    return {**fields, "num_dense_layers": num_dense,
            "moe": {"num_experts": hf["n_routed_experts"], "expert_ffn_hidden": hf["moe_intermediate_size"],
                    "num_shared_experts": int(hf.get("n_shared_experts") or 0), "router": router}}
