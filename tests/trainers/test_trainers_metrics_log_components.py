"""metrics.jsonl and TensorBoard series of reward components: a component a step's episodes did
not earn is 0.0 in that step's record, not absent, once the run has seen it (per kind of record),
and a resumed run keeps the components of the records it keeps."""

from __future__ import annotations

from toolgym.trainers.metrics_log import LoggingConfig, MetricsLog, read_metrics


def _log(tmp_path) -> MetricsLog:
    return MetricsLog(LoggingConfig(console=False), tmp_path / "metrics.jsonl", tmp_path / "tb")


def test_every_record_has_every_reward_component_its_kind_reported(tmp_path):
    log = _log(tmp_path)
    log.log("train", 1, {"rollout/reward_mean": 0.5, "rollout/reward/correct": 0.5})
    log.log(
        "train", 2, {"rollout/reward_mean": 0.6, "rollout/reward/correct": 0.5, "rollout/reward/chain": 0.1}
    )
    log.log("eval", 2, {"eval/reward_mean": 0.4, "eval/reward/correct": 0.4})
    log.log("train", 3, {"rollout/reward_mean": 0.5, "rollout/reward/correct": 0.5, "train/loss": 0.25})
    log.log("eval", 4, {"eval/reward_mean": 0.2})
    log.close()
    records = [{k: v for k, v in r.items() if k != "time"} for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert records[3] == {
        "kind": "train", "step": 3, "rollout/reward_mean": 0.5, "rollout/reward/correct": 0.5,
        "train/loss": 0.25, "rollout/reward/chain": 0.0,
    }  # fmt: skip
    assert "rollout/reward/chain" not in records[0]  # not seen yet
    assert records[4] == {"kind": "eval", "step": 4, "eval/reward_mean": 0.2, "eval/reward/correct": 0.0}
    assert "eval/reward/chain" not in records[4] and "rollout/reward/chain" not in records[2]

    resumed = _log(tmp_path)  # a resumed run: the components of the records it keeps
    resumed.log("train", 4, {"rollout/reward_mean": 0.5, "rollout/reward/correct": 0.5})
    resumed.close()
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert last["rollout/reward/chain"] == 0.0 and last["step"] == 4
