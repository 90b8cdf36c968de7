"""pa_config.num_blocks auto: the KV cache sized from the model's shape and the memory available at start."""
import math

import pytest

from llm_serving.cli import main
from llm_serving.config import ConfigError, config_from_dict
from llm_serving.startup.kv_memory import bytes_per_block, plan_blocks, size_for_model


@pytest.fixture(scope="module")
def stories_hf(stories_dir) -> str:
    return str(stories_dir / "hf")

MiB = 2 ** 20
# stories260K: 5 layers, 4 KV heads of 8 dims, float16 (pa_config.kv_cache_dtype auto): 2 x 5 x 4 x 8 x 2 bytes =
# 640 bytes per token
STORIES_TOKEN_BYTES = 2 * 5 * 4 * 8 * 2


def test_a_block_holds_keys_and_values_of_every_layer_in_its_dtype():
    assert bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16) == 2 * 30 * 3 * 64 * 16 * 2
    assert bytes_per_block(30, 3, 64, 16, "float32") == 2 * 30 * 3 * 64 * 16 * 4
    assert bytes_per_block(30, 3, 64, 16, "bfloat16") == 2 * 30 * 3 * 64 * 16 * 2
    assert bytes_per_block(30, 3, 64, 16, "int8") == 2 * 30 * 3 * (64 + 4) * 16     # each head vector's scale


def test_a_float32_cache_gets_half_the_blocks_of_the_same_memory(stories_hf):
    sets = ("serving_config.max_num_seqs=64", "spec_config.method=off", "pa_config.kv_memory_fraction=0.5")
    available = 2 * 100 * STORIES_TOKEN_BYTES * 16           # half of it: 100 float16 blocks
    blocks = {dtype: size_for_model(config_from_dict({"model_config": {"max_generate_length": 64}},
                                                     sets + (f"pa_config.kv_cache_dtype={dtype}",)),
                                   stories_hf, available_bytes=available).pa_config.num_blocks
              for dtype in ("auto", "float16", "bfloat16", "float32")}
    assert blocks == {"auto": 100, "float16": 100, "bfloat16": 100, "float32": 50}


def test_a_kv_cache_type_is_one_typed_value_from_the_setting_on():
    """pa_config.kv_cache_dtype becomes a KvCacheType once (kv_cache_type: auto decided, anything else refused by
    name), which the config, the runner spec and the model carry: its bytes per head vector (int8: 64 codes and a
    float32 scale) and whether only the CPU layer kernel reads it."""
    from llm_serving.config import KV_CACHE_TYPES, kv_cache_type
    from llm_serving.models.runner_spec import RunnerSpec

    assert [(t.name, t.vector_bytes(64), t.kernel_only) for t in KV_CACHE_TYPES.values()] == [
        ("float16", 128, False), ("bfloat16", 128, True), ("float32", 256, False), ("int8", 68, True)]
    assert kv_cache_type("auto") is KV_CACHE_TYPES["float16"] and kv_cache_type(KV_CACHE_TYPES["int8"]).scale_bytes == 4
    config = config_from_dict({"pa_config": {"num_blocks": 8}}, ("pa_config.kv_cache_dtype=int8",))
    assert config.kv_cache_type is KV_CACHE_TYPES["int8"] and config.kv_cache_dtype == "int8"
    assert RunnerSpec.from_config(config.with_decided(max_generate_length=64)).kv_cache is KV_CACHE_TYPES["int8"]
    with pytest.raises(ConfigError, match="pa_config.kv_cache_dtype.*'fp8'.*must be one of auto, float16"):
        RunnerSpec(num_blocks=8, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=(1,),
                   prefill_batch_sizes=(1,), prefill_seq_lens=(16,), kv_cache="fp8")


def test_kv_cache_dtype_is_checked_and_float32_is_refused_on_ascend():
    assert config_from_dict({}).kv_cache_dtype == "float16"
    assert config_from_dict({}, ("pa_config.kv_cache_dtype=float32",)).kv_cache_dtype == "float32"
    with pytest.raises(ConfigError, match="pa_config.kv_cache_dtype.*must be one of auto, float16, bfloat16, float32, int8"):
        config_from_dict({}, ("pa_config.kv_cache_dtype=int4",))
    for other in ("float32", "bfloat16", "int8"):
        with pytest.raises(ConfigError, match="pa_config.kv_cache_dtype.*Ascend"):
            config_from_dict({"model_config": {"device_target": "Ascend"}}, (f"pa_config.kv_cache_dtype={other}",))
    assert config_from_dict({"model_config": {"device_target": "Ascend"}}).kv_cache_dtype == "float16"
    assert config_from_dict({}, ("pa_config.kv_cache_dtype=bfloat16",)).kv_cache_dtype == "bfloat16"
    for op_path in ("model_config.layer_kernel=off", "model_config.layer_kernel_max_tokens=64",
                    "serving_config.agent_ports=[0,0]"):
        for dtype in ("bfloat16", "int8"):
            with pytest.raises(ConfigError, match=f"{dtype} is read by the CPU layer kernel only"):
                config_from_dict({}, (f"pa_config.kv_cache_dtype={dtype}", op_path))


def test_a_long_context_is_not_reserved_for_every_request_but_one_request_always_fits():
    long = config_from_dict({"model_config": {"max_generate_length": 8192}}, ("serving_config.max_num_seqs=64",))
    assert plan_blocks(long, token_bytes=1000, available_bytes=100_000 * MiB).num_blocks == 64 * 512 // 16
    few = config_from_dict({"model_config": {"max_generate_length": 8192}}, ("serving_config.max_num_seqs=4",))
    assert plan_blocks(few, token_bytes=1000, available_bytes=100_000 * MiB).num_blocks == 8192 // 16


def test_enough_memory_gives_every_running_request_its_longest_length():
    cfg = config_from_dict({"model_config": {"max_generate_length": 512}}, ("serving_config.max_num_seqs=64",))
    plan = plan_blocks(cfg, token_bytes=1000, available_bytes=10_000 * MiB)
    assert plan.num_blocks == plan.wanted_blocks == 64 * 32
    assert "bound by the blocks wanted" in plan.describe()


def test_little_memory_gives_the_share_of_it_that_the_fraction_allows():
    cfg = config_from_dict({}, ("pa_config.kv_memory_fraction=0.5", "model_config.max_generate_length=512"))
    plan = plan_blocks(cfg, token_bytes=1000, available_bytes=16 * MiB)    # 8 MiB for blocks of 16,000 bytes
    assert plan.num_blocks == 8 * MiB // 16_000 < plan.wanted_blocks
    assert "bound by the memory budget" in plan.describe()


def test_not_even_one_longest_request_fitting_is_a_config_error_saying_what_to_lower():
    cfg = config_from_dict({"model_config": {"max_generate_length": 4096}})
    with pytest.raises(ConfigError, match="max_generate_length") as err:
        plan_blocks(cfg, token_bytes=100_000, available_bytes=100 * MiB)     # 30 MiB: 19 blocks, 256 needed
    assert "pa_config.num_blocks=auto" in str(err.value)


def test_the_model_shape_is_read_from_the_checkpoint_and_a_draft_adds_its_layers(stories_hf):
    cfg = config_from_dict({"model_config": {"max_generate_length": 256}},
                           ("serving_config.max_num_seqs=4", "spec_config.method=off"))
    sized = size_for_model(cfg, stories_hf, available_bytes=1000 * MiB)
    assert sized.pa_config.num_blocks == 4 * 16               # bound by 4 requests of 256 tokens
    tight = config_from_dict({"model_config": {"max_generate_length": 64}},
                             ("serving_config.max_num_seqs=64", "spec_config.method=off",
                              "pa_config.kv_memory_fraction=0.5"))
    available = 2 * 100 * STORIES_TOKEN_BYTES * 16           # half of it: 100 blocks of the target alone
    assert size_for_model(tight, stories_hf, available_bytes=available).pa_config.num_blocks == 100
    drafted = config_from_dict({"model_config": {"max_generate_length": 64}},
                               ("serving_config.max_num_seqs=64", "spec_config.method=draft",
                                "spec_config.draft_num_layers=3", "pa_config.kv_memory_fraction=0.5"))
    # the draft keeps 3 of the 5 layers with the same block tables: 8 layers' worth per block
    assert size_for_model(drafted, stories_hf, available_bytes=available).pa_config.num_blocks == 100 * 5 // 8


def test_a_given_block_count_is_kept():
    cfg = config_from_dict({}, ("pa_config.num_blocks=100", "model_config.max_generate_length=512",
                                "model_config.vocab_size=512", "model_config.hidden_size=64",
                                "pa_config.window_blocks=0", "model_config.task=generate"))
    assert size_for_model(cfg, "/nonexistent", available_bytes=0) is cfg


def test_start_refuses_a_cache_that_cannot_hold_one_request(stories_hf, capsys):
    code = main(["start", "--model", stories_hf, "--set", "pa_config.kv_memory_fraction=0.0000001",
                 "--set", "model_config.max_generate_length=100000"])
    assert code == 2
    assert "pa_config.num_blocks=auto" in capsys.readouterr().err


def test_a_served_layer_cut_counts_only_its_layers_and_an_unreadable_shape_is_a_config_error(stories_hf, tmp_path):
    cut = config_from_dict({"model_config": {"max_generate_length": 64, "num_layers": 2}},
                           ("serving_config.max_num_seqs=64", "spec_config.method=off",
                            "pa_config.kv_memory_fraction=0.5"))
    available = 2 * 100 * STORIES_TOKEN_BYTES * 16           # 100 blocks of all 5 layers, 250 of 2
    assert size_for_model(cut, stories_hf, available_bytes=available).pa_config.num_blocks == 250
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the model's shape"):
        size_for_model(config_from_dict({}), str(broken), available_bytes=available)


def test_auto_context_is_the_models_trained_context(stories_hf):
    cfg = config_from_dict({}, ("spec_config.method=off",))
    sized = size_for_model(cfg, stories_hf, available_bytes=1000 * MiB)
    assert sized.max_model_len == 512                       # its config.json's max_position_embeddings
    assert sized.pa_config.num_blocks >= sized.max_blocks_per_seq == 512 // 16
    assert sized.model_config.vocab_size == 512             # its vocabulary: the step buffers' token mask width


def test_the_vocabulary_size_is_read_even_when_the_rest_is_given(stories_hf):
    given = config_from_dict({}, ("pa_config.num_blocks=100", "model_config.max_generate_length=512"))
    sized = size_for_model(given, stories_hf, available_bytes=0)
    assert sized.model_config.vocab_size == 512 and sized.pa_config.num_blocks == 100


def test_a_given_context_wins_over_the_models(stories_hf):
    cfg = config_from_dict({"model_config": {"max_generate_length": 2048}}, ("spec_config.method=off",))
    assert size_for_model(cfg, stories_hf, available_bytes=1000 * MiB).max_model_len == 2048


def test_auto_context_is_lowered_to_what_the_cache_holds_and_says_why(stories_hf, caplog):
    given = config_from_dict({}, ("spec_config.method=off", "pa_config.num_blocks=20"))
    with caplog.at_level("WARNING", logger="llm_serving.startup.kv_memory"):
        sized = size_for_model(given, stories_hf, available_bytes=0)
    assert sized.max_model_len == 20 * 16 and sized.pa_config.num_blocks == 20
    assert "pa_config.num_blocks=20" in caplog.text and "trained for 512 tokens" in caplog.text
    # num_blocks auto: the budget's whole blocks, the 100 of them here, bound one request
    budget = config_from_dict({}, ("spec_config.method=off", "pa_config.kv_memory_fraction=0.5",
                                   "serving_config.max_num_seqs=4"))
    sized = size_for_model(budget, stories_hf, available_bytes=2 * 20 * STORIES_TOKEN_BYTES * 16 + 100)
    assert sized.max_model_len == 20 * 16 and sized.pa_config.num_blocks == 20
    with pytest.raises(ConfigError, match="too few for one request"):
        size_for_model(budget, stories_hf, available_bytes=100)


def test_a_sliding_window_model_is_served_its_whole_trained_context():
    import dataclasses

    from llm_serving.startup.kv_memory import model_context
    from llm_serving.models.weights import LlamaConfig
    shape = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=32768)
    cfg = config_from_dict({})
    assert model_context(shape, cfg, 1000, 100_000 * MiB) == (32768, "the model's trained context", False)
    # the window is computed (models/rope.py, the kernels' windows), so it no longer cuts the context
    assert model_context(dataclasses.replace(shape, sliding_window=4096), cfg, 1000, 100_000 * MiB) == \
        (32768, "the model's trained context", False)
    n, why, cut = model_context(shape, cfg, 1000, 100 * MiB)         # 30 MiB of 1,000-byte tokens
    assert n == 30 * MiB // 16_000 * 16 and cut and "trained for 32768 tokens" in why


# --- the window pool (sliding-window layers) ------------------------------------------------------------

def gemma3_4b_shape(**changes):
    """Gemma 3 4B's cache shape: 34 layers, every 6th global, the rest sliding over 1,024 keys; 4 KV heads of 256."""
    from llm_serving.models.weights import LlamaConfig
    fields = dict(vocab_size=262_208, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
                  num_kv_heads=4, head_dim=256, max_position_embeddings=131_072, sliding_window=1024,
                  layer_types=tuple("full" if i % 6 == 5 else "sliding" for i in range(34)))
    fields.update(changes)
    return LlamaConfig(**fields)


@pytest.fixture
def gemma_shape(monkeypatch):
    import llm_serving.startup.kv_memory as kv_memory
    shape = gemma3_4b_shape()
    monkeypatch.setattr(kv_memory, "model_shape", lambda path: shape)
    return shape


GEMMA_TOKEN = bytes_per_block(34, 4, 256, 1)           # every layer's K and V of one token, float16
GEMMA_GLOBAL_TOKEN = bytes_per_block(5, 4, 256, 1)     # the 5 global layers'


def test_a_long_context_model_with_sliding_layers_keeps_them_in_a_window_pool(gemma_shape):
    sets = ("serving_config.max_num_seqs=16", "spec_config.method=off", "model_config.max_generate_length=8192",
            "pa_config.num_blocks=8192")                  # 16 requests of 8k tokens
    cfg = size_for_model(config_from_dict({}, sets), "gemma")
    assert cfg.pa_config.window_tokens == 1024
    pool = cfg.window_blocks
    # 16 requests' windows (1,024 keys and a decode run's 8 ahead: 67 blocks each) and a step's tokens (chunked)
    step = cfg.serving_config.max_num_batched_tokens
    assert pool == 16 * (-(-(1024 + 8) // 16) + 2) + -(-step // 16) + cfg.model_config.prefill_batch_size[-1]
    full = 8192 * 16 * GEMMA_TOKEN
    pooled = 8192 * 16 * GEMMA_GLOBAL_TOKEN + pool * 16 * (GEMMA_TOKEN - GEMMA_GLOBAL_TOKEN)
    assert pooled / full < 0.3                             # 5 of 34 layers hold the context, 29 a window
    # a short context saves nothing: no pool
    short = size_for_model(config_from_dict({}, sets[:2] + ("model_config.max_generate_length=512",
                                                             "pa_config.num_blocks=512")), "gemma")
    assert short.window_blocks == 0 and short.pa_config.window_tokens is None


def test_with_a_window_pool_the_memory_budget_holds_more_context(gemma_shape):
    sets = ("serving_config.max_num_seqs=4", "spec_config.method=off", "pa_config.kv_memory_fraction=0.5")
    available = 2 * 8 * 2 ** 30                           # 8 GiB for the cache
    off = size_for_model(config_from_dict({}, sets + ("pa_config.window_blocks=0",)), "gemma", available)
    on = size_for_model(config_from_dict({}, sets), "gemma", available)
    assert off.window_blocks == 0 and on.window_blocks > 0
    # every layer's bytes per token without the pool: 8 GiB / 136 KiB = 61,680 tokens; with it, the global
    # layers' 20 KiB per token beside the pool: the model's whole 131,072 tokens
    assert off.model_config.max_generate_length == 8 * 2 ** 30 // (GEMMA_TOKEN * 16) * 16
    assert on.model_config.max_generate_length == 131_072
    on_bytes = (on.pa_config.num_blocks * GEMMA_GLOBAL_TOKEN
                + on.window_blocks * (GEMMA_TOKEN - GEMMA_GLOBAL_TOKEN)) * 16
    assert on_bytes <= 8 * 2 ** 30 and on.pa_config.num_blocks >= on.max_blocks_per_seq


def test_a_window_pool_too_small_for_one_request_is_refused_by_name(gemma_shape):
    sets = ("spec_config.method=off", "model_config.max_generate_length=8192", "pa_config.num_blocks=1024")
    with pytest.raises(ConfigError, match=r"pa_config.window_blocks=100: one request needs \d+ blocks"):
        size_for_model(config_from_dict({}, sets + ("pa_config.window_blocks=100",)), "gemma")
    kept = size_for_model(config_from_dict({}, sets + ("pa_config.window_blocks=700",)), "gemma")
    assert kept.window_blocks == 700 and kept.pa_config.window_tokens == 1024


def test_a_model_without_sliding_layers_has_no_window_pool(stories_hf):
    cfg = size_for_model(config_from_dict({}, ("pa_config.window_blocks=300", "model_config.max_generate_length=64",
                                               "spec_config.method=off")), stories_hf, available_bytes=2 ** 30)
    assert cfg.window_blocks == 0 and cfg.pa_config.window_tokens is None


def test_the_kv_cache_is_sized_from_the_memory_the_weights_leave_and_a_model_too_large_is_refused(stories_hf,
                                                                                                  tmp_path):
    """A GGUF's weights take its file's size, another format's its tensors as float32; the KV cache gets what is
    left, and weights that do not fit are refused before any agent starts, naming both sizes."""
    from llm_serving.models.weights import expected_shapes, model_shape
    from llm_serving.startup.kv_memory import memory_after_weights, weight_bytes

    shape = model_shape(stories_hf)
    floats = weight_bytes(stories_hf, shape)
    assert floats == 4 * sum(math.prod(s) for s in expected_shapes(shape).values())
    assert memory_after_weights(stories_hf, shape, floats + 1000) == 1000
    gguf = tmp_path / "m.gguf"
    with open(gguf, "wb") as f:
        f.truncate(3 * 2**30)                       # (sparse: no disk used)
    assert weight_bytes(str(gguf), shape) == 3 * 2**30
    assert memory_after_weights(str(gguf), shape, 5 * 2**30) == 2 * 2**30
    with pytest.raises(ConfigError, match=r"weights take 3\.0 GiB in memory, but only 2\.0 GiB is available"):
        memory_after_weights(str(gguf), shape, 2 * 2**30)


@pytest.mark.parametrize("sets, named", [({"model_config": {"layer_kernel": "off"}}, "layer_kernel=off"),
                                         ({"model_config": {"layer_kernel_max_tokens": 16}}, "layer_kernel_max_tokens"),
                                         ({"serving_config": {"agent_ports": [0, 0]}}, "tensor parallelism")])
def test_a_mixture_on_mindspores_ops_is_refused_at_start_naming_the_setting(tmp_path, monkeypatch, sets, named):
    """A mixture of experts runs only on the layer kernel: settings that would put it on MindSpore's ops are a start
    error naming them (no agent started)."""
    from llm_serving.models.weights import LlamaConfig
    from llm_serving.startup import kv_memory

    mixture = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, architecture="mixtral", num_experts=4, experts_per_token=2,
                          expert_intermediate_size=64)
    monkeypatch.setattr(kv_memory, "model_shape", lambda path: mixture)
    with pytest.raises(ConfigError, match=f"mixture of experts \\(mixtral, 4 experts\\).*{named}"):
        size_for_model(config_from_dict(sets), str(tmp_path), available_bytes=2**30)
    assert size_for_model(config_from_dict({}), str(tmp_path), available_bytes=2**30).pa_config.num_blocks > 0


@pytest.fixture
def encoder_shape(tmp_path, monkeypatch):
    """A BERT encoder's shape (512 learned positions) read as the checkpoint's, without a checkpoint."""
    from llm_serving.models.weights import LlamaConfig
    from llm_serving.startup import kv_memory

    bert = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=4,
                       head_dim=16, max_position_embeddings=512, architecture="bert", causal=False, norm="layer",
                       post_norm=True, gated_mlp=False, mlp_bias=True, hidden_act="gelu", learned_positions=True,
                       type_vocab_size=2, embed_norm=True, attention_bias=True, o_bias=True)
    monkeypatch.setattr(kv_memory, "model_shape", lambda path: bert)
    return str(tmp_path)


def test_an_encoder_is_decided_an_embedding_model(encoder_shape):
    """task auto: embed for a bidirectional encoder, its context at most a step's row (seq_length's largest, 512 by
    default; 128 here) and its positions."""
    sized = size_for_model(config_from_dict({}), encoder_shape, available_bytes=2**30)
    assert sized.model_config.task == "embed" and sized.max_model_len == 512
    row = config_from_dict({"model_config": {"seq_length": [32, 128]}})
    assert size_for_model(row, encoder_shape, available_bytes=2**30).max_model_len == 128


def test_a_decoder_is_decided_a_generating_model_unless_told_to_embed(stories_hf):
    """A decoder generates (task auto); told to embed only, its inputs are computed whole too: its context at most a
    step's row (128 here, of its 512 positions), a larger one given refused."""
    assert size_for_model(config_from_dict({}), stories_hf, available_bytes=2**30).model_config.task == "generate"
    decoder_embeds = config_from_dict({"model_config": {"task": "embed", "seq_length": [32, 128]}})
    sized = size_for_model(decoder_embeds, stories_hf, available_bytes=2**30)
    assert sized.model_config.task == "embed" and sized.max_model_len == 128
    given = config_from_dict({"model_config": {"task": "embed", "seq_length": [32, 128], "max_generate_length": 256}})
    with pytest.raises(ConfigError, match=r"max_generate_length=256: an embedding model \(task embed\)"):
        size_for_model(given, stories_hf, available_bytes=2**30)


@pytest.mark.parametrize("sets, named", [
    ({"model_config": {"task": "generate"}}, "task=generate: the model is a bidirectional encoder"),
    ({"model_config": {"score_method": "yes_no"}}, "score_method=yes_no"),
    ({"model_config": {"attention_kernel": "off"}}, "attention_kernel=off"),
    ({"model_config": {"device_target": "Ascend"}}, "device_target=Ascend"),
    ({"serving_config": {"agent_ports": [0, 0]}}, "tensor parallelism"),
    ({"lora_config": {"enable_lora": True}}, "LoRA adapters"),
    ({"model_config": {"max_generate_length": 1024}}, "max_generate_length=1024"),
])
def test_what_cannot_serve_an_encoder_is_refused_at_start_naming_the_setting(encoder_shape, sets, named):
    with pytest.raises(ConfigError, match=named):
        size_for_model(config_from_dict(sets), encoder_shape, available_bytes=2**30)
