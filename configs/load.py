"""Loading a run config: TOML file (or a shipped preset by name) -> dict -> `--set` overrides ->
`msgspec.convert` into `Config`, with every mistake reported as ONE line naming the field:

    config error: rollout.group_size: expected int, got str
    config error: rollout.gruop_size: unknown key (rollout keys: context_length, ...)
    config error: trainer.loss.name: invalid value 'ppo' (expected one of 'reinforce', ...)
    config error: batch.groups_per_batch: must be >= 1, got 0

`--set a.b=value` parses value as a TOML value (`3`, `1e-4`, `true`, `"x"`, `[1, 2]`,
`{tier = "simple"}`), then as a Python float (`.001`, `1.`), and falls back to the plain string,
so `--set env.id=toolgym/SumDigits-v0` works unquoted. A file's env kwargs go with its env id:
`--set env.id=other` drops them (`load_config`). A nan or inf anywhere is refused, and so
is an integer beyond 64 bits. Rules between fields (`check_fields_together`) are checked at load
time too; the checks beyond one file (configs/checks.py) run before a run directory is made.

Derived defaults (filled only when the key is absent): trainer.optimizer.total_steps = run.steps,
sft.optimizer.total_steps = sft.steps, sft.optimizer.lr = 1e-3.

Deprecated keys, still accepted for one release with a ConfigDeprecationWarning naming the new
key (`migrate`, and `--set` keys in `load_config`): the section `[agent]` is now `[policy]`
(`agent.x` -> `policy.x`, in files and in `--set`); `trainer.temperature` (the trainer reads
policy.temperature; a different value is an error, as it always was).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import tomllib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
from msgspec import inspect

from .schema import Config, EnvSection, PolicySection, RunSection, SFTSection

PRESETS_DIR = Path(__file__).resolve().parent
SHIPPED_TOKENIZER = PRESETS_DIR / "assets" / "tokenizer.json"
SHIPPED_TOKENIZERS = PRESETS_DIR / "assets" / "tokenizers"  # other shipped splits, by name
DEFAULT_PRESET = "zorplex_tiny"
SFT_DEFAULT_LR = 1e-3  # supervised warm start of a small model: far above an RL learning rate


class ConfigError(ValueError):
    """A config that cannot be used; str() is the one line to print."""

    def __init__(self, where: str, message: str) -> None:
        self.where, self.message = where, message
        super().__init__(f"config error: {where}: {message}" if where else f"config error: {message}")


# ---- finding and reading files ------------------------------------------------------------------


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.toml"))


def resolve_config_path(spec: str) -> Path:
    """A path to a TOML file, or the name of a shipped preset (`zorplex_tiny`, `zorplex_tiny.toml`)."""
    path = Path(spec)
    if path.is_file():
        return path
    preset = PRESETS_DIR / (spec if spec.endswith(".toml") else f"{spec}.toml")
    if path.name == spec and preset.is_file():
        return preset
    raise ConfigError("", f"no config file or preset {spec!r} (presets: {', '.join(preset_names())})")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc}") from exc


# ---- overrides ----------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A TOML value, a JSON object or array, or the text itself when it is none of these."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        pass
    if text.lstrip().startswith(("{", "[")):  # JSON, as `toolgym record --env-kwargs` takes it
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    # TOML wants digits on both sides of the point; `.001` and `1.` are numbers on a command line.
    # (nan and inf are TOML already, and refused by config_from_dict.)
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`a.b.c=value` assignments applied to a copy of `raw` (tables are created as needed).

    Setting the tag of a tagged-union table to another variant (`rollout.context.policy=window`
    where the table held `{policy = "notes", keep_last = 1}`) starts that table afresh: the other
    variant's fields would be unknown to the new one. Set the new variant's fields after its tag."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                "--set", f"expected KEY=VALUE with a dotted key like rollout.group_size=8, got {item!r}"
            )
        *parents, leaf = key.split(".")
        table = out
        for i, part in enumerate(parents):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(".".join(parents[: i + 1]), f"is a value, not a table; cannot set {key}")
        value = parse_value(text.strip())
        if leaf in table and table[leaf] != value and _is_tag_field(parents, leaf):
            table.clear()
        table[leaf] = value
    return out


def _is_tag_field(parents: Sequence[str], leaf: str) -> bool:
    """Whether `leaf` is the tag field of a tagged union of Structs at `parents` in the schema."""
    t = _type_at(parents)
    members = t.types if isinstance(t, inspect.UnionType) else (t,)
    return any(isinstance(m, inspect.StructType) and m.tag_field == leaf for m in members)


# ---- checking against the schema ------------------------------------------------------------------


def _struct_type(t: inspect.Type) -> inspect.StructType | None:
    if isinstance(t, inspect.StructType):
        return t
    if isinstance(t, inspect.UnionType):
        structs = [s for s in t.types if isinstance(s, inspect.StructType)]
        return structs[0] if len(structs) == 1 else None
    return None


def check_unknown_keys(raw: Mapping[str, Any], cls: type = Config, where: str = "") -> None:
    """Unknown keys anywhere in `raw`, also inside reused Structs that would silently ignore them."""
    info = _struct_type(inspect.type_info(cls))
    assert info is not None
    _check_keys(raw, info, where)


def _check_keys(raw: Mapping[str, Any], info: inspect.StructType, where: str) -> None:
    fields = {f.encode_name: f for f in info.fields}
    for key, value in raw.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            section = f"{where} keys" if where else "sections"
            raise ConfigError(path, f"unknown key ({section}: {', '.join(sorted(fields))})")
        sub = _struct_type(fields[key].type)
        if sub is not None and isinstance(value, Mapping):
            _check_keys(value, sub, path)


def _type_at(path: Sequence[str]) -> inspect.Type | None:
    t: inspect.Type | None = inspect.type_info(Config)
    for part in path:
        struct = _struct_type(t) if t is not None else None
        if struct is None:
            return None
        t = next((f.type for f in struct.fields if f.encode_name == part), None)
    return t


def _choices(t: inspect.Type | None) -> list[Any]:
    if isinstance(t, inspect.LiteralType):
        return list(t.values)
    if isinstance(t, inspect.EnumType):
        return [m.value for m in t.cls]
    if isinstance(t, inspect.UnionType):
        return [c for sub in t.types for c in _choices(sub)]
    return []


def _tags(t: Any) -> list[str]:
    """The tags of a tagged union of Structs (or of one Struct), in declaration order."""
    if isinstance(t, inspect.UnionType):
        return [tag for sub in t.types for tag in _tags(sub)]
    if isinstance(t, inspect.StructType) and isinstance(t.tag, str):
        return [t.tag]
    return []


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def validation_error(exc: msgspec.ValidationError) -> ConfigError:
    """msgspec's "Expected `int`, got `str` - at `$.a.b`" as `a.b: expected int, got str`."""
    match = _AT.match(str(exc))
    assert match is not None
    message, path = match["msg"], (match["path"] or "").lstrip(".")
    parts = [p for p in re.split(r"\.|\[\d+\]", path) if p]
    if message.startswith("Expected"):
        message = "e" + message[1:].replace("`", "")
    elif message.startswith("Invalid enum value"):
        choices = _choices(_type_at(parts))
        message = "invalid value" + message.removeprefix("Invalid enum value")
        if choices:
            message += f" (expected one of {', '.join(repr(c) for c in choices)})"
    elif message.startswith("Invalid value") and parts and _tags(_type_at(parts[:-1])):
        # the tag of a tagged union (rollout.context.policy): name the tags it takes
        message = "invalid value" + message.removeprefix("Invalid value")
        message += f" (expected one of {', '.join(repr(t) for t in _tags(_type_at(parts[:-1])))})"
    else:
        path, message = _name_the_field(path, parts, message)
    return ConfigError(path, message)


def _name_the_field(path: str, parts: list[str], message: str) -> tuple[str, str]:
    """A section's own check ("EnvRolloutConfig.context_length must be >= 2, got 1" or
    "policy.max_seq_len must be ...", raised at `rollout` / `policy`) as `rollout.context_length:
    must be >= 2, got 1`, so that it names the key to change like every other error."""
    for prefix in (r"[A-Z]\w*", re.escape(path)):
        match = re.match(rf"(?:{prefix})\.(?P<field>\w+(?:\.\w+)*) (?P<rest>must\b.*)$", message, re.S)
        if path and match and _type_at([*parts, *match["field"].split(".")]) is not None:
            return f"{path}.{match['field']}", match["rest"]
    # "OverlongShaping needs 0 < cache_length <= max_length, ..." raised at the section itself
    match = re.match(r"[A-Z]\w* (?P<rest>(?:needs|must)\b.*)$", message, re.S)
    if path and match:
        return path, match["rest"]
    return path, message


def _get(raw: Mapping[str, Any], path: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """raw[a][b]... when it is there with the right type, else `default` (a wrong type is reported
    by the conversion, not here)."""
    value: Any = raw
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return default
        value = value[part]
    return value if isinstance(value, kind) and not isinstance(value, bool) else default


def _fill_derived(raw: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    derived = {
        "trainer.optimizer.total_steps": _get(raw, "run.steps", int, RunSection().steps),
        "sft.optimizer.total_steps": _get(raw, "sft.steps", int, SFTSection().steps),
        "sft.optimizer.lr": SFT_DEFAULT_LR,
    }
    for key, value in derived.items():
        *parents, leaf = key.split(".")
        table: Any = out
        for part in parents:
            table = table.setdefault(part, {}) if isinstance(table, dict) else None
        if isinstance(table, dict):
            table.setdefault(leaf, value)
    return out


INT64_MAX = 2**63 - 1


def check_finite(raw: Any, where: str = "") -> None:
    """No nan or inf anywhere: no setting means either (TOML has no null to say "no limit"), and
    a nan slips through every `x <= 0` check downstream. No integer beyond 64 bits either: Python
    and the schema take any size, the tensors, JSON records and msgspec encoders it reaches do not
    ("Overflow when unpacking long long")."""
    items = raw.items() if isinstance(raw, Mapping) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        path = f"{where}.{key}" if isinstance(key, str) and where else where or str(key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(path, f"must be a finite number, got {value}")
        if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ConfigError(path, f"must fit in 64 bits (|value| < 2**63), got {value:.3g}")
        check_finite(value, path)


class ConfigDeprecationWarning(DeprecationWarning):
    """A config key that still works for one release; the message names the new key."""


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"config key {old} is deprecated: {new}", ConfigDeprecationWarning, stacklevel=3)


# Deprecated section names -> their new names.
RENAMED_SECTIONS = {"agent": "policy"}


def _migrate_sections(raw: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for old, new in RENAMED_SECTIONS.items():
        if old not in out:
            continue
        value, current = out.pop(old), out.get(new)
        if isinstance(value, dict) and isinstance(current, dict):
            both = sorted(set(value) & set(current))
            if both:
                raise ConfigError(
                    f"{old}.{both[0]}", f"is also set as {new}.{both[0]}; [{old}] is the old name of [{new}]"
                )
            value = {**current, **value}
        elif current is not None:
            raise ConfigError(old, f"[{old}] is the old name of [{new}]; give one of them")
        out[new] = value
        _deprecated(f"[{old}]", f"it is now [{new}] ({old}.x -> {new}.x)")
    return out


def migrate_override(item: str) -> str:
    """A `--set` assignment with a deprecated section name renamed (with a warning)."""
    key = item.partition("=")[0].strip()
    section = key.partition(".")[0]
    if section in RENAMED_SECTIONS and "." in key:
        new = RENAMED_SECTIONS[section]
        _deprecated(f"{section}.*", f"it is now {new}.* (--set {new}{key.removeprefix(section)}=...)")
        return new + item.lstrip().removeprefix(section)
    return item


def migrate(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the deprecated keys (module doc) moved to their new places, each with a
    ConfigDeprecationWarning. Raises ConfigError for a deprecated key that contradicts its
    replacement."""
    out = _migrate_sections(raw)
    trainer = out.get("trainer")
    if isinstance(trainer, dict) and "temperature" in trainer:
        value = trainer.pop("temperature")
        sampled = _get(out, "policy.temperature", (int, float), PolicySection().temperature)
        if value != sampled:
            raise ConfigError(
                "",
                f"trainer.temperature ({value}) must equal policy.temperature ({sampled}): the trainer "
                "scores tokens as the sampler drew them (and reads policy.temperature itself)",
            )
        _deprecated("trainer.temperature", "the trainer reads policy.temperature; remove the key")
    return out


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Check and convert a config dict (deprecated keys migrated, derived defaults filled in).
    Raises ConfigError."""
    raw = migrate(raw)
    check_unknown_keys(raw)
    check_finite(raw)
    try:
        config = msgspec.convert(_fill_derived(raw), Config)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except (ValueError, TypeError) as exc:  # a __post_init__ at the root
        raise ConfigError("", str(exc)) from None
    check_fields_together(config)
    return config


def check_fields_together(config: Config) -> None:
    """Rules between sections that each section alone cannot see. Raises ConfigError.

    - rollout.group_size >= 2: every advantage estimator is group-relative (a reward minus its
      group's mean), so a group of one has advantage 0 on every token and dynamic sampling drops
      it as zero-variance: such a run trains on nothing, step after step. With
      `batch.advantage.credit = "turn_loo"` the baseline is the group's other episodes: a group of
      one has none, and its advantages are its raw returns (REINFORCE without a baseline).
    - trainer.replay_routes replays routes the torch engine records (agents/engine/routes.py):
      policy.backend "torch"."""
    if config.rollout.group_size < 2 and config.batch.advantage.credit != "outcome":
        raise ConfigError(
            "rollout.group_size",
            f"must be >= 2 with batch.advantage.credit = '{config.batch.advantage.credit}' (its "
            f"baseline is the group's other episodes; a group of 1 has none), got {config.rollout.group_size}",
        )
    if config.policy.implementation == "transformers":
        _check_transformers_implementation(config)
    if config.trainer.replay_routes and config.policy.backend != "torch":
        raise ConfigError(
            "trainer.replay_routes",
            f"replays the routes the torch engine records: needs policy.backend = 'torch', got '{config.policy.backend}'",
        )
    if config.rollout.group_size < 2:
        estimator = config.batch.advantage.estimator
        dynamic = config.batch.dynamic_sampling
        dropped = " and batch.dynamic_sampling drops every such group" if dynamic else ""
        raise ConfigError(
            "rollout.group_size",
            f"must be >= 2 with batch.advantage.estimator = '{estimator}' (group-relative: a group of "
            f"1 has advantage 0{dropped}, so nothing is learned), got {config.rollout.group_size}",
        )


def _check_transformers_implementation(config: Config) -> None:
    """policy.implementation = "transformers" (agents/model/hf_fallback.py) loads an HF directory,
    samples through vLLM and has no per-block torch.compile or shared-prefix attention (LoRA is
    agents/model/lora.py's, as for a native family)."""
    if not config.model.path:
        raise ConfigError(
            "model.path", "must name a Hugging Face directory with policy.implementation = 'transformers'"
        )
    if config.policy.backend != "vllm":
        raise ConfigError(
            "policy.backend",
            f"must be 'vllm' with policy.implementation = 'transformers', got '{config.policy.backend}'",
        )
    if config.trainer.compile:
        raise ConfigError("trainer.compile", "must be false with policy.implementation = 'transformers'")
    if config.trainer.share_prefix:
        raise ConfigError(
            "trainer.share_prefix",
            "must be false with policy.implementation = 'transformers' (no shared-prefix attention)",
        )


def _without_env_kwargs(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without the env's keyword arguments (env.kwargs, sft.env_kwargs)."""
    out = copy.deepcopy(raw)
    for section, key in (("env", "kwargs"), ("sft", "env_kwargs")):
        if isinstance(out.get(section), dict):
            out[section].pop(key, None)
    return out


def _add_env_modules(raw: dict[str, Any], modules: Sequence[str]) -> None:
    """Append `modules` (`--env-module`) to raw's env.module, each once (a value of the wrong
    type is left for the conversion to report)."""
    env = raw.setdefault("env", {}) if modules else None
    if not isinstance(env, dict):
        return
    current = env.get("module", [])
    if isinstance(current, str):
        current = [current] if current else []
    if isinstance(current, list):
        current = list(current)
        current += [m for m in dict.fromkeys(modules) if m not in current]
        env["module"] = current


def load_config(
    spec: str | Path | None = None, overrides: Sequence[str] = (), env_modules: Sequence[str] = ()
) -> tuple[Config, dict[str, Any]]:
    """(Config, the raw dict after overrides) from a file path or preset name (None: the CPU demo).
    run.name defaults to the file's stem; `env_modules` (`--env-module`) are added to env.module.

    A file's env kwargs belong to its env id: when the env.id after overrides differs from the
    file's own (a preset's `[env] id`, else the default), the file's env.kwargs and
    sft.env_kwargs are dropped and only those given with --set apply, so a preset's knobs
    (tier = "simple") never reach another env."""
    path = resolve_config_path(str(spec) if spec is not None else DEFAULT_PRESET)
    base = _migrate_sections(read_toml(path))
    overrides = [migrate_override(o) for o in overrides]
    raw = apply_overrides(base, overrides)
    default_id = EnvSection().id
    if _get(raw, "env.id", str, default_id) != _get(base, "env.id", str, default_id):
        raw = apply_overrides(_without_env_kwargs(base), overrides)
    _add_env_modules(raw, env_modules)
    run = raw.setdefault("run", {})
    if isinstance(run, dict) and not run.get("name"):
        run["name"] = path.stem
    return config_from_dict(raw), raw


# ---- checks that look outside the config (before anything starts) ------------------------------


SHIPPED_CHAT_TEMPLATES = PRESETS_DIR / "assets" / "chat_templates"


def chat_template_path(value: str) -> str:
    """`policy.chat_template` / `--chat-template` as a file: "" stays "" (plain ChatML), a shipped
    template's name (`qwen2.5-style`, configs/assets/chat_templates/) becomes its file, anything
    else is a path."""
    if value and not Path(value).exists() and (SHIPPED_CHAT_TEMPLATES / f"{value}.jinja").is_file():
        return str(SHIPPED_CHAT_TEMPLATES / f"{value}.jinja")
    return value


def tokenizer_file(value: str | os.PathLike[str]) -> Path:
    """`tokenizer.path` / `--tokenizer` as a file: a shipped tokenizer's name (`copy`,
    configs/assets/tokenizers/; tools/build_tokenizer.py builds it) becomes its file, anything
    else is a path."""
    path = Path(value)
    shipped = SHIPPED_TOKENIZERS / str(value) / "tokenizer.json"
    if not path.exists() and path.name == str(value) and shipped.is_file():
        return shipped
    return path


def shipped_tokenizer_hint(fingerprint: str) -> str:
    """How to name the shipped tokenizer whose fingerprint this is (each shipped tokenizer.json
    has its tokenizer.fingerprint beside it), for an error about a recording made with it; "" when
    none is."""
    default = PRESETS_DIR / "assets" / "tokenizer.fingerprint"
    if default.is_file() and default.read_text().strip() == fingerprint:
        return "It is the default tokenizer: leave --tokenizer out."
    for file in sorted(SHIPPED_TOKENIZERS.glob("*/tokenizer.fingerprint")):
        if file.read_text().strip() == fingerprint:
            return f"It is the shipped {file.parent.name!r} tokenizer: pass --tokenizer {file.parent.name}."
    return ""


def tokenizer_path(config: Config) -> Path:
    if config.tokenizer.path:
        return tokenizer_file(config.tokenizer.path)
    if config.model.path and (Path(config.model.path) / "tokenizer.json").is_file():
        return Path(config.model.path) / "tokenizer.json"
    return SHIPPED_TOKENIZER


# ---- writing the resolved config --------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value) if not isinstance(value, float) or value == value else "nan"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, Mapping):
        return (
            "{"
            + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None)
            + "}"
        )
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_value(key)


def _is_table(value: Any, free_form: bool) -> bool:
    return isinstance(value, Mapping) and not free_form


def to_toml(data: Mapping[str, Any], prefix: str = "") -> str:
    """A nested dict as TOML tables (None values are left out: TOML has no null, and None is
    every such field's default). Dicts that are free-form values (env kwargs) are inline tables."""
    free_form = {"kwargs", "overrides", "env_kwargs", "engine_args"}
    lines, tables = [], []
    for key, value in data.items():
        if value is None:
            continue
        if _is_table(value, key in free_form):
            tables.append((key, value))
        else:
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    out = ""
    if lines:
        out += (f"[{prefix}]\n" if prefix else "") + "\n".join(lines) + "\n"
    for key, value in tables:
        name = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        body = to_toml(value, name)
        out += ("\n" if out else "") + (body or f"[{name}]\n")
    return out


def config_to_toml(config: Config) -> str:
    return to_toml(msgspec.to_builtins(config))
