import pytest

from llm_serving.config import ConfigError, config_from_dict, load_config, parse_override


def test_defaults_are_valid_and_bind_loopback():
    cfg = config_from_dict({})
    assert cfg.serving_config.server_ip == "127.0.0.1"
    assert cfg.serving_config.agent_ip == "127.0.0.1"
    assert not cfg.context_decided               # the model's context, read when the server starts
    with pytest.raises(ConfigError, match="max_generate_length=auto"):
        cfg.max_model_len
    cfg = cfg.with_decided(max_generate_length=512)
    assert cfg.max_model_len == 512
    assert cfg.max_blocks_per_seq == 512 // 16
    assert cfg.decode_block_widths == [8, 16, 32]        # decode graphs for 128, 256 and 512 keys


def test_llm_serving_section_and_key_names_are_accepted(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("""
model_config:
    model_name: 'llama_7b'
    max_generate_length: 256
    end_token: 2
    seq_length: [64, 256]
    vocab_size: 32000
    prefill_batch_size: [1]
    decode_batch_size: [1, 4, 8]
    pad_token_id: 0
    zactivate_len: [512, 1024]
    backend: 'kbk'
serving_config:
    agent_ports: [16002, 16003]
    start_device_id: 2
    server_ip: 'localhost'
    server_port: 8835
    max_num_seqs: 8
pa_config:
    num_blocks: 224
    block_size: 128
    decode_seq_length: 4096
tokenizer:
    type: LlamaTokenizer
    vocab_file: '/path/tokenizer.model'
model_path:
    prefill_model: ["/x.mindir"]
""")
    cfg = load_config(str(path))
    assert cfg.model_config.model_name == "llama_7b"
    assert cfg.model_config.end_token_ids == [2]
    assert cfg.serving_config.agent_ports == [16002, 16003]
    assert cfg.serving_config.start_device_id == 2
    assert cfg.pa_config.block_size == 128
    assert cfg.max_model_len == 256
    assert cfg.max_blocks_per_seq == 4096 // 128
    assert cfg.decode_block_widths == [4, 8, 32]         # zactivate_len: llm-serving's decode KV lengths
    assert cfg.tokenizer.vocab_file == "/path/tokenizer.model"


@pytest.mark.parametrize("raw, needle", [
    ({"serving_config": {"agent_portz": [1]}}, "serving_config.agent_portz"),
    ({"nonsense": {}}, "nonsense"),
    ({"pa_config": {"num_blocks": 0}}, "pa_config.num_blocks=0"),
    ({"pa_config": {"block_size": "16"}}, "pa_config.block_size='16'"),
    ({"model_config": {"decode_batch_size": []}}, "model_config.decode_batch_size"),
    ({"model_config": {"decode_batch_size": [1, 1]}}, "distinct"),
    ({"model_config": {"device_target": "GPU"}}, "model_config.device_target='GPU'"),
    ({"serving_config": {"server_port": 70000}}, "serving_config.server_port=70000"),
    ({"serving_config": {"max_num_seqs": 64}, "model_config": {"decode_batch_size": [1, 32]}},
     "serving_config.max_num_seqs=64"),
    ({"pa_config": {"num_blocks": "lots"}}, "pa_config.num_blocks='lots'"),
    ({"pa_config": {"kv_memory_fraction": 0.95}}, "pa_config.kv_memory_fraction=0.95"),
    ({"pa_config": {"num_blocks": 4}, "model_config": {"max_generate_length": 512}}, "pa_config.num_blocks=4"),
    ({"model_config": {"end_token": [-1]}}, "model_config.end_token"),
    ({"tokenizer": {"type": "BertTokenizer"}}, "tokenizer.type"),
    ({"scheduler_config": {"policy": "sjf"}}, "scheduler_config.policy='sjf'"),
    ({"scheduler_config": {"chunked_prefill": "yes"}}, "scheduler_config.chunked_prefill='yes'"),
    ({"scheduler_config": {"max_chunk_tokens": 1024}}, "scheduler_config.max_chunk_tokens=1024"),
    ({"scheduler_config": {"max_decode_wait_steps": 0}}, "scheduler_config.max_decode_wait_steps=0"),
    ({"scheduler_config": {"max_waiting_tokens": 100}, "model_config": {"max_generate_length": 512}},
     "scheduler_config.max_waiting_tokens=100"),
    ({"model_config": {"max_generate_length": "long"}}, "model_config.max_generate_length='long'"),
    ({"scheduler_config": {"kv_watermark": 0.7}}, "scheduler_config.kv_watermark=0.7"),
    ({"serving_config": {"max_num_batched_tokens": 16}}, "serving_config.max_num_batched_tokens=16"),
    ({"serving_config": {"max_agent_restarts": -1}}, "serving_config.max_agent_restarts=-1"),
    ({"serving_config": {"agent_restart_window_s": 0}}, "serving_config.agent_restart_window_s=0"),
    ({"serving_config": {"shutdown_grace_s": -1}}, "serving_config.shutdown_grace_s=-1"),
    ({"serving_config": {"agent_huge_pages": "sometimes"}}, "serving_config.agent_huge_pages='sometimes'"),
    ({"serving_config": {"warmup": "lazy"}}, "serving_config.warmup='lazy'"),
    ({"serving_config": {"api_key": "short"}}, "serving_config.api_key='<hidden>'"),
    ({"serving_config": {"api_key": "has a space in it"}}, "without spaces"),
])
def test_bad_values_name_key_and_value(raw, needle):
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)
    assert needle in str(err.value)


def test_scheduler_config_defaults_and_chunked_prefill_lifts_the_length_limit():
    cfg = config_from_dict({"model_config": {"max_generate_length": 2048}})
    sched = cfg.scheduler_config
    assert (sched.policy, sched.chunked_prefill, sched.enable_prefix_caching) == ("prefill_first", True, True)
    assert cfg.max_model_len == 2048 and cfg.max_chunk_tokens == 512      # chunks of the largest bucket
    cfg = config_from_dict({"model_config": {"max_generate_length": 2048}, "pa_config": {"num_blocks": 512}},
                           ("scheduler_config.chunked_prefill=false",))
    assert cfg.max_model_len == 512                                        # whole prompts: the largest bucket
    cfg = config_from_dict({"model_config": {"max_generate_length": 2048}, "pa_config": {"num_blocks": 512}},
                           ("scheduler_config.max_chunk_tokens=128", "scheduler_config.policy=longest_output_first"))
    assert cfg.max_model_len == 2048 and cfg.max_chunk_tokens == 128 and cfg.max_blocks_per_seq == 128
    assert cfg.scheduler_config.policy == "longest_output_first"


def test_decode_buckets_and_max_num_seqs_derive_from_each_other():
    cfg = config_from_dict({})
    assert cfg.serving_config.max_num_seqs == 64
    assert cfg.model_config.decode_batch_size == [1, 4, 16, 64]               # the CPU kernels skip padding rows
    cfg = config_from_dict({}, ("serving_config.max_num_seqs=100",))
    assert cfg.model_config.decode_batch_size == [1, 4, 16, 64, 100]         # the last bucket fits exactly
    cfg = config_from_dict({}, ("model_config.device_target=Ascend",))
    assert cfg.model_config.decode_batch_size == [1, 4, 8, 16, 32, 64]       # padding is computed there
    cfg = config_from_dict({}, ("serving_config.max_num_seqs=3",))
    assert cfg.model_config.decode_batch_size == [1, 3]
    cfg = config_from_dict({}, ("model_config.decode_batch_size=[1,2,24]",))   # buckets given: they bound it
    assert cfg.serving_config.max_num_seqs == 24
    cfg = config_from_dict({}, ("model_config.decode_batch_size=[1,2,24]", "serving_config.max_num_seqs=10"))
    assert (cfg.serving_config.max_num_seqs, cfg.model_config.decode_batch_size) == (10, [1, 2, 24])


def test_num_blocks_auto_is_decided_later_and_then_checked():
    cfg = config_from_dict({"model_config": {"max_generate_length": 1024}})
    assert cfg.pa_config.num_blocks == "auto" and cfg.pa_config.kv_memory_fraction == 0.3
    assert cfg.with_decided(num_blocks=64).pa_config.num_blocks == 64
    with pytest.raises(ConfigError, match="pa_config.num_blocks=63"):    # 1,024 tokens need 64 blocks of 16
        cfg.with_decided(num_blocks=63)


def test_overrides_parse_yaml_values_and_win_over_file():
    cfg = config_from_dict({"pa_config": {"num_blocks": 100}},
                           ("pa_config.num_blocks=64", "serving_config.agent_ports=[16002,16003]",
                            "model_config.end_token=[1,2]"))
    assert cfg.pa_config.num_blocks == 64
    assert cfg.serving_config.agent_ports == [16002, 16003]
    assert cfg.model_config.end_token_ids == [1, 2]


@pytest.mark.parametrize("text", ["num_blocks=3", "pa_config.num_blocks", "pa_config.num_blocks=[1,"])
def test_malformed_override_is_an_error(text):
    with pytest.raises(ConfigError) as err:
        parse_override(text)
    assert text in str(err.value)


def test_unknown_override_key_is_an_error():
    with pytest.raises(ConfigError, match="pa_config.nblocks"):
        config_from_dict({}, ("pa_config.nblocks=3",))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_config: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_shipped_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert configs, "configs/ holds the example configs"
    for path in configs:
        cfg = load_config(str(path))
        if "910b" not in path.name:     # CPU configs: agents on free ports, so two servers share a machine
            assert set(cfg.serving_config.agent_ports) == {0}, path.name
    assert config_from_dict({}).serving_config.agent_ports == [0]


def test_api_key_error_never_shows_the_key():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"serving_config": {"api_key": "secret\tkey-that-is-long"}})
    assert "secret" not in str(err.value)
    assert config_from_dict({"serving_config": {"api_key": "a-long-enough-key"}}).serving_config.api_key


def test_spec_config_defaults_checks_and_a_bare_off():
    from llm_serving.config import ConfigError, config_from_dict

    cfg = config_from_dict({})
    assert cfg.spec_config.method == "ngram" and cfg.spec_config.tokens_per_row == 5
    off = config_from_dict({}, ["spec_config.method=off"])          # YAML's `off` is false
    assert off.spec_config.method == "off" and off.spec_config.tokens_per_row == 1
    switches = config_from_dict({}, ["model_config.attention_kernel=off"]).model_config.attention_kernel, \
        config_from_dict({}, ["model_config.attention_kernel=on"]).model_config.attention_kernel
    assert switches == ("off", "on")                                 # and `on` true
    tree = config_from_dict({}, ["spec_config.method=draft_tree", "spec_config.tree_width=3"]).spec_config
    assert tree.uses_draft and tree.is_tree and tree.tokens_per_row == 13
    for bad, needle in (("spec_config.method=medusa", "must be one of"),
                        ("spec_config.num_speculative_tokens=0", "integer >= 1"),
                        ("spec_config.num_speculative_tokens=17", "<= 16"),
                        ("spec_config.max_batch_size=true", "integer >= 1")):
        with pytest.raises(ConfigError, match=needle):
            config_from_dict({}, [bad])
    with pytest.raises(ConfigError, match="ngram_min"):
        config_from_dict({}, ["spec_config.ngram_min=4", "spec_config.ngram_max=2"])


def test_layer_kernel_switch_and_limit():
    from llm_serving.config import ConfigError, config_from_dict

    mc = config_from_dict({}).model_config
    assert (mc.layer_kernel, mc.layer_kernel_max_tokens) == ("auto", None)      # None: every step
    off = config_from_dict({}, ["model_config.layer_kernel=off", "model_config.layer_kernel_max_tokens=16"])
    assert (off.model_config.layer_kernel, off.model_config.layer_kernel_max_tokens) == ("off", 16)
    for bad, needle in (("model_config.layer_kernel=fast", "must be one of"),
                        ("model_config.layer_kernel_max_tokens=0", "integer >= 1")):
        with pytest.raises(ConfigError, match=needle):
            config_from_dict({}, [bad])
    with pytest.raises(ConfigError, match="needs the paged-attention kernel"):
        config_from_dict({}, ["model_config.layer_kernel=on", "model_config.attention_kernel=off"])


def test_keep_quantized_switch():
    from llm_serving.config import ConfigError, config_from_dict

    assert config_from_dict({}).model_config.keep_quantized is True
    assert config_from_dict({}, ["model_config.keep_quantized=false"]).model_config.keep_quantized is False
    with pytest.raises(ConfigError, match="keep_quantized.*must be true or false"):
        config_from_dict({"model_config": {"keep_quantized": "sometimes"}})


def test_batch_invariance_is_auto_by_default_and_true_needs_the_layer_kernel_everywhere():
    from llm_serving.config import ConfigError, config_from_dict

    assert config_from_dict({}).model_config.batch_invariant == "auto"
    for value, want in (("true", True), ("false", False), ("auto", "auto")):
        assert config_from_dict({}, [f"model_config.batch_invariant={value}"]).model_config.batch_invariant == want
    # 'auto' takes what the layer kernel can give: with it off, the steps are simply not invariant
    off = config_from_dict({}, ["model_config.layer_kernel=off"]).model_config
    assert (off.layer_kernel, off.batch_invariant) == ("off", "auto")
    with pytest.raises(ConfigError, match="batch_invariant.*must be true, false or 'auto'"):
        config_from_dict({}, ["model_config.batch_invariant=sometimes"])
    for other in ("model_config.layer_kernel=off", "model_config.attention_kernel=off",
                  "model_config.layer_kernel_max_tokens=16"):
        with pytest.raises(ConfigError, match="batch_invariant.*needs the CPU layer kernel on every step"):
            config_from_dict({}, ["model_config.batch_invariant=true", other])


def test_decode_runs_settings_and_the_output_width_they_need():
    from llm_serving.config import ConfigError, config_from_dict
    from llm_serving.shm.layout import StepLayout

    cfg = config_from_dict({}, ["spec_config.method=off", "model_config.max_generate_length=512"])
    assert (cfg.scheduler_config.decode_steps, cfg.scheduler_config.decode_steps_max_rows) == (8, None)
    assert StepLayout.from_config(cfg).max_verify == 8           # a run's tokens come back in the verify outputs
    cfg = config_from_dict({}, ["spec_config.method=off", "scheduler_config.decode_steps=1",
                                "model_config.max_generate_length=512"])
    assert StepLayout.from_config(cfg).max_verify == 1
    for bad, needle in (("scheduler_config.decode_steps=0", "integer >= 1"),
                        ("scheduler_config.decode_steps=65", "<= 64"),
                        ("scheduler_config.decode_steps_max_rows=0", "integer >= 1")):
        with pytest.raises(ConfigError, match=needle):
            config_from_dict({}, [bad])


def test_lora_config_names_slots_and_rank():
    from llm_serving.config import ConfigError, config_from_dict

    lc = config_from_dict({}).lora_config
    assert (lc.adapters, lc.max_loras, lc.max_lora_rank) == ({}, 4, 16)
    lc = config_from_dict({"lora_config": {"adapters": {"sql-v2": "/a", "chat_1": "/b"}}},
                          ["lora_config.max_loras=2", "lora_config.max_lora_rank=64"]).lora_config
    assert (lc.adapters, lc.max_loras, lc.max_lora_rank) == ({"sql-v2": "/a", "chat_1": "/b"}, 2, 64)
    for bad, needle in (({"adapters": ["/a"]}, "mapping of adapter name"),
                        ({"adapters": {"a/b": "/a"}}, "URL paths"),
                        ({"adapters": {"a": ""}}, "PEFT adapter directory"),
                        ({"max_loras": 0}, "integer >= 1"), ({"max_lora_rank": "big"}, "integer >= 1"),
                        ({"rank": 8}, "unknown config key lora_config.rank")):
        with pytest.raises(ConfigError, match=needle):
            config_from_dict({"lora_config": bad})
    lc = config_from_dict({"lora_config": {"adapters": {"a": "/a", "b": "/b", "c": "/c"}, "max_loras": 2}}).lora_config
    assert lc.slot_of() == {"a": 1, "b": 2}                  # c is loaded when a request needs it
    lc = config_from_dict({"lora_config": {"adapters": {"a": "/a", "b": "/b"}}}).lora_config
    assert lc.enabled and lc.slot_of() == {"a": 1, "b": 2}
    lc = config_from_dict({"lora_config": {"adapters": {"a": "/a"}, "slots": {"a": 3}}}).lora_config
    assert lc.slot_of() == {"a": 3}
    assert not config_from_dict({}).lora_config.enabled
    assert config_from_dict({}, ["lora_config.enable_lora=true"]).lora_config.enabled
    for slots in ({"a": 5}, {"c": 1}, {"a": 0}, {"a": 1, "b": 1}):
        with pytest.raises(ConfigError, match="its own slot in 1..max_loras"):
            config_from_dict({"lora_config": {"adapters": {"a": "/a", "b": "/b"}, "slots": slots}})
    with pytest.raises(ConfigError, match="served model's own name"):
        config_from_dict({"lora_config": {"adapters": {"m": "/a"}}}, ["model_config.model_name=m"])


def test_agent_huge_pages_is_auto_on_or_off():
    """serving_config.agent_huge_pages: auto by default; on and off (and YAML's true / false) as given (what auto
    decides: test_launch.py)."""
    cfg = config_from_dict({"serving_config": {"agent_huge_pages": False}})
    assert cfg.serving_config.agent_huge_pages == "off"
    assert config_from_dict({}).serving_config.agent_huge_pages == "auto"


def test_the_default_yaml_spells_out_every_default():
    """configs/default.yaml says it lists every key with its default: it does, and they are the code's."""
    from pathlib import Path

    import yaml
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "default.yaml").read_text())
    listed, code = config_from_dict(raw).to_dict(), config_from_dict({}).to_dict()
    assert listed == code
    missing = [f"{s}.{k}" for s in code for k in code[s] if k not in (raw.get(s) or {})]
    assert missing == ["model_config.vocab_size", "model_config.model_dtype", "model_config.hidden_size",
                       "pa_config.window_tokens"], missing
