"""The errors a user sees: `ConfigError`, reported as one line, and `first_line`, which cuts any
other exception down to one for such a report; `check_at_least`, the line for a setting below
its bound.

`ConfigError` lives here rather than in `nljax.config` so that modules the config's validation
reads (`nljax.data`) can raise it without importing the config back.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line."""


def first_line(e: BaseException) -> str:
    """The first non-blank line of `e`'s message, stripped ('' for an empty message)."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), "")


def few(names, most: int = 3) -> str:
    """Up to `most` of `names` for a line of text, ', ...' after them when there are more: a folder
    of a thousand strangers named in one line."""
    names = list(names)
    return ", ".join(map(str, names[:most])) + (", ..." if len(names) > most else "")


def check_at_least(section: str, settings, **least) -> None:
    """One line for the first field of `settings` below its least value (`least`: field=value),
    naming that key and what it was given: a line naming a group of keys left the user to find
    which one it meant."""
    for key, low in least.items():
        value = getattr(settings, key)
        if value < low:
            raise ConfigError(f"{section}.{key} must be >= {low}, got {value}")
