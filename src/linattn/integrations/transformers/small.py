"""Small random models of every family, sized as transformers' model testers size them: for tests,
the README, the demo and the benchmarks."""

from __future__ import annotations

from torch import nn

from .route import check_family, require_transformers

#: Linear-attention and full-attention layers mixed, as the hybrids do (1 in 4 full).
SMALL_LAYER_TYPES = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def small_config(model_type: str, *, hidden_size: int = 64, heads: int = 4, key_heads: int | None = None,
                 head_dim: int = 16, layer_types: tuple[str, ...] = SMALL_LAYER_TYPES, vocab_size: int = 99,
                 state_size: int | None = None, **options):
    """A small random configuration of ``model_type``'s family, built with its own config class and
    sized as transformers' model testers size them: ``hidden_size``, the linear layers' ``heads``
    value heads of width ``head_dim`` (queries and keys too), ``key_heads`` query/key heads for the
    families with grouped value heads (None: ``heads // 2`` there; the KDA families have none), the
    given layer types, small full-attention layers, experts and vocabulary. GLM5-Next gets its
    composite config (text and a one-block vision tower), since its causal LM is multimodal.

    The Mamba-2 families: ``heads`` SSD heads of width ``head_dim`` (the mixer's width is
    ``heads * head_dim``), ``key_heads`` groups of B and C (None: ``heads // 2``), ``state_size``
    (None: ``head_dim``), convolution kernel 4 and transformers' own chunk length 8 (so its scan
    pads and crosses chunks at small N). Mamba-2 has no attention layer (``layer_types`` gives
    only the number of layers); Falcon-H1 runs attention and the mixer side by side in every
    layer; Zamba2's ``"full_attention"`` layers are its hybrid layers (the shared attention block,
    then a mixer). ``options`` go to the config class as they are (``time_step_limit``,
    ``mamba_rms_norm``, ...)."""
    family = check_family(model_type)
    transformers = require_transformers("small_config")
    layers = list(layer_types)
    if family.rule == "ssd":
        return _small_ssd_config(transformers, model_type, layers, hidden_size=hidden_size, heads=heads,
                                 groups=max(heads // 2, 1) if key_heads is None else key_heads, head_dim=head_dim,
                                 state_size=head_dim if state_size is None else state_size, vocab_size=vocab_size,
                                 options=options)
    if state_size is not None or options:
        raise ValueError(f"small_config: state_size and config options are for the Mamba-2 families, not {model_type} "
                         f"(got state_size={state_size}, options {sorted(options)})")
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(layers), pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, layer_types=layers)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)  # 16: bf16 grouped_mm wants 16-byte strides
    if family.rule == "gated_delta_rule":
        if key_heads is None:
            key_heads = max(heads // 2, 1)
        gdn = dict(common, linear_num_key_heads=key_heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
                   linear_value_head_dim=head_dim, num_attention_heads=4, num_key_value_heads=2)
        qwen_moe = dict(moe, num_experts=4, shared_expert_intermediate_size=16)
        if model_type == "qwen3_next":
            return transformers.Qwen3NextConfig(**gdn, head_dim=16, intermediate_size=37, **qwen_moe)
        if model_type == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**gdn, head_dim=16, intermediate_size=37)
        if model_type == "qwen3_5_moe":
            return transformers.Qwen3_5MoeTextConfig(**gdn, head_dim=16, **qwen_moe)
        if model_type == "qwen4_exp":
            return transformers.Qwen4ExpTextConfig(
                **gdn, head_dim=16, **qwen_moe, hc_count=2, hc_lowrank=8, ngram_vocab_size_base=1000,
                make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4, heads_per_ngram=2, indexer_n_heads=2,
                indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2)
        return transformers.OlmoHybridConfig(**gdn, intermediate_size=37)  # olmo_hybrid
    if key_heads not in (None, heads):
        raise ValueError(f"small_config: {model_type} (KDA) has no grouped value heads; key_heads must be None or "
                         f"heads = {heads}, got {key_heads}")
    kda = dict(common, linear_num_heads=heads, linear_head_dim=head_dim, num_attention_heads=4, num_key_value_heads=4,
               intermediate_size=37, kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=16, **moe)
    mlp = ["dense" if i % 2 == 0 else "sparse" for i in range(len(layers))]
    if model_type == "kimi_linear":
        return transformers.KimiLinearConfig(**kda, num_local_experts=4, q_lora_rank=None, qk_rope_head_dim=8,
                                             mlp_layer_types=mlp)
    if model_type == "bailing_hybrid":
        return transformers.BailingHybridConfig(**kda, num_local_experts=4, head_dim=16, n_group=1, topk_group=1,
                                                first_k_dense_replace=1, qk_rope_head_dim=8)
    text = transformers.Glm5NextTextConfig(**kda, n_routed_experts=4, q_lora_rank=16, qk_rope_head_dim=0,
                                           mlp_layer_types=mlp, index_topk=8, index_head_dim=8, index_n_heads=2,
                                           hc_mult=2, index_kpool=4)  # glm5_next
    vision = transformers.Glm5NextVisionConfig(depth=1, hidden_size=16, num_heads=2, out_hidden_size=hidden_size,
                                               intermediate_size=16, patch_size=2, image_size=8, temporal_patch_size=1)
    return transformers.Glm5NextConfig(text_config=text.to_dict(), vision_config=vision.to_dict())


def _small_ssd_config(transformers, model_type: str, layers: list[str], *, hidden_size: int, heads: int, groups: int,
                      head_dim: int, state_size: int, vocab_size: int, options: dict):
    if heads % groups:
        raise ValueError(f"small_config: {model_type}'s heads ({heads}) must be a multiple of its groups (key_heads = "
                         f"{groups})")
    width = heads * head_dim
    if width % hidden_size:
        raise ValueError(f"small_config: {model_type}'s mixer width heads * head_dim = {width} must be a multiple of "
                         f"hidden_size = {hidden_size} (its config has an integer expansion factor)")
    expand = width // hidden_size
    full = [i for i, kind in enumerate(layers) if kind == "full_attention"]
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    attention = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=37)
    mamba = dict(mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=groups, mamba_d_state=state_size,
                 mamba_d_conv=4, mamba_expand=expand, mamba_chunk_size=8)
    if model_type == "mamba2":
        return transformers.Mamba2Config(**common, num_hidden_layers=len(layers), num_heads=heads, head_dim=head_dim,
                                         state_size=state_size, expand=expand, n_groups=groups, conv_kernel=4,
                                         chunk_size=8, **options)
    if model_type == "bamba":
        return transformers.BambaConfig(**common, **attention, **mamba, num_hidden_layers=len(layers),
                                        attn_layer_indices=full, **options)
    if model_type == "falcon_h1":
        # muP multipliers away from 1, so that every one of them is exercised
        muls = dict(ssm_in_multiplier=0.75, ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.9], ssm_out_multiplier=1.1)
        return transformers.FalconH1Config(**common, **attention, **mamba, num_hidden_layers=len(layers),
                                           mamba_d_ssm=width, head_dim=16, **(muls | options))
    if model_type == "granitemoehybrid":
        # experts of width 16: grouped_mm wants 16-byte strides
        return transformers.GraniteMoeHybridConfig(
            **common, **(attention | dict(intermediate_size=16)), **mamba, num_hidden_layers=len(layers), layer_types=layers, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=16, position_embedding_type="rope", **options)
    if model_type == "nemotron_h":
        # a plain MLP after each layer, as Nemotron-H alternates mixers and MLPs
        blocks = [kind for layer in layers for kind in (layer, "mlp")]
        return transformers.NemotronHConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=37,
            layers_block_type=blocks, mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups,
            ssm_state_size=state_size, expand=expand, conv_kernel=4, chunk_size=8, **options)
    # zamba2: a hybrid layer is the shared attention block followed by a mixer
    blocks = ["hybrid" if kind == "full_attention" else kind for kind in layers]
    return transformers.Zamba2Config(**common, num_hidden_layers=len(layers), layers_block_type=blocks,
                                     num_attention_heads=4, num_key_value_heads=4, intermediate_size=37,
                                     n_mamba_heads=heads, mamba_ngroups=groups, mamba_d_state=state_size,
                                     mamba_d_conv=4, mamba_expand=expand, chunk_size=8, num_mem_blocks=1,
                                     adapter_rank=8, **options)


def causal_lm(config, **kwargs) -> nn.Module:
    """The family's causal language model built from ``config`` with transformers' ``from_config``
    (so :func:`enable` applies): ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for
    GLM5-Next, whose causal LM is multimodal. ``kwargs`` go to ``from_config`` (``dtype``, ...)."""
    transformers = require_transformers("causal_lm")
    if config.model_type == "glm5_next":
        return transformers.AutoModelForImageTextToText.from_config(config, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
