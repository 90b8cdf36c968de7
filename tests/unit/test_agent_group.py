"""How the master combines one step's replies from a tensor-parallel group (AgentGroup.step), with
stand-in agents that answer, fail or never answer on cue (no processes: the combining rule alone)."""
from __future__ import annotations

import asyncio
import itertools

import pytest

from llm_serving.agents import protocol as proto
from llm_serving.config import config_from_dict
from llm_serving.master.agent_group import AgentError, AgentGroup


class ScriptedAgent:
    """send()/wait_reply() like AgentClient; the reply is `outcome`: a StepReply, an AgentError, or None
    (never)."""

    def __init__(self, rank: int, outcome):
        self.rank, self.outcome = rank, outcome
        self._seq = itertools.count()
        self.cancelled = False
        self.cache_epoch = 0

    def send(self, command):
        if isinstance(self.outcome, AgentError) and "not connected" in str(self.outcome):
            raise self.outcome
        return next(self._seq), command, None

    async def wait_reply(self, seq, command, fut, timeout_s):
        if self.outcome is None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        await asyncio.sleep(0.01 * self.rank)
        if isinstance(self.outcome, AgentError):
            raise self.outcome
        return self.outcome


def _ok(calls=None, epoch=0) -> proto.StepReply:
    return proto.StepReply(step=1, model_ms=1.0, agent_ms=2.0, cache_epoch=epoch, collective_calls=calls)


STEP = proto.Step(kind="decode", step=1, num_rows=1)


def _step(*outcomes):
    group = AgentGroup(config_from_dict({}, ["model_config.max_generate_length=512"]), "unused")
    group.agents = [ScriptedAgent(r, o) for r, o in enumerate(outcomes)]
    return group, asyncio.run


def test_every_rank_answering_gives_the_replies_in_rank_order():
    first, second = _ok(epoch=0), _ok(epoch=0)
    group, run = _step(first, second)
    replies, cache_reset = run(group.step(STEP))
    assert replies[0] is first and replies[1] is second and not cache_reset


def test_a_reply_with_a_new_cache_epoch_says_the_kv_cache_was_reset_once():
    group, run = _step(_ok(epoch=0), _ok(epoch=1))          # rank 1 was reset (agent-ctl reset)
    assert run(group.step(STEP))[1] is True
    assert [a.cache_epoch for a in group.agents] == [0, 1]
    assert run(group.step(STEP))[1] is False                 # known from now on


def test_a_lost_rank_fails_the_step_at_once_without_waiting_for_the_others():
    group, run = _step(None, AgentError("agent 1 connection lost (ConnectionResetError)"))

    async def bounded():
        with pytest.raises(AgentError, match="agent 1 connection lost") as err:
            await asyncio.wait_for(group.step(STEP), 5)    # rank 0 would wait forever
        await asyncio.sleep(0)                                      # (a cancellation lands on the next turn)
        return err.value, group.agents[0].cancelled                 # read before asyncio.run cancels leftovers
    error, rank0_cancelled = run(bounded())
    assert error.fatal and rank0_cancelled


def test_a_cancelled_step_leaves_no_rank_waiting():
    group, run = _step(None, None)

    async def cancel_midway():
        task = asyncio.ensure_future(group.step(STEP))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return [a.cancelled for a in group.agents]
    assert run(cancel_midway()) == [True, True]


def test_a_rank_that_cannot_even_be_sent_to_is_fatal():
    group, run = _step(_ok(), AgentError("agent 1 is not connected"))
    with pytest.raises(AgentError, match="not connected") as err:
        run(group.step(STEP))
    assert err.value.fatal


def test_every_rank_refusing_the_step_is_not_fatal_but_ranks_that_disagree_are():
    refused = AgentError("agent 0: ValueError: bad step", fatal=False)
    group, run = _step(refused, AgentError("agent 1: ValueError: bad step", fatal=False))
    with pytest.raises(AgentError) as err:
        run(group.step(STEP))
    assert not err.value.fatal and "agent 0" in str(err.value) and "agent 1" in str(err.value)

    group, run = _step(_ok(), AgentError("agent 1: RuntimeError: out of memory", fatal=False))
    with pytest.raises(AgentError, match="out of memory") as err:
        run(group.step(STEP))
    assert err.value.fatal            # rank 0 ran the step, rank 1 did not: the group is out of step


def test_a_single_agent_refusing_a_step_is_not_fatal():
    group, run = _step(AgentError("agent 0: ValueError: bad step", fatal=False))
    with pytest.raises(AgentError) as err:
        run(group.step(STEP))
    assert not err.value.fatal


def _failed(rank: int, why: str, calls=None) -> AgentError:
    return AgentError(f"agent {rank}: {why}", fatal=False, reply=proto.Failed(error=why, collective_calls=calls))


def test_ranks_that_made_the_same_collective_calls_are_in_step_whatever_else_failed():
    # rank 0 ran the model graph with its peer, then its own sampler or logits capture failed: the step's
    # requests fail, the group goes on
    group, run = _step(_failed(0, "OSError: capture dir gone", calls=7), _ok(calls=7))
    with pytest.raises(AgentError, match="capture dir gone") as err:
        run(group.step(STEP))
    assert not err.value.fatal
    # every rank refused the step before any graph: in step too
    group, run = _step(_failed(0, "ValueError: bad step", calls=3), _failed(1, "ValueError: bad step", calls=3))
    with pytest.raises(AgentError) as err:
        run(group.step(STEP))
    assert not err.value.fatal


def test_ranks_whose_collective_calls_differ_are_out_of_step():
    group, run = _step(_ok(calls=8), _failed(1, "RuntimeError: no memory", calls=7))
    with pytest.raises(AgentError, match="no memory") as err:
        run(group.step(STEP))
    assert err.value.fatal


def test_an_agent_is_started_with_a_copy_of_the_config_holding_the_lora_registrys_snapshot():
    """The master's registry (its snapshot when the agents start) decides which adapter each slot holds; the
    YAML's start-up adapters stay named, and the master's own config is never changed."""
    cfg = config_from_dict({"lora_config": {"adapters": {"a": "/a", "b": "/b"}, "max_loras": 3},
                            "serving_config": {"api_key": "k" * 12}, "model_config": {"max_generate_length": 512}})
    held = {2: ("late", "/late"), 3: ("a", "/a2")}
    group = AgentGroup(cfg, "unused", lora_snapshot=lambda: held)
    lora = group.agent_config()["lora_config"]
    assert lora["adapters"] == {"a": "/a2", "b": "/b", "late": "/late"} and lora["slots"] == {"late": 2, "a": 3}
    assert config_from_dict(group.agent_config()).lora_config.slot_of() == {"late": 2, "a": 3}   # as an agent reads it
    assert group.agent_config()["serving_config"]["api_key"] is None
    assert (cfg.lora_config.adapters, cfg.lora_config.slots) == ({"a": "/a", "b": "/b"}, None)
    held.clear()                                         # every adapter unloaded since: the next start loads none
    assert config_from_dict(group.agent_config()).lora_config.slot_of() == {}
    # without a registry (the draft model's agent), the config's own start-up slots
    assert AgentGroup(cfg, "unused").agent_config()["lora_config"]["slots"] == {"a": 1, "b": 2}
