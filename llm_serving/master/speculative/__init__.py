"""Speculative decoding, the master's part: proposing tokens for decoding requests, and the rule that keeps the
ones the target model agrees with.

A speculating request feeds, in one *verify* step, its last token and k proposed tokens x1..xk; the agent
samples the target's token y0..yk after each of them (ModelRunner verify steps, each token with the request's
sampling parameters and the uniform number plain decoding would have used at that output index). The request
keeps y0..ya, where a is the number of leading proposals with y(j-1) == xj: its proposals up to the first one
the target disagrees with, and the target's own token after them.

Why this is exact: y(j) is the token plain decoding samples at that position whenever x1..xj were accepted
(same context, same parameters, same uniform number), so greedy output and seeded sampled output are the same
with speculation on and off. For sampled requests this is speculative (rejection) sampling with a proposal that
puts all its mass on one token x: accept x with probability p(x), else sample from p without x, renormalised —
which is what "sample y from p, accept when y == x" does. A token tree (several branches) is walked from the
last token to the child whose token is the target's sample there; each kept token is the target's sample after
the path actually taken, so it is exact for the same reason.

The modules (import from them; this package's own namespace is empty so that the tree helpers import nothing
else):
- `planner.py`: what a decode step the scheduler left to speculation becomes (limits per row, blocks reserved
  through the scheduler, proposals trimmed and attached: a new, verify batch), the `Proposer` interface;
- `ngram.py`: prompt lookup (`ngram`, and `tree`: several continuations as a token tree);
- `draft.py`: a draft model in an agent group of its own (`draft`, and `draft_tree`: its likeliest first
  tokens as branches);
- `tree.py`: token trees (from paths, trimmed, walked) and the acceptance rule (`accept`);
- `stats.py`: what speculation did, for /stats;
- `setup.py`: the engine's speculation from the config (`build_speculation`), and what the agents must support.
The outcome of a verify step (tokens appended, stops, KV counted, statistics) is the OutputProcessor's
(master/output_processor.py), like every step's.

Speculation happens only in decode steps of at most spec_config.max_batch_size rows (larger steps are
compute-bound, and checking guesses costs more than it saves) and only for requests that allow it (a request's
`speculative` parameter) and need nothing only the last token's logits give (top log-probabilities, penalties,
logit controls).
"""
