"""The tool-call formats, one module each (envs/tools/call_formats.py registers them by name):
`base` (what they share), `brackets`, `harmony`, `hermes` ("json"), `llama` ("llama3_json"), `mistral`,
`pythonic`, `qwen_xml` ("qwen3_coder")."""
