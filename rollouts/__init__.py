"""toolgym.rollouts: where envs (strings) and agents (tokens) meet.

Modules (import them directly; this package imports nothing so that `toolgym.rollouts.types`
stays cheap for the trainers):
- types: StopReason, Transition, Trajectory, Episode; PolicySampling (the policy's configured
  temperature/top_p/top_k, read by the runner and the trainer) and RolloutSettings (the
  env-independent `[rollout]` settings: group size, limits).
- context: the context policies (what of the conversation the model sees at its next turn).
- env_io: the runner's checked env calls (reset, step, abandon).
- scripted: OraclePolicy / OracleConfig (the env's oracle with imperfection knobs).
- episodes: Trajectory -> loss-masked Episode, the sequence-limit rule.
- batches: collecting a training batch: TaskSeedStream / eval_seeds (the seed scheme),
  BatchConfig, BatchAssembler (scored groups -> the kept Episodes and metrics, fed by
  collect_batch with DAPO dynamic sampling and by the async taker), roll_group / ScoredGroup,
  GroupRunner.
- evaluation: held-out greedy evaluation.
- metrics: per-episode and per-batch metrics.
Sub-packages:
- episode/: one episode, run: the episode loop (turns, settling, stop reasons, fault isolation)
  that the runner (RolloutRunner, its policy as the actor; EnvRolloutConfig) and replay (the
  recorded actions as the actor) both drive, the rendering of env replies, EpisodeContext.
- scoring/: the one scorer of advantages: GRPO / Dr. GRPO, DAPO overlong shaping, turn-level
  credit (per-turn returns, leave-one-out baselines, their bias and variance, the `credit/`
  metrics), a group's advantages, signal and fate (`score_group`, the over-stale rule).
- recording/: the JSONL recording format, replay (transcripts, verification, Episodes from a
  file), its JSON Schema, chat-messages JSONL export and import.
- endpoint/: the OpenAI-compatible endpoint, its token capture, and agent programs' rollouts.
The CLI commands over these are configs/cli/.
"""
