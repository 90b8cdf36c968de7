"""How the engine gets its speculation from the config: which proposer (prompt lookup or a draft model in an agent
group of its own) behind the planner, and what the started agents must support for it."""
from __future__ import annotations

from typing import Callable, Optional

from llm_serving.master.speculative.draft import DraftProposer
from llm_serving.master.speculative.ngram import NgramProposer
from llm_serving.master.speculative.planner import SpeculativePlanner, SpeculativeSpec


def build_speculation(config, model_dir: str, block_manager, scheduler, forget_draft: Callable[[], None]
                      ) -> tuple[Optional[DraftProposer], Optional[SpeculativePlanner]]:
    """(the draft model's proposer when spec_config.method uses one, the planner), or (None, None) with
    speculation off. `forget_draft`: called when the draft model's KV cache is gone (restarted, reset)."""
    sc = config.spec_config
    if not sc.enabled:
        return None, None
    spec = SpeculativeSpec.from_config(config)
    drafter = None
    if sc.uses_draft:
        draft_dir = sc.draft_model or model_dir
        drafter = proposer = DraftProposer(config.draft_config(draft_dir), draft_dir, block_manager, forget_draft,
                                           width=spec.tree_width or 1)
    else:
        proposer = NgramProposer(sc.num_speculative_tokens, sc.ngram_max, sc.ngram_min, tree_width=spec.tree_width)
    return drafter, SpeculativePlanner(spec, proposer, scheduler)


def unsupported(config, drafter: Optional[DraftProposer], info) -> Optional[Exception]:
    """Why the started agents (`info`: the first target agent's) cannot speculate as configured, or None: a draft
    model with another vocabulary, or token trees without the CPU paged-attention kernel."""
    if drafter is not None and drafter.vocab_size != info.vocab_size:
        return ValueError(f"spec_config.draft_model: the draft's vocabulary ({drafter.vocab_size} tokens) is not "
                          f"the target's ({info.vocab_size}); a draft model must share the target's tokenizer")
    if config.spec_config.is_tree and not info.token_trees:
        return ValueError(f"spec_config.method {config.spec_config.method}: token trees need the CPU paged-attention "
                          "kernel (model_config.attention_kernel on, and a C++ compiler); these agents pad verify "
                          "steps — use method ngram or draft (chains)")
    return None
