"""KvLayout (models/runner/kv_inputs.py, pure numpy): a step's slots and block tables padded to its graph's bucket,
padding sat out where the layer kernel runs (-1) or written to the cache's scratch block where MindSpore's ops do."""
from __future__ import annotations

import numpy as np

from llm_serving.models.runner.kv_inputs import KvLayout, flat_tokens, pad
from llm_serving.models.step_inputs import StepInputs


def test_padding_goes_to_the_scratch_block_for_the_ops_and_sits_out_for_the_layer_kernel():
    layout = KvLayout(num_blocks=4, block_size=4, window_blocks=2)
    assert (layout.num_slots, layout.scratch_slot, layout.window_num_slots, layout.window_scratch_slot) == (20, 16, 12, 8)
    slots, tables = np.array([[5, -1]], np.int32), np.array([[1, 3, 2]], np.int32)
    ops_slots, ops_tables = layout.pair(slots, tables, (2, 2), 2, False, layout.scratch_slot)
    assert ops_slots.tolist() == [[5, 17], [18, 19]]            # the real slot kept, the rest scratch slots in turn
    assert ops_tables.tolist() == [[1, 3], [0, 0]]              # cut to the graph's width, padding rows 0
    kernel_slots, _ = layout.pair(slots, tables, (2, 2), 4, True, layout.scratch_slot)
    assert kernel_slots.tolist() == [[5, -1], [-1, -1]]
    main_only = layout.inputs(slots, tables, None, None, (2, 2), 2, False)
    assert main_only[2] is main_only[0] and main_only[3] is main_only[1]     # no window pool: the main pair again
    window = layout.inputs(slots, tables, np.array([[1, -1]], np.int32), tables, (2, 2), 2, False)
    assert window[2].tolist() == [[1, 9], [10, 11]]             # the pool's own scratch block
    empty = layout.padding_inputs((3,), 2, False)
    assert empty[0].tolist() == [16, 17, 18] and empty[2].tolist() == [8, 9, 10]


def test_a_packed_steps_tokens_lie_side_by_side_each_with_its_row_and_context():
    step = StepInputs(np.array([[7, 8, 9], [4, 0, 0]], np.int32), np.array([[3, 4, 5], [0, 0, 0]], np.int32),
                      np.array([[13, 14, 15], [20, -1, -1]], np.int32), np.zeros((2, 2), np.int32),
                      np.array([6, 1], np.int32), np.array([3, 1], np.int32), {})
    valid, row_of, ids, positions, slots, context, window = flat_tokens(step)
    assert valid.tolist() == [[True, True, True], [True, False, False]] and window is None
    assert (row_of.tolist(), ids.tolist(), positions.tolist()) == ([0, 0, 0, 1], [7, 8, 9, 4], [3, 4, 5, 0])
    assert (slots.tolist(), context.tolist()) == ([13, 14, 15, 20], [4, 5, 6, 1])
    assert pad(np.array([1, 2], np.int32), 4, -1).tolist() == [1, 2, -1, -1]
