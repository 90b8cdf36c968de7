"""One agent's model work: read a step's inputs from shared memory, run the model, write the outputs."""
from __future__ import annotations

import logging

import numpy as np

from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.layout import StepLayout

logger = logging.getLogger(__name__)


class Worker:
    """Owns the ModelRunner (MindSpore graphs + paged KV cache) and the attached step buffers."""

    def __init__(self, config, model_dir: str, rank: int, device_id: int):
        from llm_serving.models.runner import ModelRunner  # MindSpore is imported only in agents

        mc, pa = config.model_config, config.pa_config
        self.rank = rank
        self.layout = StepLayout.from_config(config)
        self.buffers = None
        self.num_steps = 0
        self.runner = ModelRunner(
            model_dir, num_blocks=pa.num_blocks, block_size=pa.block_size,
            max_blocks_per_seq=config.max_blocks_per_seq, decode_batch_sizes=mc.decode_batch_size,
            prefill_batch_sizes=mc.prefill_batch_size, prefill_seq_lens=mc.seq_length,
            device_target=mc.device_target, device_id=device_id, num_threads=mc.num_threads)

    def warmup(self) -> None:
        self.runner.warmup()  # logs one line per compiled bucket

    def attach(self, names: dict) -> None:
        self.detach()
        self.buffers = StepBuffers.attach(self.layout, names)

    def detach(self) -> None:
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None

    def step(self, n: int, s: int) -> None:
        """Run rows 0..n-1 with s new tokens per row (s = 1 for decode)."""
        b = self.buffers
        if b is None:
            raise RuntimeError("no shared memory attached: connect with shm names first")
        if not (1 <= n <= self.layout.max_rows and 1 <= s <= self.layout.max_tokens):
            raise ValueError(f"step shape n={n}, s={s} outside 1..{self.layout.max_rows} x "
                             f"1..{self.layout.max_tokens}")
        token_ids, logprobs = self.runner.execute(
            b.input_ids[:n, :s], b.positions[:n, :s], b.slot_mapping[:n, :s], b.block_tables[:n],
            b.context_lens[:n], b.query_lens[:n], b.temperature[:n], b.top_k[:n], b.top_p[:n],
            b.random_u[:n])
        if self.rank == 0:
            b.out_token_ids[:n] = np.asarray(token_ids, dtype=np.int32)
            b.out_logprobs[:n] = np.asarray(logprobs, dtype=np.float32)
        self.num_steps += 1

    def reset(self) -> None:
        self.runner.reset()
