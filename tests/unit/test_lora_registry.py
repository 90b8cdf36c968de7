"""The master's LoRA registry (master/lora_registry.py): slots for adapters, prefix-cache roots per load, which
slot a waiting request's adapter is loaded into (free, else least recently named and not running), unload rules
and the snapshot agents start from. Pure Python: no engine, no agents."""
from __future__ import annotations

import pytest

from llm_serving.master.lora_registry import LoraConflictError, LoraRefusedError, LoraRegistry

PATHS = {"a": "/lora/a", "b": "/lora/b", "c": "/lora/c", "d": "/lora/d"}


def _registry(slots=None, max_loras=2) -> LoraRegistry:
    """Adapters a..d served; a and b in slots 1 and 2 (the start-up loads)."""
    return LoraRegistry(PATHS, {"a": 1, "b": 2} if slots is None else slots, max_loras)


def test_a_request_gets_its_adapters_slot_and_root_or_waits_for_a_load():
    reg = _registry()
    assert (reg.place("a"), reg.place("b")) == ((1, 1), (2, 2))       # start-up loads: root = slot
    assert not reg.wants_loads
    assert reg.place("c") == (-1, 0) and reg.wants_loads               # in no slot: loaded before admitted
    with pytest.raises(KeyError, match="'zz' is not served here"):
        reg.place("zz")


def test_a_free_slot_is_taken_before_any_adapter_is_evicted():
    reg = _registry(slots={"a": 1}, max_loras=3)
    plan = reg.plan(["c", "c", "d"], running=set())
    assert plan.loads == [("c", 2, "/lora/c"), ("d", 3, "/lora/d")] and plan.evicted == [] and not plan.blocked
    assert reg.free_slot() is None                                     # both reserved while they load
    assert reg.slots == {"a": 1}
    assert (reg.loaded("c", 2), reg.loaded("d", 3)) == (4, 5)          # roots after 1..max_loras
    assert reg.slots == {"a": 1, "c": 2, "d": 3} and reg.place("d") == (3, 5)


def test_the_adapter_named_longest_ago_and_not_running_leaves_its_slot():
    reg = _registry()
    for name in ("b", "a", "c"):                                       # b named longest ago
        reg.place(name)
    plan = reg.plan(["c"], running=set())
    assert plan.evicted == [("b", 2)] and plan.loads == [("c", 2, "/lora/c")]
    assert reg.slots == {"a": 1} and "b" not in reg.roots
    assert reg.wants_loads                                             # b's waiting requests need it back
    reg.loaded("c", 2)
    assert reg.place("b") == (-1, 0)


def test_a_busy_adapter_is_never_evicted():
    reg = _registry()
    reg.place("b")
    reg.place("a")
    plan = reg.plan(["c"], running={"b"})                              # b runs: a goes though named later
    assert plan.evicted == [("a", 1)] and plan.loads == [("c", 1, "/lora/c")]
    reg.loaded("c", 1)
    plan = reg.plan(["d"], running={"b", "c"})                         # every slot serves running requests
    assert plan.blocked and plan.loads == [] and plan.evicted == [] and reg.wants_loads
    assert reg.slots == {"b": 2, "c": 1}


def test_a_plan_never_evicts_what_it_loads_nor_an_adapter_being_loaded():
    reg = _registry()
    reg.place("a")
    reg.place("b")
    plan = reg.plan(["c", "d"], running=set())                         # two loads, two victims, oldest first
    assert plan.evicted == [("a", 1), ("b", 2)]
    assert plan.loads == [("c", 1, "/lora/c"), ("d", 2, "/lora/d")]
    again = reg.plan(["c", "d", "a"], running=set())                   # c, d still loading: only a is left
    assert again.loads == [] and again.evicted == [] and again.blocked
    reg.loaded("c", 1)
    reg.load_failed(2)                                                 # d's load failed: its slot is free
    plan = reg.plan(["a"], running=set())
    assert plan.loads == [("a", 2, "/lora/a")] and plan.evicted == []


def test_an_adapter_already_in_a_slot_is_placed_not_loaded():
    reg = _registry()
    plan = reg.plan(["b"], running=set())
    assert plan.placed == ["b"] and plan.loads == [] and not reg.wants_loads


def test_each_load_has_a_prefix_cache_root_of_its_own():
    reg = _registry(max_loras=2)
    reg.place("a")
    reg.place("b")
    roots = [reg.roots["a"], reg.roots["b"]]
    for name in ("c", "a", "b", "c"):                                  # the same adapters in and out of slots
        plan = reg.plan([name], running=set())
        ((_, slot, _),) = plan.loads
        roots.append(reg.loaded(name, slot))
        reg.place(name)
    assert roots == [1, 2, 3, 4, 5, 6]
    assert reg.slots == {"b": 1, "c": 2} and reg.roots == {"b": 5, "c": 6}


def test_an_adapter_is_unloaded_only_with_no_request_in_flight():
    reg = _registry()
    reg.place("a")
    reg.hold("a")
    reg.hold("a")
    with pytest.raises(LoraConflictError, match=r"2 request\(s\) in flight use adapter 'a'"):
        reg.remove("a")
    reg.release("a")
    assert reg.in_flight("a") == 1
    reg.release("a")
    assert reg.remove("a") == 1 and "a" not in reg and reg.free_slot() == 1
    assert reg.remove("c") is None                                     # served, in no slot
    with pytest.raises(KeyError):
        reg.remove("a")


def test_an_adapter_unloaded_while_it_loads_leaves_its_slot_free():
    reg = _registry(slots={"a": 1})
    plan = reg.plan(["c"], running=set())
    assert plan.loads == [("c", 2, "/lora/c")] and reg.taken("c")
    reg.remove("c")                                                    # its waiting requests were aborted
    assert reg.loaded("c", 2) is None and reg.slots == {"a": 1} and reg.free_slot() == 2


def test_a_name_being_loaded_is_taken():
    reg = _registry()
    assert not reg.taken("new")
    reg.begin_load("new", 3)
    assert reg.taken("new") and reg.taken("a")
    reg.add("new", "/lora/new")
    assert reg.loaded("new", 3) == 3 and reg.slots["new"] == 3


def test_the_snapshot_names_each_slots_adapter_and_path():
    reg = _registry(slots={"b": 2, "a": 1}, max_loras=3)
    assert reg.snapshot() == {1: ("a", "/lora/a"), 2: ("b", "/lora/b")}
    plan = reg.plan(["d"], running=set())
    assert reg.snapshot() == {1: ("a", "/lora/a"), 2: ("b", "/lora/b")}    # not until it is loaded
    reg.loaded("d", plan.loads[0][1])
    reg.remove("a")
    assert reg.snapshot() == {2: ("b", "/lora/b"), 3: ("d", "/lora/d")}


def test_a_new_adapters_name_is_a_url_segment_not_taken():
    reg = _registry()
    reg.check_new("sql-v2.1_x", model_name="base")
    with pytest.raises(LoraRefusedError, match="an adapter name is 1-128 letters"):
        reg.check_new("a/b", model_name="base")
    with pytest.raises(LoraRefusedError, match="lora_name 7"):
        reg.check_new(7, model_name="base")
    for taken in ("base", "c"):                                        # the served model's; an adapter in no slot
        with pytest.raises(LoraConflictError, match=f"the name '{taken}' is already served"):
            reg.check_new(taken, model_name="base")
    reg.begin_load("new", 3)
    with pytest.raises(LoraConflictError):                             # being loaded under that name
        reg.check_new("new", model_name="base")
