"""Whether two runs logged the same metrics: every value of every metrics.jsonl record but the
timings, compared exactly (a refactor that moves code without rewriting it leaves none changed).

    python bench/compare_runs.py runs/a/metrics.jsonl runs/b/metrics.jsonl

Prints the first differences and "N rows, M values compared, K differ"; exits 1 if any differ.
"""

from __future__ import annotations

import sys

from toolgym.trainers.metrics_log import read_metrics

# keys that measure time or memory: they differ between any two runs
TIMING = ("time", "_s", "seconds", "per_s", "wall", "tok_s", "throughput", "peak_gib", "elapsed", "wait")


def rows(path: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in read_metrics(path)]


def main(argv: list[str]) -> int:
    a, b = rows(argv[0]), rows(argv[1])
    differ = 0 if len(a) == len(b) else 1
    if differ:
        print(f"row counts differ: {len(a)} != {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=False)):  # row counts may differ
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                differ += 1
                if differ <= 30:
                    print(f"row {i} ({x.get('kind')} step {x.get('step')}): {key}: {x.get(key)!r} != {y.get(key)!r}")
    print(f"{len(a)} rows, {sum(len(r) for r in a)} values compared, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
