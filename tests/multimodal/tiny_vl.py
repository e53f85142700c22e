"""A tiny random MiniMax M3 VL config for tests (transformers' own config class)."""

from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLConfig


def tiny_vl_config(vision_layers: int = 2, **vision_overrides) -> MiniMaxM3VLConfig:
    """Small enough for a 2-core CPU; head_dim 16 leaves a 3*4-pair RoPE span and 4 unrotated."""
    vision = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    vision.update(vision_overrides)
    text = dict(
        hidden_size=48,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        vocab_size=300,
        num_local_experts=2,
        num_experts_per_tok=1,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        rotary_dim=12,
        index_head_dim=16,
        index_n_heads=1,
        mlp_layer_types=["dense"],
        bos_token_id=1,
        eos_token_id=2,
    )
    return MiniMaxM3VLConfig(
        vision_config=vision,
        text_config=text,
        projector_hidden_size=40,
        image_token_index=290,
        video_token_index=291,
    )


MEDIA_SPECIAL_TOKENS = ["]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>["]


def tiny_tokenizer():
    """A character-level fast tokenizer with M3's media tokens as special tokens (ids 96..99)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(code): code - 32 for code in range(32, 127)}
    vocab["<unk>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": MEDIA_SPECIAL_TOKENS})
    return tokenizer
