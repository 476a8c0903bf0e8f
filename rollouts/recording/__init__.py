"""toolgym.rollouts.recording: the recording, a published trace format, and what reads it.

Modules (import them directly):
- format: append-only JSONL recordings of Trajectories (header, checksums, torn and damaged
  lines), the writer and the readers.
- replay: transcripts, summaries, `--verify` (re-running a recording's actions), and Episodes
  from a recording to train on.
- schema: the JSON Schema of a recording's lines, generated from the msgspec Structs
  (docs/trace-format.md; the checked-in copy is docs/trace-format.v<schema version>.schema.json).
- chat_jsonl: export to OpenAI chat-messages JSONL (tools, tool_calls) and import of such a file
  as SFT demonstrations (tokenized with the renderer; marked not token-exact).
The viewer (`toolgym view`) is configs/cli/viewer/.
"""
