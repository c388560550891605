"""The engine's flags, one per leaf of the configuration tree, grouped as vLLM groups them.

``--config FILE.yaml`` takes every flag of the command as a key (``port: 8080``,
``max-num-seqs: 8``, ``cache: {block_size: 32}``); flags on the command line win.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from asyncengine.config import ALIASES, SECTION_TITLES, SECTIONS, EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one flag per config leaf. Defaults are None so YAML values are not overridden."""
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(SECTION_TITLES.get(section, section))
        for f in fields(cls):
            if f.name == "model":
                continue  # positional in the CLI (or --model)
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_ = f.metadata.get("help", "")
            default = f.default if f.default is not dataclasses.MISSING else None
            if "default:" not in help_ and "auto:" not in help_:
                help_ = f"{help_} (default: {default})"
            if f.type in ("bool", bool):
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=None, help=help_)
                continue
            type_ = str(f.type)
            kind = (float if type_.startswith("float") else
                    int if type_.startswith("int") else str)
            kw: dict[str, Any] = {"dest": f.name, "type": kind, "default": None}
            for key in ("choices", "nargs"):
                if key in f.metadata:
                    kw[key] = f.metadata[key]
            group.add_argument(*flags, help=help_, **kw)
    return parser


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="read options from a YAML file: any flag of this command, by its "
                             "long name (flags on the command line win)")


def apply_yaml_defaults(parser: argparse.ArgumentParser, command: argparse.ArgumentParser,
                        argv: Sequence[str] | None,
                        args: argparse.Namespace) -> argparse.Namespace:
    """Re-parse ``argv`` with ``parser`` after making the ``--config`` file's values the
    defaults of ``command``'s own flags (``host``, ``port``...): the command line still wins.
    Engine keys are read by ``EngineConfig.from_cli``. An unknown key is a ``ValueError``."""
    path = getattr(args, "config", None)
    if not path:
        return args
    dests = {a.dest for a in command._actions if a.dest != argparse.SUPPRESS}
    engine_keys = {f.name for c in SECTIONS.values() for f in fields(c)} | set(ALIASES)
    defaults: dict[str, Any] = {}
    for key, value in _flat(EngineConfig.from_yaml(path)).items():
        if key in engine_keys:
            continue
        if key not in dests:
            raise ValueError(f"--config: unknown key {key!r} in {path} (see --help)")
        defaults[key] = value
    if not defaults:
        return args
    command.set_defaults(**defaults)
    return parser.parse_args(argv)


def _flat(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        k = str(k).replace("-", "_")
        if k in SECTIONS and isinstance(v, dict):
            out.update((str(kk).replace("-", "_"), vv) for kk, vv in v.items())
        else:
            out[k] = v
    return out
