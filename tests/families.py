"""The LLaMA family's members as tiny random models that transformers itself makes, for tests that compare this
server with transformers (the reference) and a HuggingFace directory with its GGUF twin.

- `FAMILIES`: each member's config.json (transformers 5.x's form) at test size; `config_json_v4` writes one as
  transformers 4.x did.
- `make_hf_model(family, path, seed)`: the model, random (torch.manual_seed) and scaled so that greedy choices are
  clear, saved by transformers' save_pretrained (float32 safetensors), with a byte-level BPE tokenizer.json of the
  model's vocabulary and a ChatML template (tokenizer_config.json), so a server starts from the directory.
- `write_mxfp4_hf(hf_path, out_path)`: a gpt-oss directory with its experts in MXFP4 as openai's checkpoints store
  them (uint8 `..._blocks` and `..._scales`, `quantization_config` mxfp4 in config.json), quantized by
  `quantize_mxfp4_hf`.
- `transformers_logits(path, ids)`, `transformers_greedy(path, prompt_ids, n)`: what transformers computes (an MXFP4
  directory dequantized by transformers itself).
- `ENCODERS`, `make_bert_model(name, path, seed)`: a tiny random BERT encoder as sentence-transformers ships one
  (BertModel's safetensors, modules.json and 1_Pooling/config.json naming its pooling, a WordPiece tokenizer.json
  whose post-processor adds [CLS] ... [SEP]); `transformers_embedding(path, ids, pooling)`: sentence-transformers'
  vector computed with transformers (its pooling over the model's last hidden states, L2-normalized);
  `write_bert_gguf(hf_path, out_path, qtype)`: its GGUF as convert_hf_to_gguf.py's BertModel writes it.
- `make_gemma3_vl(path, seed)`: a tiny random Gemma3ForConditionalGeneration with its SigLIP tower, image processor and
  a tokenizer holding Gemma 3's image tokens (a ChatML template that marks an image part); `vision_prompt_ids(path,
  turns)`: the prompt ids transformers' Gemma 3 processor makes of a chat, tokenized apart from the server.
  `make_smolvlm` and `make_qwen25_vl`: the same of SmolVLM and of Qwen2.5-VL (its windowed tower, an image at its
  own size, M-RoPE in the text model).
- `write_gguf(family, hf_path, out_path, qtype)`: the directory as llama.cpp's convert_hf_to_gguf.py writes it
  (tensor names from the gguf package's map, q/k rows permuted for the architectures whose llama.cpp RoPE pairs
  neighbours, Gemma's norms stored as 1 + w, Phi-3's fused tensors and longrope factors, the metadata keys; the
  vocabulary included), F32 or quantized by gguf.quants (`expert_qtype`: a mixture's expert stacks in their own type,
  as llama-quantize's MXFP4_MOE keeps gpt-oss's).

torch and transformers (the test extra) are imported only when a model is made or run: `needs_transformers()`
skips the calling test when they are missing (and runs torch on one thread: these models are tiny).
"""
from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["ENCODERS", "FAMILIES", "SPECIAL_TOKENS", "make_bert_model", "transformers_embedding", "write_bert_gguf", "config_json_v4", "make_hf_model", "needs_transformers",
           "quantize_mxfp4_hf", "transformers_greedy", "transformers_logits", "write_gguf", "write_mxfp4_hf",
           "write_tokenizer"]

_COMMON = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6, max_position_embeddings=256)
_GEMMA3_TEXT = dict(model_type="gemma3_text", vocab_size=384, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh", sliding_window=16,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                    tie_word_embeddings=True, **_COMMON)
# Phi-3's longrope: a divisor per rotated frequency (3/4 of head_dim 32 rotate: 12 frequencies)
# (values a float32 holds exactly, as the GGUF stores them)
_SHORT = [1.0 + i / 16 for i in range(12)]
_LONG = [1.0 + i * 5 / 8 for i in range(12)]

# name -> config.json (transformers 5.x's form): hidden 64-128, 4 heads / 2 KV heads, 2-4 layers
FAMILIES = {
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=320, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_bias=False,
                  tie_word_embeddings=False, **_COMMON),
    # sliding layers 0 and 2 (a window of 16 keys, RoPE base 10000) and full ones 1 and 3 (1e6, linear scaling 4)
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], **_GEMMA3_TEXT),
    "gemma3-mm": dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                      text_config=dict(_GEMMA3_TEXT),
                      vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4),
                      mm_tokens_per_image=4, boi_token_index=3, eoi_token_index=4, image_token_index=5,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True),
    # Phi-4-mini's shape of it: 3/4 of each head rotated, longrope (original context 64 of 256), tied embeddings
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=320, hidden_size=128,
                 intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 partial_rotary_factor=0.75, original_max_position_embeddings=64,
                 rope_parameters={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG,
                                  "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                  "original_max_position_embeddings": 64},
                 sliding_window=None, tie_word_embeddings=True, **_COMMON),
    # layer 3 without RoPE (no_rope_layers: 1 = uses RoPE; the every-4th rule llama.cpp hardcodes)
    "smollm3": dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=320, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    no_rope_layers=[1, 1, 1, 0], no_rope_layer_interval=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                    **_COMMON),
    "mistral-swa": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=320, hidden_size=128,
                        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, sliding_window=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                        tie_word_embeddings=False, **_COMMON),
    # layers 2 and 3 slide (those from max_window_layers on); q/k/v biases
    "qwen2-swa": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=320, hidden_size=128,
                      intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      use_sliding_window=True, sliding_window=16, max_window_layers=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True, **_COMMON),
    # mixtures of experts: Qwen3-MoE's q/k norms, 8 experts of 32 units (2 a token), layer 1 dense (mlp_only_layers);
    # Mixtral's 4 experts of 64 units (2 a token) in every layer
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=320, hidden_size=64,
                     intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6}, attention_bias=False,
                     tie_word_embeddings=False, **_COMMON),
    # gpt-oss: biases on q/k/v/o and on the experts, attention sinks, alternating sliding (16 keys) and full layers,
    # YaRN (truncated correction range, as llama.cpp computes it for a GGUF), 4 experts of 64 units (2 a token)
    "gptoss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=320, hidden_size=64,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                   layer_types=["sliding_attention", "full_attention"], attention_bias=True, swiglu_limit=7.0,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "original_max_position_embeddings": 4096, "rope_theta": 150000.0,
                                    "truncate": True},
                   tie_word_embeddings=False, **_COMMON),
    "mixtral": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=320, hidden_size=64,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
                    **_COMMON),
}
# (embedding, other matrices): the factors on transformers' random init (std 0.02), chosen by the top-2 margins of
# transformers' logits along 12-token greedy replies (seeds 0-7, a 9- and a 48-token prompt): at most 2 of those 192
# steps with a margin under 0.1% of the largest logit, 9-12 distinct tokens a reply.
_SCALES = {"qwen3": (8.0, 8.0), "gemma3": (2.0, 8.0), "gemma3-mm": (1.0, 8.0), "phi3": (8.0, 8.0),
           "smollm3": (12.0, 12.0), "mistral-swa": (12.0, 12.0), "qwen2-swa": (8.0, 8.0), "qwen3moe": (8.0, 8.0),
           "mixtral": (8.0, 8.0), "gptoss": (8.0, 8.0)}
# Gemma's gains (pre-norms, post-norms, final; the q/k norms' about 1.5): its sandwich norms make every layer add a vector of
# the post-norm's size whatever the matrices, and a random tied model with unit gains mostly repeats a token or two;
# larger gains make the layers' contributions and the attention sharper, larger logits too
_GEMMA_GAINS = {"gemma3": (4.0, 4.0, 5.0), "gemma3-mm": (3.0, 4.0, 5.0)}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]       # ids 0 (pad), 1 (bos), 2 (eos)
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def needs_transformers():
    """(torch, transformers), or the calling test skipped saying what is missing."""
    import pytest

    why = "needs transformers and torch: the test extra (pip install -e .[test])"
    torch = pytest.importorskip("torch", reason=why)
    torch.set_num_threads(1)        # these products are tiny: a thread pool's wake-ups cost ~100x more than they do
    return torch, pytest.importorskip("transformers", reason=why)


def _text(raw: dict) -> dict:
    """The text model's part of a config.json (a multimodal config's text_config)."""
    return {**raw, **raw["text_config"]} if "text_config" in raw else raw


def config_json_v4(raw: dict) -> dict:
    """A 5.x config.json as transformers 4.x wrote it: `rope_theta` and `rope_scaling` (None when unscaled) instead
    of `rope_parameters`, Gemma's local base as `rope_local_base_freq`, Phi-3's partial rotary factor and original
    context beside them."""
    if "text_config" in raw:
        return {**raw, "text_config": config_json_v4(raw["text_config"])}
    out = {k: v for k, v in raw.items() if k != "rope_parameters"}
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:
        out["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        out["sliding_window_pattern"] = 6
        params = params["full_attention"]
    params = dict(params)
    out["rope_theta"] = params.pop("rope_theta", 10000.0)
    for key in ("partial_rotary_factor", "original_max_position_embeddings"):
        if key in params:
            out[key] = params.pop(key)
    kind = params.pop("rope_type", "default")
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    return out


# ------------------------------------------------------------------------------------------ making the models

def _config(family: str):
    """The transformers config object of FAMILIES[family]."""
    _, transformers = needs_transformers()
    raw = copy.deepcopy(FAMILIES[family])         # (transformers completes the RoPE dicts it is given in place)
    raw.pop("architectures")
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def make_hf_model(family: str, path, seed: int = 0) -> Path:
    """A random `family` model made by transformers (torch.manual_seed(seed)), its matrices scaled by _SCALES from
    the init's std 0.02, its norms' gains drawn around 1 (Gemma's around _GEMMA_GAINS; so that a norm read wrong
    shows) and Qwen2's biases around 0, saved by save_pretrained as float32 safetensors, with `write_tokenizer`'s
    tokenizer. Returns the directory."""
    torch, transformers = needs_transformers()
    path = Path(path)
    config = _config(family)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family]["architectures"][0])(config).float()
    gemma = family.startswith("gemma3")
    embedding, matrices = _SCALES[family]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "vision" in name or "multi_modal" in name:
                continue
            if param.ndim >= 2:                         # (a mixture's experts: 3-D stacks in transformers 5)
                param.mul_(embedding if "embed_tokens" in name else matrices)
            elif name.endswith("norm.weight"):          # Gemma stores w of the gain 1 + w
                gain = _gemma_gain(family, name) if gemma else 1.0
                param.copy_(torch.randn(param.shape) * 0.1 + (gain - 1.0 if gemma else gain))
            else:                                       # Qwen2's q/k/v biases
                param.copy_(torch.randn(param.shape) * 0.5)
    model.save_pretrained(str(path))
    write_tokenizer(path, _text(FAMILIES[family])["vocab_size"])
    return path


def _gemma_gain(family: str, name: str) -> float:
    """The gain about which make_hf_model draws Gemma norm `name` (HF naming)."""
    pre, post, final = _GEMMA_GAINS[family]
    if ".layers." not in name:
        return final
    if "q_norm" in name or "k_norm" in name:    # about 1.5: larger ones make the attention so sharp that a float16
        return 1.5                              # cache's rounding of a key moves the logits by percents
    return post if "post_" in name else pre


def _corpus() -> list:
    from llm_serving.models.default_model import generate_story_lines

    return generate_story_lines(2000, 7)


# gpt-oss's chat format's special tokens (harmony), for a tokenizer that has them (write_tokenizer(harmony=True))
HARMONY_TOKENS = ["<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
# a harmony chat template as gpt-oss's renders a conversation (without its system message's knobs)
HARMONY_TEMPLATE = ("{% if tools %}<|start|>developer<|message|>{% for t in tools %}{{ t.function.name }} {% endfor %}"
                    "<|end|>{% endif %}"
                    "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final"
                    "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int, harmony: bool = False, extra: tuple = ()) -> str:
    """A byte-level BPE (GPT-2's split) of exactly `vocab_size` tokens: SPECIAL_TOKENS (and HARMONY_TOKENS, then the
    `extra` special tokens), the 256 bytes, merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + (HARMONY_TOKENS if harmony else []) + list(extra)
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"the tokenizer has {tok.get_vocab_size()} tokens, not the model's {vocab_size}")
    return tok.to_str()


def write_tokenizer(path, vocab_size: int, harmony: bool = False, extra: tuple = (),
                    template: Optional[str] = None) -> Path:
    """tokenizer.json (`_tokenizer_json`) and tokenizer_config.json (bos <|im_start|>, eos <|im_end|>, pad
    <|endoftext|>, no BOS added, a ChatML template; `harmony`: gpt-oss's special tokens too, and a harmony template;
    `extra`: more special tokens, after those; `template`: another chat template) in directory `path`."""
    path = Path(path)
    (path / "tokenizer.json").write_text(_tokenizer_json(vocab_size, harmony, tuple(extra)), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2], "pad_token": SPECIAL_TOKENS[0],
         "add_bos_token": False,
         "chat_template": template or (HARMONY_TEMPLATE if harmony else CHATML)}), encoding="utf-8")
    return path


# E2M1's values by code (MXFP4's elements: sign, two exponent bits, one mantissa bit)
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# the quantization_config gpt-oss's checkpoints carry (openai/gpt-oss-20b's config.json)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantize_mxfp4_hf(w: np.ndarray) -> tuple:
    """w (..., K) as HF's MXFP4 (gpt-oss's checkpoints): blocks uint8 (..., K/32, 16), each byte two E2M1 codes (low
    nibble the even weight, high the odd one), and scales uint8 (..., K/32), each block's power of two + 127, chosen
    so that its largest |w| scales into [4, 8); every weight scaled is rounded to the nearest E2M1 value."""
    x = np.asarray(w, np.float64).reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        power = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    scales = np.clip(power + 127, 0, 254).astype(np.uint8)
    scaled = x / np.exp2(scales.astype(np.float64) - 127)[..., None]
    codes = np.abs(scaled[..., None] - _E2M1).argmin(axis=-1).astype(np.uint8)
    # (C order: safetensors' save_file writes an array's buffer as it lies)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4)), np.ascontiguousarray(scales)


def write_mxfp4_hf(hf_path, out_path, shards: int = 1) -> Path:
    """gpt-oss directory `hf_path` with its experts' matrices in MXFP4, as openai ships gpt-oss: each layer's
    gate_up_proj (E, H, 2I) stored as its outputs' rows (E, 2I, H) quantized along H (`gate_up_proj_blocks`,
    `_scales`), down_proj (E, I, H) as (E, H, I) along I; biases and everything else as they are; config.json with
    MXFP4_CONFIG. `shards` 2: the experts in a second file, with the index. Returns the directory."""
    from safetensors.numpy import load_file, save_file

    hf_path, out_path = Path(hf_path), Path(out_path)
    out_path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, arr in load_file(str(hf_path / "model.safetensors")).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4_hf(np.swapaxes(arr, 1, 2))
        else:
            tensors[name] = arr
    for f in hf_path.iterdir():
        if f.is_file() and not f.name.startswith("model.safetensors"):
            (out_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((hf_path / "config.json").read_text())
    (out_path / "config.json").write_text(json.dumps({**raw, "quantization_config": MXFP4_CONFIG}, indent=2))
    if shards == 1:
        save_file(tensors, str(out_path / "model.safetensors"), metadata={"format": "pt"})
        return out_path
    files = {name: f"model-0000{2 if '.mlp.experts.' in name else 1}-of-00002.safetensors" for name in tensors}
    for fname in sorted(set(files.values())):
        save_file({n: a for n, a in tensors.items() if files[n] == fname}, str(out_path / fname),
                  metadata={"format": "pt"})
    (out_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return out_path


# ------------------------------------------------------------------------------------------ transformers' answers

@functools.lru_cache(maxsize=4)
def _model(path: str):
    """The model of directory `path`, loaded once (a directory is not rewritten under the same path); MXFP4 experts
    dequantized by transformers (to the float32 asked for: what it does on a CPU without triton's kernels)."""
    torch, transformers = needs_transformers()
    raw = json.loads((Path(path) / "config.json").read_text())
    quant = ({"quantization_config": transformers.Mxfp4Config(dequantize=True)}
             if raw.get("quantization_config", {}).get("quant_method") == "mxfp4" else {})
    model = getattr(transformers, raw["architectures"][0]).from_pretrained(path, dtype=torch.float32,
                                                                           attn_implementation="eager", **quant)
    return model.eval()


def transformers_logits(path, ids: list) -> np.ndarray:
    """transformers' float32 logits (len(ids), vocab) of `ids` in one forward pass (no cache)."""
    torch, _ = needs_transformers()
    with torch.no_grad():
        out = _model(str(path))(input_ids=torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].float().numpy()


def transformers_greedy(path, prompt_ids: list, n: int) -> list:
    """transformers' `n` greedy tokens after `prompt_ids`, each from a forward pass over the whole context (so a
    longrope model uses its long factors at every position once the context outgrows the original one)."""
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(transformers_logits(path, ids)[-1].argmax()))
    return ids[len(prompt_ids):]


# ---------------------------------------------------------------------------------- vision-language models

def greedy_with_logprobs(last_logits, ids: list, n: int) -> tuple:
    """`n` greedy tokens after `ids` and each one's log-probability, `last_logits(ids)` giving the last position's
    logits (a torch tensor) of a whole forward over `ids` (no cache)."""
    import torch

    tokens, logprobs = [], []
    for _ in range(n):
        with torch.no_grad():
            lp = torch.log_softmax(last_logits(ids + tokens).double(), -1)
        tokens.append(int(lp.argmax()))
        logprobs.append(float(lp.max()))
    return tokens, logprobs


# Gemma 3's image tokens, as the tiny vision model's tokenizer holds them (ids 3, 4, 5: after SPECIAL_TOKENS)
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# a ChatML template that, as Gemma 3's does, puts <start_of_image> where a message's image part is
VISION_CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n'}}{% if m['content'] is string %}"
                 "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                 "{{ '<start_of_image>' }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
                 "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
                 "{% endif %}")


def make_gemma3_vl(path, seed: int = 1, tokenizer: bool = True):
    """A tiny Gemma3ForConditionalGeneration that transformers makes, random (the tower's weights drawn afresh:
    transformers starts the projection at zero; the text model's scaled as make_hf_model's gemma3-mm): a 56-pixel image in 14-pixel patches (a 4 x 4 grid) pooled to 4 tokens, a 2-layer text
    model of 300 tokens (sliding window 32); its image processor beside it, and (`tokenizer`) a tokenizer holding
    Gemma 3's image tokens (GEMMA3_IMAGE_TOKENS, ids 3-5) with VISION_CHATML. Returns the model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    boi, eoi, image = (len(SPECIAL_TOKENS) + k for k in range(3))
    cfg = transformers.Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                         max_position_embeddings=512),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=56, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=4, image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    embedding, matrices = _SCALES["gemma3-mm"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name or "multi_modal" in name:       # the tower: every weight drawn afresh
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if p.ndim == 1 else 0.2))
            elif p.ndim >= 2:                                   # the text model: as make_hf_model's gemma3-mm
                p.mul_(embedding if "embed_tokens" in name else matrices)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1 + _gemma_gain("gemma3-mm", name) - 1.0)
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, 300, extra=GEMMA3_IMAGE_TOKENS, template=VISION_CHATML)
    return model


# SmolVLM's image tokens (ids 3-9 of the tiny model's tokenizer): the marker around a frame's tokens, the
# placeholder, the global image's tag, and the tiles' row/column tags of a grid of up to 2 x 2
SMOLVLM_IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<row_1_col_1>", "<row_1_col_2>",
                        "<row_2_col_1>", "<row_2_col_2>")
# a ChatML template that, as SmolVLM's does, puts <image> where a message's image part is
SMOLVLM_CHATML = VISION_CHATML.replace("<start_of_image>", "<image>")


def make_smolvlm(path, seed: int = 1, tokenizer: bool = True):
    """A tiny SmolVLMForConditionalGeneration that transformers makes, random (every weight drawn afresh, the text
    model's as make_hf_model's llama): 32-pixel frames in 8-pixel patches (a 4 x 4 grid), pixel-shuffled by 2 to 4
    tokens a frame; an image's longest edge resized to 64 pixels and split into up to 2 x 2 frames plus the whole
    image as a global frame; a 2-layer Llama text model of 300 tokens. Its image processor beside it, and
    (`tokenizer`) a tokenizer holding SMOLVLM_IMAGE_TOKENS with SMOLVLM_CHATML. Returns the model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    image = len(SPECIAL_TOKENS) + 1
    cfg = transformers.SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=False),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        scale_factor=2, image_token_id=image, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.SmolVLMForConditionalGeneration(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "text_model" not in name and "lm_head" not in name:     # the tower and the connector
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if p.ndim == 1 else 0.2))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if "embed_tokens" in name else 0.1))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(path)
    transformers.SmolVLMImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
                                       ).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4, "processor_class": "SmolVLMProcessor"}),
                                               encoding="utf-8")
    if tokenizer:
        write_tokenizer(path, 300, extra=SMOLVLM_IMAGE_TOKENS, template=SMOLVLM_CHATML)
    return model


# Qwen2.5-VL's image and video tokens (ids 3-6 of the tiny model's tokenizer): the marks around an image's
# placeholders, the image's placeholder and the video's
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# a ChatML template that, as Qwen2.5-VL's does, puts <|vision_start|><|image_pad|><|vision_end|> where a message's
# image part is (the processor then repeats <|image_pad|> once per token of the image)
QWEN_VL_CHATML = VISION_CHATML.replace("<start_of_image>", "<|vision_start|><|image_pad|><|vision_end|>")


def qwen2vl_pil_processor(**kwargs):
    """transformers' PIL Qwen2VLImageProcessor (5.x's Qwen2VLImageProcessorPil; 4.x's Qwen2VLImageProcessor, its
    "slow" one), the reference of vision/images.py's qwen_patches; it saves the same config as the torchvision one."""
    _, transformers = needs_transformers()
    return getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)(**kwargs)


def _randomize_qwen_vl(model, seed: int, tower_gains: tuple = ()) -> None:
    """Every weight of a tiny Qwen-VL model drawn afresh from `seed`, in order: the tower's and mergers' matrices
    N(0, 0.2) and vectors N(0, 0.5), but the norms' gains it names by suffix (`tower_gains`), 1 + N(0, 0.1); the text
    model's matrices N(0, 0.1) (its embeddings N(0, 0.5)), its norms' gains 1 + N(0, 0.1), its biases N(0, 0.5)."""
    torch, _ = needs_transformers()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and not name.endswith(tower_gains):             # the tower and the mergers
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if p.ndim == 1 else 0.2))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if "embed_tokens" in name else 0.1))
            elif name.endswith("norm.weight") or "visual" in name:                # the norms' gains
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            else:                                                                  # the q/k/v biases
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)


def make_qwen25_vl(path, seed: int = 1, tokenizer: bool = True):
    """A tiny Qwen2_5_VLForConditionalGeneration that transformers makes, random (every weight drawn afresh: the
    tower's as make_smolvlm's, the text model's too, its q/k/v biases as make_hf_model's Qwen2's): a 4-block tower of
    width 32 in 14-pixel patches, merged 2 x 2 into tokens of the text model's width 64, windows of 2 x 2 merge
    units (56 pixels) but in blocks 1 and 3 (full attention); a 2-layer text model of 300 tokens with M-RoPE
    (sections 2, 3, 3 of its 8 frequencies). Its image processor beside it (Qwen2VLImageProcessor, areas 56 x 56 to
    28 x 28 x 16: at most 16 tokens an image), and (`tokenizer`) a tokenizer holding QWEN_VL_TOKENS with
    QWEN_VL_CHATML. Returns the model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    start, end, image, video = (len(SPECIAL_TOKENS) + k for k in range(4))
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                           out_hidden_size=64),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, video_token_id=video,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _randomize_qwen_vl(model, seed)
    model.save_pretrained(path)
    qwen2vl_pil_processor(min_pixels=56 * 56, max_pixels=28 * 28 * 16).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, 300, extra=QWEN_VL_TOKENS, template=QWEN_VL_CHATML)
    return model


def make_qwen2_vl(path, seed: int = 1, tokenizer: bool = True):
    """A tiny Qwen2VLForConditionalGeneration that transformers makes, random (every weight drawn afresh, as
    make_qwen25_vl's; the LayerNorms' gains about 1): a 4-block tower of width 32 (embed_dim; its MLP 32 x mlp_ratio 2
    = 64 wide, quick GELU) in 14-pixel patches, full attention in every block, merged 2 x 2 (the merger's LayerNorm
    ln_q) into tokens of the text model's width 64; a 2-layer text model of 300 tokens with M-RoPE (sections 2, 3, 3
    of its 8 frequencies). Its image processor beside it (Qwen2VLImageProcessor, areas 56 x 56 to 28 x 28 x 16: at
    most 16 tokens an image), and (`tokenizer`) a tokenizer holding QWEN_VL_TOKENS with QWEN_VL_CHATML. Returns the
    model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    start, end, image, video = (len(SPECIAL_TOKENS) + k for k in range(4))
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(depth=4, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, video_token_id=video,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    _randomize_qwen_vl(model, seed, tower_gains=("norm1.weight", "norm2.weight", "ln_q.weight"))
    model.save_pretrained(path)
    qwen2vl_pil_processor(min_pixels=56 * 56, max_pixels=28 * 28 * 16).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, 300, extra=QWEN_VL_TOKENS, template=QWEN_VL_CHATML)
    return model


def make_qwen3_vl(path, seed: int = 1, tokenizer: bool = True, text_layers: int = 3, deepstack=(1, 2),
                  moe: bool = False):
    """A tiny Qwen3VLForConditionalGeneration that transformers makes, random (every weight drawn afresh, as
    make_qwen25_vl's): a 4-block tower of width 32 in 16-pixel patches (LayerNorms with biases, GELU-tanh MLPs, a
    learned 4 x 4 grid of position rows interpolated to each image's grid, 2-D rotary positions, full attention in
    every block), merged 2 x 2 into tokens of the text model's width 64, with DeepStack mergers after blocks 1 and 2
    (their rows added to the text model's hidden states after its layers 0 and 1); a 3-layer Qwen3 text model (q/k
    norms) of 300 tokens with interleaved M-RoPE (sections 2, 3, 3 of its 8 frequencies). Its image processor beside
    it (Qwen2VLImageProcessor with 16-pixel patches and Qwen3-VL's mean and std of 0.5, areas 64 x 64 to 32 x 32 x
    16: at most 16 tokens an image), and (`tokenizer`) a tokenizer holding QWEN_VL_TOKENS with QWEN_VL_CHATML.
    `text_layers`, `deepstack`: other depths (bench/vision_qwen.py's: a real tower's three DeepStack layers, four
    text layers, as llama.cpp needs more layers than DeepStack rows). `moe`: a Qwen3VLMoeForConditionalGeneration
    instead, its text layers mixtures of 4 experts of 24 units (2 chosen a token) but layer 1, dense (mlp_only_layers),
    saved as transformers 5 saves the fused experts (gate_up_proj (E, 2I, H), down_proj (E, H, I)). Returns the model
    (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    start, end, image, video = (len(SPECIAL_TOKENS) + k for k in range(4))
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
                   mlp_only_layers=[1]) if moe else {}
    cfg = (transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig)(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=text_layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True},
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, **experts),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=16, deepstack_visual_indexes=list(deepstack)),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end, video_token_id=video,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (transformers.Qwen3VLMoeForConditionalGeneration if moe else
             transformers.Qwen3VLForConditionalGeneration)(cfg).eval()
    _randomize_qwen_vl(model, seed, tower_gains=("norm1.weight", "norm2.weight", "norm.weight"))
    model.save_pretrained(path)
    qwen2vl_pil_processor(patch_size=16, min_pixels=64 * 64, max_pixels=32 * 32 * 16, image_mean=[0.5] * 3,
                          image_std=[0.5] * 3).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, 300, extra=QWEN_VL_TOKENS, template=QWEN_VL_CHATML)
    return model


# Mistral 3's image tokens (ids 3-5 of the tiny model's tokenizer): an image's placeholder, the token that ends each
# row of its placeholders, and the one that ends the image (in place of its last row's break)
MISTRAL3_IMAGE_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# a ChatML template that, as Mistral Small 3.1's does, puts [IMG] where a message's image part is (the processor then
# makes it the image's rows of [IMG] placeholders, each row ended by [IMG_BREAK], the last by [IMG_END])
MISTRAL3_CHATML = VISION_CHATML.replace("<start_of_image>", "[IMG]")


def pixtral_pil_processor(**kwargs):
    """transformers' PIL PixtralImageProcessor (5.x's PixtralImageProcessorPil; 4.x's PixtralImageProcessor, its
    "slow" one), the reference of vision/images.py's Pixtral sizes and patches."""
    _, transformers = needs_transformers()
    return getattr(transformers, "PixtralImageProcessorPil", transformers.PixtralImageProcessor)(**kwargs)


def make_mistral3(path, seed: int = 1, tokenizer: bool = True, llava: bool = False):
    """A tiny Mistral3ForConditionalGeneration that transformers makes, random (every weight drawn afresh, as
    make_qwen25_vl's): a 3-block Pixtral tower of width 32 in 8-pixel patches (RMS norms, 2-D rotary positions, full
    attention, SwiGLU), Mistral 3's projector (RMS norm, 2 x 2 patch merger, linear_1, GELU, linear_2) into tokens of
    the text model's width 64; a 2-layer Mistral text model of 300 tokens. Its image processor beside it
    (PixtralImageProcessor: the longest edge at most 64 pixels, so at most 4 x 4 tokens an image, each row of them
    ended by a break), and (`tokenizer`) a tokenizer holding MISTRAL3_IMAGE_TOKENS with MISTRAL3_CHATML. With
    `llava`, Pixtral 12B's kind instead (make_pixtral). Returns the model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    image = len(SPECIAL_TOKENS)
    text = dict(model_type="mistral", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=1e6,
                sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                pad_token_id=0)
    longest, merge = (48, 1) if llava else (64, 2)      # (the tower's image_size: its processor's longest edge)
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  head_dim=16, patch_size=8, image_size=longest, rope_theta=10000.0, hidden_act="silu")
    if llava:
        cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image,
                                       projector_hidden_act="gelu", vision_feature_layer=-1,
                                       vision_feature_select_strategy="full", multimodal_projector_bias=True,
                                       tie_word_embeddings=False)
    else:
        cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=image,
                                          spatial_merge_size=2, multimodal_projector_bias=False,
                                          tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = (transformers.LlavaForConditionalGeneration if llava else
             transformers.Mistral3ForConditionalGeneration)(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                if p.ndim == 1 and not name.endswith("bias"):          # the RMS norms' gains
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
                else:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if "embed_tokens" in name else 0.1))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(path)
    pixtral_pil_processor(patch_size={"height": 8, "width": 8}, size={"longest_edge": longest}).save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 8, "spatial_merge_size": merge, "image_token": "[IMG]",
         "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}), encoding="utf-8")
    if tokenizer:
        write_tokenizer(path, 300, extra=MISTRAL3_IMAGE_TOKENS, template=MISTRAL3_CHATML)
    return model


def make_pixtral(path, seed: int = 1, tokenizer: bool = True):
    """A tiny LlavaForConditionalGeneration of Pixtral 12B's kind that transformers makes (make_mistral3's tower and
    text model, random): each 8-pixel patch a token (no merge), LLaVA's projector (linear_1 and linear_2 with biases,
    GELU), the image's longest edge at most 48 pixels (at most 6 x 6 tokens, each row ended by a break), the same
    tokens and template as make_mistral3's. Returns the model (eval mode)."""
    return make_mistral3(path, seed, tokenizer, llava=True)


# LLaVA 1.5's image placeholder (id 3 of the tiny model's tokenizer), and a ChatML template that puts it where a
# message's image part is (the processor then makes it the image's tokens: one <image> a patch)
LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_CHATML = VISION_CHATML.replace("<start_of_image>", LLAVA_IMAGE_TOKEN)


def make_llava(path, seed: int = 1, tokenizer: bool = True):
    """A tiny LlavaForConditionalGeneration of LLaVA 1.5's kind that transformers makes, random: a 3-layer CLIP tower
    of width 32 on a 32-pixel image in 8-pixel patches (a class token, the pre-LayerNorm, quick GELU), its
    second-to-last layer's output read with the class token's row dropped (16 tokens an image), LLaVA's projector
    (linear_1, GELU, linear_2, with biases) into a 2-layer Llama text model of width 64 and 300 tokens. Its image
    processor beside it (LlavaImageProcessor: the image padded to a square in the mean's colour, its short edge to 32
    pixels, the middle 32 x 32 cropped, CLIP's mean and std), and (`tokenizer`) a tokenizer holding LLAVA_IMAGE_TOKEN with LLAVA_CHATML. Returns the model (eval mode)."""
    torch, transformers = needs_transformers()
    path = Path(path)
    cfg = transformers.LlavaConfig(
        text_config=dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32,
                           hidden_act="quick_gelu", layer_norm_eps=1e-5),
        image_token_index=len(SPECIAL_TOKENS), projector_hidden_act="gelu", vision_feature_layer=-2,
        vision_feature_select_strategy="default", multimodal_projector_bias=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            gain = p.ndim == 1 and ("norm" in name or "layrnorm" in name) and name.endswith("weight")
            if gain:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if "embed_tokens" in name else 0.1))
    model.save_pretrained(path)
    processor = getattr(transformers, "LlavaImageProcessorPil", transformers.LlavaImageProcessor)
    processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, resample=3, do_center_crop=True,
              do_pad=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
              image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, 300, extra=(LLAVA_IMAGE_TOKEN,), template=LLAVA_CHATML)
    return model


def vision_prompt_ids(path, turns: list) -> list:
    """The prompt transformers' processor makes of a chat (VISION_CHATML rendered by hand, each image mark made its
    placeholders as Gemma3Processor does), tokenized by the tokenizers library: nothing of the server's own."""
    from tokenizers import Tokenizer

    boi, eoi, image = GEMMA3_IMAGE_TOKENS
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
    full = f"\n\n{boi}{image * 4}{eoi}\n\n"
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(text.replace(boi, full)).ids


# ------------------------------------------------------------------------------------------ BERT encoders

# name -> (BertConfig's settings, the pooling sentence-transformers' 1_Pooling/config.json declares): all-MiniLM's
# shape of it (mean pooling), and bge's (the [CLS] token's state)
_BERT = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=128, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0)
ENCODERS = {"bert": (_BERT, "mean"), "bert-cls": (dict(_BERT, hidden_size=96, num_attention_heads=6), "cls")}
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]           # ids 0-4
_POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "last": "pooling_mode_lasttoken"}


@functools.lru_cache(maxsize=None)
def _wordpiece_json(vocab_size: int) -> str:
    """A lower-casing WordPiece tokenizer.json of exactly `vocab_size` tokens (BERT_SPECIALS first), trained on the
    story corpus, whose post-processor puts [CLS] before a text and [SEP] after it, as BERT's do. Like
    all-MiniLM's, it also carries a truncation (16 tokens) and a fixed padding (to 24), which the library applies
    to every encode unless the loader turns them off."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(_corpus(), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=BERT_SPECIALS))
    if tok.get_vocab_size() != vocab_size:
        raise AssertionError(f"the tokenizer has {tok.get_vocab_size()} tokens, not the model's {vocab_size}")
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.enable_truncation(16)
    tok.enable_padding(length=24, pad_id=0, pad_token="[PAD]")
    return tok.to_str()


def make_bert_model(name: str, path, seed: int = 0) -> Path:
    """ENCODERS[name] as a random BertModel (torch.manual_seed(seed)): its matrices 4x transformers' init (std
    0.02), its LayerNorms' gains about 1 and biases about 0 and the products' biases random, so that a norm, a bias
    or the attention read wrong shows in the embeddings; saved as sentence-transformers ships a model (float32
    safetensors, modules.json, 1_Pooling/config.json declaring the pooling, 2_Normalize) with `_wordpiece_json`'s
    tokenizer and a BertTokenizer's tokenizer_config.json. Returns the directory."""
    torch, transformers = needs_transformers()
    settings, pooling = ENCODERS[name]
    path = Path(path)
    torch.manual_seed(seed)
    model = transformers.BertModel(transformers.BertConfig(**settings), add_pooling_layer=False).float()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.ndim >= 2:
                param.mul_(4.0)
            elif pname.endswith("LayerNorm.weight"):
                param.copy_(1.0 + torch.randn(param.shape) * 0.2)
            else:                                       # LayerNorm biases and the products' biases
                param.copy_(torch.randn(param.shape) * 0.2)
    model.save_pretrained(str(path))
    (path / "tokenizer.json").write_text(_wordpiece_json(settings["vocab_size"]), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]",
         "do_lower_case": True, "tokenizer_class": "BertTokenizer", "model_max_length": 512}), encoding="utf-8")
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": settings["hidden_size"],
         **{key: mode == pooling for mode, key in _POOLING_KEYS.items()}}))
    (path / "2_Normalize").mkdir(exist_ok=True)
    return path


def transformers_embedding(path, ids: list, pooling: str) -> np.ndarray:
    """sentence-transformers' embedding of one input `ids` (its [CLS] and [SEP] included) with transformers:
    BertModel's last hidden states pooled (mean over the tokens, the first's: cls), L2-normalized; float64 (H,)."""
    torch, transformers = needs_transformers()
    model = _bert_model(str(path))
    with torch.no_grad():
        states = model(input_ids=torch.tensor([list(ids)]), token_type_ids=torch.zeros(1, len(ids), dtype=torch.long)
                       ).last_hidden_state[0].double().numpy()
    pooled = states.mean(axis=0) if pooling == "mean" else states[0] if pooling == "cls" else states[-1]
    return pooled / np.linalg.norm(pooled)


@functools.lru_cache(maxsize=4)
def _bert_model(path: str):
    torch, transformers = needs_transformers()
    return transformers.BertModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                  add_pooling_layer=False).eval()


def write_bert_gguf(hf_path, out_path, qtype=None) -> Path:
    """make_bert_model's directory as a GGUF, as llama.cpp's converter (convert_hf_to_gguf.py's BertModel) writes it:
    `bert.*` hyperparameters (causal false, the pooling type its 1_Pooling/config.json declares), the vocabulary in
    llama.cpp's phantom-space form (a word's first piece "▁"-prefixed, a "##" continuation bare, [..] specials as
    they are) with the special ids gguf's SpecialVocab reads ([CLS] its BOS, [SEP] its EOS, both added), the tensors
    under the gguf package's BERT names (position_ids and the pooler left out); matrices as `qtype` (default F32),
    1-D tensors F32."""
    import gguf

    hf_path, out_path = Path(hf_path), Path(out_path)
    cfg = json.loads((hf_path / "config.json").read_text())
    pooling = json.loads((hf_path / "1_Pooling" / "config.json").read_text())
    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    w = gguf.GGUFWriter(str(out_path), "bert")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.CLS if pooling["pooling_mode_cls_token"] else gguf.PoolingType.MEAN)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32
                    else getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}"))
    tok = json.loads((hf_path / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    specials = {t["content"] for t in tok["added_tokens"] if t.get("special")}

    def phantom(piece: str) -> str:
        if piece.startswith("[") and piece.endswith("]"):
            return piece
        return piece[2:] if piece.startswith("##") else "\u2581" + piece

    tokens = sorted(vocab, key=vocab.get)
    w.add_token_type_count(cfg["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([phantom(t) for t in tokens])
    w.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    gguf.SpecialVocab(str(hf_path), n_vocab=len(tokens)).add_to_gguf(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg["num_hidden_layers"])
    from safetensors.numpy import load_file

    for name, arr in load_file(str(hf_path / "model.safetensors")).items():
        if name.endswith("position_ids") or name.startswith("pooler."):
            continue
        base, suffix = name.rsplit(".", 1)
        out = names.get_name(base)
        if out is None:
            raise KeyError(f"write_bert_gguf: no GGUF name for {name}")
        arr = np.ascontiguousarray(arr, np.float32)
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"{out}.{suffix}", gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{out}.{suffix}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


# ------------------------------------------------------------------------------------------ GGUF twins

# config.json architecture -> llama.cpp's architecture name
_GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
              "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3", "Qwen3MoeForCausalLM": "qwen3moe",
              "MixtralForCausalLM": "llama", "GptOssForCausalLM": "gpt-oss",
              "Qwen2VLForConditionalGeneration": "qwen2vl", "Qwen2_5_VLForConditionalGeneration": "qwen2vl",
              "Qwen3VLForConditionalGeneration": "qwen3vl",
              "Qwen3VLMoeForConditionalGeneration": "qwen3vlmoe", "Mistral3ForConditionalGeneration": "llama",
              "LlavaForConditionalGeneration": "llama"}
# one expert's matrix (model.layers.N.<prefix>E.<part>.weight) -> the name the converter gives their stack (E, rows,
# cols) before mapping it (Qwen3MoeModel / the Mixtral path of LlamaModel: experts merged)
_EXPERT_STACKS = {"mlp.experts.": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe.experts.": ("w1", "w2", "w3")}
_INTERLEAVED = ("llama", "smollm3")         # the converter permutes q/k rows for these (LlamaModel.undo_permute)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's LlamaModel.permute: each head's rows from rotate-half to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _text_tensors(hf_path: Path) -> dict:
    """The text model's tensors under Gemma3ForCausalLM's / LlamaForCausalLM's names (a multimodal checkpoint's
    vision tower and projector left out, as the converter's filter_tensors does)."""
    from safetensors.numpy import load_file

    out = {}
    for name, arr in load_file(str(hf_path / "model.safetensors")).items():
        for prefix, text in (("language_model.model.", "model."), ("model.language_model.", "model."),
                             ("language_model.lm_head.", "lm_head.")):
            if name.startswith(prefix):
                name = text + name[len(prefix):]
                break
        if name.startswith(("model.", "lm_head.")) and not name.startswith("model.visual."):
            out[name] = arr
    return out


def _layer_kinds(cfg: dict) -> Optional[list]:
    """Which layers slide (True) by a config.json as transformers 5.x saves it (`layer_types` listed; Mistral's and
    Phi-3's window in every layer), or None when none does."""
    arch = cfg["architectures"][0]
    if not cfg.get("sliding_window") or (arch.startswith(("Qwen", "SmolLM3")) and not cfg.get("use_sliding_window")):
        return None
    types = cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"]
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        types = ["sliding_attention"] * cfg["num_hidden_layers"]
    return [t == "sliding_attention" for t in types] if "sliding_attention" in types else None


def edited_gguf(src, dst, fields: Optional[dict] = None, tensors: Optional[dict] = None) -> Path:
    """A copy of the GGUF `src` at `dst` with `fields` ({key: value}, None dropping one; a new key's type from its
    value: bool, int as uint32, float as float32, str, list) and `tensors` ({name: array}, None dropping one) changed;
    every other key keeps its type and every other tensor its values (an mmproj a test makes one fault in)."""
    import gguf

    fields, tensors = fields or {}, tensors or {}
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in fields:
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for name, value in fields.items():
        if value is not None:
            {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string,
             list: writer.add_array}[type(value)](name, value)
    for tensor in reader.tensors:
        if tensor.name not in tensors:
            writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(tuple(reversed(tensor.shape.tolist()))))
    for name, array in tensors.items():
        if array is not None:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def write_gguf(family: str, hf_path, out_path, qtype=None, expert_qtype=None) -> Path:
    """`hf_path` (make_hf_model's directory of `family`) as a GGUF, written as llama.cpp's converter writes the
    architecture; matrices as `qtype` (a gguf.GGMLQuantizationType, default F32; 1-D tensors stay F32, as the
    converter keeps them). Beyond what the converter writes, and only where the model needs it, keys of the gguf
    package's: `attention.sliding_window` (+ `sliding_window_pattern`, a flag per layer) for Mistral's and Qwen2's
    windows (llama.cpp ignores them for `llama` and `qwen2`: it serves those with full attention) and for a Gemma 3
    layer pattern other than every 6th layer full (llama.cpp reads that), and `gemma3.attention.scale` for a
    query_pre_attn_scalar other than what llama.cpp assumes (head_dim; llama.cpp does not read it for gemma3)."""
    import gguf

    hf_path, out_path = Path(hf_path), Path(out_path)
    raw = json.loads((hf_path / "config.json").read_text())
    cfg = _text(raw)
    arch = _GGUF_ARCH[raw["architectures"][0]]
    # (family None: a directory not among FAMILIES' tiny models, such as make_qwen25_vl's)
    assert family is None or raw["architectures"] == FAMILIES[family]["architectures"], (family, raw["architectures"])
    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads, head_dim = cfg["num_key_value_heads"], cfg.get("head_dim") or hidden // heads
    rope = cfg.get("rope_parameters") or {}
    full, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, None)

    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(full["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32
                    else getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.name}"))
    extra = {}
    if arch == "phi3":                      # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        original = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(full.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        if full.get("long_factor"):
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra = {"rope_factors_long.weight": np.asarray(full["long_factor"], np.float32),
                     "rope_factors_short.weight": np.asarray(full["short_factor"], np.float32)}
    else:                                   # TextModel.set_gguf_parameters
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        elif full.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(full["factor"])
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
            w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        elif full.get("rope_type", "default") != "default":
            raise NotImplementedError(f"write_gguf: RoPE type {full['rope_type']!r}")
        if local is not None:
            w.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("mrope_section"):       # (TextModel.set_gguf_parameters: the sections padded to four)
            w.add_rope_dimension_sections((list(full["mrope_section"]) + [0] * 4)[:4])
        if "head_dim" in cfg:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    deepstack = (raw.get("vision_config") or {}).get("deepstack_visual_indexes")
    if arch in ("qwen3vl", "qwen3vlmoe"):   # Qwen3VLTextModel's / Qwen3VLMoeTextModel's set_gguf_parameters
        w.add_num_deepstack_layers(len(deepstack or ()))
    if arch in _INTERLEAVED:                # LlamaModel.set_gguf_parameters
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:                             # TextModel.set_gguf_parameters, Qwen2MoeModel's expert size
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        elif arch == "gpt-oss":             # GptOssModel.set_gguf_parameters
            w.add_expert_feed_forward_length(cfg["intermediate_size"])
    kinds = _layer_kinds(raw if "text_config" not in raw else {**cfg, "architectures": raw["architectures"]})
    if arch == "gemma3":                    # Gemma3Model.set_gguf_parameters
        w.add_sliding_window(cfg["sliding_window"])
        if kinds != [i % 6 < 5 for i in range(layers)]:
            w.add_sliding_window_pattern(kinds or [False] * layers)
        if cfg["query_pre_attn_scalar"] != head_dim:
            w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    elif arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
        assert kinds == [i % 2 == 0 for i in range(layers)], kinds      # (llama.cpp's fixed pattern for it)
    elif kinds is not None and arch != "phi3":
        w.add_sliding_window(cfg["sliding_window"])
        if not all(kinds):
            w.add_sliding_window_pattern(kinds)
    _add_vocabulary(w, hf_path, cfg)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper().replace("-", "_")), layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tensors = _text_tensors(hf_path)
    if arch == "gpt-oss":
        tensors = _gpt_oss_tensors(tensors)
    elif arch == "qwen3vlmoe":
        tensors = _halves_tensors(tensors)
    for name, arr in _stacked_experts(tensors).items():
        base, suffix = name.rsplit(".", 1)
        # (a dense layer of a mixture: llama.cpp's qwen3moe has no names for it, the reader takes LLaMA's)
        out = names.get_name(base) or dense_names.get_name(base)
        if out is None:
            raise KeyError(f"write_gguf: no GGUF name for {name}")
        arr = np.asarray(arr, np.float32)
        if arch in _INTERLEAVED and name.endswith("q_proj.weight"):
            arr = _llama_cpp_permute(arr, heads)
        elif arch in _INTERLEAVED and name.endswith("k_proj.weight"):
            arr = _llama_cpp_permute(arr, kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)     # Gemma3Model.norm_shift
        arr = np.ascontiguousarray(arr)
        if arr.ndim == 3 and expert_qtype is not None:       # (llama-quantize's MXFP4_MOE: the experts alone)
            w.add_tensor(f"{out}.{suffix}", gguf.quants.quantize(arr, expert_qtype), raw_dtype=expert_qtype)
        # (a router stays F32, as the converter keeps ffn_gate_inp)
        elif arr.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32 and "ffn_gate_inp" not in out:
            w.add_tensor(f"{out}.{suffix}", gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{out}.{suffix}", arr)
    for name, arr in extra.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _gpt_oss_tensors(tensors: dict) -> dict:
    """gpt-oss's tensors as GptOssModel.modify_tensors gives them (its float, not MXFP4, path): each expert's
    gate_up_proj (H, 2I) transposed and cut into gate (even rows) and up (odd rows), down_proj transposed, the biases
    cut alike and named `.bias`, the sinks named `.weight`."""
    out = {}
    for name, arr in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            t = np.swapaxes(arr, -1, -2)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = np.ascontiguousarray(t[:, ::2, :])
            out[name.replace("gate_up_proj", "up_proj.weight")] = np.ascontiguousarray(t[:, 1::2, :])
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = np.ascontiguousarray(arr[..., ::2])
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = np.ascontiguousarray(arr[..., 1::2])
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = np.ascontiguousarray(np.swapaxes(arr, -1, -2))
        elif name.endswith("mlp.experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = arr
        elif name.endswith("self_attn.sinks"):
            out[name + ".weight"] = arr
        else:
            out[name] = arr
    return out


def _halves_tensors(tensors: dict) -> dict:
    """Qwen3-VL-MoE's fused experts as Qwen3VLMoeTextModel.modify_tensors gives them: gate_up_proj cut into gate (its
    first half of units) and up, each (E, I, H), and down_proj (E, H, I), from transformers 5's saved layout
    (gate_up (E, 2I, H), down (E, H, I): the converter's (E, H, 2I) and (E, I, H) transposed, the same stacks)."""
    out = {}
    for name, arr in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = arr.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj.weight")] = np.ascontiguousarray(arr[:, :half, :])
            out[name.replace("gate_up_proj", "up_proj.weight")] = np.ascontiguousarray(arr[:, half:, :])
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = arr
        else:
            out[name] = arr
    return out


def _stacked_experts(tensors: dict) -> dict:
    """The tensors with each layer's experts merged as the converter merges them: expert E's `<part>` matrices
    stacked in expert order into one (E, rows, cols) tensor named `model.layers.N.<prefix><part>.weight`."""
    out, experts = {}, {}
    for name, arr in tensors.items():
        parts = name.split(".")
        prefix = ".".join(parts[3:5]) + "." if len(parts) > 6 else ""
        if prefix in _EXPERT_STACKS and parts[5].isdigit() and parts[6] in _EXPERT_STACKS[prefix]:
            key = f"model.layers.{parts[2]}.{prefix}{parts[6]}.weight"
            experts.setdefault(key, {})[int(parts[5])] = arr
        else:
            out[name] = arr
    for key, by_expert in experts.items():
        out[key] = np.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def _add_vocabulary(w, hf_path: Path, cfg: dict) -> None:
    """The tokenizer.json's byte-level BPE as the converter's _set_vocab_gpt2 writes it (tokens in id order, added
    special tokens as control tokens, merges, the special ids, the BOS rule and the chat template)."""
    tok = json.loads((hf_path / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((hf_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in tok["added_tokens"] if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    w.add_chat_template(tok_cfg["chat_template"])
