"""The warmup plan's order and staging (models/warmup.py), with entries that only name the graphs they call."""
from __future__ import annotations

import json

import pytest

from llm_serving.models.warmup import RECORD, Entry, WarmupPlan


class Graphs:
    """Stands in for the runner: each entry 'calls' graphs by name through the plan, as RunnerGraphs.call does."""

    def __init__(self):
        self.plan = None
        self.ran = []

    def entry(self, label: str, names: list, first: bool = False) -> Entry:
        def run():
            self.ran.append(label)
            for name in names:
                self.plan.before_call(name)
        return Entry(label, run, first)

    def make(self, cache_dir, labels=None) -> WarmupPlan:
        spec = [("run B=1", [("decode_run", (1, 8))], True), ("decode B=1", [("model", (1, 1)), ("plain", (1,))], True),
                ("prefill T=32", [("packed", (32, 4)), ("plain", (4,))], True),
                ("decode B=4", [("model", (4, 1)), ("plain", (4,))], False),
                ("prefill T=64", [("packed", (64, 4)), ("plain", (4,))], False),
                ("verify T=5", [("packed", (5, 5)), ("plain", (5,))], False)]
        if labels is not None:
            spec = [(label, names, first) for (_, names, first), label in zip(spec, labels)]
        self.plan = WarmupPlan([self.entry(*e) for e in spec], str(cache_dir))
        return self.plan


def test_without_a_record_the_whole_plan_runs_at_start_and_is_recorded(tmp_path):
    g = Graphs()
    plan = g.make(tmp_path)
    plan.run(staged=False)
    assert not plan.pending and len(g.ran) == 6
    record = json.loads((tmp_path / RECORD).read_text())
    assert record["labels"] == g.ran
    # each entry's names, "plain" (4,) under both prefill entries and decode B=4: every entry that called it
    assert record["calls"][3] == [["model", [4, 1]], ["plain", [4]]]
    assert record["calls"][2] == [["packed", [32, 4]], ["plain", [4]]]


def test_staged_without_a_record_a_graph_no_run_entry_called_runs_the_rest_first(tmp_path):
    """A first start (a cold cache, no record): the first entries before ready, as on a recorded cache; which
    pending entry calls a graph is not known, so a step about to call one that no entry run so far called runs all
    of the rest first, in order, and the plan is then recorded. A graph an entry already called waits for nothing."""
    g = Graphs()
    plan = g.make(tmp_path)
    assert plan.can_stage
    plan.run(staged=True)
    assert g.ran == ["run B=1", "decode B=1", "prefill T=32"] and plan.done == 3
    plan.before_call(("plain", (4,)))           # called by prefill T=32, run: nothing
    assert plan.done == 3 and not (tmp_path / RECORD).exists()
    plan.before_call(("model", (4, 1)))         # not called so far: the whole rest
    assert g.ran[3:] == ["decode B=4", "prefill T=64", "verify T=5"] and not plan.pending
    assert json.loads((tmp_path / RECORD).read_text())["labels"] == g.ran
    again = Graphs()
    again.make(tmp_path).run(staged=True)       # the next start reads the record: the first entries, as below
    assert again.ran == ["run B=1", "decode B=1", "prefill T=32"]


def test_staged_on_a_record_runs_the_first_entries_then_the_rest_in_order(tmp_path):
    g = Graphs()
    g.make(tmp_path).run(staged=False)
    g = Graphs()
    plan = g.make(tmp_path)
    assert plan.can_stage
    plan.run(staged=True)
    assert g.ran == ["run B=1", "decode B=1", "prefill T=32"] and plan.done == 3
    plan.before_call(("model", (1, 1)))         # an entry already run: nothing
    plan.before_call(("topk", (1,)))            # in no entry: nothing (it compiles outside the cache)
    plan.before_call(("model", (4, 1), ))       # entry 4 of 6: a step before its graph
    assert plan.done == 4 and g.ran[-1] == "decode B=4"
    plan.before_call(("packed", (5, 5)))        # entry 6: through 5 and 6, in order
    assert g.ran[3:] == ["decode B=4", "prefill T=64", "verify T=5"] and not plan.pending
    assert not plan.warm_next()


def test_a_name_is_run_by_the_first_entry_that_calls_it(tmp_path):
    g = Graphs()
    g.make(tmp_path).run(staged=False)
    g = Graphs()
    plan = g.make(tmp_path)
    plan.run(staged=True)
    plan.before_call(("plain", (4,)))           # first called by prefill T=32, already run
    assert plan.done == 3
    assert plan.warm_next() and plan.done == 4 and g.ran[-1] == "decode B=4"
    while plan.warm_next():
        pass
    assert g.ran[4:] == ["prefill T=64", "verify T=5"]


def test_a_record_of_other_entries_or_an_unreadable_one_stages_nothing(tmp_path):
    g = Graphs()
    g.make(tmp_path).run(staged=False)
    g = Graphs()
    plan = g.make(tmp_path, labels=["a", "b", "c", "d", "e", "f"])
    assert not plan.can_stage
    plan.run(staged=True)
    assert len(g.ran) == 6
    (tmp_path / RECORD).write_text("{not json")
    assert not Graphs().make(tmp_path).can_stage


def test_the_first_entries_must_lead_and_a_failed_entry_ends_the_plan(tmp_path):
    with pytest.raises(ValueError, match="first"):
        WarmupPlan([Entry("a", lambda: None), Entry("b", lambda: None, first=True)], None)
    g = Graphs()
    g.make(tmp_path).run(staged=False)

    def broken():
        raise RuntimeError("compile failed")
    plan = WarmupPlan([Entry("run B=1", lambda: None, True), Entry("decode B=1", lambda: None, True),
                       Entry("prefill T=32", lambda: None, True), Entry("decode B=4", broken),
                       Entry("prefill T=64", lambda: None), Entry("verify T=5", lambda: None)], str(tmp_path))
    plan.run(staged=True)
    with pytest.raises(RuntimeError, match="compile failed"):
        plan.warm_next()
    assert plan.pending and plan.done == 3         # the runner then abandons it: nothing more runs
    plan.abandon()
    assert not plan.pending and not plan.warm_next()
