"""The pure logic of images in a prompt (issue 67), without MindSpore: the placeholders found and expanded
(vision/model.py), the prefix cache's keys and the scheduler's chunks around an image (master/request.py,
master/scheduler.py), the step frame's image entries and the pixels' segments (master/images.py, shm/images.py,
agents/protocol.py), and the agent's placement of an image's rows and its graph calls (models/runner/images.py)."""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from llm_serving.agents import protocol as proto
from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.images import ImageTable, PromptImageInput
from llm_serving.master.request import PromptImage, Request, SamplingParams
from llm_serving.master.scheduler import _whole_images
from llm_serving.models.runner.images import pieces, place
from llm_serving.shm.images import PixelSegment, read_pixels
from llm_serving.vision import ImageFacts, ImageSpec

IMG = 9                                      # the placeholder id of these tests


def _facts(tokens: int = 4) -> ImageFacts:
    return ImageFacts(tokens, IMG, "<boi>", "<eoi>", "<img>", ImageSpec(8, 8))


def _request(ids: list, images: tuple = ()) -> Request:
    req = Request(ids, SamplingParams(), frozenset())
    req.images = images
    return req


def test_an_image_mark_becomes_gemma_3_s_placeholder_sequence_and_its_runs_are_found():
    facts = _facts()
    assert facts.expand("a<boi>b<boi>") == ("a\n\n<boi><img><img><img><img><eoi>\n\nb"
                                             "\n\n<boi><img><img><img><img><eoi>\n\n")
    ids = [1, 2, IMG, IMG, IMG, IMG, 3, IMG, IMG, IMG, IMG]
    assert facts.spans(ids) == [(2, 4), (7, 4)]
    with pytest.raises(ValueError, match="3 image placeholder tokens in a row at 2"):
        facts.spans([1, 2, IMG, IMG, IMG, 3])


def test_the_prefix_cache_keys_an_image_s_tokens_by_its_content():
    ids = [1, 2, IMG, IMG, IMG, IMG, 3]
    a = _request(ids, (PromptImage(2, 4, "aaa", None),))
    a2 = _request(ids, (PromptImage(2, 4, "aaa", None),))
    b = _request(ids, (PromptImage(2, 4, "bbb", None),))
    assert a.cache_tokens(0, 7) == [1, 2, ("aaa", 0), ("aaa", 1), ("aaa", 2), ("aaa", 3), 3]
    assert a.cache_tokens(3, 5) == [("aaa", 1), ("aaa", 2)]
    assert a.cache_tokens(0, 7) == a2.cache_tokens(0, 7) != b.cache_tokens(0, 7)
    assert a.tokens(0, 7) == ids                        # (the tokens themselves unchanged)
    assert [i.key for i in a.image_at(5, 7)] == ["aaa"] and a.image_at(6, 7) == []


@pytest.mark.parametrize("computed, q, budget, first_row, want", [
    (0, 4, 16, False, 2),          # a chunk ending inside the image ends before it
    (0, 8, 16, False, 8),          # one past it: as asked
    (0, 6, 16, False, 6),          # ending where it ends
    (2, 2, 16, False, 4),          # starting at it: the image whole, the budget allows
    (2, 2, 3, False, 0),           # ... or nothing when it does not
    (2, 2, 3, True, 4),            # ... unless the row is the step's first (alone: it must make progress)
    (4, 1, 16, False, 2),          # starting inside it (a prefix-cache hit): the rest of it
])
def test_a_chunk_never_ends_inside_an_image(computed, q, budget, first_row, want):
    req = _request([1, 2, IMG, IMG, IMG, IMG, 3, 4], (PromptImage(2, 4, "k", None),))
    assert _whole_images(req, computed, q, budget, first_row) == want
    assert _whole_images(_request([1, 2, 3, 4]), computed, q, budget, first_row) == q


def test_a_step_feeds_at_most_its_room_of_images():
    images = (PromptImage(1, 2, "a", None), PromptImage(4, 2, "b", None))
    req = _request([1, IMG, IMG, 2, IMG, IMG, 3], images)
    assert _whole_images(req, 0, 7, 16, False, room=2) == 7
    assert _whole_images(req, 0, 7, 16, False, room=1) == 4          # ends before the second image
    assert _whole_images(req, 0, 7, 16, False, room=0) == 1          # ends before the first
    assert _whole_images(req, 1, 6, 16, True, room=0) == 0           # starts at one: nothing this step
    assert _whole_images(req, 6, 1, 16, False, room=0) == 1          # past both: the step's images do not matter


def test_a_step_frame_names_the_image_tokens_each_row_feeds():
    seg = types.SimpleNamespace(name="seg-a", shape=(3, 8, 8))
    image = PromptImage(3, 4, "k", seg)
    fresh = _request([1, 2, 3, IMG, IMG, IMG, IMG, 5], (image,))
    resumed = _request([1, 2, 3, IMG, IMG, IMG, IMG, 5], (image,))
    resumed.num_computed_tokens = 5                      # (a prefix-cache hit inside the image)
    text = _request([1, 2, 3])
    batch = ScheduledBatch([text, fresh, resumed], [3, 8, 3])
    entries = ImageTable.step_images(batch)
    assert entries == [
        {"row": 1, "offset": 3, "first": 0, "count": 4, "length": 4, "key": "k", "segment": "seg-a", "shape": [3, 8, 8]},
        {"row": 2, "offset": 0, "first": 2, "count": 2, "length": 4, "key": "k", "segment": "seg-a", "shape": [3, 8, 8]}]
    assert ImageTable.step_images(ScheduledBatch([text], [3])) is None
    # what the agent reads back from the frame, and a malformed entry named
    step = proto.Step.from_payload({"kind": "prefill", "step": 1, "num_rows": 3, "max_query_len": 8,
                                    "images": entries})
    assert [(i.row, i.first, i.count, i.segment) for i in step.step_images()] == [(1, 0, 4, "seg-a"),
                                                                                (2, 2, 2, "seg-a")]
    assert "images" not in proto.Step("decode", 2, 1).payload()
    with pytest.raises(proto.ProtocolError, match="'count' must be int"):
        proto.Step.from_payload({"kind": "prefill", "step": 1, "num_rows": 1,
                                 "images": [{**entries[0], "count": "4"}]}).step_images()
    with pytest.raises(proto.ProtocolError, match="must be an object"):
        proto.Step.from_payload({"kind": "prefill", "step": 1, "num_rows": 1, "images": [3]}).step_images()


def test_pixels_live_in_shared_memory_until_the_step_that_may_read_them_is_done():
    pixels = np.random.default_rng(0).standard_normal((3, 8, 8)).astype(np.float32)
    table = ImageTable()
    req = _request([1, IMG, IMG, IMG, IMG])
    table.attach(req, [PromptImageInput(1, 4, "k", pixels)])
    segment = req.images[0].pixels
    np.testing.assert_array_equal(read_pixels(segment.name, segment.shape), pixels)
    table.in_flight = True                   # the request ends while a step runs: its pixels stay for that step
    table.release(req)
    assert req.images == ()
    np.testing.assert_array_equal(read_pixels(segment.name, (3, 8, 8)), pixels)
    table.step_done()
    with pytest.raises(ValueError, match="gone"):
        read_pixels(segment.name, (3, 8, 8))
    with pytest.raises(ValueError, match="holds"):          # a shape larger than the segment
        other = PixelSegment.create(pixels)
        try:
            read_pixels(other.name, (3, 9, 9))
        finally:
            other.unlink()


class _Encoder:
    """The tower's stand-in: image `key`'s rows are key's number in every column of row i + that number * 10;
    `bidirectional`: its image tokens see their whole image (Gemma 3's), else causal (SmolVLM's)."""
    tokens_per_image = 4

    def __init__(self, bidirectional: bool = True):
        self.cfg = types.SimpleNamespace(bidirectional=bidirectional)

    def grid(self, shape):
        return None

    def tokens_of(self, shape):
        return self.tokens_per_image

    def token_rows(self, shape):
        return np.arange(self.tokens_per_image)

    def rows(self, key, segment, shape):
        base = float(key)
        return np.array([[base * 10 + i] * 3 for i in range(4)], np.float32)


def test_a_pixtral_image_s_row_breaks_keep_their_own_tokens():
    """Mistral 3's image of 2 x 3 merge units is 8 tokens, each row ended by a text token (the break, then the
    image's end): the real encoder's token_rows gives those -1, `place` takes the tower's 6 rows for the other 6 and
    leaves the two their own ids, whole or from a step that starts inside the image (a prefix-cache hit)."""
    from llm_serving.models.runner.images import ImageEncoder

    tower = types.SimpleNamespace(cfg=types.SimpleNamespace(family="pixtral", bidirectional=False))
    encoder = ImageEncoder(tower, 1 << 20)
    shape = [2, 3, 4, 12]                                   # (rows, cols, m m, features): the patches' shape
    assert encoder.tokens_of(shape) == 8
    assert encoder.token_rows(shape).tolist() == [0, 1, 2, -1, 3, 4, 5, -1]
    encoder._keep("7", np.arange(6, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32))
    query_lens = np.array([10, 6])
    positions = np.concatenate([np.arange(10), np.arange(30, 36)]).astype(np.int32)
    images = [proto.StepImage(0, 1, 0, 8, 8, "7", "s", shape), proto.StepImage(1, 0, 2, 6, 8, "7", "s", shape)]
    placed = place(images, encoder, query_lens, positions, positions + 1)
    assert placed.source.tolist() == [-1, 0, 1, 2, -1, 3, 4, 5, -1, -1, 6, -1, 7, 8, 9, -1]
    assert placed.rows[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    assert placed.spans == [(1, 9), (10, 16)]
    assert placed.context.tolist() == (positions + 1).tolist()          # (causal: Mistral 3's image tokens)


def test_an_image_s_rows_replace_its_placeholders_and_it_sees_its_whole_image():
    # row 0: 3 text tokens; row 1: text, image "1" whole at offset 1, text; row 2: image "2"'s last two tokens
    query_lens = np.array([3, 6, 2])
    positions = np.concatenate([np.arange(3), np.arange(10, 16), np.arange(20, 22)]).astype(np.int32)
    context = positions + 1
    images = [proto.StepImage(1, 1, 0, 4, 4, "1", "s", [3, 8, 8]), proto.StepImage(2, 0, 2, 2, 4, "2", "s", [3, 8, 8])]
    placed = place(images, _Encoder(), query_lens, positions, context)
    assert placed.source.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, -1, 4, 5]
    assert placed.rows[:, 0].tolist() == [10, 11, 12, 13, 22, 23]
    assert placed.spans == [(4, 8), (9, 11)]
    # each image token sees up to its image's last token (position 14 for image "1", 21 for "2"); the rest causal
    assert placed.context.tolist() == [1, 2, 3, 11, 15, 15, 15, 15, 16, 22, 22]
    ids = np.arange(100, 111, dtype=np.int32)
    buffer = np.zeros((8, 3), np.float32)
    placed.fill(3, 11, ids[3:], buffer, vocab=50)           # a graph call of tokens 3..10
    assert ids.tolist() == [100, 101, 102, 103, 50, 51, 52, 53, 108, 54, 55]
    assert buffer[:6, 0].tolist() == [10, 11, 12, 13, 22, 23]
    with pytest.raises(ValueError, match="do not fit row 0"):
        place([proto.StepImage(0, 1, 0, 4, 4, "1", "s", [3, 8, 8])], _Encoder(), query_lens, positions, context)
    # a model whose image tokens are causal (SmolVLM's): the same rows, every context its own position + 1
    causal = place(images, _Encoder(bidirectional=False), query_lens, positions, context)
    assert causal.source.tolist() == placed.source.tolist() and causal.context.tolist() == context.tolist()


def _smolvlm_facts():
    from llm_serving.vision import ImageFacts, ImageSpec

    spec = ImageSpec(32, 32, 1, tile=32, longest_edge=64)
    return ImageFacts(4, 9, "<image>", "", "<image>", spec, family="smolvlm", fake="<F>", global_tag="<G>")


@pytest.mark.parametrize("size, want", [
    ((70, 50), (2, 2)),      # wide: 64 x 46 (even), then whole tiles 64 x 64
    ((10, 100), (2, 1)),     # tall: 6 x 64, then 32 x 64
    ((30, 20), (2, 2)),      # small: upscaled to 64 x 42, then 64 x 64
    ((65, 31), (1, 2)),      # 64 x 30, then 64 x 32
])
def test_smolvlm_grid_follows_its_processor_s_resizes(size, want):
    from llm_serving.vision.images import grid

    assert grid(*size, _smolvlm_facts().spec) == want


def test_smolvlm_expansion_writes_each_tile_then_the_whole_image():
    facts = _smolvlm_facts()
    frame = "<image>" * 4
    got = facts.expand("a<image>b<image>c", [(70, 50), (65, 31)])
    first = f"<F><row_1_col_1>{frame}<F><row_1_col_2>{frame}\n<F><row_2_col_1>{frame}<F><row_2_col_2>{frame}\n"
    second = f"<F><row_1_col_1>{frame}<F><row_1_col_2>{frame}\n"
    whole = f"\n<F><G>{frame}<F>"
    assert got == f"a{first}{whole}b{second}{whole}c"
    # one tile's image (no split): the global frame alone; a mark past the images given stays a mark
    single = dataclasses.replace(facts, spec=dataclasses.replace(facts.spec, longest_edge=32))
    assert single.expand("<image>x<image>", [(10, 20)]) == f"<F><G>{frame}<F>x<image>"
    assert facts.needs_sizes and not dataclasses.replace(facts, family="gemma3").needs_sizes


@pytest.mark.parametrize("t, spans, want", [
    (20, [], [(0, 8, 8), (8, 16, 8), (16, 20, 4)]),
    (20, [(6, 10)], [(0, 6, 8), (6, 14, 8), (14, 20, 8)]),         # the call that would cut the image ends before it
    (10, [(0, 8)], [(0, 8, 8), (8, 10, 2)]),
    (12, [(2, 6), (8, 12)], [(0, 8, 8), (8, 12, 4)]),
])
def test_graph_calls_never_cut_an_image(t, spans, want):
    assert pieces(t, [2, 4, 8], spans) == want


def test_graph_calls_around_an_image_pad_as_little_as_text_steps_do():
    """A Gemma 3 image question of 290 tokens (its image at 5..260): 32 + 256 + 32 tokens of buckets, not one call
    of 512 (222 tokens of padding through every layer); an image at the start of a call is held whole."""
    sizes = [32, 64, 128, 256, 512, 1024]
    assert pieces(290, sizes, [(5, 261)]) == [(0, 5, 32), (5, 261, 256), (261, 290, 32)]
    assert pieces(290, sizes, [(20, 276)]) == [(0, 20, 32), (20, 276, 256), (276, 290, 32)]
    assert pieces(300, sizes, [(0, 280)]) == [(0, 280, 512), (280, 300, 32)]
    assert pieces(290, sizes, []) == [(0, 256, 256), (256, 290, 64)]


def test_an_image_larger_than_a_graph_call_is_named():
    with pytest.raises(ValueError, match="an image of 10 tokens does not fit one graph call of at most 8"):
        pieces(12, [2, 4, 8], [(0, 10)])


def test_a_text_model_and_bad_images_are_refused_before_anything_runs():
    from llm_serving.server.errors import ValidationError
    from llm_serving.server.translate import decode_images

    limits = types.SimpleNamespace(max_images=2, max_image_bytes=1000, max_image_pixels=1 << 20)
    engine = types.SimpleNamespace(image_facts=None, model_name="text-model",
                                   config=types.SimpleNamespace(serving_config=limits))
    assert decode_images(engine, ()) == []
    with pytest.raises(ValidationError, match="model 'text-model' does not take images"):
        decode_images(engine, (b"x",))
    engine.image_facts = _facts()
    with pytest.raises(ValidationError, match="3 images; at most 2"):
        decode_images(engine, (b"x", b"y", b"z"))
    with pytest.raises(ValidationError, match="image 1 of 1 has 2000 bytes"):
        decode_images(engine, (b"x" * 2000,))
    with pytest.raises(ValidationError, match="image 2 of 2: .*not an image"):
        import io

        from PIL import Image
        png = io.BytesIO()
        Image.new("RGB", (4, 4)).save(png, "PNG")
        decode_images(engine, (png.getvalue(), b"garbage"))


def test_the_scheduler_feeds_one_image_a_step_and_never_splits_one():
    """Three prompts with an image each, queued together, chunked prefill of 6-token chunks: a chunk that would cut
    an image ends before it, the next starts with it whole, and no step feeds two images; all three prompts are
    fed in a few steps."""
    import dataclasses

    from llm_serving.master.block_manager import BlockManager
    from llm_serving.master.scheduler import Scheduler, SchedulerSpec

    spec = SchedulerSpec(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_rows=4, max_waiting_requests=10,
                         chunked_prefill=True, max_chunk_tokens=6)
    sched = Scheduler(dataclasses.replace(spec), BlockManager(64, 4))
    reqs = []
    for k in range(3):
        req = _request([1, 2, 3, IMG, IMG, IMG, IMG, 4, 5], (PromptImage(3, 4, f"k{k}", None),))
        sched.add(req)
        reqs.append(req)
    fed = []
    while any(r.num_computed_tokens < 9 for r in reqs) and len(fed) < 10:
        batch = sched.schedule()
        images = 0
        for r, q in zip(batch.requests, batch.num_new_tokens):
            for image in r.image_at(r.num_computed_tokens, r.num_computed_tokens + q):     # whole in the step
                assert r.num_computed_tokens <= image.start and image.start + 4 <= r.num_computed_tokens + q
                images += 1
            r.num_computed_tokens += q
        fed.append(([reqs.index(r) for r in batch.requests], list(batch.num_new_tokens), images))
    assert fed[0] == ([0, 1, 2], [3, 3, 3], 0)          # (a chunk of 6 would cut each image: it ends before)
    assert all(images <= 1 for _, _, images in fed), fed
    assert sum(images for _, _, images in fed) == 3 and len(fed) == 4, fed


def _encode_ahead_scheduler(on: bool = True):
    from llm_serving.master.block_manager import BlockManager
    from llm_serving.master.scheduler import Scheduler, SchedulerSpec

    spec = SchedulerSpec(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_rows=4, max_waiting_requests=10,
                         chunked_prefill=True, encode_ahead=on, decode_steps=1)
    return Scheduler(spec, BlockManager(64, 4))


def _ran(batch) -> list:
    """The step's rows and counts, then each row's tokens computed (and a token sampled at a prompt's end, as the
    output processor appends one)."""
    out = []
    for r, q in zip(batch.requests, batch.num_new_tokens):
        out.append((r.prompt_ids[0], q))
        r.num_computed_tokens += q
        if r.num_computed_tokens == r.num_tokens:
            r.output_ids.append(7)
    return out


def test_while_requests_decode_an_image_is_fed_only_once_its_tower_ran_ahead():
    """A text request decodes (T); an image question (I) arrives: its admission feeds the 3 tokens before its image;
    the next steps decode T (the image is left out) and carry the image's tower ahead, until the agent says it is
    encoded; then a prefill step feeds the image whole. With encode_ahead off, or with nothing decoding, the image
    is fed at once (its tower inside the step)."""
    def scenario(on: bool, decoding: bool) -> tuple:
        sched = _encode_ahead_scheduler(on)
        text = _request([50, 2, 3])
        if decoding:
            sched.add(text)
            assert _ran(sched.schedule()) == [(50, 3)]
        image = PromptImage(3, 4, "k", None)
        req = _request([60, 2, 3, IMG, IMG, IMG, IMG, 4, 5], (image,))
        sched.add(req)
        steps = []
        for _ in range(4):
            batch = sched.schedule()
            ahead = sched.image_to_encode(batch)
            steps.append((_ran(batch), None if ahead is None else (ahead[0] is req, ahead[1].key)))
            if len(steps) == 3:
                sched.mark_encoded("k")          # (the agent's reply to the third step: the tower is done)
        return steps

    assert scenario(True, True) == [
        ([(60, 3)], None),                       # admitted up to its image (a prompt's step: no tower in it)
        ([(50, 1)], (True, "k")),                # T decodes (the image row left out), the tower goes on
        ([(50, 1)], (True, "k")),
        ([(60, 6)], None),                       # encoded: the image and the tokens after it, whole
    ]
    assert scenario(False, True)[0] == ([(60, 9)], None)                 # off: the image in its admission step
    assert scenario(True, False)[0] == ([(60, 9)], None)                 # no one decoding: at once


def test_an_image_starting_a_waiting_request_s_new_tokens_is_fed_whole():
    """A waiting request whose first token to feed is an image cannot be admitted feeding nothing: it is fed whole,
    encoded ahead or not; a running one behind an image being encoded ahead does not hold up the rows after it."""
    sched = _encode_ahead_scheduler()
    text = _request([50, 2, 3])
    sched.add(text)
    _ran(sched.schedule())
    first = _request([IMG, IMG, IMG, IMG, 4], (PromptImage(0, 4, "a", None),))
    sched.add(first)
    assert _ran(sched.schedule()) == [(IMG, 5)]
    held = _request([60, IMG, IMG, IMG, IMG], (PromptImage(1, 4, "b", None),))
    other = _request([70, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    sched.add(held)
    assert _ran(sched.schedule()) == [(60, 1)]
    sched.add(other)
    batch = sched.schedule()
    assert _ran(batch) == [(70, 10)]          # the prefill step: `held` left out, `other` behind it admitted
    batch = sched.schedule()
    assert sched.image_to_encode(batch)[1].key == "b" and _ran(batch) == [(50, 1), (IMG, 1), (70, 1)]


def test_an_image_encoded_ahead_travels_in_the_step_frame_and_its_failure_is_its_request_s_alone():
    """A step's `encode` (protocol.EncodeSlice) reads back as sent and is named when malformed; the agent's
    `Worker.encode_ahead` turns the encoder's failure into the reply's `encode_error` (the step it came with runs on),
    and the engine then ends the image's request with it, where a done image is recorded for the scheduler."""
    from llm_serving.agents.worker import Worker
    from llm_serving.master.engine import Engine

    ahead = {"key": "k" * 16, "segment": "seg-a", "shape": [3, 8, 8], "budget_ms": 3000}
    step = proto.read_command(proto.decode_body(proto.encode(4, proto.Step("decode", 9, 2, encode=ahead))
                                                [proto.HEADER.size:]))
    assert step.encode_slice() == proto.EncodeSlice("k" * 16, "seg-a", [3, 8, 8], 3000)
    assert proto.Step("decode", 9, 2).encode_slice() is None and "encode" not in proto.Step("decode", 9, 2).payload()
    with pytest.raises(proto.ProtocolError, match="'budget_ms' must be float"):
        proto.Step.from_payload({"kind": "decode", "step": 1, "num_rows": 1,
                                 "encode": {**ahead, "budget_ms": "3"}}).encode_slice()

    class Encoder:
        def __init__(self, fault=None):
            self.fault, self.calls = fault, []

        def advance(self, key, segment, shape, budget_s):
            self.calls.append((key, segment, shape, budget_s))
            if self.fault:
                raise self.fault
            return True
    ok, gone = Encoder(), Encoder(FileNotFoundError("no segment seg-a"))
    assert Worker.encode_ahead(types.SimpleNamespace(runner=types.SimpleNamespace(images=ok)),
                               step.encode_slice())[:2] == (True, None)
    assert ok.calls == [("k" * 16, "seg-a", (3, 8, 8), 3.0)]
    assert Worker.encode_ahead(types.SimpleNamespace(runner=types.SimpleNamespace(images=gone)),
                               step.encode_slice())[:2] == (False, "FileNotFoundError: no segment seg-a")

    ended, marked = [], []
    engine = types.SimpleNamespace(num_encode_ahead_steps=0, scheduler=types.SimpleNamespace(mark_encoded=marked.append),
                                   _finish=lambda req, reason, error=None: ended.append((req.prompt_ids, reason, error)))
    req = _request([1, IMG, IMG, IMG, IMG], (PromptImage(1, 4, "k", None),))
    Engine._encoded_ahead(engine, req, req.images[0], types.SimpleNamespace(encoded=False, encode_error=None))
    Engine._encoded_ahead(engine, req, req.images[0], types.SimpleNamespace(encoded=True, encode_error=None))
    assert marked == ["k"] and not ended
    Engine._encoded_ahead(engine, req, req.images[0], types.SimpleNamespace(encoded=False, encode_error="gone"))
    assert ended == [([1, IMG, IMG, IMG, IMG], "error", "its image could not be encoded: gone")]
    assert engine.num_encode_ahead_steps == 3


def test_a_decode_step_that_carries_an_image_ahead_is_a_decode_run_not_left_to_speculation():
    """With speculation on (decode steps of few rows are left to the planner), a decode step while an image is encoded
    ahead is a decode run instead: the step carries seconds of tower, and K greedy tokens a row make the most of it;
    once no image awaits, decode steps are the planner's again."""
    from llm_serving.master.block_manager import BlockManager
    from llm_serving.master.scheduler import Scheduler, SchedulerSpec
    from llm_serving.shm.layout import StepKind

    spec = SchedulerSpec(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_rows=4, max_waiting_requests=10,
                         chunked_prefill=True, encode_ahead=True, decode_steps=4, decode_steps_max_rows=4,
                         spec_max_rows=4)
    sched = Scheduler(spec, BlockManager(64, 4))
    text = _request([50, 2, 3])
    text.sampling = SamplingParams(temperature=0.0, max_new_tokens=40)
    sched.add(text)
    _ran(sched.schedule())
    assert sched.schedule().may_speculate                       # (nothing to encode: the planner's)
    text.num_computed_tokens = text.num_tokens - 1
    sched.add(_request([60, 2, IMG, IMG, IMG, IMG], (PromptImage(2, 4, "k", None),)))
    _ran(sched.schedule())                                      # admitted up to its image
    batch = sched.schedule()
    assert batch.kind is StepKind.DECODE_RUN and batch.steps == 4 and not batch.may_speculate
    assert sched.image_to_encode(batch)[1].key == "k"
    sched.mark_encoded("k")
    assert [r.prompt_ids[0] for r in sched.schedule().requests] == [60]      # the image, fed
