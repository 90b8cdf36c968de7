"""A float64 numpy LLaMA forward: the yardstick the served logits are checked against.

Written on its own, sharing nothing with llm_serving/models/ except the checkpoint loader (so both read
the same weights): plain per-sequence attention with a growing K/V list, RMSNorm with its gain, RoPE in
the HuggingFace rotate-half layout (Llama-3.1's frequency scaling computed here from config.json), q/k/v biases
when the checkpoint has them (Qwen2), grouped-query attention, SwiGLU, untied or tied lm_head; and what the other
families change, read from the loader's LlamaConfig and computed here in transformers' own form: q/k head norms
(Qwen3, Gemma 3), sandwich norms, the embedding's scale, GELU-tanh, the query scale (Gemma 3), a partial rotation
over each head's first dimensions (Phi-4-mini: pairs (i, i + r/2), not reordered), longrope's factors and scale
(Phi-3), sliding-window layers with their own RoPE base (Gemma 3, Mistral), layers without RoPE (SmolLM3), mixtures of
experts (Qwen3-MoE, Mixtral: a token's top-k experts by its router's logits), gpt-oss's biases, attention sinks and
clamped SwiGLU, multimodal RoPE (Qwen2.5-VL: an image's tokens rotated by their time, row and column, the text after
an image going on from its grid's larger side, as transformers' get_rope_index places them; Qwen3-VL's frequencies
interleaved, and its DeepStack rows added to an image's tokens after the first layers); and a bidirectional
encoder's (BERT): learned positions and token type 0 added to the embedding, its LayerNorm, every token seeing the
whole input, LayerNorms after each residual add, biases, an ungated GELU (erf) MLP.
`embed(ids, pooling)` is an input's embedding (final hidden states, the final norm where the model has one, pooled
and L2-normalized), as /v1/embeddings serves it.

    ref = ReferenceLlama("../shared/models/stories260K/hf")
    seq = ref.new_sequence()
    logits = ref.forward(seq, token_ids, start=0)      # (len(token_ids), vocab) float64
    logits = ref.forward(seq, [next_id], start=len(token_ids))
    vector = ref.embed(token_ids, "mean")              # (H,) float64, unit length
    many = ref.forward_many([ids_a, ids_b])            # each list's logits, every layer read once for all

A model whose float64 weights pass RESIDENT_BYTES (a 4B: 32 GB) is held a layer at a time, read (dequantized) as
each forward pass reaches it: forward_many is the way to score many sequences there.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from llm_serving.models.weights import expected_shapes, load_llama_weights, stored_llama_weights

# Below this many bytes of float64 weights the reference holds them all (every model the tests use); above, one\n# layer's at a time (a 4B's float64 copy is 32 GB): forward_many() then reads each layer once for many sequences.
RESIDENT_BYTES = 8 << 30


def _hf_rope_scaling(model_path: str):
    """A HuggingFace config.json's llama3 RoPE scaling (4.x `rope_scaling` or 5.x `rope_parameters`), or None."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return scaling if (scaling.get("rope_type") or scaling.get("type")) == "llama3" else None


def _llama3_inv_freq(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama-3.1 frequency scaling, per frequency: wavelengths longer than original/low_freq_factor are divided
    by `factor`, shorter than original/high_freq_factor kept, and those between interpolated linearly in
    original/wavelength."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    original = float(s["original_max_position_embeddings"])
    out = []
    for f in inv_freq:
        wavelength = 2 * np.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            t = (original / wavelength - low) / (high - low)
            out.append((1 - t) * f / factor + t * f)
    return np.array(out)


class _LayerAtATime:
    """The checkpoint's tensors as float64, each read (dequantized) on first use. A decoder layer's are dropped when
    another layer's are asked for; the others (embedding, final norm, lm_head) stay. So a forward pass holds one
    layer at a time, and reads every layer again: forward_many() shares one pass among many sequences."""

    def __init__(self, stored: dict, names):
        self.stored, self.names = stored, frozenset(names)
        self.held: dict = {}
        self.layer = None

    def _read(self, name: str) -> np.ndarray:
        tensor = self.stored[name]
        return np.asarray(tensor.read(tuple(slice(None) for _ in tensor.shape)), dtype=np.float64)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.held:
            if name not in self.names:
                raise KeyError(name)
            if name.startswith("model.layers."):
                layer = name.split(".")[2]
                if layer != self.layer:
                    self.held = {k: v for k, v in self.held.items() if not k.startswith("model.layers.")}
                    self.layer = layer
            tied = next((k for k, v in self.held.items() if self.stored[k] is self.stored[name]), None)
            self.held[name] = self.held[tied] if tied is not None else self._read(name)
        return self.held[name]

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str, default=None):
        return self[name] if name in self.names else default

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        raise TypeError("reference: a model read a layer at a time cannot have its weights replaced")


class ReferenceSequence:
    """One sequence's cached keys and values: per layer, (positions, kv_heads, head_dim) float64; and, for
    multimodal RoPE, the images fed so far: (the position after each one, how far it moved the RoPE positions of the
    tokens after it past its token count)."""

    def __init__(self, num_layers: int):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers
        self.length = 0
        self.rope_moves: list = []

    def rope_delta(self, position: int) -> int:
        """What the RoPE position of the token at `position` adds to it (multimodal RoPE; 0 without images)."""
        return sum(move for end, move in self.rope_moves if end <= position)

    def truncate(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:length], v[:length]
        self.length = min(self.length, length)
        self.rope_moves = [(end, move) for end, move in self.rope_moves if end <= length]


class ReferenceLlama:
    """`max_context`: the context the model is served with, which picks longrope's factors (long ones past the
    original context, as the server does); None: the original context (short factors). `resident`: hold every
    weight as float64 (True) or a layer's at a time (False); None: as RESIDENT_BYTES says."""

    def __init__(self, model_path: str, max_context: int | None = None, resident: bool | None = None):
        c, stored = stored_llama_weights(model_path)
        if resident is None:
            resident = sum(math.prod(shape) for shape in expected_shapes(c).values()) * 8 <= RESIDENT_BYTES
        self.config, self.resident = c, resident
        if resident:
            weights = load_llama_weights(model_path)[1]
            self.w = {name: np.asarray(t, dtype=np.float64) for name, t in weights.items()}
        else:
            self.w = _LayerAtATime(stored, expected_shapes(c))
        r = c.rotary_dims
        base = np.arange(0, r, 2, dtype=np.float64) / r
        self.inv_freq = 1.0 / (c.rope_theta ** base)
        self.rope_scale = c.rope_scale
        scaling = _hf_rope_scaling(model_path)
        long = (c.rope_long_factors is not None and max_context is not None
                and max_context > (c.rope_original_context or 0))
        if scaling is not None:               # computed here from config.json, independently of the loader
            self.inv_freq = _llama3_inv_freq(self.inv_freq, scaling)
        elif long:
            self.inv_freq = self.inv_freq / np.asarray(c.rope_long_factors, np.float64)
        elif c.rope_freq_factors is not None:     # a GGUF's rope_freqs tensor, linear scaling, longrope's short ones
            self.inv_freq = self.inv_freq / np.asarray(c.rope_freq_factors, np.float64)
        self.local_inv_freq = (None if c.local_rope_theta is None else 1.0 / (c.local_rope_theta ** base))
        self.routes: dict = {}                  # a mixture's choices in the last forward (_experts)

    def new_sequence(self) -> ReferenceSequence:
        return ReferenceSequence(self.config.num_layers)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """Norm `name`'s (its `.weight` gain, a LayerNorm's `.bias` too) of x over the last axis: RMSNorm, or
        LayerNorm (the mean subtracted first) as the config says."""
        c, w = self.config, self.w
        if c.norm == "layer":
            x = x - x.mean(axis=-1, keepdims=True)
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w[name + ".weight"] \
                + w[name + ".bias"]
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.rms_norm_eps) * w[name + ".weight"]

    def _rms(self, x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.rms_norm_eps) * gain

    def _rope(self, x: np.ndarray, positions: np.ndarray, layer: int) -> np.ndarray:
        # x (T, heads, D): of the first r dimensions, pairs (i, i + r/2) rotate by angle position * inv_freq[i];
        # the rest pass through. Multimodal RoPE: positions (T, 3), frequency i turned by the position of its
        # section (time, row, column: mrope_section's runs of frequencies)
        kind = self.config.layer_rope(layer)
        if kind == "none":
            return x
        inv_freq, scale = (self.local_inv_freq, 1.0) if kind == "local" else (self.inv_freq, self.rope_scale)
        r = self.config.rotary_dims
        half = r // 2
        if positions.ndim == 2:
            which = np.repeat([0, 1, 2], self.config.mrope_section)
            if self.config.mrope_interleaved:      # Qwen3-VL: t's frequencies, h's at 1, 4, .., w's at 2, 5, ..
                _, h_count, w_count = self.config.mrope_section
                which = np.zeros(half, np.int64)
                which[1:3 * h_count:3] = 1
                which[2:3 * w_count:3] = 2
            angle = (positions[:, which] * inv_freq[None, :])[:, None, :]          # (T, 1, r/2)
        else:
            angle = positions[:, None, None] * inv_freq[None, None, :]          # (T, 1, r/2)
        cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
        x1, x2, rest = x[..., :half], x[..., half:r], x[..., r:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

    def forward(self, seq: ReferenceSequence, token_ids, start: int, images=()) -> np.ndarray:
        """Feed token_ids at positions start, start+1, ...; keys cached beyond `start` are dropped first
        (a recomputed prefill). Returns logits (len(token_ids), vocab) float64.
        `images`: (offset, rows, bidirectional) of each image among the tokens: its rows (count, H) (a
        ReferenceVision's) take the embedding's place at token_ids[offset:offset + count], after the embedding's
        scale, as transformers scatters image features (a NaN row leaves its token's own: Pixtral's breaks); bidirectional (Gemma 3's): those tokens also see each other,
        the mask being causal OR the same image, within each query's own sliding window. With multimodal RoPE, a
        fourth entry: the image's (rows, cols) grid of tokens (the image whole in this call)."""
        if not self.config.generates:
            raise ValueError(f"reference: {self.config.architecture} is an embedding model; it has no lm_head")
        x = self._hidden(seq, token_ids, start, images)
        return self._norm(x, "model.norm") @ self.w["lm_head.weight"].T

    def forward_many(self, token_lists) -> list:
        """Each list's logits (len, vocab) float64, fed from position 0 on a sequence of its own: forward's values,
        computed layer by layer across the lists, so that a model held a layer at a time reads each layer once
        (a 4B: about a minute to read, where a forward per list would take that each)."""
        if not self.config.generates:
            raise ValueError(f"reference: {self.config.architecture} is an embedding model; it has no lm_head")
        ids = [np.asarray(t, dtype=np.int64) for t in token_lists]
        seqs = [self.new_sequence() for _ in ids]
        positions = [np.arange(len(t), dtype=np.float64) for t in ids]
        xs = [self._embed(t, 0) for t in ids]
        for i in range(self.config.num_layers):
            xs = [self._layer(i, x, seq, pos, 0) for x, seq, pos in zip(xs, seqs, positions)]
        for seq, t in zip(seqs, ids):
            seq.length = len(t)
        return [self._norm(x, "model.norm") @ self.w["lm_head.weight"].T for x in xs]

    def embed(self, token_ids, pooling: str = "mean") -> np.ndarray:
        """The input's embedding (H,) float64: its final hidden states (after the final norm where the model has
        one), pooled ("mean" over its tokens, the "last" token's, the first's: "cls"), L2-normalized."""
        x = self._hidden(self.new_sequence(), token_ids, 0)
        if not self.config.post_norm:
            x = self._norm(x, "model.norm")
        pooled = {"mean": lambda: x.mean(axis=0), "last": lambda: x[-1], "cls": lambda: x[0]}[pooling]()
        return pooled / np.linalg.norm(pooled)

    def _hidden(self, seq: ReferenceSequence, token_ids, start: int, images=()) -> np.ndarray:
        """The last layer's output (T, H) for token_ids fed at positions start.. (an encoder's whole input at 0);
        `images` as forward's."""
        c = self.config
        if not c.causal and start != 0:
            raise ValueError("reference: a bidirectional encoder computes a whole input at once (start 0)")
        if start > seq.length:
            raise ValueError(f"reference: tokens start at position {start} but only {seq.length} are cached")
        seq.truncate(start)
        ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.arange(start, start + len(ids), dtype=np.float64)
        x = self._embed(ids, start)
        h = x.shape[1]
        spans = []                              # (first, last) positions of each image whose tokens see it all
        deep = []                               # (offset, rows): DeepStack's rows after the embedding's (Qwen3-VL)
        for offset, rows, bidirectional, *_ in images:
            rows = np.asarray(rows, np.float64)
            if offset < 0 or offset + len(rows) > len(ids) or rows.ndim != 2 \
                    or rows.shape[1] != h * (1 + c.deepstack_layers):
                raise ValueError(f"reference: {rows.shape} image rows at token {offset} of {len(ids)}")
            own = np.isnan(rows[:, 0])          # (a token among an image's that keeps its own embedding: Pixtral's)
            x[offset:offset + len(rows)] = np.where(own[:, None], x[offset:offset + len(rows)], rows[:, :h])
            deep.append((offset, rows[:, h:]))
            if bidirectional:
                spans.append((start + offset, start + offset + len(rows) - 1))
        rope = self._mrope_positions(seq, start, len(ids), images) if c.mrope_section is not None else positions
        for i in range(c.num_layers):
            x = self._layer(i, x, seq, positions, start, spans, rope)
            if i < c.deepstack_layers:          # DeepStack: the image tokens' row i + 1 added after layer i
                for offset, rows in deep:
                    x[offset:offset + len(rows)] += rows[:, i * h:(i + 1) * h]
        seq.length = start + len(ids)
        return x

    @staticmethod
    def _mrope_positions(seq: ReferenceSequence, start: int, t: int, images) -> np.ndarray:
        """(t, 3) multimodal RoPE positions (time, row, column) of t tokens fed at start.. (transformers'
        get_rope_index): a text token's three are its place plus the moves of the images before it; an image's
        tokens sit at its start (where its first token would be as text) plus (0, row, column) in its grid, and it
        moves the tokens after it by its grid's larger side less its token count (kept in seq for later calls)."""
        out = np.repeat((np.arange(start, start + t) + seq.rope_delta(start)).astype(np.float64)[:, None], 3, 1)
        for offset, rows, _, *grid in sorted(images, key=lambda im: im[0]):
            if not grid or grid[0] is None:
                continue
            height, width = grid[0]
            n = len(rows)
            if n != height * width:
                raise ValueError(f"reference: an image of {n} tokens in a {height} x {width} grid")
            first = out[offset, 0]
            k = np.arange(n)
            out[offset:offset + n] = np.stack([np.full(n, first), first + k // width, first + k % width], 1)
            move = max(height, width) - n
            out[offset + n:] += move
            seq.rope_moves.append((start + offset + n, move))
        return out

    def _embed(self, ids: np.ndarray, start: int) -> np.ndarray:
        """The first layer's input (T, H) for ids at positions start..: embedding rows (scaled), and a BERT's
        positions, token type and norm."""
        c, w = self.config, self.w
        t = len(ids)
        x = w["model.embed_tokens.weight"][ids] * c.embed_scale                 # (T, H)
        if c.learned_positions:                 # BERT: each position's row and token type 0's (one text)
            x = x + w["model.embed_positions.weight"][start:start + t]
            if c.type_vocab_size:
                x = x + w["model.embed_token_types.weight"][0]
        if c.embed_norm:
            x = self._norm(x, "model.embed_norm")
        return x

    def _layer(self, i: int, x: np.ndarray, seq: ReferenceSequence, positions: np.ndarray, start: int,
               spans=(), rope=None) -> np.ndarray:
        """Decoder layer i's output for its input x (T, H) at `positions` (start..), its keys and values appended
        to seq's; `spans`: (first, last) positions whose tokens see each other (forward's bidirectional images);
        `rope`: the positions RoPE turns them by, where they are not `positions` (multimodal RoPE's (T, 3))."""
        c, w = self.config, self.w
        t = len(x)
        nh, kvh, d = c.num_heads, c.num_kv_heads, c.head_dim
        group = nh // kvh
        p = f"model.layers.{i}."
        h = x if c.post_norm else self._norm(x, p + "input_layernorm")
        q = (h @ w[p + "self_attn.q_proj.weight"].T + w.get(p + "self_attn.q_proj.bias", 0.0)).reshape(t, nh, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T + w.get(p + "self_attn.k_proj.bias", 0.0)).reshape(t, kvh, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T + w.get(p + "self_attn.v_proj.bias", 0.0)).reshape(t, kvh, d)
        if c.qk_norm:
            q, k = self._rms(q, w[p + "self_attn.q_norm.weight"]), self._rms(k, w[p + "self_attn.k_norm.weight"])
        rope = positions if rope is None else rope
        q, k = self._rope(q, rope, i), self._rope(k, rope, i)
        window = c.layer_window(i)
        keys = k if seq.keys[i] is None else np.concatenate([seq.keys[i], k])      # (start+T, KVH, D)
        values = v if seq.values[i] is None else np.concatenate([seq.values[i], v])
        seq.keys[i], seq.values[i] = keys, values
        out = np.empty((t, nh, d))
        key_pos = np.arange(start + t)
        for head in range(nh):
            kv = head // group
            scores = q[:, head, :] @ keys[:, kv, :].T * c.attention_scale         # (T, start+T)
            # causal: each token sees the keys up to its own; an encoder's every token sees all of them
            visible = key_pos[None, :] <= (positions[:, None] if c.causal else math.inf)
            for first, last in spans:
                visible |= (((positions >= first) & (positions <= last))[:, None]
                            & ((key_pos >= first) & (key_pos <= last))[None, :])
            if window is not None:
                visible &= key_pos[None, :] > positions[:, None] - window
            scores = np.where(visible, scores, -np.inf)
            top = scores.max(axis=-1, keepdims=True)
            scores = np.exp(scores - top)
            total = scores.sum(axis=-1, keepdims=True)
            if c.attention_sinks:               # gpt-oss: the head's sink logit in the denominator
                total = total + np.exp(w[p + "self_attn.sinks"][head] - top)
            out[:, head, :] = (scores / total) @ values[:, kv, :]
        o = out.reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T + w.get(p + "self_attn.o_proj.bias", 0.0)
        if c.sandwich_norms:
            o = self._norm(o, p + "attn_output_norm")
        x = x + o
        if c.post_norm:                         # BERT: the norm after the residual add
            x = self._norm(x, p + "attn_output_norm")
        h = x if c.post_norm else self._norm(x, p + "post_attention_layernorm")
        if c.layer_moe(i):
            down = self._experts(h, p)
        elif c.gated_mlp:
            down = self._mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                             w[p + "mlp.down_proj.weight"],
                             tuple(w.get(p + f"mlp.{n}.bias", 0.0) for n in ("gate_proj", "up_proj", "down_proj")))
        else:                                   # BERT: down(f(up h + b)) + b
            up = h @ w[p + "mlp.up_proj.weight"].T + w.get(p + "mlp.up_proj.bias", 0.0)
            down = self._act(up) @ w[p + "mlp.down_proj.weight"].T + w.get(p + "mlp.down_proj.bias", 0.0)
        if c.sandwich_norms:
            down = self._norm(down, p + "mlp_output_norm")
        x = x + down
        if c.post_norm:
            x = self._norm(x, p + "mlp_output_norm")
        return x

    def _act(self, g: np.ndarray) -> np.ndarray:
        """The MLP's activation of g: SiLU, GELU's tanh approximation, or GELU (erf)."""
        kind = self.config.hidden_act
        if kind == "gelu_tanh":
            return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
        if kind == "gelu":
            return 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0)))
        return g / (1.0 + np.exp(-g))

    def _mlp(self, h: np.ndarray, gate_w: np.ndarray, up_w: np.ndarray, down_w: np.ndarray, biases=(0.0, 0.0, 0.0),
             act: str = "") -> np.ndarray:
        """The gated MLP: down(f(gate h) * up h), f SiLU or GELU-tanh; or gpt-oss's experts (act "swiglu_oai"):
        biases on the three products, gate clamped to at most the limit, up to +- it, g sigmoid(alpha g) (up + 1)."""
        gate, up = h @ gate_w.T + biases[0], h @ up_w.T + biases[1]
        if act == "swiglu_oai":
            c = self.config
            gate, up = np.minimum(gate, c.swiglu_limit), np.clip(up, -c.swiglu_limit, c.swiglu_limit)
            return (gate / (1.0 + np.exp(-c.swiglu_alpha * gate)) * (up + 1.0)) @ down_w.T + biases[2]
        return (self._act(gate) * up) @ down_w.T + biases[2]

    def _experts(self, h: np.ndarray, p: str) -> np.ndarray:
        """A mixture of experts as transformers computes it: each token's router logits, its experts_per_token
        largest (ties to the lower expert), weighted by the softmax over all experts, renormalized over the chosen
        ones (norm_topk_prob), each chosen expert's gated MLP (rows e * size of the stacks). The experts each token
        chose are kept in `routes` (layer prefix -> a tuple per token of the last forward)."""
        c, w = self.config, self.w
        size, hidden = c.expert_intermediate_size, c.hidden_size
        logits = h @ w[p + "mlp.router.weight"].T + w.get(p + "mlp.router.bias", 0.0)    # (T, E)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)
        self.routes[p] = []
        for t in range(len(h)):
            chosen = sorted(range(c.num_experts), key=lambda e: (-logits[t, e], e))[:c.experts_per_token]
            self.routes[p].append(tuple(chosen))
            weights = probs[t, chosen] / (probs[t, chosen].sum() if c.norm_topk_prob else 1.0)
            for e, weight in zip(chosen, weights):
                rows, cols = slice(e * size, (e + 1) * size), slice(e * hidden, (e + 1) * hidden)
                biases = ((w[p + "mlp.experts.gate_proj.bias"][rows], w[p + "mlp.experts.up_proj.bias"][rows],
                           w[p + "mlp.experts.down_proj.bias"][cols]) if c.moe_bias else (0.0, 0.0, 0.0))
                out[t] += weight * self._mlp(h[t:t + 1], w[p + "mlp.experts.gate_proj.weight"][rows],
                                             w[p + "mlp.experts.up_proj.weight"][rows],
                                             w[p + "mlp.experts.down_proj.weight"][cols], biases, c.expert_act)[0]
        return out

    def generate_greedy(self, token_ids, num_positions: int) -> list:
        """Greedy continuation until `num_positions` tokens are fed (prompt included); returns new ids."""
        seq = self.new_sequence()
        logits = self.forward(seq, token_ids, 0)
        out = []
        while True:
            out.append(int(np.argmax(logits[-1])))
            if len(token_ids) + len(out) > num_positions:
                return out
            logits = self.forward(seq, [out[-1]], seq.length)
