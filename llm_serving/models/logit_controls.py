"""A step's logit controls, applied on the agent before sampling and the greedy pick (pure numpy): each row's
bias entries (`logit_bias`, and the master's bans: stop tokens before `min_tokens`, bad words), its token mask
(a grammar's next tokens, `allowed_token_ids`: llguidance's bitmask layout, a set bit = allowed) and `min_p`.

The master writes them (master/logits.py through step_io.RowWriter) after it sends the step, while the model runs;
`StepInputs.per_row` keeps which rows have them (`logit_rows`), and the runner reads them when it samples those rows
(`read_controls`, which waits for the master's `controls_pending` flag), then picks every row of the step from the
logits returned here. The log-probabilities it reports are those of the distribution the token was
picked from, as with penalties."""
from __future__ import annotations

import time

import numpy as np

MASKED = np.float32(-3.0e38)       # a token the mask leaves out (below any banned token's BAN_BIAS)
KEYS = ("controls_on", "mask_on", "token_mask", "bias_len", "bias_ids", "bias_values", "min_p")


def logit_rows(step, n: int) -> dict:
    """What StepInputs keeps of a step's controls when it is made: min_p, and for a step some row of which has
    controls (`controls_on`) those flags and each row's index (the master writes the controls themselves while
    the model runs: `read_controls` reads them when the rows are sampled)."""
    out = {}
    on = step.controls_on
    if on is not None and np.any(on):
        out["controls_on"] = np.asarray(on, np.int32).copy()
        out["row_index"] = np.arange(n)
    min_p = step.min_p
    if min_p is not None and np.any(np.asarray(min_p) > 0):
        out["min_p"] = np.asarray(min_p, np.float32)
    return out


def read_controls(step, rows: np.ndarray, vocab_size: int, check, timeout_s: float = 60.0) -> dict:
    """The mask and bias entries of the step's `rows` (indices), read from the live step buffers once the master
    has written them (`controls_pending` is 0; it writes them while the model runs); only those some row uses;
    `check` (a message) raises for a malformed one or a master that never finishes."""
    pending = step.controls_pending
    if pending is not None and pending[0]:
        deadline = time.monotonic() + timeout_s
        while pending[0]:
            if time.monotonic() > deadline:
                check(f"the master did not write the step's logit controls within {timeout_s:g} s")
            time.sleep(20e-6)
    out = {}
    n = len(rows)
    on = np.asarray(step.controls_on)[rows] != 0        # (a row without controls this step has none, whatever is left)
    mask_on = (np.asarray(step.mask_on)[rows] != 0) & on
    if mask_on.any():
        words = (vocab_size + 31) // 32
        mask = np.asarray(step.token_mask, np.int32)
        if mask.ndim != 2 or mask.shape[1] < words:
            check(f"token_mask has shape {mask.shape}, expected (rows, >= {words})")
        out["mask_on"] = mask_on.astype(np.int32)
        out["token_mask"] = mask[rows, :words]
    bias_len = np.where(on, np.asarray(step.bias_len, np.int32)[rows], 0)
    if bias_len.any():
        width = int(bias_len.max())
        ids = np.asarray(step.bias_ids, np.int32)[rows, :width]
        values = np.asarray(step.bias_values, np.float32)[rows, :width]
        if ids.shape != (n, width) or bias_len.min() < 0:
            check(f"bias_ids / bias_values / bias_len are malformed: {ids.shape}, {bias_len.tolist()}")
        used = np.arange(width)[None, :] < bias_len[:, None]
        if ids[used].min() < 0 or ids[used].max() >= vocab_size:
            check(f"bias_ids must be token ids in [0, {vocab_size})")
        out.update(bias_len=bias_len, bias_ids=ids, bias_values=values)
    return out


def uses_controls(per_row: dict) -> bool:
    return any(key in per_row for key in KEYS)


def apply_controls(logits: np.ndarray, per_row: dict, temperature: np.ndarray, owned: bool = False) -> np.ndarray:
    """logits (R, V) float32 (R >= the rows per_row describes; the rest are padding, left as they are) with each
    row's bias entries added, the tokens its mask leaves out set to MASKED, then (sampling rows with min_p) the
    tokens less likely than min_p x the likeliest's probability at the row's temperature set to MASKED. `owned`:
    the caller's copy, changed in place."""
    logits = np.array(logits, np.float32, copy=not owned)
    if "bias_len" in per_row:
        lens, ids, values = per_row["bias_len"], per_row["bias_ids"], per_row["bias_values"]
        for r in np.nonzero(lens)[0]:
            k = int(lens[r])
            np.add.at(logits[r], ids[r, :k], values[r, :k])
    if "mask_on" in per_row:
        rows = np.nonzero(per_row["mask_on"])[0]
        v = logits.shape[1]
        allowed = np.unpackbits(per_row["token_mask"][rows].view(np.uint8), axis=1, bitorder="little")[:, :v]
        masked = logits[rows]
        np.putmask(masked, allowed == 0, MASKED)
        logits[rows] = masked
    if "min_p" in per_row:
        min_p = per_row["min_p"]
        for r in np.nonzero((min_p > 0) & (temperature[:len(min_p)] > 0))[0]:
            row = logits[r]
            # p(t) >= min_p * p(max)  <=>  logit(t) >= max + T * log(min_p)
            row[row < row.max() + temperature[r] * np.log(min_p[r])] = MASKED
    return logits
