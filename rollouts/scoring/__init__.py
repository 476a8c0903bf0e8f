"""toolgym.rollouts.scoring: the one place where rewards become advantages.

Modules (import them directly):
- advantages: the estimators (GRPO, Dr. GRPO), DAPO overlong shaping, `AdvantageConfig` (the
  estimator and the credit choice).
- credit: per-turn rewards and returns-to-go, turn-level advantages (leave-one-out per turn index
  or per state), their bias and variance, the `credit/` metrics.
- scorer: `score_group` (a group's advantages and whether it carries signal), the group's members
  (`trainable`) and fate in a batch (`group_fate`, the over-stale rule `OverStale`), and
  `score_recorded` (recorded groups, for replay and the viewer).
- distill: on-policy distillation's `DistillConfig` ([distill]) and per-token advantage (the
  teacher's log-ratio on each sampled token), the `distill/` metrics.
- teacher: the checkpoint teacher that scores a group's sampled tokens (`Teacher`), and what
  every teacher shares (`GroupTeacher`, `position_logprobs`).
- endpoint_teacher: the endpoint teacher, an OpenAI-compatible server's `prompt_logprobs`
  (`EndpointTeacher`).
The sync collector and the async taker feed scored groups to one assembler (rollouts/batches.py
`BatchAssembler`); trainers receive finished advantages.
"""
