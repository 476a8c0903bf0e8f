"""toolgym.configs.cli: the `toolgym` command line, each command a thin function over library calls.

Modules (import them directly; this package imports nothing, so `toolgym --help` stays cheap):
- main: the argument parser and dispatch (`toolgym = toolgym.configs.cli.main:main`).
- parts: command-line settings -> parts (`load_renderer`, `load_policy`).
- rollout: `envs`, `record`, `eval` (a policy rolled out on envs).
- recordings: `replay`, `export`, `import` (commands over recordings).
- summary: the summary table and error text the commands above print.
- view: `view` over recordings or run directories; viewer/ is the page and its server.
- serve: `serve`, a checkpoint as the OpenAI-compatible endpoint (rollouts/endpoint/).
`train` and `plot` are configs/train.py and configs/plot.py. `python -m toolgym.configs.cli` is
`toolgym` (what torchrun launches on every rank).
"""
