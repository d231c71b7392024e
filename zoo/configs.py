"""Turns a zoo `ModelSpec` plus its tokenizer's special-token ids into a Hugging Face config."""

from __future__ import annotations

from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, Qwen2_5_VLConfig, Qwen2VLConfig

from .specs import ModelSpec


def _qwen_text(spec: ModelSpec, ids: dict[str, int]) -> dict:
    t = spec.text
    return dict(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
        hidden_act="silu", max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
        tie_word_embeddings=t.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                         "mrope_section": list(t.mrope_section)},
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
    )


def hf_config(spec: ModelSpec, ids: dict[str, int]):
    """ids: token ids from the checkpoint's tokenizer (bos, eos, pad, image, video, vision_start, vision_end).

    Every id must lie inside the embedding, or the model would index past it.
    """
    for key, value in ids.items():
        if value is not None and not 0 <= value < spec.text.vocab_size:
            raise ValueError(f"{spec.name}: token id {key}={value} lies outside vocab_size {spec.text.vocab_size}")
    v, t = spec.vision, spec.text
    if spec.arch == "qwen2_vl":
        vision = dict(depth=v.depth, embed_dim=v.hidden_size, hidden_size=t.hidden_size,
                      mlp_ratio=v.intermediate_size // v.hidden_size, num_heads=v.num_heads,
                      patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                      temporal_patch_size=v.temporal_patch_size, hidden_act="quick_gelu")
        cls = Qwen2VLConfig
    elif spec.arch == "qwen2_5_vl":
        vision = dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                      out_hidden_size=t.hidden_size, num_heads=v.num_heads, patch_size=v.patch_size,
                      spatial_merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
                      window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_block_indexes),
                      tokens_per_second=2, hidden_act="silu")
        cls = Qwen2_5_VLConfig
    else:
        text = LlamaConfig(
            vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
            num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
            max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta},
            tie_word_embeddings=t.tie_word_embeddings,
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        )
        vision = CLIPVisionConfig(
            hidden_size=v.hidden_size, intermediate_size=v.intermediate_size, num_hidden_layers=v.depth,
            num_attention_heads=v.num_heads, image_size=v.image_size, patch_size=v.patch_size,
            projection_dim=v.projection_dim, hidden_act="quick_gelu",
        )
        n_patches = (v.image_size // v.patch_size) ** 2
        return LlavaConfig(
            vision_config=vision, text_config=text, image_token_index=ids["image"],
            image_seq_length=n_patches, projector_hidden_act="gelu", vision_feature_layer=-2,
            vision_feature_select_strategy="default", tie_word_embeddings=t.tie_word_embeddings,
        )
    return cls(
        text_config=_qwen_text(spec, ids), vision_config=vision,
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=t.tie_word_embeddings,
    )
