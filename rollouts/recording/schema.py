"""The JSON Schema of a recording's lines, generated from the msgspec Structs that write them.

`trace_schema()` is the schema of recording schema version `SCHEMA_VERSION` (rollouts/recording/format.py):
line 1 is a `RecordingHeader`, every other line a `RecordLine` (a `Trajectory` object with its
last key `crc32`). It is msgspec's schema of the Structs with what the writer adds on top: the
per-line checksums, the text "nan" / "inf" / "-inf" that stands for a non-finite float in the
reward and logprob fields (JSON has no NaN), and the shape of the header's `extra["scoring"]`
(a `ScoringEntry`: how the run scored its episodes). The Structs' docstrings are left out (the spec's
prose is docs/trace-format.md), so the schema changes only when a field does.

The checked-in copy is docs/trace-format.v<version>.schema.json; a test keeps it equal to this.
Regenerate it with `python -m toolgym.rollouts.recording.schema docs/`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from ..types import Trajectory
from .format import FORMAT_NAME, READABLE_VERSIONS, SCHEMA_VERSION, SCORING, RecordingHeader, ScoringEntry

_NON_FINITE = {"enum": ["nan", "inf", "-inf"]}
_CRC = {"type": "string", "pattern": "^[0-9a-f]{8}$"}


def schema_filename(version: int = SCHEMA_VERSION) -> str:
    return f"trace-format.v{version}.schema.json"


def _number_or_text(schema: dict[str, Any]) -> dict[str, Any]:
    """A float field's schema that also takes the writer's text for a non-finite value."""
    out = {"anyOf": [{"type": "number"}, _NON_FINITE]}
    if "default" in schema:
        out["default"] = schema["default"]
    return out


def trace_schema() -> dict[str, Any]:
    """The schema (a dict, JSON Schema draft 2020-12); see the module doc."""
    _, defs = msgspec.json.schema_components(
        [RecordingHeader, Trajectory, ScoringEntry], ref_template="#/$defs/{name}"
    )
    for definition in defs.values():
        definition.pop("description", None)
    trajectory = defs["Trajectory"]["properties"]
    trajectory["total_reward"] = _number_or_text(trajectory["total_reward"])
    trajectory["reward_components"]["additionalProperties"] = _number_or_text({})
    transition = defs["Transition"]["properties"]
    transition["reward"] = _number_or_text(transition["reward"])
    defs["Completion"]["properties"]["logprobs"]["items"] = _number_or_text({})
    header = defs["RecordingHeader"]["properties"]
    header["format"] = {"const": FORMAT_NAME}
    header["extra"]["properties"] = {SCORING: {"$ref": "#/$defs/ScoringEntry"}}
    header["schema_version"] = {"enum": list(READABLE_VERSIONS)}
    header["checksum"] = {
        "anyOf": [_CRC, {"const": ""}],
        "default": "",
        "description": "version 2: crc32 (hex) of the header line with this value as 00000000; "
        "version 1: empty",
    }
    defs["RecordingHeader"]["required"] = sorted({*defs["RecordingHeader"]["required"], "format", "schema_version"})
    defs["RecordLine"] = {
        "title": "RecordLine",
        "description": "A record line: a Trajectory object whose last key is crc32, the crc32 (hex) of "
        "the line's bytes without that key (version 2; a version-1 line has no crc32).",
        "allOf": [{"$ref": "#/$defs/Trajectory"}],
        "properties": {"crc32": _CRC},
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://toolgym.invalid/schemas/{schema_filename()}",
        "title": f"toolgym recording (JSON Lines), schema version {SCHEMA_VERSION}",
        "description": "Each line of a recording is one JSON object: line 1 is a RecordingHeader, every "
        "other line a RecordLine. See docs/trace-format.md.",
        "anyOf": [{"$ref": "#/$defs/RecordingHeader"}, {"$ref": "#/$defs/RecordLine"}],
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    return json.dumps(trace_schema(), indent=2, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`python -m toolgym.rollouts.recording.schema FOLDER`: write the schema file into FOLDER."""
    args = sys.argv[1:] if argv is None else argv
    folder = Path(args[0]) if args else Path("docs")
    path = folder / schema_filename()
    path.write_text(schema_text())
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
