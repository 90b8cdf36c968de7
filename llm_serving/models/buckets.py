"""Graph buckets: the static shapes the model is compiled for, and which one a step of a given size runs in.

MindSpore graphs have static shapes, so a step is padded up to a bucket:
  - decode: (batch, 1) for every decode batch size, and per block-table width when the graph gathers keys
    (a step gathers only the keys its rows can have); kernels that read the cache through the block table
    (the CPU paged-attention kernel, Ascend) need one width, the widest;
  - prefill, unpacked: (batch, seq) for every prefill batch size and seq length;
  - prefill, packed (with the CPU kernel): the step's real tokens side by side, padded to a token bucket
    (powers of two from the smallest prefill seq length up to max prefill batch x max seq length, or the
    scheduler's step budget if smaller): a prompt of 17 tokens costs 17 tokens, not a 32-token row;
  - verify (speculative decoding: every new token sampled), when the config speculates: packed, token
    buckets of 1, 2, 4, ... speculating rows' worth of tokens (a row feeds `verify_width` tokens); unpacked,
    (batch, verify_width) for the decode batch sizes up to `verify_rows`.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import numpy as np


def token_buckets(smallest: int, largest: int) -> list:
    """Powers of two from `smallest` up, then `largest`: padding a packed step wastes < half its tokens."""
    sizes = [smallest]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes) | {largest})


def _positive_ints(name: str, values) -> list:
    if not values or any((not isinstance(v, (int, np.integer))) or v < 1 for v in values):
        raise ValueError(f"ModelRunner: {name} must be a non-empty list of positive integers, got {values!r}")
    return sorted(set(int(v) for v in values))


@dataclass(frozen=True)
class Buckets:
    decode_batch_sizes: list
    decode_block_widths: list       # block-table widths of the decode graphs (the widest is max_blocks_per_seq)
    prefill_batch_sizes: list
    prefill_seq_lens: list          # all >= 2 (a one-token step always runs in a decode graph)
    prefill_token_sizes: list       # packed prefill token buckets (used when `packed`)
    max_blocks_per_seq: int
    packed: bool
    verify_width: int = 1           # tokens a speculating row feeds (1: the config does not speculate)
    verify_sizes: tuple = ()        # packed: verify token buckets; unpacked: verify batch buckets

    @classmethod
    def make(cls, *, decode_batch_sizes, prefill_batch_sizes, prefill_seq_lens, max_blocks_per_seq: int,
             decode_block_widths=None, packed: bool, one_width: bool,
             max_step_tokens: Optional[int] = None, verify_width: int = 1, verify_rows: int = 0) -> "Buckets":
        """The buckets of a configuration, checked. one_width: the decode kernel reads the cache through the
        block table (one decode graph per batch size); max_step_tokens caps the packed token buckets;
        verify_width > 1 and verify_rows > 0: verify steps of up to verify_rows speculating rows."""
        decode = _positive_ints("decode_batch_sizes", decode_batch_sizes)
        prefill = _positive_ints("prefill_batch_sizes", prefill_batch_sizes)
        seq_lens = _positive_ints("prefill_seq_lens", prefill_seq_lens)
        if seq_lens[-1] < 2:
            raise ValueError(f"ModelRunner: prefill_seq_lens needs a length >= 2 (s=1 always uses the decode "
                             f"graph), got {prefill_seq_lens!r}")
        seq_lens = [s for s in seq_lens if s >= 2]
        widths = decode_block_widths or [max_blocks_per_seq]
        if any((not isinstance(v, (int, np.integer))) or not 1 <= v <= max_blocks_per_seq for v in widths):
            raise ValueError(f"ModelRunner: decode_block_widths must be integers in [1, max_blocks_per_seq="
                             f"{max_blocks_per_seq}], got {widths!r}")
        if one_width:
            widths = [max_blocks_per_seq]
        most = prefill[-1] * seq_lens[-1]
        if max_step_tokens is not None:          # the scheduler never puts more tokens in a step
            most = max(min(most, int(max_step_tokens)), seq_lens[-1])
        verify: tuple = ()
        if verify_width > 1 and verify_rows > 0:
            rows = min(int(verify_rows), decode[-1])
            if packed:
                verify = tuple(verify_width * r for r in token_buckets(1, rows))
            else:
                verify = tuple(b for b in decode if b < rows) + (decode[bisect.bisect_left(decode, rows)],)
        return cls(decode_batch_sizes=decode, decode_block_widths=sorted(set(int(v) for v in widths)
                                                                         | {max_blocks_per_seq}),
                   prefill_batch_sizes=prefill, prefill_seq_lens=seq_lens,
                   prefill_token_sizes=token_buckets(seq_lens[0], most), max_blocks_per_seq=max_blocks_per_seq,
                   packed=packed, verify_width=int(verify_width) if verify else 1, verify_sizes=verify)

    def bucket(self, n: int, s: int) -> tuple:
        """(batch, seq) of the graph a step of n rows and s tokens per row runs in; ValueError if none fits."""
        if s == 1:
            sizes, seq = self.decode_batch_sizes, 1
        else:
            i = bisect.bisect_left(self.prefill_seq_lens, s)
            if i == len(self.prefill_seq_lens):
                raise ValueError(f"ModelRunner.execute: query length {s} exceeds the largest prefill bucket "
                                 f"{self.prefill_seq_lens[-1]} (prefill_seq_lens={self.prefill_seq_lens})")
            sizes, seq = self.prefill_batch_sizes, self.prefill_seq_lens[i]
        j = bisect.bisect_left(sizes, n)
        if j == len(sizes):
            kind = "decode_batch_sizes" if s == 1 else "prefill_batch_sizes"
            raise ValueError(f"ModelRunner.execute: batch of {n} rows exceeds the largest {kind} bucket "
                             f"{sizes[-1]} ({kind}={sizes})")
        return sizes[j], seq

    def verify_bucket(self, n: int, t: int) -> int:
        """The verify graph of a step of n rows and t new tokens in all: its tokens (packed) or rows
        (unpacked); ValueError when the configuration has none that holds it."""
        need = t if self.packed else n
        i = bisect.bisect_left(self.verify_sizes, need)
        if i == len(self.verify_sizes):
            raise ValueError(f"ModelRunner.execute: a verify step of {n} rows and {t} tokens exceeds the largest "
                             f"verify bucket ({'tokens' if self.packed else 'rows'}: {list(self.verify_sizes)})")
        return self.verify_sizes[i]

    def width(self, s: int, needed: int) -> int:
        """Block-table width of the graph for a step whose longest row has `needed` blocks."""
        if s > 1:
            return self.max_blocks_per_seq
        return self.decode_block_widths[bisect.bisect_left(self.decode_block_widths, needed)]

    def token_pieces(self, t: int) -> list:
        """`token_pieces` over this runner's prefill token buckets."""
        return token_pieces(self.prefill_token_sizes, t)

    def row_pieces(self, lengths) -> list:
        """(start, stop, bucket) graph calls over rows of `lengths` tokens side by side, each row whole within one
        call (a bidirectional encoder's input: its keys must all be written before any of its tokens attends):
        consecutive rows while they fit the largest token bucket, each call in the smallest bucket that holds its
        tokens; a row longer than the largest bucket alone, in the largest times the power of two that holds it."""
        sizes = self.prefill_token_sizes
        pieces, start, run = [], 0, 0

        def close(tokens: int) -> None:
            i = bisect.bisect_left(sizes, tokens)
            size = sizes[i] if i < len(sizes) else sizes[-1]
            while size < tokens:
                size *= 2
            pieces.append((start, start + tokens, size))

        for n in (int(v) for v in lengths):
            if run and run + n > sizes[-1]:
                close(run)
                start, run = start + run, 0
            run += n
        if run:
            close(run)
        return pieces

    def graphs(self) -> list:
        """(kind, batch, seq, decode width) of every model graph warmup compiles, in order."""
        out = [("decode", b, 1, w) for b in self.decode_batch_sizes for w in self.decode_block_widths]
        if self.packed:
            out += [("packed", t, None, None) for t in self.prefill_token_sizes]
            return out + [("verify", t, None, None) for t in self.verify_sizes]
        out += [("prefill", b, s, None) for b in self.prefill_batch_sizes for s in self.prefill_seq_lens]
        return out + [("verify", b, self.verify_width, None) for b in self.verify_sizes]


def token_pieces(sizes: list, t: int) -> list:
    """Token buckets of `sizes` (ascending) whose sum covers t tokens: the smallest bucket that holds them, unless
    that would pad more than the smallest bucket's worth of tokens — then the largest bucket that fits runs first
    and the rest is split the same way (272 tokens with buckets ..., 256, 512: 256 + 32, not 512); more tokens than
    the largest bucket fill it as often as needed."""
    pieces = []
    while t > 0:
        i = bisect.bisect_left(sizes, t)
        if i == len(sizes):                  # more than the largest bucket (max_step_tokens): fill it
            pieces.append(sizes[-1])
            t -= sizes[-1]
            continue
        fit = sizes[i]
        below = sizes[bisect.bisect_right(sizes, t) - 1] if t >= sizes[0] else None
        if below is None or fit - t <= sizes[0]:
            pieces.append(fit)
            break
        pieces.append(below)
        t -= below
    return pieces
