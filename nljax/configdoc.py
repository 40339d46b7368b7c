"""The config's keys with their comments: the one source for the config reference page and for
`python -m nljax.train --print-config`.

Each key's documentation is the comment written beside its field in the section's dataclass:
the `# ...` lines right above the field and the `# ...` after it on the same line. They are read
from the source with `tokenize` (a `#` inside a string is not a comment), so the dataclasses stay
the only place a key is described and the reference cannot drift from them
(tests/test_reference.py fails when docs/reference/config.md is stale).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml

from nljax import config


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its dotted name, annotation, default (or resolved value) and comment."""

    name: str  # dotted, e.g. "model.nl_lm.window"
    type: Any  # the field's annotation, resolved
    value: Any  # the default (`config.load()`), or the value in the config walked
    comment: str  # the field's comment, "" where it has none
    bounds: tuple | None  # the section's RANGES entry for a float field: (low, high, low_in, high_in)


@dataclasses.dataclass(frozen=True)
class Section:
    """A dataclass section (`run`, `model.nl_lm`, or "" for the top-level keys) and its own keys."""

    name: str
    cls: type
    keys: tuple[Key, ...]


# ---------------------------------------------------------------------------------------------
# Comments from the source


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} for the dataclass `cls` and the dataclasses it inherits from."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            out.update(_own_comments(klass))
    return out


def _own_comments(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time): no comments
        return {}
    return comments_in_class_body(source)


def comments_in_class_body(source: str) -> dict[str, str]:
    """{name: comment} of the annotated names (`name: type = ...`) in the body of the class whose
    source is `source`: the comment lines just above each (at the body's indentation, no blank
    line between) and the comment on its own line(s), joined into one line of text."""
    out: dict[str, str] = {}
    pending: list[str] = []  # comment lines above the next statement
    body_col, depth = None, 0
    line: list[tokenize.TokenInfo] = []  # the tokens of the current logical line
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.INDENT:
            depth += 1
            body_col = len(tok.string) if body_col is None else body_col
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT and not line:  # a comment on a line of its own
            # at the body's indentation (before the body's first statement, INDENT is not seen yet)
            at_body = tok.start[1] == body_col if body_col is not None else tok.start[1] > 0
            pending = pending + [tok.string] if at_body else []
        elif tok.type == tokenize.NL and not line and tok.line.strip() == "":
            pending = []  # a blank line detaches the comment above it
        elif tok.type == tokenize.NEWLINE:
            name = _annotated_name(line) if depth == 1 else None
            if name:
                trailing = [t.string for t in line if t.type == tokenize.COMMENT]
                trailing += [tok.line[tok.start[1]:].strip()] if tok.string == "" else []
                out[name] = _join(pending + trailing)
            pending, line = [], []
        elif tok.type not in (tokenize.NL, tokenize.ENCODING):
            line.append(tok)
    return out


def _annotated_name(line: list[tokenize.TokenInfo]) -> str | None:
    """`name` when the logical line is `name: ...` (a field), else None."""
    if len(line) >= 2 and line[0].type == tokenize.NAME and line[1].string == ":":
        return line[0].string
    return None


def _join(comments: list[str]) -> str:
    return " ".join(c.lstrip("#").strip() for c in comments if c.lstrip("#").strip())


# ---------------------------------------------------------------------------------------------
# The walk


def sections(cfg: config.Config | None = None) -> Iterator[Section]:
    """Every section of `cfg` (default: the default config, with every registered model's
    section), parents before their subsections, the top-level keys (`seed`) first as section ""."""
    yield from _walk(cfg if cfg is not None else config.load(), "")


def _walk(node: Any, prefix: str) -> Iterator[Section]:
    cls = type(node)
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    ranges = getattr(cls, "RANGES", {})
    keys, subs = [], []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            subs.append((value, f"{prefix}{f.name}"))
        else:
            keys.append(Key(prefix + f.name, hints[f.name], value, comments.get(f.name, ""), ranges.get(f.name)))
    if keys or not prefix:
        yield Section(prefix.rstrip("."), cls, tuple(keys))
    for value, name in subs:
        yield from _walk(value, name + ".")


def _source_of(cls: type) -> str:
    """The file declaring `cls`, from the package's folder on (`nljax/engine/optim.py`)."""
    for klass in cls.__mro__:  # a section class made at run time: the class it extends
        try:
            where = Path(inspect.getsourcefile(klass) or "?").as_posix()
            break
        except TypeError:
            where = "?"
    return where[where.rfind("nljax/"):] if "nljax/" in where else where


def keys(cfg: config.Config | None = None) -> list[Key]:
    return [k for s in sections(cfg) for k in s.keys]


# ---------------------------------------------------------------------------------------------
# How a type and a value are written


def type_text(tp: Any) -> str:
    """An annotation as a reader writes it: `int`, `list of int`, `"a" | "b"`, `str | None`."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(_yaml(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if origin is typing.Union or (origin is not None and origin.__name__ == "UnionType"):
        return " | ".join("None" if a is type(None) else type_text(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    """`value` as one line of YAML that reads back as the same value (flow style for lists)."""
    value = _plain(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, allow_unicode=True).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def bounds_text(bounds: tuple) -> str:
    low, high, low_in, high_in = bounds
    lo = "-inf" if low is None else f"{'[' if low_in else '('}{low}"
    hi = "inf)" if high is None else f"{high}{']' if high_in else ')'}"
    return f"{lo}, {hi}"


# ---------------------------------------------------------------------------------------------
# The resolved config as commented YAML (--print-config)


def to_yaml(cfg: config.Config, width: int = 100) -> str:
    """`cfg` as YAML with each key's comment above it; `config.load` of the text gives `cfg` back."""
    out = ["# nljax config (python -m nljax.train --print-config): every key, resolved, with its comment.",
           "# Give it back with --config FILE; keys left out of a file keep their defaults."]
    for sec in sections(cfg):
        parts = sec.name.split(".")
        if parts[0] == "model" and len(parts) > 1 and parts[1] != cfg.model.name:
            continue  # another model's section: not this run's (`config.own_model`)
        depth = sec.name.count(".") + 1 if sec.name else 0
        if sec.name:
            note = f"{sec.cls.__name__}, {_source_of(sec.cls)}"
            out.append("")
            out.append("  " * (depth - 1) + sec.name.rpartition(".")[2] + ":" + (f"  # {note}" if note else ""))
        pad = "  " * depth
        for k in sec.keys:
            if k.comment:
                out += textwrap.wrap(k.comment, width - len(pad) - 2, initial_indent=pad + "# ",
                                     subsequent_indent=pad + "# ", break_on_hyphens=False)
            out.append(f"{pad}{k.name.rpartition('.')[2]}: {_yaml(k.value)}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# The reference page


CONFIG_PAGE = Path("docs/reference/config.md")
REGENERATE = "python -m nljax.refdoc"


def config_markdown() -> str:
    """docs/reference/config.md: every key of the default config with its type, default and comment,
    one heading per key (so the site's search finds a key by its name)."""
    cfg = config.load()
    out = ["# Config reference", "",
           f"<!-- Generated by `{REGENERATE}` from the config dataclasses' field comments; do not edit. -->", "",
           "Every config key, its type, its default and what it does, generated from the comments beside "
           "the fields of the config dataclasses (each section is declared beside the code that reads it). "
           "Set a key in a YAML file given with `--config` or as a dotted override on the command line "
           "(`train.steps=50`); `python -m nljax.train --print-config` prints the resolved config in the "
           "same form (one that cannot train as it is, such as `data.source=files` before `data.train` is "
           "chosen, is printed too, with a note on standard error saying what it lacks). An unknown key or a value of the wrong type stops the run with one line naming the key.",
           "",
           "A config file may build on another: `base_config: nl_gpu` (a packaged config by name) or "
           "`base_config: ../shared.yaml` (a YAML file, relative to the file naming it) at its top level is read "
           "first, and the file's own keys update it section by section (a base may name a base of its own). "
           "`--config A --config B` layers B on A the same way, and the overrides come last. "
           "`--print-config` and the run's `config.yaml` hold the resolved settings, with no `base_config`.",
           ""]
    for sec in sections(cfg):
        out += _section_markdown(cfg, sec)
    return "\n".join(out).rstrip() + "\n"


def _section_markdown(cfg: config.Config, sec: Section) -> list[str]:
    title = f"`{sec.name}`" if sec.name else "Top-level keys"
    out = [f"## {title}", "", f"`{sec.cls.__name__}`, declared in `{_source_of(sec.cls)}`."]
    doc = (inspect.getdoc(sec.cls) or "").split("\n\n")[0].replace("\n", " ")
    if sec.name and doc and not doc.startswith(sec.cls.__name__ + "("):  # not the generated signature
        out += ["", doc]
    out.append("")
    for k in sec.keys:
        facts = [f"`{type_text(k.type)}`", f"default `{_yaml(k.value)}`"]
        if k.bounds:
            facts.append(f"range `{bounds_text(k.bounds)}`")
        *path, leaf = k.name.split(".")
        as_yaml = "".join(f"{p}: {{" for p in path) + f"{leaf}: {_yaml(k.value)}" + "}" * len(path)
        facts.append(f"YAML `{as_yaml}`")  # also puts the key's own name in the search index
        out += [f"### `{k.name}`", "", " · ".join(facts), ""]
        if k.comment:
            out += [_escape(k.comment), ""]
    return out


def _escape(text: str) -> str:
    """A comment as Markdown: outside `code` spans, `<`, `*` and `_` stand for themselves (not
    HTML or emphasis)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts)
