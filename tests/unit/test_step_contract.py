"""The step contract: the step arrays declared once (shm/layout.py), read and written through named views
(StepView, StepBuffers.view), the master's one row writer (master/step_io.py's RowWriter) and the runner's spec
(models/runner_spec.py). Pure numpy, no MindSpore."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llm_serving.config import KV_CACHE_TYPES, config_from_dict
from llm_serving.master.step_io import RowWriter
from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.models.step_inputs import StepInputs, StepLimits
from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.layout import ARRAYS, INPUT_NAMES, OUTPUT_NAMES, StepKind, StepLayout, StepView

LAYOUT = StepLayout(max_rows=4, max_tokens=8, max_blocks_per_seq=3, max_context=48, max_verify=5)


def test_every_step_array_is_declared_once_with_its_shape_class_writer_and_reader():
    names = [a.name for a in ARRAYS]
    assert len(names) == len(set(names)) and set(INPUT_NAMES) | set(OUTPUT_NAMES) == set(names)
    assert {a.writer for a in ARRAYS} == {"master", "agent0"}
    assert {a.reader for a in ARRAYS if a.is_input} == {"model", "sampler", "trace"}
    shapes = {spec.name: spec.shape for spec in LAYOUT.arrays()}
    assert shapes["input_ids"] == (4, 8) and shapes["block_tables"] == (4, 3) and shapes["history"] == (4, 48)
    assert shapes["verify_parent"] == shapes["out_verify_ids"] == (4, 5) and shapes["out_top_ids"] == (4, 20)
    assert shapes["request_ids"] == (4,) and LAYOUT.arrays()[names.index("request_ids")].dtype == np.int64


def test_a_view_is_the_steps_part_of_the_buffers_by_name():
    b = StepBuffers.private(LAYOUT)
    view = b.view(StepKind.PREFILL, 2, 6)
    assert view.kind is StepKind.PREFILL and view.input_ids.shape == (2, 6) and view.block_tables.shape == (2, 3)
    assert view.top_n.shape == (2,) and view.history.shape == (2, 48) and view.out_top_ids.shape == (2, 20)
    assert view.verify_random_u is None and view.verify_parent is None     # verify inputs: verify steps only
    view.input_ids[1, 5] = 7                                                 # a view, not a copy
    view.out_token_ids[:] = [3, 4]
    assert b.input_ids[1, 5] == 7 and b.out_token_ids[:3].tolist() == [3, 4, 0]
    verify = b.view("verify", 3, 4)
    assert verify.verify_random_u.shape == verify.verify_parent.shape == verify.out_verify_ids.shape == (3, 4)
    run = b.view("decode_run", 2, 1, steps=5)                               # a slot per step of the run
    assert run.slot_mapping.shape == run.out_verify_ids.shape == (2, 5) and run.verify_parent is None
    part = b.view("decode", 3, 1).rows(np.array([0, 2]))
    assert part.input_ids.shape == (2, 1) and part.kind is StepKind.DECODE
    with pytest.raises(TypeError, match="no step array named verify_u"):
        StepView("verify", verify_u=np.zeros((1, 2)))
    with pytest.raises(ValueError):
        StepView("sideways")


@pytest.mark.parametrize("kind", list(StepKind))
def test_the_broadcast_holds_the_model_inputs_of_the_step(kind):
    """What rank 0 sends other nodes' ranks: the `model` inputs, from the declarations, verify inputs for verify
    steps only; never the sampler's penalties or the request numbers."""
    names = [name for name, _ in LAYOUT.step_inputs(kind, 2, 1, 5 if kind is StepKind.DECODE_RUN else 1)]
    model = [a.name for a in ARRAYS if a.is_input and a.reader == "model"]
    assert names == [n for n in model if kind is StepKind.VERIFY or not n.startswith("verify_")]
    assert "history" not in names and "request_ids" not in names and "repetition_penalty" not in names


def test_the_row_writer_writes_what_the_runners_step_inputs_read():
    b = StepBuffers.private(LAYOUT)
    b.input_ids[0] = b.slot_mapping[0] = 99                     # left from an earlier step
    rows = RowWriter(b, block_size=16)
    rows.table(0, [2, 5])
    rows.tokens(0, [11, 12, 13], 14)                            # positions 14..16: blocks 2, 5
    rows.sampling(0, prompt_len=14, request_id=3, top_n=2)
    rows.table(1, [1])
    rows.tokens(1, [21], 4)
    rows.sampling(1, prompt_len=4, request_id=4, temperature=0.7, top_k=5, lora=1)
    assert b.block_tables[:2].tolist() == [[2, 5, 0], [1, 0, 0]]
    assert b.input_ids[0].tolist() == [11, 12, 13] + [0] * 5 and b.positions[0, :3].tolist() == [14, 15, 16]
    assert b.slot_mapping[0].tolist() == [2 * 16 + 14, 2 * 16 + 15, 5 * 16 + 0] + [-1] * 5
    assert b.context_lens[:2].tolist() == [17, 5] and b.query_lens[:2].tolist() == [3, 1]
    assert b.top_n[:2].tolist() == [2, 0] and b.temperature[1] == np.float32(0.7) and b.lora[:2].tolist() == [0, 1]
    assert b.repetition_penalty[0] == 1 and b.top_p[0] == 1 and b.request_ids[:2].tolist() == [3, 4]
    rows.table(1, [1, 6], written=1)                                        # a table that grew: appended
    rows.history(1, [1, 2, 3], 0)
    assert b.block_tables[1].tolist() == [1, 6, 0] and b.history_len[1] == 3
    limits = StepLimits(vocab_size=100, max_context=48, num_blocks=8, max_blocks_per_seq=3, scratch_slot=128,
                        lora_slots=1)
    step = StepInputs.make(limits, b.view("prefill", 2, 3))
    assert step.query_lens.tolist() == [3, 1] and step.lora.tolist() == [0, 1] and not step.penalized


def test_the_runner_spec_is_made_from_the_config_in_one_place():
    config = config_from_dict({"spec_config": {"method": "ngram"}, "lora_config": {"enable_lora": True},
                              "model_config": {"max_generate_length": 512}, "pa_config": {"num_blocks": 64}})
    spec = RunnerSpec.from_config(config, device_id=3, num_threads=2, compile_cache=True)
    mc = config.model_config
    assert (spec.device_id, spec.num_threads, spec.compile_cache) == (3, 2, True)
    assert spec.decode_batch_sizes == tuple(mc.decode_batch_size) and spec.block_size == config.pa_config.block_size
    assert spec.verify_width == config.spec_config.tokens_per_row and spec.lora_slots == config.lora_config.max_loras
    assert RunnerSpec.from_config(config).num_threads == mc.num_threads       # the config's unless the rank's own
    assert RunnerSpec.from_config(config_from_dict({"pa_config": {"num_blocks": 64}}).with_decided(
        max_generate_length=512)).lora_slots == 0
    assert spec.kv_cache is KV_CACHE_TYPES["float16"] and spec.num_blocks == 64    # (auto decided: typed values)
    with pytest.raises(ValueError, match="RunnerSpec.num_blocks must be an integer >= 1, got 'auto'"):
        RunnerSpec.from_config(config_from_dict({"model_config": {"max_generate_length": 512}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_blocks = 1
    assert dataclasses.replace(spec, layer_kernel="off").layer_kernel == "off"


def test_the_window_pool_is_written_beside_the_main_tables_and_a_left_window_points_at_the_scratch_block():
    """StepIO with a window pool: each row's window table and slots as its main ones (the same block indices,
    the pool's blocks), entries its window left written as the pool's scratch block (the agents' own, after its
    blocks), rewritten as they are left; a draft's StepIO writes none (its layers read the main tables)."""
    from llm_serving.master.batch import ScheduledBatch
    from llm_serving.master.block_manager import BlockManager
    from llm_serving.master.request import Request, SamplingParams
    from llm_serving.master.step_io import StepIO

    layout = StepLayout(max_rows=2, max_tokens=16, max_blocks_per_seq=6, max_context=24, max_verify=1)
    b = StepBuffers.private(layout)
    bm = BlockManager(num_blocks=12, block_size=4, window=5, window_blocks=5)
    bm.allocate("other", 4)                                   # (so the two pools' block ids differ)
    bm.free("other")
    bm.allocate("other", 8)
    req = Request(list(range(10, 20)), SamplingParams(max_new_tokens=4), frozenset(), req_id="r")
    io, draft_io = StepIO(bm), StepIO(bm, window=False)
    bm.allocate("r", 10)
    io.write_inputs(b, ScheduledBatch([req], [10]))
    main, window = bm.block_tables["r"], bm.window_tables["r"]
    assert b.block_tables[0, :3].tolist() == main and b.window_tables[0, :3].tolist() == window != main
    assert b.window_slots[0, :10].tolist() == [window[p // 4] * 4 + p % 4 for p in range(10)]
    req.num_computed_tokens = 10
    req.output_ids.append(7)
    assert bm.release_window("r", 10) == 1                    # the query at 10 sees 6..10: block 0 left
    bm.allocate("r", 11)
    io.write_inputs(b, ScheduledBatch([req], [1]))            # a decode step: the left entry rewritten
    assert b.window_tables[0, :3].tolist() == [5] + window[1:] and b.window_slots[0, 0] == window[2] * 4 + 2
    assert b.slot_mapping[0, 0] == main[2] * 4 + 2
    b.window_tables[:] = b.window_slots[:] = -7
    draft_io.write_inputs(b, ScheduledBatch([req], [1]))
    assert (b.window_tables == -7).all() and (b.window_slots == -7).all() and b.slot_mapping[0, 0] == main[2] * 4 + 2
