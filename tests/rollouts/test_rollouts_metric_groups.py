"""Metric groups (info `metric_group`, envs/core/info.py): the batch summary reports each env
metric's mean over the episodes of each group, beside the batch-wide means."""

from toolgym.agents.types import Completion
from toolgym.rollouts.metrics import batch_metrics, episode_metrics
from toolgym.rollouts.types import StopReason, Trajectory, Transition


def episode(group, success, calls=None):
    metrics = {"success": success, **({"tool_calls": calls} if calls is not None else {})}
    info = {"metrics": metrics, **({"metric_group": group} if group is not None else {})}
    t = Trajectory(
        "e",
        {},
        0,
        0,
        [Transition("obs", [1], Completion([2], [0.0], "stop", "x"), info=info)],
        StopReason.ANSWERED,
    )
    t.metrics = episode_metrics(t, 0.0, 0.0)
    return t


def test_each_group_has_its_own_means_and_count():
    batch = [
        episode("base", 1.0, 2),
        episode("base", 0.0, 4),
        episode("miss_func", 1.0),
        episode(None, 0.0, 6),
    ]
    m = batch_metrics(batch, prefix="eval/")
    assert m["eval/success"] == 0.5 and m["eval/tool_calls"] == 3.0  # over all four episodes
    assert m["eval/by_group/base/episodes"] == 2.0 and m["eval/by_group/base/success"] == 0.5
    assert m["eval/by_group/base/tool_calls"] == 3.0
    assert m["eval/by_group/miss_func/episodes"] == 1.0 and m["eval/by_group/miss_func/success"] == 1.0
    assert m["eval/by_group/miss_func/tool_calls"] == 0.0  # never reported in the group: 0 there
    assert not [
        k for k in m if k.startswith("eval/by_group/") and k.split("/")[2] not in ("base", "miss_func")
    ]


def test_episodes_without_a_group_add_no_group_keys():
    t = episode(None, 1.0)
    assert "metric_group" not in t.metrics
    assert not [k for k in batch_metrics([t]) if "by_group" in k]
    assert episode("a/b", 1.0).metrics["metric_group"] == "a/b"
    assert not [k for k in batch_metrics([episode("a/b", 1.0)]) if "by_group" in k]  # not a usable group
