"""The config of a short `toolgym train` run for config tests: 2 RL steps of the `test` model on
easy recursive Zorplex, no evals, checkpoints or plots, the training episodes recorded; and a
tokenizer other than the run's (`other_tokenizer`), for the checks that refuse one."""

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

BASE: dict[str, dict[str, Any]] = {
    "run": {"steps": 2, "plot": False, "export_hf": False},
    "env": {"kwargs": {"tier": "recursive", "difficulty": "easy", "max_turns": 3}},
    "model": {"name": "test", "overrides": {"vocab_size": 1024}},
    "policy": {"max_batch_size": 16, "max_seq_len": 256},
    "rollout": {"group_size": 2, "max_turns": 3, "max_tokens_per_turn": 8, "max_tokens_per_episode": 24},
    "batch": {"groups_per_batch": 2},
    "eval": {"every_steps": 0, "at_start": False, "at_end": False, "num_tasks": 2, "record": False},
    "checkpoint": {"every_steps": 0, "at_end": False},
    "logging": {"progress_bar": False, "record_training": True},
}


def short_run(run_dir: Path, **sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The raw config (a TOML-shaped dict) of a short run in `run_dir`: each section given is
    merged over the base one, its keys replacing the base's."""
    raw = {name: dict(section) for name, section in BASE.items()}
    raw["run"]["run_dir"] = str(run_dir)
    for name, section in sections.items():
        raw[name] = {**raw.get(name, {}), **section}
    return raw


def other_tokenizer(path: Path) -> Path:
    """A small BPE tokenizer.json, not the run's, written to `path`."""
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(
        ["another vocabulary"] * 5,
        trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"], show_progress=False),
    )
    other.save(str(path))
    return path
