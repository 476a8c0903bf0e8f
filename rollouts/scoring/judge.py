"""Rewards from a judge: rubric criteria that a model scores, each a named reward component.

A run's `[judge]` section (`JudgeConfig`) names an OpenAI-compatible endpoint (`toolgym serve` of
a checkpoint, a vLLM server, a provider's URL), its model, the NAME of the environment variable
that holds its API key (the config never holds the key), and criteria: each a name, a prompt
(what to judge) or a function (a programmatic check, "module:function", scored in-process with
no request), and a weight. At batch assembly, before the group's advantages are computed
(rollouts/batches.py `_score`, beside on-policy distillation's teacher), `Judge.annotate(group)`
asks the judge about every episode of the group that is not an infrastructure failure, and for
each criterion c and episode with score s in [0, 1]:

- the episode's `reward_components["judge_<c>"]` = weight x s (a component name holds no '/':
  it becomes the metric `rollout/reward/judge_<c>`), added to `total_reward` and to the last
  turn's reward (so the sum of the turns' rewards stays the episode's, and turn-level credit
  sees it);
- the last transition's `info["judge"][c]` = {"prompt", "answer", "score", "weight"} (in group
  mode also "order": the permutation shown to the judge, and "position": this episode's place
  in it), so the recording keeps what the judge saw and said.

What the judge sees of an episode is `transcript(trajectory)`: the system prompt, then each
turn's observation and action text, and the env's final reply, as plain text labelled by role.

Modes: "episode" asks once per episode per criterion, for a JSON object {"score": s} (or a
`<score>s</score>` tag); "group" (RULER-style ranking) asks once per group per criterion, with
the group's episodes in a random order (seeded by `seed`, the group id and the criterion, so
re-judging a group asks the same question), for {"scores": [s_1, ..., s_n]} in the order shown
(or n `<score>` tags); the permutation is recorded. Every score must be a number in [0, 1].

Requests: up to `max_concurrent` at once (a thread pool), each with `timeout_s`; a failure with
no answer or a retryable status (model_client.py) is asked again up to `retries` times, after
backoff_s, 2 backoff_s, ...; answers are cached by (url, model, the request's messages), in
memory and, with `cache_file`, in a JSONL file read at start, so judging the same prompt again
pays nothing (a cache hit), in this process or a later one. Per group `annotate`
returns the calls made, cache hits, seconds waited and the answers' usage tokens (`JudgeStats`),
which the batch metrics sum (`judge/...`).

Failures: a request that fails after its retries, times out, or answers something that does not
parse into valid scores makes the whole GROUP an infrastructure failure: `annotate` returns the
cause in one line, nothing is written into the group, and the batch drops it (counted in
`batch/groups_scoring_failed`), so it never becomes reward 0; `max_consecutive_failures` failures
in a row raise JudgeError with the cause, which stops the run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgspec

from ...envs.core.info import SUCCESS_METRIC
from ...envs.registry import import_env_modules
from ..episodes import INFRA_STOP_REASONS
from ..types import Trajectory
from .model_client import EndpointError, request_json

# Transition.info key (the last transition's): per criterion, the judge's prompt, answer and score.
JUDGE_INFO = "judge"
# Reward component name of criterion c.
COMPONENT_PREFIX = "judge_"
# Trajectory.metrics key, with reward = "replace": the env's reward components the judge replaced
REPLACED_REWARD = "replaced_reward"
PASS = 0.5  # a criterion's score at or above passes


def grader_label(trajectory: Trajectory) -> int | None:
    """The env's own verdict: its `success` metric as 1 or 0 (None: the env reported none)."""
    metrics = trajectory.metrics.get("env")
    value = metrics.get(SUCCESS_METRIC) if isinstance(metrics, dict) else None
    return None if not isinstance(value, int | float) else int(value > 0)


EPISODE_INSTRUCTIONS = (
    "You are a strict judge. Read the transcript of an assistant's episode and score it on the "
    "criterion below, from 0 (does not meet it at all) to 1 (fully meets it). Answer with a JSON "
    'object {"score": s}, s a number in [0, 1], and nothing else.'
)
GROUP_INSTRUCTIONS = (
    "You are a strict judge. Read the transcripts of {n} attempts at the same task and score each "
    "on the criterion below, from 0 (does not meet it at all) to 1 (fully meets it); compare them "
    'with each other. Answer with a JSON object {{"scores": [s_1, ..., s_{n}]}}, one number in '
    "[0, 1] per attempt in the order shown, and nothing else."
)


class JudgeError(RuntimeError):
    """The judge cannot be used (its endpoint, its key), or it failed `max_consecutive_failures`
    groups in a row; `str()` names the cause."""


class JudgeCriterion(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One rubric criterion (`[[judge.criteria]]`).

    name: the criterion's name, a Python identifier; its reward component is `judge_<name>`.
    prompt: what the judge scores, e.g. "The answer is correct and states its reasoning."
    function: instead of a prompt, a programmatic check "module:function" (importable from the
        current directory, as env.module), called with the Trajectory and returning its score in
        [0, 1]; no request is made for it, and what it returned is recorded as the judge's are.
    weight: the component is weight x the score in [0, 1]; any finite number (a negative weight
        makes a penalty).
    """

    name: str
    prompt: str = ""
    function: str = ""
    weight: float = 1.0


class JudgeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A config's `[judge]` section (module doc).

    url: the judge's OpenAI-compatible base URL, `http://host:port/v1`; "" = no judge.
    model: the request's `model`; "" = the one model the endpoint's /v1/models lists.
    api_key_env: the NAME of the environment variable holding the API key, sent as the bearer
        token (e.g. "OPENAI_API_KEY"); "" = no key. The key itself never goes in a config.
    mode: "episode" (one call per episode per criterion) or "group" (one call per group per
        criterion, every episode in a random order, one score each: RULER-style ranking).
    criteria: the rubric; each criterion becomes the reward component `judge_<name>`.
    max_concurrent: requests in flight at once.
    timeout_s: seconds a request may take before it counts as a failure.
    retries: how many times a request that got no answer, or a retryable status (429, 5xx), is
        sent again before the group counts as a failure.
    backoff_s: the wait before the first retry; it doubles at each further one.
    temperature: the judge's sampling temperature.
    max_tokens: the most tokens the judge may answer with.
    max_transcript_chars: an episode's transcript is cut to its last this many characters.
    final_reply: the env's reply after the last action is in the transcript (false: a judge that
        must not see the env's own verdict, e.g. Zorplex's CORRECT / INCORRECT).
    reward: "add" (the criteria's components added to the env's reward) or "replace" (they are the
        whole reward, on the last turn; the env's components kept in the trajectory's
        metrics["replaced_reward"], its own metrics such as `success` still logged): RL from the
        judge alone, with the env's grader as the ground truth it never trains on.
    max_consecutive_failures: groups in a row whose judging failed (each dropped as an
        infrastructure failure) before the run stops with the cause.
    seed: seeds group mode's orders (with the group id and the criterion).
    cache_file: a JSONL file the cache is kept in across processes ("" = in memory only): read
        at start, each new answer appended, so a resumed run or a `replay --rejudge` of the same
        judge pays nothing for a question asked before.
    """

    url: str = ""
    model: str = ""
    api_key_env: str = ""
    mode: Literal["episode", "group"] = "episode"
    criteria: list[JudgeCriterion] = msgspec.field(default_factory=list)
    max_concurrent: int = 8
    timeout_s: float = 60.0
    retries: int = 2
    backoff_s: float = 0.5
    temperature: float = 0.0
    max_tokens: int = 256
    max_transcript_chars: int = 20000
    final_reply: bool = True
    reward: Literal["add", "replace"] = "add"
    max_consecutive_failures: int = 5
    seed: int = 0
    cache_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.url)

    def __post_init__(self) -> None:
        if not self.url:
            return
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"judge.url must be an http:// or https:// URL, got {self.url!r}")
        if not self.criteria:
            raise ValueError("judge.criteria is empty: name at least one criterion to judge")
        names = [c.name for c in self.criteria]
        for c in self.criteria:
            if not c.name.isidentifier():
                raise ValueError(f"judge.criteria: name {c.name!r} is not an identifier")
            if bool(c.prompt.strip()) == bool(c.function):
                raise ValueError(
                    f"judge.criteria: criterion {c.name!r} needs a prompt (for the judge) or a function "
                    "(module:function, a programmatic check), not both or neither"
                )
            if c.function and (c.function.count(":") != 1 or not all(c.function.split(":"))):
                raise ValueError(
                    f"judge.criteria: criterion {c.name!r} function must be 'module:function', got {c.function!r}"
                )
            if not math.isfinite(c.weight):
                raise ValueError(
                    f"judge.criteria: criterion {c.name!r} weight must be finite, got {c.weight}"
                )
        duplicate = next((n for n in names if names.count(n) > 1), None)
        if duplicate is not None:
            raise ValueError(f"judge.criteria: criterion {duplicate!r} is named twice")
        if self.api_key_env and not self.api_key_env.isidentifier():
            raise ValueError(
                f"judge.api_key_env must name an environment variable (not hold the key), got a value "
                f"of {len(self.api_key_env)} characters that is not a variable name"
            )
        for name in ("max_concurrent", "max_tokens", "max_transcript_chars", "max_consecutive_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"judge.{name} must be >= 1, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"judge.retries must be >= 0, got {self.retries}")
        for name in ("timeout_s", "backoff_s", "temperature"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0) or (name == "timeout_s" and value == 0):
                raise ValueError(
                    f"judge.{name} must be a finite number {'>' if name == 'timeout_s' else '>='} 0, got {value}"
                )


class JudgeStats(msgspec.Struct):
    """One group's judging: requests sent (retries included), answers from the cache, seconds
    spent waiting for answers (summed over requests), the answers' usage tokens; and the
    verdicts: episodes judged, passed (every criterion scored >= 0.5), and among the passed ones
    whose env reported `success`, those the env failed (the judge was fooled)."""

    calls: int = 0
    cache_hits: int = 0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    judged: int = 0
    passed: int = 0
    passed_graded: int = 0
    passed_failed: int = 0

    def add(self, other: JudgeStats) -> None:
        for name in self.__struct_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        """judge/calls, cache_hits, latency_s, prompt_tokens, completion_tokens; pass_rate (of the
        episodes judged) and hacking_rate (the share of the passed episodes that the env's own
        grader failed; only where the env reports `success`)."""
        out = {
            "judge/calls": float(self.calls),
            "judge/cache_hits": float(self.cache_hits),
            "judge/latency_s": self.latency_s,
            "judge/prompt_tokens": float(self.prompt_tokens),
            "judge/completion_tokens": float(self.completion_tokens),
        }
        if self.judged:
            out["judge/pass_rate"] = self.passed / self.judged
        if self.passed_graded:
            out["judge/hacking_rate"] = self.passed_failed / self.passed_graded
        return out


def transcript(trajectory: Trajectory, max_chars: int = 20000, final_reply: bool = True) -> str:
    """The episode as plain text, each part labelled by its role (module doc); cut to its last
    `max_chars` characters. `final_reply`: the env's reply after the last action (often its own
    verdict) included."""
    parts = []
    if trajectory.system_prompt:
        parts.append(f"[system]\n{trajectory.system_prompt}")
    for k, transition in enumerate(trajectory.transitions):
        if transition.observation:
            parts.append(f"[{'user' if k == 0 else 'environment'}]\n{transition.observation}")
        parts.append(f"[assistant]\n{transition.action.text}")
    if trajectory.final_observation and final_reply:
        parts.append(f"[environment]\n{trajectory.final_observation}")
    text = "\n\n".join(parts)
    return text if len(text) <= max_chars else "[...]\n" + text[-max_chars:]


_SCORE_TAG = re.compile(r"<score>\s*(.*?)\s*</score>", re.DOTALL | re.IGNORECASE)


def episode_question(
    criterion: str, trajectory: Trajectory, max_chars: int = 20000, final_reply: bool = True
) -> list[dict[str, str]]:
    """Episode mode's request messages for one criterion (its prompt) and episode: what a judge
    is asked, and what a judge model is trained on (rollouts/scoring/judge_data.py)."""
    text = transcript(trajectory, max_chars, final_reply)
    return [
        {"role": "system", "content": EPISODE_INSTRUCTIONS},
        {"role": "user", "content": f"Criterion: {criterion}\n\nTranscript:\n{text}"},
    ]


def group_question(
    criterion: str, shown: Sequence[Trajectory], max_chars: int = 20000, final_reply: bool = True
) -> list[dict[str, str]]:
    """Group mode's request messages for one criterion (its prompt) and the group's episodes in
    the order shown: what a judge is asked, and what a ranking judge model is trained on
    (rollouts/scoring/judge_data.py)."""
    attempts = "\n\n".join(
        f"=== Attempt {k + 1} ===\n{transcript(t, max_chars, final_reply)}" for k, t in enumerate(shown)
    )
    return [
        {"role": "system", "content": GROUP_INSTRUCTIONS.format(n=len(shown))},
        {"role": "user", "content": f"Criterion: {criterion}\n\n{attempts}"},
    ]


def _load_check(spec: str) -> Callable[[Trajectory], Any]:
    """A criterion's programmatic check, "module:function", imported as env.module is (the
    current directory importable); JudgeError when it does not load."""
    module_name, _, attr = spec.partition(":")
    try:
        import_env_modules([module_name], where="module")
        check = getattr(importlib.import_module(module_name), attr)
    except ValueError as exc:  # import_env_modules' one line: the module and why
        raise JudgeError(f"judge criterion function {spec!r} does not load: {exc}") from None
    except AttributeError as exc:
        raise JudgeError(f"judge criterion function {spec!r} does not load: AttributeError: {exc}") from None
    if not callable(check):
        raise JudgeError(f"judge criterion function {spec!r} is not callable")
    return check


def _number(value: Any, what: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{what} {value!r:.40} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} {value!r:.40} is not a number")
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{what} {value!r} is outside [0, 1]")
    return float(value)


def _json_object(text: str) -> Any:
    """The JSON object in `text` (the whole text, or from its first '{' to its last '}', so code
    fences and a sentence around it are allowed); None when there is none."""
    for candidate in (text.strip(), text[text.find("{") : text.rfind("}") + 1]):
        try:
            found = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return None


def parse_scores(text: str, n: int | None) -> list[float]:
    """The scores in a judge's answer: n of them (n None: one, from {"score": s}); from a JSON
    object ({"score": s}, or {"scores": [...]} with n) or from `<score>` tags; ValueError naming
    what is wrong (none found, a wrong count, not a number, outside [0, 1])."""
    want = 1 if n is None else n
    found = _json_object(text)
    values: list[Any] | None = None
    if found is not None:
        if n is None and "score" in found:
            values = [found["score"]]
        elif n is not None and isinstance(found.get("scores"), list):
            values = found["scores"]
    if values is None:
        tags = _SCORE_TAG.findall(text)
        values = tags or None
    if values is None:
        shape = '{"score": s}' if n is None else '{"scores": [...]}'
        raise ValueError(f"the answer holds no {shape} and no <score> tag: {' '.join(text.split())[:120]!r}")
    if len(values) != want:
        raise ValueError(f"the answer holds {len(values)} scores for {want} episodes")
    return [_number(v, "score") for v in values]


class Judge:
    """The judge of a run (module doc). Building it checks the endpoint: its key's variable is
    set (when named) and it lists its models (the one to use, when `model` is "")."""

    def __init__(self, config: JudgeConfig) -> None:
        if not config.enabled:
            raise JudgeError("judge.url is empty: no judge")
        self.config, self.url = config, config.url.rstrip("/")
        self.api_key: str | None = None
        if config.api_key_env:
            self.api_key = os.environ.get(config.api_key_env)
            if not self.api_key:
                raise JudgeError(
                    f"judge.api_key_env names ${config.api_key_env}, which is not set: export the "
                    "judge's API key there"
                )
        self._checks = {c.name: _load_check(c.function) for c in config.criteria if c.function}
        asks = any(not c.function for c in config.criteria)
        self.model = config.model or (self._only_model() if asks else "")
        self._cache: dict[str, tuple[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._cache_file = Path(config.cache_file) if config.cache_file else None
        if self._cache_file is not None:
            self._load_cache(self._cache_file)
        self.consecutive_failures = 0
        self.failures = 0  # groups whose judging failed, over the run

    def describe(self) -> str:
        """One line for the run's log."""
        names = ", ".join(f"{c.name} x{c.weight:g}" for c in self.config.criteria)
        key = f"key from ${self.config.api_key_env}" if self.config.api_key_env else "no key"
        return f"judge: {self.url}, model {self.model}, {self.config.mode} mode ({key}); criteria: {names}"

    def _only_model(self) -> str:
        try:
            listed = request_json(self.url, "/models", timeout=self.config.timeout_s, api_key=self.api_key)
        except EndpointError as exc:
            raise JudgeError(f"judge.url {self.url}: cannot list its models: {exc}") from None
        data = listed.get("data") if isinstance(listed, dict) else None
        ids = [c["id"] for c in data or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        if len(ids) != 1:
            raise JudgeError(
                f"judge.url {self.url} lists {len(ids)} models ({', '.join(ids) or 'none'}): name one in judge.model"
            )
        return ids[0]

    # ---- one request --------------------------------------------------------------------------

    def _ask(self, messages: list[dict[str, str]], stats: JudgeStats) -> str:
        """The judge's answer to `messages` (from the cache when asked before); retries (module
        doc); EndpointError or ValueError when there is none."""
        key = self._key(messages)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                stats.cache_hits += 1
                return cached[0]
        body = {
            "model": self.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
        }
        attempt = 0
        while True:
            started = time.perf_counter()
            stats.calls += 1
            try:
                answer = request_json(
                    self.url, "/chat/completions", body, timeout=self.config.timeout_s, api_key=self.api_key
                )
            except EndpointError as exc:
                stats.latency_s += time.perf_counter() - started
                if not exc.retryable or attempt >= self.config.retries:
                    raise
                time.sleep(self.config.backoff_s * 2**attempt)
                attempt += 1
                continue
            stats.latency_s += time.perf_counter() - started
            break
        if not isinstance(answer, dict):
            answer = {}
        choices = answer.get("choices")
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        text = message.get("content") if isinstance(message, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{self.url}/chat/completions answered without choices[0].message.content")
        usage: dict[str, Any] = answer["usage"] if isinstance(answer.get("usage"), dict) else {}
        stats.prompt_tokens += int(usage.get("prompt_tokens") or 0)
        stats.completion_tokens += int(usage.get("completion_tokens") or 0)
        with self._lock:
            self._cache[key] = (text, usage)
            if self._cache_file is not None:
                line = json.dumps({"key": key, "text": text, "usage": usage}, ensure_ascii=False)
                with self._cache_file.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
        return text

    def _key(self, messages: list[dict[str, str]]) -> str:
        """The cache's key: the judge (url, model) and the request's messages, hashed."""
        raw = json.dumps([self.url, self.model, messages], ensure_ascii=False)
        return hashlib.sha256(raw.encode()).hexdigest()

    def _load_cache(self, path: Path) -> None:
        """The answers a cache file holds; a line that does not read (a torn last line) is skipped."""
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            return
        text = path.read_bytes()
        if text and not text.endswith(b"\n"):  # a torn last line: the next answer starts a line of its own
            with path.open("ab") as f:
                f.write(b"\n")
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    self._cache[str(entry["key"])] = (str(entry["text"]), dict(entry.get("usage") or {}))
                except (ValueError, KeyError, TypeError):
                    continue

    # ---- a group ------------------------------------------------------------------------------

    def _episode_question(self, criterion: JudgeCriterion, trajectory: Trajectory) -> list[dict[str, str]]:
        return episode_question(
            criterion.prompt, trajectory, self.config.max_transcript_chars, self.config.final_reply
        )

    def _group_question(self, criterion: JudgeCriterion, shown: Sequence[Trajectory]) -> list[dict[str, str]]:
        return group_question(
            criterion.prompt, shown, self.config.max_transcript_chars, self.config.final_reply
        )

    def order(self, group_id: int, criterion: str, n: int) -> list[int]:
        """Group mode's order for this group and criterion: order[k] is the index (in the group's
        judged episodes) of the k-th attempt shown."""
        order = list(range(n))
        random.Random(f"{self.config.seed}:{group_id}:{criterion}").shuffle(order)
        return order

    def judge(
        self, group: Sequence[Trajectory], stats: JudgeStats | None = None
    ) -> dict[int, dict[str, dict[str, Any]]]:
        """Judge the group without writing anything: per judged episode (its index in `group`),
        per criterion, {"prompt", "answer", "score", "weight"} (+ "order", "position" in group
        mode). Its requests are counted into `stats`, failed ones too. Raises the first failure."""
        judged = [i for i, t in enumerate(group) if t.transitions and t.stop_reason not in INFRA_STOP_REASONS]
        stats = JudgeStats() if stats is None else stats
        results: dict[int, dict[str, dict[str, Any]]] = {i: {} for i in judged}
        if not judged:
            return results
        jobs: list[tuple[JudgeCriterion, list[int], list[dict[str, str]]]] = []
        for criterion in self.config.criteria:
            if criterion.function:  # a programmatic check: no request
                for i in judged:
                    score = _number(self._checks[criterion.name](group[i]), f"{criterion.function}'s score")
                    results[i][criterion.name] = {
                        "function": criterion.function,
                        "score": score,
                        "weight": criterion.weight,
                    }
            elif self.config.mode == "group":
                order = self.order(group[judged[0]].group_id, criterion.name, len(judged))
                shown = [judged[k] for k in order]
                jobs.append((criterion, shown, self._group_question(criterion, [group[i] for i in shown])))
            else:
                for i in judged:
                    jobs.append((criterion, [i], self._episode_question(criterion, group[i])))
        group_mode = self.config.mode == "group"

        def run(
            job: tuple[JudgeCriterion, list[int], list[dict[str, str]]],
        ) -> tuple[str, list[float], JudgeStats]:
            own = JudgeStats()
            try:
                text = self._ask(job[2], own)
            finally:
                with self._lock:
                    stats.add(own)
            return text, parse_scores(text, len(job[1]) if group_mode else None), own

        answers = []
        if jobs:  # a rubric of programmatic checks alone asks nothing
            workers = min(self.config.max_concurrent, len(jobs))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge") as pool:
                answers = list(pool.map(run, jobs))
        for (criterion, shown, messages), (text, scores, _) in zip(jobs, answers, strict=True):
            prompt = "\n\n".join(m["content"] for m in messages)
            for position, (i, score) in enumerate(zip(shown, scores, strict=True)):
                entry: dict[str, Any] = {
                    "prompt": prompt,
                    "answer": text,
                    "score": score,
                    "weight": criterion.weight,
                }
                if group_mode:
                    entry["order"] = [judged.index(j) for j in shown]
                    entry["position"] = position
                results[i][criterion.name] = entry
        return results

    def score(self, group: Sequence[Trajectory], stats: JudgeStats | None = None) -> None:
        """Judge the group and write the scores into it (module doc), its requests counted into
        `stats`; raises the first failure, having written nothing."""
        results = self.judge(group, stats)
        replace = self.config.reward == "replace"
        for i, by_criterion in results.items():
            trajectory = group[i]
            last = trajectory.transitions[-1]
            if stats is not None:
                stats.judged += 1
                if all(entry["score"] >= PASS for entry in by_criterion.values()):
                    stats.passed += 1
                    label = grader_label(trajectory)
                    stats.passed_graded += label is not None
                    stats.passed_failed += label == 0
            if replace:  # the judge's components become the whole reward, on the last turn
                trajectory.metrics[REPLACED_REWARD] = dict(trajectory.reward_components)
                trajectory.reward_components.clear()
                trajectory.total_reward = 0.0
                for transition in trajectory.transitions:
                    transition.reward = 0.0
            for name, entry in by_criterion.items():
                value = entry["weight"] * entry["score"]
                component = COMPONENT_PREFIX + name
                trajectory.reward_components[component] = (
                    trajectory.reward_components.get(component, 0.0) + value
                )
                trajectory.total_reward += value
                last.reward += value
            last.info[JUDGE_INFO] = by_criterion

    def annotate(self, group: Sequence[Trajectory]) -> tuple[str | None, JudgeStats]:
        """`score`, with failures counted (module doc): (None, stats) when the group was judged,
        else (the cause in one line, stats) and the caller drops the group (the stats count the
        failed requests too); JudgeError on the `max_consecutive_failures`-th failure in a row."""
        stats = JudgeStats()
        try:
            self.score(group, stats)
        except Exception as exc:  # any failure of the judge is an infrastructure failure
            self.consecutive_failures += 1
            self.failures += 1
            cause = " ".join(f"{type(exc).__name__}: {exc}".split())
            limit = self.config.max_consecutive_failures
            if self.consecutive_failures >= limit:
                raise JudgeError(
                    f"the judge ({self.url}) failed {self.consecutive_failures} groups in a row "
                    f"(judge.max_consecutive_failures = {limit}); last cause: {cause}"
                ) from exc
            return f"judge: {cause}", stats
        self.consecutive_failures = 0
        return None, stats
