"""The text-env base and the tool env: `TextEnv` and its encodable-text wrappers, `Task`,
`ToolEnv` and the pieces its step is made of (the reward ledger, the limits, the prompt and error
text), the info contract, the text spaces and the graders. The public names are re-exported by
toolgym.envs; this package re-exports nothing, so importing one module loads only what it needs.
"""
