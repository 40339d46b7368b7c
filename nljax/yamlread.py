"""YAML as nljax reads it from a user (a config file, an override's value): bounded before it is
built, and strict about keys.

- at most `MAX_BYTES` of text, nested at most `MAX_DEPTH` deep, at most `MAX_NODES` values once
  its aliases are expanded (a few hundred bytes of aliases can stand for hundreds of millions of
  values, which whatever walks the tree then takes minutes or gigabytes for);
- a key given twice in one mapping (a section given twice included) is refused: YAML keeps the
  last silently.

Each limit is one line (`ConfigError`), raised before anything is constructed.
"""

from __future__ import annotations

import yaml

from nljax.errors import ConfigError

MAX_BYTES = 1 << 18  # 256 KiB: a config is a few KiB
MAX_DEPTH = 32  # a config is 3 deep (section.key: [list])
MAX_NODES = 100_000  # values, aliases expanded
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's: several times faster


def load(text: str, what: str):
    """The value of the YAML document `text` (None when empty); `what` names it in the lines."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what} is {len(text):,} characters of YAML, more than the {MAX_BYTES:,} a config may have")
    try:  # bytes that are not UTF-8 reach Python (argv, a file read with surrogateescape) as lone surrogates
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text (at character {e.start})") from None
    _check_depth(text, what)
    loader = _LOADER(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check(node, what, 0, {})
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_depth(text: str, what: str) -> None:
    """Refuses nesting past MAX_DEPTH from the parser's events, before the composer, which
    recurses once per level (thousands of levels: a RecursionError after seconds)."""
    # PyYAML's scanner is quadratic in the flow nesting ([[[[...): bounded on the text first (a
    # bracket inside a quoted string counts too: 33 unclosed ones in a string are refused)
    depth = top = 0
    for c in text:
        if c in "[{":
            depth += 1
            top = max(top, depth)
        elif c in "]}":
            depth -= 1
    if top > MAX_DEPTH:
        raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels ([ and {{ brackets)")
    depth = 0
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def _check(node: yaml.Node, what: str, depth: int, sizes: dict[int, int]) -> int:
    """The number of values under `node` (aliases expanded; `sizes` memoizes shared nodes),
    refusing depth, size and duplicate keys."""
    if id(node) in sizes:
        return sizes[id(node)]
    if depth > MAX_DEPTH:
        raise ConfigError(f"{what} is nested deeper than {MAX_DEPTH} levels (or an alias refers to itself)")
    n = 1
    if isinstance(node, yaml.ScalarNode) and "\x00" in node.value:  # no path or name can hold one
        raise ConfigError(f"{what}: a value holds a NUL character (line {node.start_mark.line + 1})")
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise ConfigError(f"{what}: key '{key.value}' is given twice in one mapping (line "
                                      f"{key.start_mark.line + 1}); YAML would keep the last silently")
                seen.add(key.value)
            n += _check(key, what, depth + 1, sizes) + _check(value, what, depth + 1, sizes)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            n += _check(item, what, depth + 1, sizes)
    if n > MAX_NODES:
        raise ConfigError(f"{what} expands to more than {MAX_NODES:,} values (YAML aliases?): a config is far smaller")
    sizes[id(node)] = n
    return n
