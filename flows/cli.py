"""A command line derived from a pydantic model, so that the CLI and the Prefect form cannot drift.

Each field is a ``--kebab-case`` option (fields of nested models too, flattened; a field may be
given another flag name), its help is the field's description, default and bounds:

- ``Literal`` -> choices; ``bool`` -> ``--x / --no-x``; ``list`` -> several values (``nargs``);
  ``dict`` -> one JSON value;
- one ``list[str]`` field may take everything after ``--`` as it is (the server's own flags).

Options not given are left out, so the model's defaults apply; the model validates the values and
a ValidationError becomes a usage error naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


@dataclass(frozen=True)
class Option:
    """One field of the model as a command-line option."""

    path: tuple[str, ...]  # ("node", "python")
    flag: str  # "--node-python"
    field: FieldInfo
    kind: type  # the annotation without "| None" and list[...]
    is_list: bool

    @property
    def dest(self) -> str:
        return "__".join(self.path)


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(inner type, is a list) of ``X``, ``X | None``, ``list[X]``, ``list[X] | None``. None is the
    default of such fields, never given on the command line."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {annotation}")
        annotation = args[0]
    if get_origin(annotation) is list:
        return get_args(annotation)[0], True
    return annotation, False


def model_options(model: type[BaseModel], flags: dict[str, str] | None = None,
                  prefix: tuple[str, ...] = ()) -> list[Option]:
    """Every leaf field of ``model``; ``flags`` maps a dotted path ("node.python") to its flag."""
    flags = flags or {}
    options = []
    for name, field in model.model_fields.items():
        path = prefix + (name,)
        kind, is_list = _unwrap(field.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            options += model_options(kind, flags, path)
            continue
        flag = "--" + name.replace("_", "-")
        options.append(Option(path, flags.get(".".join(path), flag), field, kind, is_list))
    return options


def _default_text(field: FieldInfo) -> str:
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return "none"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _bounds_text(field: FieldInfo) -> str:
    bounds = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                bounds.append(f"{sign} {getattr(meta, attr)}")
    return f"; {', '.join(bounds)}" if bounds else ""


class ModelCli:
    """``ModelCli(Model, prog=..., flags={"a.b": "--flag"}, rest="a.extra").parse(argv) -> Model``."""

    def __init__(self, model: type[BaseModel], prog: str, description: str | None = None,
                 flags: dict[str, str] | None = None, rest: str | None = None):
        self.model, self.rest = model, tuple(rest.split(".")) if rest else None
        self.options = [o for o in model_options(model, flags) if o.path != self.rest]
        self.parser = argparse.ArgumentParser(prog=prog, description=description,
                                              formatter_class=argparse.RawDescriptionHelpFormatter,
                                              epilog=self._rest_help())
        groups: dict[tuple[str, ...], Any] = {(): self.parser}
        for option in self.options:
            group_path = option.path[:-1]
            if group_path not in groups:
                groups[group_path] = self.parser.add_argument_group(".".join(group_path),
                                                                    self._model_at(group_path).__doc__)
            self._add(groups[group_path], option)

    def _rest_help(self) -> str | None:
        if not self.rest:
            return None
        field = self._field(self.rest)
        return f"-- ARGS...  {field.title}: {field.description}"

    def _model_at(self, path: tuple[str, ...]) -> type[BaseModel]:
        model = self.model
        for part in path:
            model = _unwrap(model.model_fields[part].annotation)[0]
        return model

    def _field(self, path: tuple[str, ...]) -> FieldInfo:
        return self._model_at(path[:-1]).model_fields[path[-1]]

    def _add(self, group, option: Option) -> None:
        field = option.field
        help_text = (f"{field.title}: {field.description or ''} "
                     f"(default: {_default_text(field)}{_bounds_text(field)})").replace("%", "%%")
        kwargs: dict[str, Any] = dict(dest=option.dest, default=argparse.SUPPRESS, help=help_text)
        kind = option.kind
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(kind) is Literal:
            kwargs["choices"] = list(get_args(kind))
        elif get_origin(kind) is dict or kind is dict:
            kwargs.update(type=json.loads, metavar="JSON")
        elif kind in (int, float, str):
            kwargs.update(type=kind, metavar=option.path[-1].upper())
        else:
            raise TypeError(f"{'.'.join(option.path)}: no command-line form for {kind}")
        if option.is_list:
            fixed = [m.max_length for m in field.metadata if getattr(m, "max_length", None) is not None]
            kwargs["nargs"] = fixed[0] if fixed else "*"
        group.add_argument(option.flag, **kwargs)

    def parse(self, argv: list[str] | None = None) -> BaseModel:
        argv = list(sys.argv[1:] if argv is None else argv)
        rest: list[str] = []
        if self.rest and "--" in argv:
            argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
        given = vars(self.parser.parse_args(argv))
        values: dict[str, Any] = {}
        for option in self.options:
            if option.dest in given:
                _set(values, option.path, given[option.dest])
        if rest:
            _set(values, self.rest, rest)
        try:
            return self.model.model_validate(values)
        except ValidationError as exc:
            self.parser.error("; ".join(f"{self._flag_at(e['loc'])}: {e['msg']}" for e in exc.errors()))

    def _flag_at(self, loc: tuple) -> str:
        """The flag of the field a validation error's location points into."""
        loc = tuple(map(str, loc))
        for option in self.options:
            if loc[:len(option.path)] == option.path:
                return option.flag
        return "--" if self.rest and loc[:len(self.rest)] == self.rest else ".".join(loc)


def _set(values: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        values = values.setdefault(part, {})
    values[path[-1]] = value
