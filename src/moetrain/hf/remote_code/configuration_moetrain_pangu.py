"""Configuration of moetrain's Pangu-style MoE decoder, as exported by ``moetrain convert --to-hf``.

Written for this folder by moetrain (``moetrain.hf.remote_code``); it describes the model that
``modeling_moetrain_pangu.py`` computes. Fields follow the usual Hugging Face names where one exists.
"""

from transformers import PretrainedConfig


class MoetrainPanguConfig(PretrainedConfig):
    """A decoder of ``num_hidden_layers`` layers: multi-head latent attention (MLA), a dense SwiGLU in the
    first ``first_k_dense_replace`` layers and a routed MoE (plus fused shared experts) after; pre-norm or
    sandwich norm; ``num_nextn_predict_layers`` multi-token-prediction modules kept for further training."""

    model_type = "moetrain_pangu"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size=2048, hidden_size=128, num_hidden_layers=8, first_k_dense_replace=0,
                 intermediate_size=384, hidden_act="silu",
                 num_attention_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                 v_head_dim=32, rotary_base=10000.0, rotary_yarn=None, max_position_embeddings=4096,
                 n_routed_experts=0, moe_intermediate_size=0, n_shared_experts=0, num_experts_per_tok=1,
                 scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                 use_score_bias=False, sandwich_norm=True, rms_norm_eps=1e-6, num_nextn_predict_layers=0,
                 initializer_range=0.02, tie_word_embeddings=False, use_cache=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.first_k_dense_replace = first_k_dense_replace
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.num_attention_heads = num_attention_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        # Own names, not rope_theta/rope_scaling: transformers rewrites those into its own rope parameters.
        self.rotary_base = rotary_base
        self.rotary_yarn = rotary_yarn
        self.max_position_embeddings = max_position_embeddings
        self.n_routed_experts = n_routed_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.n_group = n_group
        self.topk_group = topk_group
        self.use_score_bias = use_score_bias
        self.sandwich_norm = sandwich_norm
        self.rms_norm_eps = rms_norm_eps
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
