"""Paged attention: the one place that writes new K/V into the cache and attends over it.

Cache layout (per layer): key and value Parameters holding [num_slots, kv_heads, head_dim] float32 in
row-major order, where slot = block_id * block_size + offset. They are *stored* flat as
[num_slots * kv_heads, head_dim] (same memory, same element order): on MindSpore 2.10 CPU a reshape of
a Parameter inside the graph copies the whole cache (per layer, per step), so the graph must work on
the flat view directly.

Each row of a step brings S new tokens; their K/V are written to `slot_mapping`, then the row's
keys/values are gathered back through its block table (width W, so L = W * block_size keys per row)
and the row's queries attend to them under the mask built once per step by `paged_metadata` (key j
is visible to a query at position p iff j <= p and j < context_len). The same code serves decode
(S=1), batched prefill, and prefills whose first positions are already cached (chunked prefill /
prefix caching).

One switch, `device_target` in PagedAttention: on Ascend the cache is written by ReshapeAndCache and decode
attends through the fused PagedAttention kernel (no gather of the keys); everything else is shared. Its
CPU twin, `decode_kernel` (kernels/paged_attention_cpu.cc, an `ops.Custom` AOT kernel the runner builds
with the machine's C++ compiler), does the same for CPU decode steps: it reads each row's keys and values
in place through the block table, so a decode step's attention costs ~ the row's real context instead
of gathering W * block_size keys per row (docs/benchmarks/JOURNAL.md has the figures). It serves prefill
too: ModelRunner packs a prefill step's tokens as decode-shaped rows (S=1), each with its own row's block
table and context, and all K/V are written before the kernel reads. Without a compiler the gather path
below serves decode and prefill.

CPU path (measured on MindSpore 2.10 CPU):
- write: `ops.ScatterUpdate` on the flat Parameter, rows slot * KVH + h; cost ~ rows written
  (ScatterNdUpdate on a 4-D [blocks, block_size, KVH, D] cache costs ~ the whole cache).
- read (prefill, and decode without the kernel): one `ops.gather` with indices (B, KVH, L), which lands
  keys directly in the (B, KVH, L, D) layout the batched matmuls want (gathering (B, L, KVH, D) and transposing was the most expensive
  kernel of a decode step; GatherNd on the 3-D view is ~10x slower than Gather).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer

from llm_serving.config import KV_CACHE_TYPES, KvCacheType

__all__ = ["MASK_VALUE", "PagedAttention", "paged_metadata"]

# Large negative instead of -inf: a query whose keys are all masked still gets finite weights (no NaN).
MASK_VALUE = -1e9


def paged_metadata(block_tables, positions, slot_mapping, context_lens, block_size: int, num_kv_heads: int,
                   tree_bits=None, window: int = 0, causal: bool = True):
    """Per-step values shared by the layers of one attention window (`window` > 0: a sliding window, each query
    sees the last `window` keys up to its own, as LlamaConfig.layer_window; 0: all keys). causal False (a
    bidirectional encoder): each query sees every key of its row's context, later positions too.

    block_tables (B, W), positions (B, S), slot_mapping (B, S), context_lens (B,) int32, tree_bits (B,) int32
    (decode kernel only: which of each token's last 32 keys it sees, see kernels/paged_attention_cpu.cc;
    None = all) ->
      write_idx (B*S*KVH,) int32: flat cache row of head h of each new token (slot * KVH + h)
      gather_idx (B, KVH, L) int32: flat cache row of head h of the row's key j
      mask (B, 1, S, 1, L) float32: 0 where key j is visible to the query, else MASK_VALUE
      and slot_mapping flattened (B*S,), block_tables, context_lens as given (for the Ascend path), tree_bits
    """
    b, w = block_tables.shape
    s = positions.shape[1]
    kvh = num_kv_heads
    n_keys = w * block_size
    heads = ops.arange(0, kvh, dtype=ms.int32)                                               # (KVH,)
    write_idx = (slot_mapping.reshape(b * s, 1) * kvh + heads.reshape(1, kvh)).reshape(-1)   # (B*S*KVH,)
    offsets = ops.arange(0, block_size, dtype=ms.int32).reshape(1, 1, block_size)           # (1, 1, bs)
    slots = (block_tables.reshape(b, w, 1) * block_size + offsets).reshape(b, 1, n_keys)      # (B, 1, L)
    gather_idx = slots * kvh + heads.reshape(1, kvh, 1)                                      # (B, KVH, L)
    key_pos = ops.arange(0, n_keys, dtype=ms.int32).reshape(1, 1, n_keys)                    # (1, 1, L)
    visible = key_pos < context_lens.reshape(b, 1, 1)                                        # (B, 1, L)
    if causal:
        visible = ops.logical_and(key_pos <= positions.reshape(b, s, 1), visible)             # (B, S, L)
    else:
        visible = ops.broadcast_to(visible, (b, s, n_keys))                                   # (B, S, L)
    if window > 0:
        visible = ops.logical_and(visible, key_pos > positions.reshape(b, s, 1) - window)     # (B, S, L)
    zeros = ops.zeros((b, s, n_keys), ms.float32)
    mask = ops.select(visible, zeros, zeros + MASK_VALUE)                                    # (B, S, L)
    # the raw step tensors ride along for the Ascend kernels (ReshapeAndCache / PagedAttention)
    if tree_bits is None:
        tree_bits = ops.full((b,), -1, dtype=ms.int32)                                        # (B,) all visible
    return (write_idx, gather_idx, mask.reshape(b, 1, s, 1, n_keys),                        # (B, 1, S, 1, L)
            slot_mapping.reshape(-1), block_tables, context_lens, tree_bits)


class PagedAttention(nn.Cell):
    """Writes this step's K/V into the layer's cache and computes attention for the new queries."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_slots: int, *,
                 layer_id: int, device_target: str = "CPU", block_size: int = 16,
                 decode_kernel: Optional[str] = None, kernel_threads: int = 1,
                 cache: KvCacheType = KV_CACHE_TYPES["float16"], window: Optional[int] = None):
        super().__init__()
        self.window = window                # a sliding window (LlamaConfig.layer_window), or None: every key
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.on_ascend = device_target == "Ascend"
        if self.on_ascend:
            # Ascend 910B: the fused kernels own the cache, [num_blocks, block_size, KVH, D] float16 (the same
            # element order as the CPU's flat view). ReshapeAndCache writes the step's K/V by slot;
            # PagedAttention attends a decode query over its row's blocks without copying them; prefill
            # reads the cache through the same gather + mask as the CPU (it also covers cached prefixes).
            # Not registered on CPU: tests/integration/test_ascend_path.py checks on the CPU that MindSpore's
            # shape and dtype inference accepts this path; it runs only on Ascend.
            from mindspore.ops.operations.nn_ops import PagedAttention as AscendPagedAttention
            from mindspore.ops.operations.nn_ops import ReshapeAndCache
            shape, dtype = (num_slots // block_size, block_size, num_kv_heads, head_dim), ms.float16
            self.reshape_and_cache = ReshapeAndCache()
            self.paged_attention = AscendPagedAttention(num_heads, 1.0, num_kv_heads)   # q is pre-scaled
        else:
            # flat [num_slots, KVH, D]; int8: each head vector's D codes, then its float32 scale's 4 bytes
            shape = (num_slots * num_kv_heads, head_dim + cache.scale_bytes)
            dtype = getattr(ms, cache.name)
        # zeros allocated by MindSpore when the graph first needs them (a numpy copy cost 0.35 s per start for
        # SmolLM2's 377 MB cache)
        self.key_cache = Parameter(initializer(Zero(), shape, dtype), name=f"key_cache.{layer_id}", requires_grad=False)
        self.value_cache = Parameter(initializer(Zero(), shape, dtype), name=f"value_cache.{layer_id}",
                                     requires_grad=False)
        self.decode_kernel = None
        if decode_kernel is not None and not self.on_ascend:
            # "path.so:PagedDecodeAttention"; out = q's shape and dtype: (B, KVH, G, D) float32
            self.decode_kernel = ops.Custom(decode_kernel, out_shape=lambda q, *_: q, out_dtype=lambda q, *_: q,
                                            func_type="aot")
            self.kernel_config = Tensor(np.array([block_size, kernel_threads, window or 0], np.int32))   # read by the kernel
        self.scatter = ops.ScatterUpdate()
        self.bmm = ops.BatchMatMul()
        self.bmm_t = ops.BatchMatMul(transpose_b=True)
        self.softmax = ops.Softmax(-1)

    def construct(self, q, k, v, meta):
        # q (B*S, NH, D), already scaled by 1/sqrt(D); k, v (B*S, KVH, D); meta from paged_metadata:
        # write_idx (B*S*KVH,); gather_idx (B, KVH, L); mask (B, 1, S, 1, L); slots (B*S,); block_tables;
        # context_lens; tree_bits (B,)
        write_idx, gather_idx, mask, slots, block_tables, context_lens, tree_bits = meta
        b, s = mask.shape[0], mask.shape[2]
        d = self.head_dim
        if self.on_ascend:
            t = k.shape[0]
            self.reshape_and_cache(k.reshape(t, -1).astype(ms.float16), v.reshape(t, -1).astype(ms.float16),
                                   self.key_cache, self.value_cache, slots)                 # k, v (T, KVH*D)
            if s == 1 and self.window is None:         # (the fused kernel knows no window: the gather path then)
                out = self.paged_attention(q.reshape(b, 1, -1).astype(ms.float16), self.key_cache,
                                           self.value_cache, block_tables, context_lens)   # (B, 1, NH*D)
                return out.astype(ms.float32).reshape(b, -1)                             # (B, NH*D)
            key_cache = self.key_cache.reshape(-1, d)                                    # (N*KVH, D)
            value_cache = self.value_cache.reshape(-1, d)
        else:
            k, v = k.reshape(-1, d).astype(self.key_cache.dtype), v.reshape(-1, d).astype(self.key_cache.dtype)
            key_cache = self.scatter(self.key_cache, write_idx, k)                      # (N*KVH, D), in place
            value_cache = self.scatter(self.value_cache, write_idx, v)                  # (N*KVH, D)
            if s == 1 and self.decode_kernel is not None:
                out = self.decode_kernel(q.reshape(b, self.num_kv_heads, self.group, d), key_cache, value_cache,
                                         block_tables, context_lens, tree_bits, self.kernel_config)  # (B, KVH, G, D)
                return out.reshape(b, -1)                                                # (B, NH*D)
        return self._attend(q, key_cache, value_cache, gather_idx, mask, b, s)

    def _attend(self, q, key_cache, value_cache, gather_idx, mask, b, s):
        kvh, g, d = self.num_kv_heads, self.group, self.head_dim
        keys = ops.gather(key_cache, gather_idx, 0).astype(ms.float32)              # (B, KVH, L, D)
        values = ops.gather(value_cache, gather_idx, 0).astype(ms.float32)          # (B, KVH, L, D)
        if s == 1:
            q = q.reshape(b, kvh, g, d)                                      # (B, KVH, G, D)
        else:
            q = q.reshape(b, s, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, s * g, d)  # (B, KVH, S*G, D)
        scores = self.bmm_t(q, keys)                                         # (B, KVH, S*G, L); q pre-scaled
        scores = scores.reshape(b, kvh, s, g, -1) + mask                     # (B, KVH, S, G, L)
        probs = self.softmax(scores).reshape(b, kvh, s * g, -1)              # (B, KVH, S*G, L)
        out = self.bmm(probs, values)                                        # (B, KVH, S*G, D)
        if s == 1:
            return out.reshape(b, kvh * g * d)                               # (B*S, NH*D)
        return out.reshape(b, kvh, s, g, d).transpose(0, 2, 1, 3, 4).reshape(b * s, kvh * g * d)  # (B*S, NH*D)
