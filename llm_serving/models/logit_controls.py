"""A step's logit controls, applied on the agent before sampling and the greedy pick (pure numpy): each row's
bias entries (`logit_bias`, and the master's bans: stop tokens before `min_tokens`, bad words), its token mask
(a grammar's next tokens, `allowed_token_ids`: llguidance's bitmask layout, a set bit = allowed) and `min_p`.

The master writes them (master/logits.py through step_io.RowWriter); the step's arrays come in
`StepInputs.per_row` only when some row uses them (`logit_rows`), and the runner then picks every row of the step
from the logits returned here. The log-probabilities it reports are those of the distribution the token was
picked from, as with penalties."""
from __future__ import annotations

import numpy as np

MASKED = np.float32(-3.0e38)       # a token the mask leaves out (below any banned token's BAN_BIAS)
KEYS = ("mask_on", "token_mask", "bias_len", "bias_ids", "bias_values", "min_p")


def logit_rows(step, n: int, vocab_size: int, check) -> dict:
    """The controls' arrays of a step object (a StepView) for its n rows, only those some row uses; `check`
    (a message) raises for a malformed one."""
    out = {}
    mask_on = step.mask_on
    if mask_on is not None and np.any(mask_on):
        mask = np.asarray(step.token_mask, np.int32)
        words = (vocab_size + 31) // 32
        if mask.ndim != 2 or mask.shape[0] != n or mask.shape[1] < words:
            check(f"token_mask has shape {mask.shape}, expected ({n}, >= {words})")
        out["mask_on"] = np.asarray(mask_on, np.int32)
        out["token_mask"] = mask[:, :words]
    bias_len = step.bias_len
    if bias_len is not None and np.any(bias_len):
        bias_len = np.asarray(bias_len, np.int32)
        ids, values = np.asarray(step.bias_ids, np.int32), np.asarray(step.bias_values, np.float32)
        width = int(bias_len.max())
        if ids.ndim != 2 or ids.shape[0] != n or ids.shape[1] < width or values.shape != ids.shape \
                or bias_len.min() < 0:
            check(f"bias_ids / bias_values / bias_len are malformed: {ids.shape}, {values.shape}, {bias_len.tolist()}")
        ids, values = ids[:, :width], values[:, :width]
        used = np.arange(width)[None, :] < bias_len[:, None]
        if used.any() and (ids[used].min() < 0 or ids[used].max() >= vocab_size):
            check(f"bias_ids must be token ids in [0, {vocab_size})")
        out.update(bias_len=bias_len, bias_ids=ids, bias_values=values)
    min_p = step.min_p
    if min_p is not None and np.any(np.asarray(min_p) > 0):
        out["min_p"] = np.asarray(min_p, np.float32)
    return out


def uses_controls(per_row: dict) -> bool:
    return any(key in per_row for key in KEYS)


def apply_controls(logits: np.ndarray, per_row: dict, temperature: np.ndarray) -> np.ndarray:
    """logits (R, V) float32 (R >= the rows per_row describes; the rest are padding, left as they are) with each
    row's bias entries added, the tokens its mask leaves out set to MASKED, then (sampling rows with min_p) the
    tokens less likely than min_p x the likeliest's probability at the row's temperature set to MASKED."""
    logits = np.array(logits, np.float32, copy=True)
    if "bias_len" in per_row:
        lens, ids, values = per_row["bias_len"], per_row["bias_ids"], per_row["bias_values"]
        for r in np.nonzero(lens)[0]:
            k = int(lens[r])
            np.add.at(logits[r], ids[r, :k], values[r, :k])
    if "mask_on" in per_row:
        v = logits.shape[1]
        for r in np.nonzero(per_row["mask_on"])[0]:
            allowed = np.unpackbits(per_row["token_mask"][r].view(np.uint8), bitorder="little")[:v].astype(bool)
            logits[r, ~allowed] = MASKED
    if "min_p" in per_row:
        min_p = per_row["min_p"]
        for r in np.nonzero((min_p > 0) & (temperature[:len(min_p)] > 0))[0]:
            row = logits[r]
            # p(t) >= min_p * p(max)  <=>  logit(t) >= max + T * log(min_p)
            row[row < row.max() + temperature[r] * np.log(min_p[r])] = MASKED
    return logits
