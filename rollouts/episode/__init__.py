"""One episode, run: its rules once, for the rollout runner and for replay.

Modules (import them directly; this package imports nothing):
- loop: the episode loop (make, reset, turns, settling, stop reasons, fault isolation) over an
  `Actor`, the side that acts; `run_grouped`, G episodes per task seed.
- runner: `RolloutRunner`, the loop with the policy as its actor (limits, sampling, rendering).
- recorded: `replay_episode`, the loop with a recording's actions (what `replay --verify` runs).
- config: `EnvRolloutConfig` (the rollout settings bound to one env) and the sampling seeds.
- rendering: the env's reset and replies as chat messages for the renderer.
- context: `EpisodeContext`, the conversation as tokens and as messages for a context policy.
- step_pool: the worker threads that step envs whose step waits.
"""
