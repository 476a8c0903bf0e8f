"""toolgym.rollouts.traces: the recording as a published trace format, and the tools around it.

Modules (import them directly):
- schema: the JSON Schema of a recording's lines, generated from the msgspec Structs
  (docs/trace-format.md; the checked-in copy is docs/trace-format.v<schema version>.schema.json).
- chat_jsonl: export to OpenAI chat-messages JSONL (tools, tool_calls) and import of such a file
  as SFT demonstrations (tokenized with the renderer; marked not token-exact).
- index: a recording read tolerantly into a light per-episode index (filters, sorting, pages,
  comparison by task seed) and one episode's per-token view, for the viewer.
- server: `toolgym view`: a local web page (stdlib HTTP server; the page's scripts ship in
  `static/`, nothing is fetched from elsewhere).
"""
