"""metrics.jsonl in: what `toolgym plot`, `--resume` and the end-of-run summary read back."""

from __future__ import annotations

import json

import pytest

from toolgym.trainers.metrics_log import MetricsWarning, read_metrics, truncate_metrics

GOOD = [
    {"kind": "sft", "step": 1, "sft/loss": 2.0},
    {"kind": "train", "step": 1, "rollout/reward_mean": 0.1},
    {"kind": "eval", "step": 2, "eval/accuracy": 0.5},
    {"kind": "train", "step": 2, "rollout/reward_mean": 0.2},
]


def write(path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_lines_that_are_not_records_are_skipped_with_one_warning_naming_them(tmp_path):
    path = tmp_path / "metrics.jsonl"
    bad = ["42", "[1, 2]", '{"kind": "train", "step": null}', '{"kind": "train"}', '"x"', '{"step": true}']
    lines = [json.dumps(GOOD[0]), *bad[:3], json.dumps(GOOD[1]), "{not json", *bad[3:]]
    lines += [json.dumps(r) for r in GOOD[2:]]
    write(path, lines)
    with pytest.warns(MetricsWarning) as caught:
        records = read_metrics(path)
    assert records == GOOD
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f'{path}: skipped lines 2, 3, 4, 6, 7, 8, 9: not a metrics record (a JSON object with an integer "step")'
    )


def test_a_torn_last_line_is_skipped_without_a_warning(tmp_path, recwarn):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD) + '{"kind": "tr')
    assert read_metrics(path) == GOOD
    assert not [w for w in recwarn if issubclass(w.category, MetricsWarning)]


def test_resume_truncation_survives_and_drops_lines_that_are_not_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, [json.dumps(GOOD[0]), "42", json.dumps(GOOD[1]), '{"step": null}', json.dumps(GOOD[3])])
    with pytest.warns(MetricsWarning, match="lines 2, 4"):
        truncate_metrics(path, last_step=1)
    assert read_metrics(path) == GOOD[:2]
