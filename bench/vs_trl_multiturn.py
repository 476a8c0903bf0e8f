"""One multi-turn GRPO step with JSON tool calls, toolgym vs TRL's `GRPOTrainer` with its own tool
support (`environment_factory`), on CPU: same model, env, prompts, template, group and budgets.

    python bench/vs_trl_multiturn.py --threads 2                 # 4 prompts x 8, Shop-v0, <= 4 turns
    python bench/vs_trl_multiturn.py --model-dir DIR --steps 3 --rounds 2 --threads 2

Needs the `bench` extra (trl, datasets, transformers) in the running interpreter's environment.
The single-turn comparison is bench/vs_trl.py; this one follows its rules (each system in its own
subprocess, `--warmup` steps untimed then `--steps` timed, medians, process CPU time too, same
torch threads, same loss and optimizer settings) and reuses its helpers.

The task: `toolgym/Shop-v0` (envs/tasks/shop.py): "What do 6 kites cost?", a typed `price(item, quantity)`
tool called with JSON `<tool_call>` blocks, a decimal answer `[ANSWER] 21.9`, at most `--max-turns`
assistant turns. Both render it through the shipped Qwen2.5-style template
(configs/assets/chat_templates/qwen2.5-style.jinja): the tools block in the system turn, tool
results as a user turn of `<tool_response>` blocks.

Why the model is SFT-warmed: a random model practically never writes a parseable tool call, so
neither system would ever run a second turn and "multi-turn" would be measured as single-turn.
So the model is bench-3m (the size vs_trl uses), initialised from seed 0 and taught the format by
`--sft-steps` of toolgym's SFT on the env's oracle demonstrations (clean JSON calls), then saved
once as a Hugging Face directory that both systems load (`--model-dir` reuses one, `--save-model`
keeps it). Same shape, same per-token cost as the random model; it now calls `price` on turn 1 and
answers on turn 2 in most episodes, sampled at temperature 1 on both sides. The SFT is set-up,
not timed. Because the episodes are sampled, the two systems do not generate exactly the same
number of tokens or turns: the table gives each side's sampled and trained tokens, turns and tool
calls per step, and per-token costs beside the per-step time, so the ratio can be checked against
the work done.

What both sides get:
- The same prompts: the task seeds of toolgym's training stream (`TaskSeedStream(0)`), the same
  ones in the same order on each step; system message = the env's instructions, user = its
  question, `tools` = the env's tool spec (JSON Schema). TRL's tokenizer is the same
  `configs/assets/tokenizer.json` (PreTrainedTokenizerFast) with the same template text as its
  `chat_template`; the TRL worker checks that TRL's own prompt rendering gives exactly
  toolgym's prompt ids. (transformers derives a tool's schema from a Python function's
  docstring, which would drop the env's `additionalProperties: false`; the worker maps the
  `price` method to the env's spec so the two prompts are the same text.)
- The same tool: TRL's environment wraps a `ShopEnv` reset with the row's task seed; its `price`
  method is the env's own tool and returns the env's result text, so the `<tool_response>` blocks
  are the same text. TRL parses calls with transformers' `parse_response` and the Qwen
  `response_template` TRL ships for Qwen2.5/3 (our template writes calls the same way; TRL's
  `add_response_schema` only recognises the upstream template text, so the worker sets it).
- The same reward: the env's. toolgym's runner steps the env with each sampled turn; TRL's reward
  function replays the episode's assistant turns (content + its tool calls written back as
  `<tool_call>` JSON) through a fresh ShopEnv with the same seed and sums the step rewards,
  settling an unanswered episode with the env's `abandon()` as toolgym's runner does.
- The same budgets: G = `--group`, at most `--max-turns` assistant turns (TRL:
  max_tool_calling_iterations = max_turns - 1), at most `--turn-tokens` sampled tokens a turn
  (TRL: generation_kwargs max_new_tokens), `--episode-tokens` sampled tokens an episode (TRL's
  max_completion_length counts the tool-response tokens too, so it gets the episode budget plus
  max_turns - 1 tool responses' worth of room; with the warmed model neither binds often).
  Temperature 1, no top-k/top-p; turns end at `<|im_end|>` on both sides.
- The same update: group-normalised advantages, the GRPO loss (PPO clip 0.2, per-sequence token
  mean, no KL, one update per batch), loss only on sampled tokens (TRL: its tool_mask), AdamW,
  grad-norm clip 1.0, constant lr, the whole batch in one forward/backward.

toolgym's step is what `toolgym train` does per step (trainers/loop/rl.py): `collect_batch` through
the RolloutRunner (envs, asyncio, the template renderer token-in-token-out, the torch engine with
its continuous batching), `Trainer.train_step`, `push_weights`. TRL's step is the wall time between
`on_step_end` callbacks; its rollout share is `_generate_and_score_completions` (generation with
`model.generate` turn by turn for the rows that called a tool, tool calls, parsing, reward).

On a shared machine the wall time moves with other work; the process CPU time per step (all
threads) is steadier, and the fastest step (`best`) is the least disturbed. Neither survives
another process holding a core while `--threads` equals the core count: OpenMP threads then spin
at barriers and CPU time grows with wall time (bench/RESULTS.md, this script's section);
`--threads 1` is the robust setting there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import RESULT, TOKENIZER, cpu_seconds, require_trl, run_rounds, spawn_worker

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = "qwen2.5-style"
ENV_ID = "toolgym/Shop-v0"


# ---- setup (parent process) ---------------------------------------------------------------------


def toolgym_config(args: argparse.Namespace, model_dir: Path | None = None, sft: bool = False):
    """The shop preset with this benchmark's model, group, limits and precision."""
    from toolgym.configs.load import load_config

    bf16 = args.precision == "bf16"
    overrides = [
        f"model.name='{args.model}'",
        f"rollout.group_size={args.group}",
        f"rollout.max_turns={args.max_turns}",
        f"rollout.max_tokens_per_turn={args.turn_tokens}",
        f"rollout.max_tokens_per_episode={args.episode_tokens}",
        f"env.kwargs={{max_turns = {args.max_turns}}}",
        f"policy.max_batch_size={args.prompts * args.group}",
        f"model.dtype='{'bfloat16' if bf16 else 'float32'}'",
        f"sft.num_tasks={args.sft_tasks}",
        "sft.oracle.p_malformed_call=0.0",
        "run.seed=0",
    ]
    if model_dir is not None:
        overrides.append(f"model.path='{model_dir}'")
    config, _ = load_config("shop_tiny", overrides)
    return config


def warm_model(args: argparse.Namespace, directory: Path) -> str:
    """bench-3m (seed 0) after `--sft-steps` of SFT on Shop's oracle demonstrations, as a HF dir."""
    import torch

    from toolgym.agents.model.checkpoint import save_hf_checkpoint
    from toolgym.agents.model.transformer import build_model
    from toolgym.configs.assembly.demos import demo_episodes
    from toolgym.configs.assembly.parts import build_renderer
    from toolgym.trainers.config import OptimizerConfig, TrainerConfig
    from toolgym.trainers.sft import BatchOrder
    from toolgym.trainers.trainer import Trainer

    torch.set_num_threads(args.threads)
    config = toolgym_config(args)
    renderer, _ = build_renderer(config)
    episodes, _, _ = demo_episodes(config, renderer, max_seq_len=512)
    model = build_model(args.model, seed=0)
    trainer = Trainer(
        model,
        TrainerConfig(
            optimizer=OptimizerConfig(lr=2e-3, betas=(0.9, 0.95), warmup_steps=20),
            micro_batch_tokens=16384,
        ),
        device="cpu",
    )
    order = BatchOrder(len(episodes), 32, seed=0)
    started = time.perf_counter()
    loss = float("nan")
    for _ in range(args.sft_steps):
        loss = trainer.sft_step([episodes[i] for i in order.next()])["loss"]
    save_hf_checkpoint(model, model.config, directory, tokenizer_path=TOKENIZER)
    return f"SFT {args.sft_steps} steps on {len(episodes)} oracle episodes, loss {loss:.3f}, {time.perf_counter() - started:.0f} s"


def make_workload(args: argparse.Namespace, count: int) -> dict[str, Any]:
    """The first `count` task seeds of toolgym's stream 0, each as toolgym's prompt ids and as the
    chat messages + tools a TRL dataset row holds."""
    import gymnasium

    import toolgym.envs  # noqa: F401  (registers toolgym/*)
    from toolgym.configs.assembly.parts import build_renderer
    from toolgym.rollouts.batches import TaskSeedStream
    from toolgym.rollouts.episode.rendering import first_messages

    renderer, _ = build_renderer(toolgym_config(args))
    seeds, _ = TaskSeedStream(stream=0).take(count)
    env = gymnasium.make(ENV_ID, max_turns=args.max_turns)
    rows = []
    for seed in seeds:
        observation, info = env.reset(seed=seed)
        messages, tools = first_messages(renderer, observation, info, info["system_prompt"])
        ids = renderer.render_prompt(messages, tools=tools)
        rows.append(
            dict(
                seed=seed,
                ids=ids,
                messages=[{"role": m.role, "content": m.content} for m in messages],
                tools=tools,
            )
        )
    env.close()
    from toolgym.configs.load import chat_template_path

    return dict(rows=rows, template=Path(chat_template_path(TEMPLATE)).read_text(encoding="utf-8"))


def run_worker(system: str, args: argparse.Namespace, workdir: Path) -> dict:
    flags = (
        "model", "prompts", "group", "max_turns", "turn_tokens", "episode_tokens",
        "steps", "warmup", "threads", "lr", "precision",
    )  # fmt: skip
    return spawn_worker(__file__, system, args, workdir, flags, TRL_EXPERIMENTAL_SILENCE="1")


# ---- workers (one subprocess per system) --------------------------------------------------------


def toolgym_worker(args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from toolgym.agents.model.checkpoint import load_hf_checkpoint
    from toolgym.configs.assembly.parts import build_policy, build_renderer
    from toolgym.rollouts.batches import BatchConfig, TaskSeedStream, collect_batch
    from toolgym.rollouts.episode.runner import RolloutRunner
    from toolgym.trainers.config import OptimizerConfig, TrainerConfig
    from toolgym.trainers.losses import LossConfig
    from toolgym.trainers.trainer import Trainer
    from toolgym.trainers.weight_sync import push_weights

    torch.set_num_threads(args.threads)
    workload = json.loads((workdir / "workload.json").read_text())
    rows = workload["rows"]
    p, g = args.prompts, args.group
    config = toolgym_config(args, workdir / "model")
    renderer, _ = build_renderer(config)
    model = load_hf_checkpoint(workdir / "model", dtype=torch.float32)
    policy = build_policy(config, model, None, renderer, torch.device("cpu"))
    longest = max(len(r["ids"]) for r in rows) + args.episode_tokens + args.max_turns * 32
    trainer = Trainer(
        model,
        TrainerConfig(
            precision=args.precision,
            loss=LossConfig(name="grpo"),
            optimizer=OptimizerConfig(lr=args.lr, max_grad_norm=1.0),
            micro_batch_tokens=p * g * longest,  # the whole batch in one forward/backward, like TRL
        ),
        device="cpu",
        sampling=config.policy,
    )
    runner = RolloutRunner(policy, renderer, config.rollout_config())
    stream = TaskSeedStream(stream=0)
    batch_config = BatchConfig(groups_per_batch=p, dynamic_sampling=False)
    steps = []
    with asyncio.Runner() as loop:
        for step in range(args.warmup + args.steps):
            start, cpu_start = time.perf_counter(), cpu_seconds(policy)
            batch = loop.run(collect_batch(runner, stream, batch_config))
            rollout_done = time.perf_counter()
            metrics = trainer.train_step(batch.episodes)
            train_done = time.perf_counter()
            push_weights(trainer, policy)
            end, cpu_end = time.perf_counter(), cpu_seconds(policy)
            expected = rows[step * p : (step + 1) * p]
            trajectories = batch.trajectories
            if [t.task_seed for t in trajectories] != [r["seed"] for r in expected for _ in range(g)]:
                raise RuntimeError("toolgym's step did not roll out the workload's task seeds")
            by_seed = {r["seed"]: r["ids"] for r in expected}
            if any(list(t.transitions[0].observation_tokens) != by_seed[t.task_seed] for t in trajectories):
                raise RuntimeError("toolgym's first prompt differs from the workload's prompt ids")
            if metrics["skipped"]:
                raise RuntimeError("the toolgym update was skipped (non-finite loss or grad norm)")
            steps.append(
                dict(
                    step=end - start,
                    rollout=rollout_done - start,
                    train=train_done - rollout_done,
                    sync=end - train_done,
                    cpu=cpu_end - cpu_start,
                    sampled=sum(sum(e.loss_mask) for e in batch.episodes),
                    tokens=sum(len(e.tokens) for e in batch.episodes),
                    turns=sum(len(t.transitions) for t in trajectories),
                    tool_calls=sum(t.metrics["env"].get("tool_calls", 0.0) for t in trajectories),
                    reward=statistics.mean(t.total_reward for t in trajectories),
                    episodes=len(batch.episodes),
                )
            )
    policy.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return dict(system="toolgym", threads=torch.get_num_threads(), steps=steps[args.warmup :])


class ShopTools:
    """TRL's environment: a ShopEnv reset with the row's task seed; `price` is the env's tool."""

    max_turns = 4

    def __init__(self) -> None:
        from toolgym.envs.tasks.shop import ShopEnv

        self.env = ShopEnv(max_turns=self.max_turns)

    def reset(self, seed: int, **kwargs: Any) -> None:
        self.env.reset(seed=seed)
        return None

    def price(self, item: str, quantity: int) -> str:
        """The price of a quantity of an item today.

        Args:
            item: the item, singular (`kite`).
            quantity: how many, 1 to 9.
        """
        from toolgym.envs.tools.typed import result_text

        return result_text(self.env.price(item, quantity))


def replay_reward(seed: int, messages: list[dict], max_turns: int) -> tuple[float, int, int]:
    """(the env's total reward, assistant turns, tool calls) of a TRL completion, replayed through
    a fresh ShopEnv: each assistant message as the text toolgym's env would have been given."""
    from toolgym.envs.tasks.shop import ShopEnv

    env = ShopEnv(max_turns=max_turns)
    env.reset(seed=seed)
    total, turns, calls, done = 0.0, 0, 0, False
    for message in messages:
        if message.get("role") != "assistant" or done:
            continue
        text = message.get("content") or ""
        for call in message.get("tool_calls") or []:
            function = call.get("function", call)
            block = json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})
            text += ("\n" if text else "") + f"<tool_call>\n{block}\n</tool_call>"
            calls += 1
        _, reward, terminated, truncated, _ = env.step(text)
        total += float(reward)
        turns += 1
        done = terminated or truncated
    if not done and turns:
        reward, _ = env.abandon()
        total += float(reward)
    return total, turns, calls


def trl_worker(args: argparse.Namespace, workdir: Path) -> dict:
    import datasets
    import torch
    import transformers
    import transformers.utils.chat_template_utils as hf_templates
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl.chat_template_utils import qwen3_template

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    workload = json.loads((workdir / "workload.json").read_text())
    rows = workload["rows"]
    p, g = args.prompts, args.group
    total_steps = args.warmup + args.steps
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER), eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tokenizer.chat_template = workload["template"]
    tokenizer.response_template = qwen3_template  # TRL's parser for Qwen-style <tool_call> JSON

    # The env's tool spec for the price method (see the module doc), else transformers' own.
    env_spec = rows[0]["tools"][0]
    derive = hf_templates.get_json_schema

    def tool_schema(func):
        return env_spec if getattr(func, "__name__", "") == "price" else derive(func)

    hf_templates.get_json_schema = tool_schema
    ShopTools.max_turns = args.max_turns

    probe = ShopTools()
    for row in rows:
        ids = tokenizer.apply_chat_template(
            row["messages"], tools=[probe.price], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if list(ids) != row["ids"]:
            raise RuntimeError(f"TRL's rendering of task {row['seed']} differs from toolgym's prompt ids")

    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    suffix = tokenizer.apply_chat_template(
        [{"role": "tool", "name": "price", "content": "123.45"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    tool_room = (args.max_turns - 1) * (len(suffix) + 8)
    config = trl.GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=args.precision == "bf16",
        fp16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=p * g,
        gradient_accumulation_steps=1,
        num_generations=g,
        max_completion_length=args.episode_tokens + tool_room,
        max_tool_calling_iterations=args.max_turns - 1,
        generation_kwargs={"max_new_tokens": args.turn_tokens},
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        loss_type="grpo",
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=total_steps,
        shuffle_dataset=False,
        seed=0,
        report_to="none",
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )
    rollout_seconds: list[float] = []
    step_ends: list[tuple[float, float]] = []  # (wall, process CPU) at each step's end
    work: list[dict] = []  # per step: sampled/total tokens, turns, tool calls, reward
    seen_seeds: list[list[int]] = []

    def reward(prompts, completions, completion_ids, seed, **kwargs) -> list[float]:
        seen_seeds.append(list(seed))
        graded = [replay_reward(s, c, args.max_turns) for s, c in zip(seed, completions, strict=True)]
        work.append(
            dict(
                turns=sum(t for _, t, _ in graded),
                tool_calls=sum(c for _, _, c in graded),
                reward=statistics.mean(r for r, _, _ in graded),
            )
        )
        return [r for r, _, _ in graded]

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            rollout_seconds.append(time.perf_counter() - start)
            mask = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
            work[-1]["sampled"] = int(mask.sum())
            work[-1]["tokens"] = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not step_ends:
                step_ends.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append((time.perf_counter(), time.process_time()))

    dataset = datasets.Dataset.from_dict(
        {
            "prompt": [r["messages"] for r in rows[: total_steps * p]],
            "seed": [r["seed"] for r in rows[: total_steps * p]],
        }
    )
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=ShopTools,
        callbacks=[StepClock()],
    )
    trainer.train()
    expected = [[r["seed"] for r in rows[i * p : (i + 1) * p] for _ in range(g)] for i in range(total_steps)]
    if seen_seeds != expected:
        raise RuntimeError("TRL's steps did not see the workload's task seeds (each G times in a row)")
    if len(rollout_seconds) != total_steps or len(step_ends) != total_steps + 1:
        raise RuntimeError(f"TRL ran {len(rollout_seconds)} rollouts, {len(step_ends) - 1} steps")
    steps = []
    for i in range(args.warmup, total_steps):
        step = step_ends[i + 1][0] - step_ends[i][0]
        steps.append(
            dict(
                step=step,
                rollout=rollout_seconds[i],
                train=step - rollout_seconds[i],
                cpu=step_ends[i + 1][1] - step_ends[i][1],
                episodes=p * g,
                **work[i],
            )
        )
    return dict(
        system=f"TRL {trl.__version__}",
        threads=torch.get_num_threads(),
        steps=steps,
        versions=dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__),
    )


# ---- report -------------------------------------------------------------------------------------


def summarise(results: list[dict]) -> dict:
    """Medians over all timed steps (per-token costs per step, then the median), and the fastest
    step's wall and CPU time: on a shared machine other work only adds time, so the best step is
    the least disturbed one."""
    steps = [dict(s) for r in results for s in r["steps"]]
    for s in steps:
        s["us_per_sampled"] = 1e6 * s["rollout"] / s["sampled"]
        s["us_per_trained"] = 1e6 * s["train"] / s["tokens"]
        s["cpu_ms_per_sampled"] = 1e3 * s["cpu"] / s["sampled"]
    summary = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    summary.update(
        system=results[0]["system"],
        spread=(min(s["step"] for s in steps), max(s["step"] for s in steps)),
        best_step=min(s["step"] for s in steps),
        best_cpu=min(s["cpu"] for s in steps),
    )
    return summary


def format_table(ours: dict, theirs: dict) -> str:
    from _common import format_table as table

    rows = []
    for s in (ours, theirs):
        rows.append(
            [
                s["system"],
                f"{s['step']:.3f}",
                f"{s['spread'][0]:.2f}-{s['spread'][1]:.2f}",
                f"{s['rollout']:.3f}",
                f"{s['train']:.3f}",
                f"{s['cpu']:.2f}",
                f"{s['best_cpu']:.2f}",
                f"{s['turns']:.0f} / {s['tool_calls']:.0f}",
                f"{s['sampled']:.0f} / {s['tokens']:.0f}",
                f"{s['us_per_sampled']:.0f}",
                f"{s['us_per_trained']:.1f}",
                f"{s['cpu_ms_per_sampled']:.2f}",
                f"{s['reward']:.2f}",
                f"{theirs['step'] / s['step']:.2f}x",
                f"{theirs['cpu'] / s['cpu']:.2f}x",
            ]
        )
    headers = [
        "system", "step s", "min-max", "rollout s", "train s", "cpu s", "best cpu s", "turns / calls",
        "tokens (sampled / trained)", "rollout us/sampled tok", "train us/trained tok",
        "cpu ms/sampled tok", "reward", "wall vs TRL", "cpu vs TRL",
    ]  # fmt: skip
    return table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-3m", help="ModelConfig name (initialised from seed 0)")
    parser.add_argument(
        "--model-dir", type=Path, help="use this HF directory (a warmed model) instead of SFT"
    )
    parser.add_argument("--sft-steps", type=int, default=60, help="SFT steps that teach the tool-call format")
    parser.add_argument("--sft-tasks", type=int, default=256, help="oracle demonstrations for the SFT")
    parser.add_argument("--save-model", type=Path, help="also keep the warmed model here (for --model-dir)")
    parser.add_argument("--prompts", type=int, default=4, help="task seeds per step")
    parser.add_argument("--group", type=int, default=8, help="episodes per task seed (G)")
    parser.add_argument("--max-turns", type=int, default=4, help="assistant turns per episode at most")
    parser.add_argument("--turn-tokens", type=int, default=40, help="sampled tokens per turn at most")
    parser.add_argument("--episode-tokens", type=int, default=120, help="sampled tokens per episode at most")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (>= 1)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two systems this many times")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="as in bench/vs_trl.py")
    parser.add_argument("--json", type=Path, help="also write the raw per-step figures here")
    parser.add_argument("--worker", choices=("toolgym", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1 or args.group < 2 or args.max_turns < 2:
        parser.error("--warmup, --steps, --rounds must be >= 1, --group and --max-turns >= 2")

    if args.worker:
        worker = toolgym_worker if args.worker == "toolgym" else trl_worker
        print(RESULT + json.dumps(worker(args, args.workdir)), flush=True)
        return

    require_trl("bench/vs_trl_multiturn.py")
    with tempfile.TemporaryDirectory(prefix="vs_trl_mt_") as tmp:
        workdir = Path(tmp)
        if args.model_dir:
            import shutil

            shutil.copytree(args.model_dir, workdir / "model")
            origin = f"{args.model_dir}"
        else:
            origin = warm_model(args, workdir / "model")
            if args.save_model:
                import shutil

                shutil.copytree(workdir / "model", args.save_model, dirs_exist_ok=True)
        workload = make_workload(args, (args.warmup + args.steps) * args.prompts)
        (workdir / "workload.json").write_text(json.dumps(workload))
        lengths = [len(r["ids"]) for r in workload["rows"]]
        print(
            f"model {args.model} ({origin}), {ENV_ID} through {TEMPLATE}, {args.prompts} prompts x G={args.group}, "
            f"<= {args.max_turns} turns of <= {args.turn_tokens} tokens, <= {args.episode_tokens} an episode, "
            f"prompts {min(lengths)}-{max(lengths)} tokens, {args.precision}, {args.threads} threads, "
            f"{args.warmup} warm-up + {args.steps} timed steps x {args.rounds} round(s)",
            flush=True,
        )
        runs = run_rounds(args.rounds, lambda system: run_worker(system, args, workdir), show_cpu=True)

    ours, theirs = summarise(runs["toolgym"]), summarise(runs["trl"])
    versions = runs["trl"][0]["versions"]
    print(f"\ntorch {versions['torch']}, transformers {versions['transformers']}, TRL {versions['trl']}")
    print("(medians over the timed steps; turns, calls, tokens, reward: per step over all its episodes)")
    print(format_table(ours, theirs))
    print(
        f"\ntoolgym is {theirs['step'] / ours['step']:.2f}x faster than TRL per multi-turn GRPO step (median wall, "
        f"target >= 3x), {theirs['best_step'] / ours['best_step']:.2f}x on the fastest steps; "
        f"{theirs['cpu'] / ours['cpu']:.2f}x less process CPU time per step (median), "
        f"{theirs['best_cpu'] / ours['best_cpu']:.2f}x on the least; per sampled token "
        f"{theirs['cpu_ms_per_sampled'] / ours['cpu_ms_per_sampled']:.2f}x less CPU time (median)"
    )
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
