"""What `llm-serving start` and `llm-serving agent` decide from the model before any agent starts. This package's
interface: import from here.

- `model.py`      which model: its path, served name and tokenizer file (`resolve_model`), the draft model and
                  the LoRA adapters checked against it
- `kv_memory.py`  what depends on its shape (`size_for_model`): the vocabulary size, the context
                  (`max_generate_length: auto`) and the KV blocks (`num_blocks: auto`)

`decide` does both, in that order. The package reads the config, the model's files (models/) and the tokenizers;
it never imports the master, HTTP or the agents.
"""
from llm_serving.cache_dir import default_cache_dir
from llm_serving.config import Config
from llm_serving.models.kernels import libraries_for
from llm_serving.models.weights.page_cache import read_ahead_model

from .kv_memory import size_for_model
from .model import resolve_model

__all__ = ["decide", "resolve_model", "size_for_model"]


def decide(config: Config) -> tuple:
    """(config with what the model decides, model path, served name, tokenizer file): `resolve_model`, then
    `size_for_model` on its path. The model's files are asked into the page cache meanwhile (weights/page_cache.py),
    so that a start reads them from the disk while its agent imports MindSpore. A ConfigError names the setting that
    does not fit (the model, its draft or adapters, the memory it needs)."""
    model_dir, model_name, vocab_file = resolve_model(config)
    mc = config.model_config
    layer_kernel = "decoder_layer_cpu" in libraries_for(mc.device_target, mc.attention_kernel, mc.layer_kernel,
                                                        len(config.serving_config.agent_ports))
    read_ahead_model(model_dir, layer_kernel, mc.keep_quantized, default_cache_dir())
    return size_for_model(config, model_dir), model_dir, model_name, vocab_file
