"""BERT encoders (`model_type: bert`: BertModel as sentence-transformers ships all-MiniLM and bge, or a head's
checkpoint of one): bidirectional, post-LayerNorm, biases on every product, an ungated GELU MLP, learned absolute
positions and token types, an embedding LayerNorm. Its whole config is its own (`hf_config`, `gguf_config`), and so
are its tensor names (`tensor_name`). nomic-bert (rotary, SwiGLU, shipped as remote code) is refused by name.
"""
from typing import Callable

from ..weights.common import LlamaConfig, WeightLoadError
from . import Family

# config.json's hidden_act -> LlamaConfig.hidden_act (transformers' "gelu" is the exact, erf form)
ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# LlamaConfig's encoder switches, every one a difference from LLaMA
_ENCODER = dict(architecture="bert", attention_bias=True, o_bias=True, causal=False, norm="layer", post_norm=True,
                gated_mlp=False, mlp_bias=True, learned_positions=True, embed_norm=True, bos_token_id=None,
                eos_token_id=None)
# its tensors (BertModel's names; a head's checkpoint has them under "bert.") -> the internal names: the
# embedding's parts, and per layer (after "encoder.layer.N.") its products and post norms
EMBEDDINGS = {"embeddings.word_embeddings.weight": "model.embed_tokens.weight",
              "embeddings.position_embeddings.weight": "model.embed_positions.weight",
              "embeddings.token_type_embeddings.weight": "model.embed_token_types.weight",
              "embeddings.LayerNorm.weight": "model.embed_norm.weight",
              "embeddings.LayerNorm.bias": "model.embed_norm.bias"}
LAYER = {"attention.self.query": "self_attn.q_proj", "attention.self.key": "self_attn.k_proj",
         "attention.self.value": "self_attn.v_proj", "attention.output.dense": "self_attn.o_proj",
         "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "mlp.up_proj",
         "output.dense": "mlp.down_proj", "output.LayerNorm": "mlp_output_norm"}


def tensor_name(name: str) -> str:
    """The internal name of a BERT checkpoint's tensor (a name the model does not use stays as it is)."""
    name = name.removeprefix("bert.")
    if name in EMBEDDINGS:
        return EMBEDDINGS[name]
    if name.startswith("encoder.layer."):
        _, _, layer, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        if module in LAYER and kind in ("weight", "bias"):
            return f"model.layers.{layer}.{LAYER[module]}.{kind}"
    return name


def hf_config(raw: dict, path: str) -> LlamaConfig:
    """Its LlamaConfig from config.json; an option it would compute wrong without (relative positions, a decoder,
    another activation) fails naming it."""
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise WeightLoadError(f"{path}: position_embedding_type={kind!r} is not supported (only absolute)")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise WeightLoadError(f"{path}: a BERT decoder (is_decoder / add_cross_attention) is not supported; only "
                              "the bidirectional encoder")
    act = raw.get("hidden_act", "gelu")
    if act not in ACTS:
        raise WeightLoadError(f"{path}: hidden_act={act!r} is not supported for bert (supported: {', '.join(ACTS)})")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return LlamaConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)), hidden_act=ACTS[act],
            type_vocab_size=int(raw.get("type_vocab_size", 2)), **_ENCODER)
    except KeyError as e:
        raise WeightLoadError(f"{path}: missing key {e.args[0]!r}") from None


def gguf_config(path: str, meta: Callable, tensors: dict) -> LlamaConfig:
    """Its LlamaConfig from a GGUF's `bert.*` (convert_hf_to_gguf.py's BertModel): GELU in its exact form, as the
    HF model it was converted from computes it. A causal `bert.attention.causal` is refused."""
    if meta("bert.attention.causal", False, required=False):
        raise WeightLoadError(f"{path}: GGUF bert.attention.causal=true is not supported (a bidirectional encoder)")
    hidden, heads = int(meta("bert.embedding_length")), int(meta("bert.attention.head_count"))
    for name in ("token_embd.weight", "position_embd.weight", "token_embd_norm.weight"):
        if name not in tensors:
            raise WeightLoadError(f"{path}: GGUF tensor {name!r} is missing")
    types = tensors.get("token_types.weight")
    return LlamaConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]), hidden_size=hidden,
        intermediate_size=int(meta("bert.feed_forward_length")), num_layers=int(meta("bert.block_count")),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=float(meta("bert.attention.layer_norm_epsilon", 1e-12)),
        max_position_embeddings=int(meta("bert.context_length", 512)), hidden_act="gelu",
        type_vocab_size=0 if types is None else int(types.shape[-1]), **_ENCODER)


FAMILY = Family(
    name="bert", title="BERT encoders",
    hf_architectures=("BertModel",), hf_model_types=("bert",), gguf_architecture="bert",
    refused_model_types={"nomic_bert": "nomic_bert (rotary, SwiGLU; its modelling code ships with the checkpoint) is "
                                       "not supported; BERT encoders (model_type bert: all-MiniLM, bge, ...) are"},
    config_keys=("layer_norm_eps", "type_vocab_size", "position_embedding_type", "is_decoder", "add_cross_attention"),
    attention_bias=True, o_bias=True, hidden_act="gelu", causal=False,
    hf_config=hf_config, hf_tensor_name=tensor_name, gguf_config=gguf_config,
    chat_format="none: an encoder, served for embeddings only (model_config.task embed)",
    readme_row="BERT encoders (all-MiniLM, bge)",
    tests=("tests/integration/test_encoders.py", "tests/unit/test_bert.py",
           "tests/unit/test_bert.py::test_a_bert_config_is_llama_with_the_encoder_switches"),
    test_models=("bert", "bert-cls"),
)
