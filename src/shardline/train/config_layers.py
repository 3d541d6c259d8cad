"""Where the config layers of ``shardline train`` come from, and how the model node is layered.

Three kinds of experiment files can be selected with ``experiment=...`` (several stacked with
``experiment=[a,b]``):

* a shipped one, by name (``shardline/train/conf/experiment/NAME.yaml``);
* one in a folder passed with ``--config-dir DIR`` (``DIR/experiment/NAME.yaml``; the folder may
  also hold ``trainer_strategy/NAME.yaml``), by name;
* any YAML file, by path (``experiment=path/to/file.yaml``).

Note: how files given by path reach Hydra. Hydra finds experiments only as
``experiment/NAME.yaml`` under a search-path root, so each file given by path is copied into a
private temporary root (as ``experiment/_file<i>_<stem>.yaml``, a name no user file can shadow)
for the duration of the composition. An experiment is always a ``# @package _global_`` overlay;
a copied file without a package line gets that one. Error messages name the original path.

Note: YAML errors in a copied file. The YAML parser names the file it read -- for a file given
by path, the temporary copy, whose lines are shifted by one when a package line was added. The
plan keeps each copy's original and that shift (:attr:`ConfigPlan.copies`), and
:meth:`ConfigPlan.yaml_error` turns the parser's error into one line naming the user's own file,
line and column (files under ``--config-dir`` are read in place and need no mapping).

Note: replacing the model node. Hydra merges every layer's ``model`` node into the previous
one, so an experiment that swaps the model class would inherit the default model's keyword
arguments (``unexpected keyword argument 'n_heads'``). shardline's rule: a layer -- an
experiment file or a command-line override -- that sets ``model._target_`` to a different class
than the layers before it *replaces* the node: only the keys that layer and later ones set
survive. A layer restating the same ``_target_`` merges as usual.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, cast

import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from shardline.engine import ShardingStrategy
from shardline.errors import ConfigurationError

__all__ = [
    "DEFAULT_EXPERIMENT",
    "GROUPS",
    "ConfigPlan",
    "ExperimentRef",
    "apply_model_replacement",
    "prepare",
    "shipped_options",
    "strategy_selection",
    "suggest",
]

DEFAULT_EXPERIMENT = "tiny_gpt"
GROUPS = ("experiment", "trainer_strategy")
_YAML = (".yaml", ".yml")
_PACKAGE_LINE = re.compile(r"^\s*#\s*@package\s+(\S+)", re.M)
_FILE_PREFIX = "_file"


def shipped_options(group: str) -> list[str]:
    """Names of the shipped YAML files of a config group."""
    folder = resources.files("shardline.train.conf") / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def strategy_selection(name: str, config_dirs: Sequence[str | Path] = ()) -> str:
    """The ``trainer_strategy`` file that ``trainer.strategy=NAME`` selects.

    A file of that name -- shipped, or in a ``--config-dir`` -- is taken as named. Otherwise a
    sharding-strategy name or alias (``full_shard``, ``zero3``, ``shard_grad_op``, ``no_shard``,
    ``hybrid_shard``..., :meth:`ShardingStrategy.vocabulary`) selects the shipped file that sets
    that strategy, so every command takes one vocabulary. Anything else is returned unchanged, for
    the composition's own "unknown strategy" error.
    """
    shipped = shipped_options("trainer_strategy")
    if name in shipped or any((Path(d) / "trainer_strategy" / f"{name}.yaml").is_file() for d in config_dirs):
        return name
    wanted = ShardingStrategy.vocabulary().get(name.strip().lower().replace("-", "_"))
    if wanted is None:
        return name
    for option in shipped:
        if _shipped_sharding(option) == wanted.value:
            return option
    return name


def _shipped_sharding(name: str) -> str | None:
    """The ``sharding_strategy`` a shipped strategy file sets."""
    path = _shipped_file("trainer_strategy", name)
    loaded = yaml.safe_load(path.read_text(encoding="utf-8")) if path is not None else None
    value = loaded.get("sharding_strategy") if isinstance(loaded, dict) else None
    return str(value) if value is not None else None


def _shipped_file(group: str, name: str) -> Path | None:
    path = Path(str(resources.files("shardline.train.conf") / group / f"{name}.yaml"))
    return path if path.is_file() else None


def _is_path(item: str) -> bool:
    return item.endswith(_YAML) or "/" in item or "\\" in item


@dataclass(frozen=True)
class ExperimentRef:
    """One selected experiment: the name Hydra sees, how the user wrote it, and its file."""

    name: str
    display: str
    file: Path | None


@dataclass
class ConfigPlan:
    """The overrides handed to Hydra and what the layers are made of (see the module docstring)."""

    overrides: list[str]
    experiments: list[ExperimentRef]
    search_dirs: list[Path]
    cli_model_layers: list[dict[str, Any]] = field(default_factory=list)
    copies: dict[Path, tuple[Path, int]] = field(default_factory=dict)
    """Each temporary copy of a file given by path -> (the user's file, lines added at its top)."""

    def yaml_error(self, exc: yaml.YAMLError) -> str:
        """One line for a YAML syntax error: the user's own file (never a temporary copy), line, column, problem."""
        problem = getattr(exc, "problem", None)
        mark = getattr(exc, "problem_mark", None)
        if problem is None or mark is None:  # an error without a position (e.g. a reader error): its own words
            return "invalid YAML in a config file: " + " ".join(str(exc).split())
        path, shift = self._original(mark.name)
        text = f"{path}, line {mark.line + 1 - shift}, column {mark.column + 1}: invalid YAML: {problem}"
        context = getattr(exc, "context", None)
        context_mark = getattr(exc, "context_mark", None)
        if context:
            where = ""
            if context_mark is not None and (context_mark.line, context_mark.column) != (mark.line, mark.column):
                where = f" at line {context_mark.line + 1 - shift}, column {context_mark.column + 1}"
            text += f" ({context}{where})"
        return text + ". Fix the file and run again."

    def _original(self, name: str) -> tuple[str, int]:
        try:
            copy = Path(name).resolve()
        except (OSError, ValueError):
            return name, 0
        for tmp, (original, shift) in self.copies.items():
            if tmp.resolve() == copy:
                return str(original), shift
        return name, 0

    @property
    def run_name(self) -> str:
        """The experiment(s) as runs are filed: names, or file stems for files given by path."""
        names = [Path(e.display).stem if _is_path(e.display) else e.display for e in self.experiments]
        return "+".join(names) or DEFAULT_EXPERIMENT

    def describe(self, source: str) -> str:
        """``experiment/_file0_x`` (a Hydra config path) as the user knows it."""
        for e in self.experiments:
            if source == f"experiment/{e.name}" and e.file is not None:
                return f"experiment/{e.name}.yaml" if _shipped_file("experiment", e.name) == e.file else str(e.file)
        return f"{source}.yaml"


def _parse(overrides: Sequence[str]) -> list[Any]:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigurationError(
            f"cannot parse the command-line overrides: {text} (Hydra override syntax: key=value)"
        ) from None


def _config_dirs(config_dirs: Sequence[str | Path]) -> list[Path]:
    dirs = []
    for raw in config_dirs:
        path = Path(raw).expanduser().absolute()
        if not path.is_dir():
            raise ConfigurationError(
                f"--config-dir {raw}: no such directory. Pass a folder holding experiment/NAME.yaml (and/or "
                "trainer_strategy/NAME.yaml) files."
            )
        for group in GROUPS:
            clashes = sorted(p.stem for p in (path / group).glob("*.yaml") if p.stem in set(shipped_options(group)))
            if clashes:
                raise ConfigurationError(
                    f"--config-dir {raw}: {group}/{clashes[0]}.yaml has the name of a shipped "
                    f"{group.replace('_', ' ')}, which would take precedence over it silently. Rename your file (e.g. "
                    f"{group}/my_{clashes[0]}.yaml) and select it by that name."
                )
        dirs.append(path)
    return dirs


def _find_experiment(name: str, dirs: Sequence[Path]) -> Path | None:
    shipped = _shipped_file("experiment", name)
    if shipped is not None:
        return shipped
    for d in dirs:
        if (d / "experiment" / f"{name}.yaml").is_file():
            return d / "experiment" / f"{name}.yaml"
    return None


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _copy_experiment(src: Path, dst: Path) -> int:
    """Copy ``src`` to ``dst`` as a global package; returns the lines added at the top (0 or 1)."""
    try:
        text = src.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"experiment={src}: not a UTF-8 text file ({exc.reason} at byte {exc.start}); save it as UTF-8 YAML"
        ) from None
    added = 0
    if not _PACKAGE_LINE.search(text):
        text = "# @package _global_\n" + text
        added = 1
    dst.write_text(text, encoding="utf-8")
    return added


@contextlib.contextmanager
def prepare(overrides: Sequence[str], config_dirs: Sequence[str | Path] = ()) -> Iterator[ConfigPlan]:
    """The plan for composing ``overrides`` (a context: files given by path live in a temporary root meanwhile).

    Raises:
        ConfigurationError: a config folder or experiment file that does not exist, a folder
            shadowing a shipped name, or overrides that do not parse.
    """
    dirs = _config_dirs(config_dirs)
    parsed = _parse(overrides)
    out = list(overrides)
    extra_search: list[str] = []
    experiments: list[ExperimentRef] = []
    cli_layers: list[dict[str, Any]] = []
    copies: dict[Path, tuple[Path, int]] = {}
    selected = False
    with tempfile.TemporaryDirectory(prefix="shardline-experiments-") as tmp:
        root = Path(tmp)
        for index, override in enumerate(parsed):
            key = override.key_or_group
            if key == "hydra.searchpath" and not override.is_delete():
                value = override.value()
                extra_search.extend(str(v) for v in (value if isinstance(value, list) else [value]))
                out[index] = ""
            elif key == "experiment" and not override.is_delete():
                selected = True
                value = override.value()
                items = [str(v) for v in (value if isinstance(value, list) else [value])]
                names = []
                for i, item in enumerate(items):
                    if _is_path(item):
                        src = Path(item).expanduser()
                        if not src.is_file():
                            raise ConfigurationError(
                                f"experiment={item}: no such file. Pass the path of a YAML file, or the name of an "
                                f"experiment ({', '.join(shipped_options('experiment'))}, or one in --config-dir)."
                            )
                        stem = re.sub(r"[^A-Za-z0-9_]", "_", src.stem)
                        name = f"{_FILE_PREFIX}{i}_{stem}"
                        (root / "experiment").mkdir(exist_ok=True)
                        copy = root / "experiment" / f"{name}.yaml"
                        copies[copy] = (src.absolute(), _copy_experiment(src, copy))
                        experiments.append(ExperimentRef(name, item, src.absolute()))
                    else:
                        name = item
                        experiments.append(ExperimentRef(name, item, _find_experiment(name, dirs)))
                    names.append(name)
                out[index] = f"experiment=[{','.join(names)}]" if isinstance(value, list) else f"experiment={names[0]}"
            elif key == "experiment" and override.is_delete():
                selected = True
            elif (key == "model" or key.startswith("model.")) and not override.is_delete():
                cli_layers.append(_cli_model_layer(key, override.value()))
        if not selected:
            experiments.append(
                ExperimentRef(DEFAULT_EXPERIMENT, DEFAULT_EXPERIMENT, _find_experiment(DEFAULT_EXPERIMENT, dirs))
            )
        search = [*dirs, root]
        entries = [_quote(f"file://{d}") for d in search] + [_quote(s) for s in extra_search]
        hydra_overrides = [o for o in out if o]
        hydra_overrides.append(f"hydra.searchpath=[{','.join(entries)}]")
        yield ConfigPlan(
            overrides=hydra_overrides,
            experiments=experiments,
            search_dirs=search,
            cli_model_layers=cli_layers,
            copies=copies,
        )


def _cli_model_layer(key: str, value: Any) -> dict[str, Any]:
    """The top-level model keys a command-line override sets (and the target, if it sets one)."""
    if key == "model":
        return dict(value) if isinstance(value, dict) else {}
    first = key.split(".")[1]
    return {first: value if key.count(".") == 1 else {}}


def _experiment_model(ref: ExperimentRef) -> dict[str, Any]:
    """The ``model`` node an experiment file sets (empty if none, or if the file cannot be read)."""
    if ref.file is None:
        return {}
    try:
        text = ref.file.read_text(encoding="utf-8")
        node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except (OSError, OmegaConfBaseException, ValueError):
        return {}  # Hydra reports the file itself
    package = _PACKAGE_LINE.search(text)
    if package is not None and package.group(1) != "_global_":
        return {}
    model = node.get("model") if isinstance(node, DictConfig) else None
    if not isinstance(model, DictConfig):
        return {}
    container = OmegaConf.to_container(model, resolve=False)
    return dict(cast("dict[str, Any]", container))  # a DictConfig's container is a dict


def apply_model_replacement(cfg: DictConfig, plan: ConfigPlan) -> None:
    """Drop model keys set before the last layer that changed ``model._target_`` (see the module docstring)."""
    layers = [_experiment_model(e) for e in plan.experiments] + plan.cli_model_layers
    target: Any = None
    start: int | None = None
    for i, layer in enumerate(layers):
        if "_target_" in layer:
            if target is not None and layer["_target_"] != target:
                start = i
            target = layer["_target_"]
    if start is None or not isinstance(cfg.get("model"), DictConfig):
        return
    keep = {key for layer in layers[start:] for key in layer}
    with open_dict(cfg):
        for key in [k for k in cfg.model if k not in keep]:
            del cfg.model[key]


def suggest(name: str, options: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
