"""A prefill step's images: the tower's rows put where the prompt holds their placeholders.

The master's step frame names each image a prefill step feeds (`StepImage`, agents/protocol.py): its row, where
its tokens start among the row's new tokens, which of the image's tokens the step holds (an image is never split
across steps, but a prefix-cache hit may start a step inside one), the image's content key, and the shared-memory
segment of its pixels. `ImageEncoder.rows` gives an image's (tokens, H) rows: from its cache of encoded images
(keyed by content, least recently used dropped first past its byte cap) or by running the tower on the pixels.

While other requests decode, the master has an image's tower run ahead of its prefill step, for a time budget a step
(`Step.encode`, agents/protocol.py's `EncodeSlice`): `ImageEncoder.advance` keeps the image's state between steps
(`_partial`, a few images at most, as the tower's `kept` gives it: its patches as numpy, and Qwen3-VL's DeepStack rows
so far), and `rows` finishes it with the projector when the prefill step comes. An image encoded in parts gives the
rows `encode` gives in one go, to the bit: the same graphs on the same values in the same order (vision_tower.py's
and vision_qwen.py's `embed`, `run_layers`, `project`).

`place` turns a step's images into what the packed graph calls read (`Placed`): for each of the step's real tokens,
the row of the stacked image rows it takes (-1: its own embedding), and its context. Gemma 3's attention among an
image's tokens is bidirectional: an image token sees every key up to its image's last token (the causal limit
elsewhere), and the keys of a graph call's tokens are all written before any attends, so an image must lie within
one graph call (`pieces`). Before each call, `fill` copies the call's image rows into the model's image buffer and
gives their tokens the ids V + j that select them (llama.py's `embed_tokens`). A Mistral 3 image's tokens are its rows
of merge units, each row ended by a token of the text's own (the row break, the image's end): `token_rows` says
which of an image's tokens take a tower row, and the others keep their own ids and embeddings.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..buckets import token_pieces
from ..rope import mrope_rows

__all__ = ["ImageEncoder", "Placed", "pieces", "place", "vision_checkpoint_of"]

logger = logging.getLogger(__name__)


class ImageEncoder:
    """The tower and the encoded-image cache (`cache_bytes`: at most this many bytes of rows kept, 0: none)."""

    MAX_PARTIAL = 2          # images whose encoding is under way (patches of hidden size each: 19 MB at Gemma 3's)

    def __init__(self, tower, cache_bytes: int):
        self.tower, self.cfg = tower, tower.cfg
        self.cache_bytes = int(cache_bytes)
        self._cache: OrderedDict = OrderedDict()         # key -> (tokens, H) float32
        self._bytes = 0
        self._partial: OrderedDict = OrderedDict()       # key -> [state (tower.kept's), layers done, seconds, steps]
        self.compiled = False                            # the tower's graphs (compile: when the agent is idle)

    @classmethod
    def build(cls, checkpoint: tuple, cache_mb: int, threads: int = 1,
              kernels: Optional[str] = None, int16: bool = False, int16_scores: bool = False) -> "ImageEncoder":
        """The encoder of a tower as stored (`vision_checkpoint_of`'s), its weights read now; `kernels`: the CPU
        kernel library its layers run on `threads` threads (runner/kernels.py's build_vision_kernels), their
        products and attention values in int16 when `int16` (runner/kernels.py's vision_int16), the attention's
        scores too with `int16_scores` (otherwise float, on AMX tiles where the library runs them: VisionAmx). A
        Qwen2.5-VL, Qwen3-VL or Mistral 3 (Pixtral) tower (models/vision_qwen.py): its products and attention (full
        and windowed) on those kernels, its norms and activations on MindSpore's ops; Qwen3-VL's rows are row_width
        wide (the merger's, then the DeepStack mergers')."""
        from ..vision_qwen import QwenVisionTower
        from ..vision_tower import VisionTower
        from ..weights.vision import QwenVisionConfig

        t0 = time.perf_counter()
        if isinstance(checkpoint[0], QwenVisionConfig):
            tower = QwenVisionTower(*checkpoint, kernels=kernels, threads=threads, int16=int16)
        else:
            tower = VisionTower(*checkpoint, kernels=kernels, threads=threads, int16=int16, int16_scores=int16_scores)
        encoder = cls(tower, cache_mb << 20)
        tokens = encoder.tokens_per_image
        kind = "int16" if tower.int16 else "float32"
        if kernels is not None and not tower.int16:
            import ctypes
            kind = "AMX bfloat16-piece" if ctypes.CDLL(kernels).VisionAmx(-1) else kind
        logger.info("vision tower: %d layers of %d, %s, %.2f GB of weights (%s products), read in %.1f s",
                    tower.cfg.num_layers, tower.cfg.hidden_size,
                    f"{tokens} tokens an image" if tokens > 0 else "an image's tokens by its size",
                    tower.nbytes / 1e9, kind, time.perf_counter() - t0)
        return encoder

    @property
    def tokens_per_image(self) -> int:
        """The tokens every image becomes, or -1: as many as its size makes (Qwen2.5-VL's and Qwen3-VL's grid)."""
        return getattr(self.cfg, "tokens_per_image", -1)

    def grid(self, shape) -> Optional[tuple]:
        """(rows, cols) of an image's tokens where the model places them by their grid (multimodal RoPE: the
        pixels' shape is Qwen2.5-VL's patches, (rows, cols, merge^2, features)); None for the other families."""
        return (int(shape[0]), int(shape[1])) if self.tokens_per_image < 0 else None

    def tokens_of(self, shape) -> int:
        """The tokens an image of pixels `shape` becomes (Pixtral's: its rows of merge units, each row ended by a
        token of the text's own, a row break or the image's end)."""
        grid = self.grid(shape)
        if grid is None:
            return self.tokens_per_image
        return grid[0] * (grid[1] + (getattr(self.cfg, "family", "") == "pixtral"))

    def token_rows(self, shape) -> np.ndarray:
        """(tokens,) each of an image's tokens' row among its tower rows, -1 for a token that keeps its own
        embedding (Pixtral's row breaks and image end); the tokens' own rows in order for the other families."""
        tokens = self.tokens_of(shape)
        if getattr(self.cfg, "family", "") != "pixtral":
            return np.arange(tokens)
        cols = self.grid(shape)[1]
        k = np.arange(tokens)
        return np.where(k % (cols + 1) < cols, k // (cols + 1) * cols + k % (cols + 1), -1)

    def rows(self, key: str, segment: str, shape) -> np.ndarray:
        """The image's (tokens, H) rows (H: Qwen3-VL's row_width): cached under `key`, else the tower's on the pixels
        in `segment` (from where `advance` left them, if it began)."""
        rows = self._cache.get(key)
        if rows is not None:
            self._cache.move_to_end(key)
            return rows
        layers = self.cfg.num_layers
        partial = self._partial.pop(key, None)
        t0 = time.perf_counter()
        if partial is None:
            partial = [self._embed(segment, shape), 0, 0.0, 0]
        x, done, seconds, steps = partial
        rows = self.tower.project(self.tower.run_layers(x, done, layers))[0]
        self.compiled = True
        seconds += time.perf_counter() - t0
        logger.info("image %s encoded in %.2f s%s", key[:12], seconds,
                    f" (over {steps + 1} steps: {done} of {layers} layers ahead)" if steps else "")
        self._keep(key, rows)
        return rows

    def advance(self, key: str, segment: str, shape, budget_s: float) -> bool:
        """Run the image's tower layers for about `budget_s` (at least one layer; from its pixels in `segment` the
        first time), ahead of its prefill step; whether its encoding is now done (its rows cached, or every layer
        run: `rows` has only the projector left). Never more than MAX_PARTIAL images under way: the oldest is
        dropped (its prefill step then runs its tower whole)."""
        if key in self._cache:
            return True
        partial = self._partial.get(key)
        t0 = time.perf_counter()
        if partial is None:
            partial = self._partial[key] = [self._embed(segment, shape), 0, 0.0, 0]
            while len(self._partial) > self.MAX_PARTIAL:
                dropped, _ = self._partial.popitem(last=False)
                logger.info("image %s: its encoding set aside (%d images under way at most)", dropped[:12],
                            self.MAX_PARTIAL)
        self._partial.move_to_end(key)
        x, done, layers = partial[0], partial[1], self.cfg.num_layers
        ran = 0
        while done < layers:        # (a layer more only if one more like the last ones still fits the budget)
            x = self.tower.run_layers(x, done, done + 1)
            done, ran = done + 1, ran + 1
            spent = time.perf_counter() - t0
            if spent + spent / ran > budget_s:
                break
        if ran:
            partial[0], partial[1] = self.tower.kept(x), done
            self.compiled = True
        partial[2] += time.perf_counter() - t0
        partial[3] += 1
        return done == layers

    def _embed(self, segment: str, shape) -> np.ndarray:
        """The patches' embeddings of the pixels in `segment`, as kept between steps (numpy: the tower's `kept`)."""
        from llm_serving.shm.images import read_pixels

        if self.tokens_per_image < 0:           # Qwen2.5-VL, Qwen3-VL: its patches, (rows, cols, merge^2, features)
            cfg = self.cfg
            m = cfg.spatial_merge_size
            if len(shape) != 4 or min(shape[:2]) < 1 or tuple(shape[2:]) != (m * m, cfg.patch_features):
                raise ValueError(f"an image's patches are {tuple(shape)}; the tower reads (rows, cols, {m * m}, "
                                 f"{cfg.patch_features})")
            return self.tower.kept(self.tower.embed(read_pixels(segment, shape)))
        size, c = self.cfg.image_size, self.cfg.num_channels
        if tuple(shape) != (c, size, size):
            raise ValueError(f"an image's pixels are {tuple(shape)}; the tower reads ({c}, {size}, {size})")
        return self.tower.kept(self.tower.embed(read_pixels(segment, shape)[None]))

    def _keep(self, key: str, rows: np.ndarray) -> None:
        """Cache an image's rows (least recently used dropped past cache_bytes)."""
        if rows.nbytes <= self.cache_bytes:
            self._cache[key] = rows
            self._bytes += rows.nbytes
            while self._bytes > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._bytes -= dropped.nbytes

    def compile(self) -> None:
        """Compile and warm the tower's graphs ahead of the first image (`VisionTower.warm`: one run of each on
        zeros), outside the compile cache (whose graphs are named by their compile order: warmup's)."""
        from ..mindspore_env import set_compile_cache

        if self.compiled:
            return
        set_compile_cache(False)
        t0 = time.perf_counter()
        self.tower.warm()
        self.compiled = True
        logger.info("vision tower compiled and warmed in %.1f s", time.perf_counter() - t0)


def vision_checkpoint_of(model_path: str, mmproj: Optional[str]) -> Optional[tuple]:
    """(VisionConfig, tensors) of the model's tower: from the mmproj GGUF beside a GGUF model, or from a HF
    directory; None for a model without one."""
    from ..weights.vision import mmproj_checkpoint, vision_checkpoint

    if mmproj is not None:
        return mmproj_checkpoint(mmproj)
    if not os.path.isdir(model_path) or not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    return vision_checkpoint(model_path)


@dataclass
class Placed:
    """A packed step's image tokens (`place`): per real token, its row in `rows` (-1: none); the stacked rows of the
    step's images; each image's (first, stop) among the step's tokens; and every token's context, an image token's
    reaching its image's end where the model's image tokens attend both ways (Gemma 3's; SmolVLM's are causal).
    With multimodal RoPE, `grid` (K, 3): each stacked row's (t, h, w) RoPE positions."""
    source: np.ndarray           # (t,) int32
    rows: np.ndarray             # (K, H) float32
    spans: list                  # [(first, stop)]
    context: np.ndarray          # (t,) int32
    grid: Optional[np.ndarray] = None

    def fill(self, start: int, stop: int, ids: np.ndarray, buffer: np.ndarray, vocab: int,
             pos: Optional[np.ndarray] = None, mrope: Optional[tuple] = None) -> None:
        """Ready the graph call of tokens start..stop-1 (ids, pos: theirs, padded): their image rows into `buffer`
        (the model's image_buffer), their ids V + j; with multimodal RoPE (`mrope`: the model's (config, first
        row, its cos and sin tables)) their (t, h, w) rows into the tables' rows first + j and their positions
        those rows."""
        source = self.source[start:stop]
        mine = np.nonzero(source >= 0)[0]
        if not len(mine):
            return
        if len(mine) > len(buffer):
            raise ValueError(f"a graph call holds {len(mine)} image tokens; the image buffer has {len(buffer)} rows")
        buffer[:len(mine)] = self.rows[source[mine]]
        j = np.arange(len(mine), dtype=np.int32)
        ids[mine] = vocab + j
        if self.grid is not None and mrope is not None:
            cfg, first, (cos, sin) = mrope
            cos[first:first + len(mine)], sin[first:first + len(mine)] = mrope_rows(
                cfg, first, *self.grid[source[mine]].T)
            pos[mine] = first + j


def place(images: list, encoder: ImageEncoder, query_lens: np.ndarray, positions: np.ndarray,
          context: np.ndarray, rope: Optional[np.ndarray] = None) -> Placed:
    """The step's images (`StepImage`s) on its real tokens; positions and context: flat_tokens' (t,) arrays. `rope`
    (multimodal RoPE: the tokens' RoPE positions, each row's rope_delta added): the tokens after an image in its
    row moved on by the image's advance (its grid's larger side, less its token count), and each image token's
    (t, h, w) in `grid`: the image's start, and that plus its row and its column in the image's grid."""
    starts = np.concatenate([[0], np.cumsum(query_lens)[:-1]]).astype(np.int64)       # each row's first token
    t = len(positions)
    source = np.full(t, -1, np.int32)
    context = np.array(context, np.int32)
    parts, spans, grids, at = [], [], [], 0
    for image in sorted(images, key=lambda im: (im.row, im.offset)):
        if not 0 <= image.row < len(query_lens):
            raise ValueError(f"an image names row {image.row}; the step has {len(query_lens)}")
        tokens = encoder.tokens_of(image.shape)
        if not (0 <= image.first and image.count >= 1 and image.first + image.count <= image.length
                == tokens and 0 <= image.offset and image.offset + image.count <= query_lens[image.row]):
            raise ValueError(f"an image's tokens {image.first}..{image.first + image.count - 1} of {image.length} at "
                             f"offset {image.offset} do not fit row {image.row} ({int(query_lens[image.row])} new "
                             f"tokens) or the tower's {tokens} tokens for it")
        rows = encoder.rows(image.key, image.segment, image.shape)
        first = int(starts[image.row]) + image.offset
        stop = first + image.count
        taken = encoder.token_rows(image.shape)[image.first:image.first + image.count]
        used = taken >= 0                       # (Pixtral's row breaks and end keep their own embeddings)
        source[first:stop] = np.where(used, at + np.cumsum(used) - 1, -1)
        parts.append(rows[taken[used]])
        at += int(used.sum())
        if encoder.cfg.bidirectional:
            # every token of the image sees up to its last: the position of the image's first token + its length
            context[first:stop] = positions[first] - image.first + image.length
        grid = encoder.grid(image.shape)
        if rope is not None and grid is not None:
            cols = grid[1]
            s = rope[first] - image.first                    # the image's start: its first token's RoPE position
            k = np.arange(image.first, image.first + image.count)
            grids.append(np.stack([np.full(image.count, s), s + k // cols, s + k % cols], 1).astype(np.int32))
            if image.first + image.count == image.length:    # the image ends in this step: the row's later tokens
                row_end = int(starts[image.row] + query_lens[image.row])
                rope[stop:row_end] += max(grid) - image.length
        spans.append((first, stop))
    rows = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
    return Placed(source, rows, sorted(spans), context, np.concatenate(grids) if grids else None)


def pieces(t: int, sizes: list, spans: list) -> list:
    """(start, stop, bucket) graph calls over t tokens with token buckets `sizes` (ascending), no span of `spans`
    cut between two calls. Each call is the first piece `buckets.token_pieces` cuts of the tokens left, as a text
    step's (so a 290-token image question runs as 32 + 256 + 32 tokens, not 512), ending before an image it would
    cut, or at the end of an image it starts with. ValueError for an image longer than the largest bucket."""
    out, start = [], 0
    largest = sizes[-1]
    while start < t:
        stop = start + min(t - start, token_pieces(sizes, t - start)[0])
        for first, end in spans:
            if first < stop < end:
                if first > start:
                    stop = first
                elif end - start <= largest:
                    stop = end                                   # (an image starting the call: held whole)
                else:
                    raise ValueError(f"an image of {end - first} tokens does not fit one graph call of at most "
                                     f"{largest} tokens (serving_config.max_num_batched_tokens)")
        out.append((start, stop, sizes[bisect.bisect_left(sizes, stop - start)]))
        start = stop
    return out
