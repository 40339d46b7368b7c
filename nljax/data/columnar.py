"""Parquet and Arrow IPC files as documents, one row each: the column `data.text_key`, read with
pyarrow (the optional extra: pip install 'nljax[parquet]') one row group or record batch at a
time, so a file of any size is read in the memory of its largest row group (or record batch).

An Arrow file is the IPC file format or the stream format (what `datasets.Dataset.save_to_disk`
writes as its `.arrow` shards); a `.feather` file is read as one (Feather v2 is the IPC file format). The column is text: string, large_string, string_view, or a
dictionary of them (pandas categoricals, `dictionary_encode()`), read as its strings. pyarrow is
imported only when such a file is named: `import nljax` never loads it. Every problem is one line
naming the file: no pyarrow, not a Parquet or Arrow file (empty, cut short, damaged), no such
column, a column that is not text, a null row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from nljax.errors import ConfigError, first_line

PARQUET, ARROW = ".parquet", ".arrow"
FEATHER = ".feather"  # pandas' to_feather (Feather v2): the Arrow IPC file format under another name
# how an Arrow file begins: the IPC file format's magic, the stream format's first message marker
FILE_MAGIC, STREAM_MARKER = b"ARROW1", b"\xff\xff\xff\xff"
FEATHER_V1 = b"FEA1"  # Feather's first format (pyarrow's write_feather(version=1)): not Arrow IPC
SUFFIXES = (PARQUET, ARROW, FEATHER)
INSTALL = "pip install 'nljax[parquet]'"


def require_pyarrow(path: Path) -> None:
    """One line with the pip command when pyarrow is missing, before anything is read."""
    try:
        import pyarrow  # noqa: F401 - only whether it is installed
    except ImportError:
        raise ConfigError(f"{path}: reading Parquet and Arrow files needs pyarrow: {INSTALL}") from None


def rows(path: Path, text_key: str, skip: int, batch: int) -> Iterator[tuple[list[str], int]]:
    """The texts of `path`'s column `text_key` from row `skip`, in lists of up to `batch` rows,
    each with the number of rows read so far (the position a resumed read starts from)."""
    require_pyarrow(path)
    import pyarrow as pa

    kind = "Parquet" if path.name.endswith(PARQUET) else "Arrow"
    try:
        yield from (_parquet if kind == "Parquet" else _arrow)(path, text_key, skip, batch)
    except (pa.ArrowException, OSError) as e:  # empty, cut short, damaged, unreadable
        raise ConfigError(f"{path}: not a readable {kind} file ({first_line(e) or type(e).__name__})") from None


def _parquet(path: Path, text_key: str, skip: int, batch: int) -> Iterator[tuple[list[str], int]]:
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as f:  # the footer only; closed when the reader stops, not when collected
        _check_column(path, f.schema_arrow, text_key)
        done = 0
        for group in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(group).num_rows
            if done + n <= skip:  # before the resumed position: not read at all
                done += n
                continue
            # one row group at a time, the text column only: the memory bound
            for part in f.iter_batches(batch_size=batch, row_groups=[group], columns=[text_key], use_threads=False):
                done = yield from _texts(path, part.column(0), text_key, done, skip)


def _arrow(path: Path, text_key: str, skip: int, batch: int) -> Iterator[tuple[list[str], int]]:
    import pyarrow as pa

    with pa.OSFile(str(path)) as source:  # read, not mapped: one record batch in memory at a time
        head = source.read(len(FILE_MAGIC))
        source.seek(0)
        if head.startswith(FEATHER_V1):  # pyarrow's own line: "Expected to read 826361158 metadata bytes"
            raise ConfigError(f"{path}: a Feather v1 file (deprecated by pyarrow), not the Arrow format read here: "
                              "write it again as Feather v2 (the default of pandas' to_feather and pyarrow's "
                              "write_feather) or Parquet")
        reader = None
        try:
            if head == FILE_MAGIC:  # the file format: its footer, at the end, lists the record batches
                reader = pa.ipc.open_file(source)
                parts = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:  # the stream format (save_to_disk's shards): one message after another
                reader = pa.ipc.open_stream(source)
                parts = iter(reader)
            _check_column(path, reader.schema, text_key)
            done = 0
            for record_batch in parts:
                column = record_batch.column(text_key)
                for start in range(0, len(column), batch):
                    done = yield from _texts(path, column.slice(start, batch), text_key, done, skip)
        except (pa.ArrowException, OSError) as e:
            line = _cut_short(path, head, reader is not None, e)
            if line is None:
                raise
            raise ConfigError(line) from None


def _cut_short(path: Path, head: bytes, opened: bool, e: Exception) -> str | None:
    """The line for a file that begins as Arrow (`head`: either format's first bytes) and fails
    further on: cut short or damaged, which pyarrow's words do not say ("Not an Arrow file" for the
    file format without its footer). None for anything else (no Arrow file at all, a read error of
    the disk: errno set), which `rows` words."""
    if (isinstance(e, OSError) and e.errno is not None) or not head.startswith((FILE_MAGIC, STREAM_MARKER)):
        return None
    why = ("its footer, which ends the file, is missing or unreadable" if head == FILE_MAGIC and not opened
           else f"pyarrow: {first_line(e)}")
    return f"{path}: not a readable Arrow file: cut short or damaged ({why}); write or copy it again"


def _texts(path: Path, column, text_key: str, done: int, skip: int):
    """Yield the texts of `column` (rows done .. done + len) at and past row `skip`; return the
    rows done after it."""
    import pyarrow as pa

    end = done + len(column)
    if end > skip:
        start = done + max(0, skip - done)  # the file's row of the column's first
        column = column.slice(max(0, skip - done))
        if pa.types.is_dictionary(column.type):  # categories: the strings they stand for
            column = column.dictionary_decode()
        if column.null_count:
            first = start + column.is_null().to_pylist().index(True)
            raise ConfigError(f"{path}: row {first}: column '{text_key}' is null (data.text_key)")
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError as e:  # the row found again one by one: only on the way to this line
            row = start + next(i for i in range(len(column)) if not _decodes(column[i]))
            raise ConfigError(f"{path}: row {row}: column '{text_key}' holds bytes that are not UTF-8 "
                              f"({e.reason})") from None
        yield texts, end
    return end


def _decodes(value) -> bool:
    """Whether one string of a column reads as UTF-8 text."""
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def _check_column(path: Path, schema, text_key: str) -> None:
    import pyarrow as pa

    if text_key not in schema.names:
        names = ", ".join(schema.names[:8]) + (", ..." if len(schema.names) > 8 else "")
        raise ConfigError(f"{path}: no column '{text_key}' (data.text_key; its columns: {names or 'none'})")
    kind = schema.field(text_key).type
    if pa.types.is_dictionary(kind):  # pandas categoricals, dictionary_encode(): read as their values
        kind = kind.value_type
    string_view = getattr(pa.types, "is_string_view", lambda t: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or string_view(kind)):
        raise ConfigError(f"{path}: column '{text_key}' holds {kind}, not text (data.text_key)")
