"""toolgym.rollouts: where envs (strings) and agents (tokens) meet.

Modules (import them directly; this package imports nothing so that `toolgym.rollouts.types`
stays cheap for the trainers):
- types: StopReason, Transition, Trajectory, Episode, SamplingConfig (read by sampler and trainer).
- runner: RolloutSettings / RolloutConfig (the one declaration of the rollout settings),
  RolloutRunner (concurrent multi-turn episodes, limits, fault isolation).
- scripted: OraclePolicy / OracleConfig (the env's oracle with imperfection knobs).
- episodes: Trajectory -> loss-masked Episode, the sequence-limit rule.
- advantages: GRPO / Dr. GRPO group advantages, DAPO overlong shaping.
- sampling: TaskSeedStream / eval_seeds (the seed scheme), BatchConfig, collect_batch (DAPO
  dynamic sampling).
- recording / replay: JSONL recordings, transcripts, verification, Episodes from a file.
- evaluation: held-out greedy evaluation.
- metrics: per-episode and per-batch metrics. commands: what the CLI subcommands do.
"""
