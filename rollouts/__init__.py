"""toolgym.rollouts: where envs (strings) and agents (tokens) meet.

Modules (import them directly; this package imports nothing so that `toolgym.rollouts.types`
stays cheap for the trainers):
- types: StopReason, Transition, Trajectory, Episode; PolicySampling (the policy's configured
  temperature/top_p/top_k, read by the runner and the trainer) and RolloutSettings (the
  env-independent `[rollout]` settings: group size, limits).
- runner: EnvRolloutConfig (RolloutSettings bound to one env, the sampling and a seed),
  RolloutRunner (concurrent multi-turn episodes, limits, fault isolation).
- env_io: the runner's checked env calls (reset, step, abandon).
- scripted: OraclePolicy / OracleConfig (the env's oracle with imperfection knobs).
- episodes: Trajectory -> loss-masked Episode, the sequence-limit rule.
- advantages: GRPO / Dr. GRPO group advantages, DAPO overlong shaping, the credit choice.
- credit: per-turn rewards and returns-to-go, turn-level advantages (leave-one-out per turn
  index), their bias and variance, the `credit/` metrics.
- batches: collecting a training batch: TaskSeedStream / eval_seeds (the seed scheme),
  BatchConfig, collect_batch (DAPO dynamic sampling), GroupRunner / score_group.
- evaluation: held-out greedy evaluation.
- metrics: per-episode and per-batch metrics.
Sub-packages:
- recording/: the JSONL recording format, replay (transcripts, verification, Episodes from a
  file), its JSON Schema, chat-messages JSONL export and import.
- endpoint/: the OpenAI-compatible endpoint, its token capture, and agent programs' rollouts.
The CLI commands over these are configs/cli/.
"""
