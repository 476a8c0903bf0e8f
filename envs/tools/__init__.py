"""Tools: typed Python functions with a JSON Schema each (typed.py), the tool-call formats the
policy writes them in (call_formats.py, one module each in formats/: the bracket grammar
`NAME[arg]` and each model family's own dialect), and
tools from an MCP server (mcp.py), and the code sandbox's `python(code)` tool (sandbox.py, with
the zygote it runs in, sandbox_zygote.py). The public names are re-exported by toolgym.envs.
"""
