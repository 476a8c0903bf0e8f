"""Tools: typed Python functions with a JSON Schema each (typed.py), the tool-call formats the
policy writes them in (call_formats.py: the bracket grammar `NAME[arg]` and JSON calls), and
tools from an MCP server (mcp.py). The public names are re-exported by toolgym.envs.
"""
