"""The agent program of tests/rollouts/endpoint/test_endpoint_verifiers.py: the test taskset
(vf_digits_taskset.py) through toolgym's verifiers adapter, wired as docs/environments.md shows."""

from toolgym.rollouts.endpoint.verifiers_program import VerifiersProgram

program = VerifiersProgram("vf_digits_taskset")
run_agent, task = program.run_agent, program.task

# verifiers' own `best-of-n` env over the same taskset: two attempts per episode.
best_of_n = VerifiersProgram("vf_digits_taskset", env_id="best-of-n", env_args={"n": 2})
run_best_of_n, best_of_n_task = best_of_n.run_agent, best_of_n.task
