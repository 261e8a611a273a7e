"""``lightning-tsp`` console script.

    lightning-tsp fit --config recipes/tiny-cpu.yaml              # LightningCLI: fit / validate / test / predict
    lightning-tsp fit --config recipes/paper-7b-128k.yaml --print_config
    lightning-tsp fit --config recipes/tiny-cpu.yaml --ckpt_path auto   # resume from the newest checkpoint, if any
    lightning-tsp plan --model paper-7b --seq-len 131072 --gpus 1024 --gpus-per-node 8
    lightning-tsp demo --tsp-size 2 --steps 150                   # plain PyTorch loop, no Lightning
    lightning-tsp consolidate CKPT_DIR OUT                        # DCP checkpoint -> one file
    lightning-tsp generate MODEL --prompt "def main("             # text generation

Subcommands import only what they need: ``plan`` answers without importing torch, and the Lightning subcommands
import Lightning only when they run. ``python -m lightning_tsp.cli ...`` is the same as ``lightning-tsp ...``.

The Lightning subcommands are a ``LightningCLI`` with :class:`~lightning_tsp.module.TSPLanguageModel` and
:class:`~lightning_tsp.datamodule.TextDataModule` as defaults (any LightningModule / LightningDataModule subclass can
be given with ``class_path``) and ``TSPStrategy`` as the default strategy. ``trainer.strategy`` may be written
``tsp`` (or ``TSPStrategy``): it is expanded to ``class_path: lightning_tsp.TSPStrategy`` with its arguments, so
``--print_config`` and the saved ``config.yaml`` always show them.
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

# name -> (module, help); module None = a LightningCLI subcommand
COMMANDS: dict[str, tuple[str | None, str]] = {
    "fit": (None, "train with LightningCLI (e.g. --config recipes/tiny-cpu.yaml)"),
    "validate": (None, "run the validation loop with LightningCLI"),
    "test": (None, "run the test loop with LightningCLI"),
    "predict": (None, "score sequences with LightningCLI (per-sequence NLL and perplexity)"),
    "plan": ("lightning_tsp.planning.cli", "which parallel layout fits a model, sequence length and cluster"),
    "demo": ("lightning_tsp.demo", "tiny TSP training on CPU processes (plain PyTorch, no Lightning)"),
    "consolidate": ("lightning_tsp.checkpoint", "turn a sharded (DCP) checkpoint into one full file"),
    "generate": ("lightning_tsp.inference.cli", "generate text with a TSP-sharded model"),
}

TSP_CLASS_PATH = "lightning_tsp.TSPStrategy"
_TSP_NAMES = {"tsp", "tspstrategy", "lightning_tsp.tspstrategy", "lightning_tsp.strategy.tspstrategy"}


def _usage() -> str:
    lines = ["usage: lightning-tsp COMMAND [ARGS]   (lightning-tsp COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


# ---- LightningCLI -------------------------------------------------------------------------------------------------


def _is_tsp_name(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in _TSP_NAMES


def _normalise_strategy_args(args: list[str]) -> list[str]:
    """``--trainer.strategy tsp`` / ``=tsp`` -> the class path (so that ``--trainer.strategy.tsp_size 4`` may follow)."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--trainer.strategy" and i + 1 < len(out) and _is_tsp_name(out[i + 1]):
            out[i + 1] = TSP_CLASS_PATH
        elif arg.startswith("--trainer.strategy=") and _is_tsp_name(arg.split("=", 1)[1]):
            out[i] = "--trainer.strategy=" + TSP_CLASS_PATH
    return out


_CLASSES: dict[str, Any] = {}


def _cli_classes() -> dict[str, Any]:
    """The LightningCLI pieces, built on first use (importing Lightning and torch)."""
    if _CLASSES:
        return _CLASSES
    from jsonargparse import Namespace

    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    import lightning_tsp  # noqa: F401  (registers the strategy name "tsp")
    from lightning_tsp.datamodule import TextDataModule
    from lightning_tsp.module import TSPLanguageModel

    def normalise(cfg: Any) -> None:
        """Expand ``strategy: tsp`` into the class form, wherever a trainer section is in ``cfg``."""
        keys = ["trainer.strategy"]
        subcommand = cfg.get("subcommand") if isinstance(cfg, Namespace) else None
        if subcommand:
            keys.insert(0, f"{subcommand}.trainer.strategy")
        for key in keys:
            try:
                value = cfg.get(key)
            except (KeyError, AttributeError, TypeError):
                continue
            if _is_tsp_name(value):
                cfg[key] = Namespace(class_path=TSP_CLASS_PATH)

    class TSPArgumentParser(LightningArgumentParser):
        def _parse_common(self, cfg, *args, **kwargs):  # runs before --print_config prints and before validation
            normalise(cfg)
            return super()._parse_common(cfg, *args, **kwargs)

    class TSPLightningCLI(LightningCLI):
        """LightningCLI with TSPLanguageModel / TextDataModule / TSPStrategy as defaults."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("model_class", TSPLanguageModel)
            kwargs.setdefault("datamodule_class", TextDataModule)
            kwargs.setdefault("subclass_mode_model", True)
            kwargs.setdefault("subclass_mode_data", True)
            kwargs.setdefault("parser_class", TSPArgumentParser)
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            kwargs.setdefault("parser_kwargs", {"prog": "lightning-tsp"})
            defaults = {"strategy": {"class_path": TSP_CLASS_PATH}}
            defaults.update(kwargs.pop("trainer_defaults", None) or {})
            kwargs["trainer_defaults"] = defaults
            super().__init__(*args, **kwargs)

        def _resolve_auto_ckpt_path(self) -> None:
            """``--ckpt_path auto``: the newest complete checkpoint of the run if any (below default_root_dir and
            every ModelCheckpoint dirpath: SLURM hpc_ckpt_N, last, top-k), else None (start from scratch)."""
            from lightning.pytorch.utilities import rank_zero_info

            from lightning_tsp.checkpoint import AUTO_CKPT_PATH, find_latest_checkpoint

            section = self.config_init.get(self.subcommand) if self.subcommand else None
            if section is None or section.get("ckpt_path") != AUTO_CKPT_PATH:
                return
            found = find_latest_checkpoint(self.trainer)
            section["ckpt_path"] = None if found is None else str(found)
            rank_zero_info(f"--ckpt_path {AUTO_CKPT_PATH}: " + (f"resuming from {found}" if found is not None else
                           f"no checkpoint below {self.trainer.default_root_dir} yet, starting from scratch"))

        def before_fit(self) -> None:
            self._resolve_auto_ckpt_path()

        def before_validate(self) -> None:
            self._resolve_auto_ckpt_path()

        def before_test(self) -> None:
            self._resolve_auto_ckpt_path()

        def before_predict(self) -> None:
            self._resolve_auto_ckpt_path()

    _CLASSES.update(TSPArgumentParser=TSPArgumentParser, TSPLightningCLI=TSPLightningCLI)
    return _CLASSES


def lightning_cli(args: list[str] | None = None, **kwargs: Any):
    """Run the package's LightningCLI (``args=None``: ``sys.argv[1:]``, starting with the subcommand)."""
    cls = _cli_classes()["TSPLightningCLI"]
    if args is not None:
        args = _normalise_strategy_args(args)
    elif any(_is_tsp_name(a) or a.startswith("--trainer.strategy=") for a in sys.argv[1:]):
        sys.argv[1:] = _normalise_strategy_args(sys.argv[1:])
    return cls(args=args, **kwargs)


# ---- dispatch -----------------------------------------------------------------------------------------------------


def _run_module(name: str, rest: list[str]) -> int:
    import importlib

    module_name = COMMANDS[name][0]
    assert module_name is not None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the module exists but one of its own imports is missing: show the real error
        print(f"lightning-tsp {name}: this installation has no {module_name} module, so `{name}` is not "
              f"available (update lightning-tsp)", file=sys.stderr)
        return 1
    main = getattr(module, "main", None)
    if main is None:
        print(f"lightning-tsp {name}: {module_name} has no main() entry point", file=sys.stderr)
        return 1
    return int(main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    from_sys = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"lightning-tsp: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in LIGHTNING_COMMANDS:
        # From the console script, LightningCLI reads sys.argv itself: Lightning's subprocess launcher re-runs
        # exactly that command line for the other local ranks.
        # in a context of its own: jsonargparse leaves a context variable holding its parser (and through it the
        # Trainer, the model and their process groups) set after parsing; run in a copy, nothing outlives the
        # run into interpreter shutdown, where gloo's worker threads would abort the process (lightning_tsp.teardown)
        contextvars.Context().run(lightning_cli, None if from_sys else [name, *rest])
        return 0
    return _run_module(name, rest)


if __name__ == "__main__":
    sys.exit(main())
