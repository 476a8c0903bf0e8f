"""toolgym.configs.cli: the `toolgym` command line, each command a thin function over library calls;
settings become parts in configs/assembly/ (the one builder), for these commands and `train` alike.

Modules (import them directly; this package imports nothing, so `toolgym --help` stays cheap):
- main: the argument parser and dispatch (`toolgym = toolgym.configs.cli.main:main`).
- rollout: `envs`, `record`, `eval` (a policy rolled out on envs).
- recordings: `replay`, `export`, `import` (commands over recordings).
- summary: the summary table and error text the commands above print.
- view: `view` over recordings or run directories; viewer/ is the page and its server.
- serve: `serve`, a checkpoint as the OpenAI-compatible endpoint (rollouts/endpoint/).
- train: `train`, one config in, one run directory out (SFT, the RL loop, export, plots).
`plot` is trainers/plots.py's plot_run. `python -m toolgym.configs.cli` is
`toolgym` (what torchrun launches on every rank).
"""
