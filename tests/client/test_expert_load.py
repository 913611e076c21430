"""Each MoE layer's expert load in the client: the window's figures, the public call, and a
real Hugging Face MoE model's routers counted as the model routed."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from gpumon.client import StepMonitor
from gpumon.client.watchers.expert_window import ExpertWindow, summarise
from gpumon.client.watchers.moe import layer_names

from .conftest import Receiver


def _figures(counts: list[int]) -> tuple[float, float, int]:
    """The busiest expert over the mean, the CV, the dead experts: by the definitions."""
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    return max(counts) / mean, std / mean, counts.count(0)


def test_summary_of_one_layer() -> None:
    experts, tokens, ratio, cv, dead = summarise([30, 10, 0, 0])
    assert (experts, tokens, dead) == (4, 40, 2)
    assert ratio == pytest.approx(3.0)
    assert cv == pytest.approx(_figures([30, 10, 0, 0])[1], abs=1e-6)
    assert summarise([5, 5, 5, 5])[2:] == [1.0, 0.0, 0]
    assert summarise([0, 0, 0]) is None  # nothing routed: nothing to say


def test_the_window_covers_the_last_steps_only() -> None:
    rng = random.Random(3)
    window = ExpertWindow(steps=5)
    history: list[list[int]] = []
    for step in range(12):
        counts = [rng.randrange(0, 20) for _ in range(6)]
        counts[step % 6] += 1  # never a step of no token
        history.append(counts)
        wire = window.add({"0": counts})
        expected = [sum(column) for column in zip(*history[-5:], strict=True)]
        experts, tokens, ratio, cv, dead = wire["layers"]["0"]
        assert wire["window"] == min(step + 1, 5)
        assert tokens == sum(expected)
        assert (ratio, cv, dead) == pytest.approx(_figures(expected), abs=1e-6)


def test_an_expert_idle_for_the_whole_window_is_dead_and_revives() -> None:
    window = ExpertWindow(steps=3)
    for _ in range(3):
        wire = window.add({"a": [4, 4, 0]})
    assert wire["layers"]["a"][4] == 1
    wire = window.add({"a": [4, 4, 1]})
    assert wire["layers"]["a"][4] == 0


def test_a_layer_missing_from_a_step_counts_nothing_there() -> None:
    window = ExpertWindow(steps=2)
    window.add({"a": [1, 1], "b": [2, 0]})
    wire = window.add({"a": [1, 1]})
    assert wire["layers"]["b"][:2] == [2, 2]
    wire = window.add({"a": [1, 1]})
    assert "b" not in wire["layers"]  # none of its tokens left in the window


def test_a_layer_whose_experts_change_is_refused_not_mixed() -> None:
    window = ExpertWindow()
    window.add({"a": [1, 2]})
    wire = window.add({"a": [1, 2, 3]})
    assert wire["layers"]["a"][:2] == [2, 3]
    assert window.refused == 1


def test_layer_names() -> None:
    assert layer_names(["model.layers.0.mlp.experts", "model.layers.11.mlp.experts"]) == ["0", "11"]
    assert layer_names(["enc.layers.0.moe", "dec.layers.0.moe"]) == ["0", "1"]  # alike: positions
    assert layer_names(["moe"]) == ["0"]


def test_expert_load_sends_each_layers_window(receiver: Receiver, socket_path: Path) -> None:
    with StepMonitor(run="moe-api", socket_path=str(socket_path), rank=0, world=1) as mon:
        for step in range(4):
            with mon.step():
                mon.expert_load(0, [10, 0, 5, 5])
                mon.expert_load(0, [0, 0, 5, 5])  # a second forward in the step adds up
                mon.expert_load("router.b", [step + 1, 1])
    steps = receiver.wait_for_steps(4)
    last = {load.layer: load for load in steps[-1].moe.layers}
    # The first call attaches the watch inside step 0, whose end it does not see: step 0's
    # counts travel with step 1's, none lost.
    assert steps[0].moe is None and steps[-1].moe.window == 3
    assert last["0"].tokens == 120 and last["0"].dead == 1
    assert last["0"].max_ratio == pytest.approx(40 / 30)
    assert last["router.b"].max_ratio == pytest.approx(10 / 7)


def test_bad_input_is_said_and_loses_nothing_else(receiver: Receiver, socket_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with StepMonitor(run="moe-bad", socket_path=str(socket_path), rank=0, world=1) as mon:
        with mon.step():
            pass
        mon.expert_load(4, [0, 0])  # attaches the watch between steps; counts nothing
        with mon.step():
            mon.expert_load("bad layer", [1, 2])
            mon.expert_load(1, [[1, 2], [3, 4]])
            mon.expert_load(2, [1, -2])
            mon.expert_load(3, "not counts")
            mon.expert_load(4, [3, 1])
    steps = receiver.wait_for_steps(2)
    assert [load.layer for load in steps[1].moe.layers] == ["4"]
    assert mon.stats.extension_errors == 0
    said = caplog.text
    assert "'bad layer'" in said and "1-D" in said and "negative" in said


def test_a_hugging_face_moe_is_counted_as_it_routed(receiver: Receiver, socket_path: Path) -> None:
    """A tiny Mixtral, watched: each layer's counts are those of the router's own top-k over
    the router logits the model returns."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    totals = [[0] * 6 for _ in range(2)]
    with StepMonitor(run="moe-hf", socket_path=str(socket_path), rank=0, world=1) as mon:
        mon.watch(model)
        for _ in range(3):
            with mon.step():
                ids = torch.randint(0, 64, (2, 12))
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()
                for layer, logits in enumerate(out.router_logits):
                    chosen = torch.topk(torch.softmax(logits.float(), -1), 2).indices
                    for index, count in enumerate(torch.bincount(chosen.flatten(), minlength=6).tolist()):
                        totals[layer][index] += count
        with torch.no_grad(), mon.step():
            model(input_ids=ids)  # evaluation: not counted
    steps = receiver.wait_for_steps(4)
    assert steps[-1].moe is None
    loads = {load.layer: load for load in steps[2].moe.layers}
    assert sorted(loads) == ["0", "1"]
    for layer, counts in enumerate(totals):
        load = loads[str(layer)]
        assert load.tokens == sum(counts) == 3 * 24 * 2
        assert (load.max_ratio, load.cv, load.dead) == pytest.approx(_figures(counts), abs=1e-6)
