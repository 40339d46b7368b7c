"""A file of prompts for `python -m nljax.generate prompts=FILE` (nljax/generate.py).

`.txt`: one prompt a line, as it stands (its spaces kept: "def " is not "def"), the line's end
(`\\n` or `\\r\\n`) not part of it; empty lines are skipped. There are no escapes: a prompt that
holds a line break is given in a `.jsonl` file.
`.jsonl`: one JSON object a line with a string field `prompt`; its other fields are copied to
each of the prompt's result records. Empty lines are skipped.

A prompt's index is its place among the prompts (0 for the first), not its line number; errors
name the line (from 1). Every line is read and checked before anything slow runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from nljax.errors import ConfigError

# the fields nljax.generate writes into each result record: an input record's own would be lost
RESULT_FIELDS = ("prompt", "completion", "index", "sample", "finish_reason", "new_tokens")


# what a request record of vLLM's or OpenAI's batch files sets per prompt; nljax.generate's settings
# are its command line's, for every prompt, so such a field is copied to the results and not read
SETTING_FIELDS = ("max_new_tokens", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_at_eos")
SETTING_NAMES = {"max_tokens": "max_new_tokens"}  # a field's nljax.generate setting, where named otherwise


@dataclasses.dataclass(frozen=True)
class Prompt:
    line: int  # the file's line it came from, from 1
    text: str
    fields: dict  # a .jsonl record's other fields (copied to the results); {} for .txt


def read(path: str) -> list[Prompt]:
    """The prompts of `path` (module docstring); one line naming the file and line when it cannot."""
    named = f"prompts={path}"
    p = Path(path).expanduser()
    suffix = p.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise ConfigError(f"{named}: give a .txt file (one prompt a line) or a .jsonl file (a \"prompt\" field a "
                          "line)")
    if p.is_dir():
        raise ConfigError(f"{named} is a directory: give the file of prompts")
    if not p.is_file():
        raise ConfigError(f"{named}: no such file")
    out = []
    with p.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{named} line {n}: not UTF-8 text (at byte {e.start})") from None
            if n == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write: not part of the prompt
            line = line.removesuffix("\n").removesuffix("\r")
            if not (line.strip() if suffix == ".jsonl" else line):  # a .txt line of spaces is a prompt
                continue
            out.append(_record(named, n, line) if suffix == ".jsonl" else Prompt(n, line, {}))
    if not out:
        raise ConfigError(f"{named} holds no prompt" + (" (empty lines are skipped)" if p.stat().st_size else
                                                        ": the file is empty"))
    return out


def _record(named: str, n: int, line: str) -> Prompt:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{named} line {n}: not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        got = (f"a {type(record).__name__}" if not isinstance(record, dict) else
               "no \"prompt\" field" if "prompt" not in record else f"\"prompt\": {json.dumps(record['prompt'])[:40]}")
        raise ConfigError(f"{named} line {n}: each line is a JSON object with a string field \"prompt\", got {got}")
    taken = [k for k in RESULT_FIELDS[1:] if k in record]
    if taken:  # a prompt/completion data set's reference answer would be overwritten in silence
        raise ConfigError(f"{named} line {n}: the field \"{taken[0]}\" is one nljax.generate writes "
                          f"({', '.join(RESULT_FIELDS)}): rename it in the file")
    text = record.pop("prompt")
    try:  # a JSON "\\ud800" escape reads as a lone surrogate, which no tokenizer encodes
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{named} line {n}: the prompt is not UTF-8 text (at character {e.start})") from None
    return Prompt(n, text, record)


def settings_in(prompts: list[Prompt]) -> list[str]:
    """The `SETTING_FIELDS` the records hold, in that order: per-prompt settings that are not read."""
    held = {k for p in prompts for k in p.fields}
    return [k for k in SETTING_FIELDS if k in held]
