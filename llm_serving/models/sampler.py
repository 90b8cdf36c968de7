"""In-graph token selection: one token id and its log-probability per row.

`greedy_pick(logits)` (used inside the model graph): argmax (ties -> lowest id) and its logprob.

`Sampler` (its own small graph, one per batch size and variant, run by the runner only when some row
has temperature > 0; its input is the model graph's logits Tensor, which stays in MindSpore memory):
- temperature <= 0: greedy, as above.
- otherwise sample from softmax(logits / temperature) by inverse CDF with the row's host-provided
  uniform u in [0, 1), so a step is reproducible from the host's RNG seed:
  * no filter (top_k == 0 or >= vocab, and top_p >= 1): inverse CDF over the whole vocabulary in id
    order (exact, and no sort of the vocabulary);
  * top-k (0 = off) then top-p (>= 1 = off; on the top-k-renormalised distribution; the most likely
    token is always kept): inverse CDF over the descending-sorted, filtered candidates. Candidates are
    the `MAX_CANDIDATES` most likely tokens (TopK; a full Sort of a 32k vocabulary costs ~90 ms per
    32 rows on this CPU), so a top_k larger than that, or a nucleus needing more tokens, is cut there.
The log-probability returned is log_softmax of the raw (temperature 1, unfiltered) logits at the token.

Why two graphs: graph-mode control flow (`if (temperature > 0).any()`) inside the model graph cost
0.3-1 ms per decode step on CPU; always running the sampling ops costs ~15 ms per step at vocab 32k,
batch 32. Splitting keeps greedy steps at the cost of greedy only.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from .attention import MASK_VALUE
from .kernels.signatures import SAMPLE_LOGITS

__all__ = ["MAX_CANDIDATES", "KernelSampler", "Penalizer", "Sampler", "TopLogprobs", "greedy_pick", "token_logprob"]

MAX_CANDIDATES = 1024


class Sampler(nn.Cell):
    """construct(logits, temperature, top_k, top_p, random_u) -> (token (B,) int32, logprob (B,) float32).

    filters=False builds the light variant that ignores top_k/top_p (the runner uses it when no sampling
    row asks for them): it skips the TopK, which is most of the sampling cost on CPU.
    """

    def __init__(self, vocab_size: int, *, filters: bool = True):
        super().__init__()
        self.vocab_size = vocab_size
        self.filters = filters
        self.num_candidates = min(vocab_size, MAX_CANDIDATES)
        self.topk = ops.TopK(sorted=True)
        self.cumsum = ops.CumSum()
        self.cumsum_excl = ops.CumSum(exclusive=True)
        self.softmax = ops.Softmax(-1)
        self.reduce_sum = ops.ReduceSum()

    def count(self, flags):
        """(B, N) bool -> (B,) int32 number of True per row (Tensor.sum would promote to int64)."""
        return self.reduce_sum(flags.astype(ms.int32), 1).astype(ms.int32)

    def first_above(self, cdf, threshold):
        """cdf (B, N) non-decreasing, threshold (B, 1) -> (B,) int32 index of the first cdf > threshold
        (N if none). A binary search: comparing and counting costs ~10 ms per 32 rows at vocab 32k."""
        return ops.searchsorted(cdf, threshold, out_int32=True, right=True).reshape(cdf.shape[0])

    def filtered_pick(self, scaled, probs, top_k, top_p, u):
        """Top-k then top-p over the descending candidates; inverse CDF. -> (B,) int32 token ids."""
        b, v, c = scaled.shape[0], self.vocab_size, self.num_candidates
        cand_logits, cand_ids = self.topk(scaled, c)                                      # (B, C) each
        ranks = ops.arange(0, c, dtype=ms.int32).reshape(1, c)                            # (1, C)
        k = ops.select(top_k > 0, top_k, ops.full_like(top_k, v))                         # (B,)
        keep = ranks < k.reshape(b, 1)                                                    # (B, C)
        cand_probs = self.softmax(ops.select(keep, cand_logits, ops.full_like(cand_logits, MASK_VALUE)))
        # With top-k off (or k beyond the candidates) the renormalisation is over the whole vocabulary.
        whole = ops.broadcast_to((k > c).reshape(b, 1), (b, c))                           # (B, C)
        cand_probs = ops.select(whole, ops.gather_elements(probs, 1, cand_ids), cand_probs)  # (B, C)
        before = self.cumsum_excl(cand_probs, 1)                                          # (B, C) mass of better tokens
        keep = ops.logical_and(keep, ops.logical_or(before < top_p.reshape(b, 1), (top_p >= 1.0).reshape(b, 1)))
        keep = ops.logical_or(ops.logical_and(keep, cand_probs > 0.0), ranks == 0)        # (B, C), a prefix
        kept = ops.select(keep, cand_probs, ops.zeros_like(cand_probs))                   # (B, C)
        kept_cdf = self.cumsum(kept, 1)                                                   # (B, C)
        pick = self.first_above(kept_cdf, u * kept_cdf[:, c - 1:])                        # (B,)
        pick = ops.minimum(pick, self.count(keep) - 1)                                    # (B,)
        return ops.gather_elements(cand_ids, 1, pick.reshape(b, 1)).reshape(b).astype(ms.int32)

    def construct(self, logits, temperature, top_k, top_p, random_u):
        # logits (B, V) float32; temperature, top_p, random_u (B,) float32; top_k (B,) int32
        b, v = logits.shape
        greedy, _ = greedy_pick(logits)                                                   # (B,)
        do_sample = temperature > 0.0                                                     # (B,)
        temp = ops.select(do_sample, temperature, ops.ones_like(temperature))             # (B,)
        scaled = logits / temp.reshape(b, 1)                                              # (B, V)
        u = random_u.reshape(b, 1)                                                        # (B, 1)
        # Unfiltered rows: inverse CDF over the vocabulary in id order.
        probs = self.softmax(scaled)                                                      # (B, V)
        cdf = self.cumsum(probs, 1)                                                       # (B, V)
        token = ops.minimum(self.first_above(cdf, u * cdf[:, v - 1:]), v - 1)             # (B,)
        if self.filters:
            unfiltered = ops.logical_and(ops.logical_or(top_k <= 0, top_k >= v), top_p >= 1.0)  # (B,)
            token = ops.select(unfiltered, token, self.filtered_pick(scaled, probs, top_k, top_p, u))
        # A zero-probability pick can only come from rounding at u ~ 1: fall back to the argmax.
        ok = ops.gather_elements(probs, 1, token.reshape(b, 1)).reshape(b) > 0.0         # (B,)
        token = ops.select(ops.logical_and(ok, do_sample), token, greedy)                 # (B,)
        return token, token_logprob(logits, token)


class KernelSampler(nn.Cell):
    """Sampler(filters=False) as one CPU kernel (kernels/decoder_layer_cpu.cc's SampleLogits, from the layer
    kernel's library `layer_kernel`): the same construct arguments (top_k and top_p unused) and results (tokens the
    same but at a cumulative probability within float32 rounding of u; logprobs within ~1e-5). MindSpore's
    sampler graph keeps ~7 logits-sized (B, V) buffers per compiled batch size for the life of the process
    (~150 MiB for batches 1..64 at vocab 49k); the kernel's live in a reused per-thread scratch."""

    def __init__(self, layer_kernel: str, threads: int):
        super().__init__()
        self.kernel = ops.Custom(f"{layer_kernel}:SampleLogits", func_type="aot",
                                 out_shape=lambda logits, *_: ((logits[0],), (logits[0],)),
                                 out_dtype=lambda *_: (ms.int32, ms.float32))
        self.held = SAMPLE_LOGITS.held(iconfig=Tensor(SAMPLE_LOGITS.iconfig_array(threads=threads)))
        SAMPLE_LOGITS.check_call(self.sample)

    def sample(self, logits, temperature, random_u):
        return self.kernel(logits, temperature, random_u, *self.held)

    def construct(self, logits, temperature, top_k, top_p, random_u):
        # logits (B, V) float32; temperature, random_u (B,) float32 -> token (B,) int32, logprob (B,) float32
        return self.sample(logits, temperature, random_u)


class Penalizer(nn.Cell):
    """construct(logits (B, V), history (B, H) int32, history_len, prompt_len (B,) int32, repetition, presence,
    frequency (B,) float32) -> penalized logits (B, V). Its own small graph, run only in steps where some
    row has a penalty; the sampler then picks from its output (greedy rows too).

    - repetition (HF / TGI, 1 = off): a token anywhere in the row's history (prompt + output) has its logit
      divided by the penalty when positive, multiplied when negative;
    - presence and frequency (OpenAI, 0 = off): a token's logit loses presence once if it occurs in the
      output, and frequency per occurrence there.
    Counts come from one scatter-add of the history over the vocabulary."""

    def construct(self, logits, history, history_len, prompt_len, repetition, presence, frequency):
        b, h = history.shape
        pos = ops.arange(0, h, dtype=ms.int32).reshape(1, h)                              # (1, H)
        valid = pos < history_len.reshape(b, 1)                                           # (B, H)
        output = ops.logical_and(valid, pos >= prompt_len.reshape(b, 1))                  # (B, H)
        ids = ops.select(valid, history, ops.zeros_like(history))                         # (B, H)
        zeros = ops.zeros_like(logits)                                                    # (B, V)
        seen = ops.tensor_scatter_elements(zeros, ids, valid.astype(ms.float32), axis=1, reduction="add")
        count = ops.tensor_scatter_elements(zeros, ids, output.astype(ms.float32), axis=1, reduction="add")
        rep = repetition.reshape(b, 1)                                                    # (B, 1)
        logits = ops.select(seen > 0.0, ops.select(logits > 0.0, logits / rep, logits * rep), logits)
        return (logits - frequency.reshape(b, 1) * count
                - presence.reshape(b, 1) * (count > 0.0).astype(ms.float32))


class TopLogprobs(nn.Cell):
    """construct(logits (B, V)) -> (ids (B, K) int32, log-probabilities (B, K) float32), most likely first.
    Its own small graph, run by the runner only in steps where some row asks for top log-probabilities."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.topk = ops.TopK(sorted=True)

    def construct(self, logits):
        values, ids = self.topk(ops.log_softmax(logits, -1), self.k)
        return ids.astype(ms.int32), values


def token_logprob(logits, token):
    """logits (B, V), token (B,) int32 -> log_softmax(logits)[b, token[b]] (B,) float32."""
    b = logits.shape[0]
    return ops.gather_elements(ops.log_softmax(logits, -1), 1, token.reshape(b, 1)).reshape(b)


def greedy_pick(logits):
    """logits (B, V) -> (argmax (B,) int32, its log-probability (B,) float32)."""
    token = ops.Argmax(axis=-1, output_type=ms.int32)(logits)                             # (B,)
    return token, token_logprob(logits, token)
