"""A verifiers taskset for the tests: name a number's digit sum. Two weighted rewards (verifiers'
reward is their weighted sum) and a metric, so the tests see named parts come back."""

import verifiers.v1 as vf


class DigitsData(vf.TaskData):
    answer: str


class DigitsTask(vf.Task[DigitsData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply) < 40)

    @vf.metric
    async def reply_chars(self, task, trace) -> float:
        return float(len(trace.last_reply))


class DigitsTaskset(vf.Taskset[DigitsTask, vf.TasksetConfig]):
    def load(self):
        for n in range(100, 120):
            data = DigitsData(prompt=f"What is the digit sum of {n}?", answer=str(sum(map(int, str(n)))))
            yield DigitsTask(data, self.config.task)


__all__ = ["DigitsTaskset"]
