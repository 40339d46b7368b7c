"""Parquet, Arrow IPC (file and stream format) and `datasets` save_to_disk folders as data.train /
data.eval: the same documents as a .jsonl give the same tokens, document starts, held-out split
and content digest (the reference); a corpus of many row groups is read in the memory of one;
every bad file is one line, exit 2, nothing written. The files are written here with pyarrow, and
the save_to_disk folder with `datasets` itself."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from nljax import config  # noqa: E402
from nljax.data import documents, prepared  # noqa: E402
from nljax.prepare import main as prepare_main  # noqa: E402
from nljax.train import main as train_main  # noqa: E402

WORDS = "the a memory level stream token window été 記憶 🙂 data row group shard".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    """n documents; some empty (skipped), one with a NUL (removed), multi-byte characters."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "\n" for _ in range(n)]
    docs[3], docs[10], docs[11] = "", "with a \0 NUL inside\n", "\0"
    return docs


def data(*overrides: str):
    return config.load(None, ["data.source=files", "data.eval_fraction=0.2", *overrides]).data


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict:
    """The same 60 documents as a .jsonl (the reference), 3 Parquet shards (row groups of 7, a
    column 'id' beside), an Arrow file (batches of 9), an Arrow stream (large_string), and a
    save_to_disk folder of 3 shards."""
    root = tmp_path_factory.mktemp("columnar")
    docs = _docs(60)
    (root / "ref.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "shards").mkdir()
    for i in range(3):
        part = docs[i * 20:(i + 1) * 20]
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}), root / "shards" / f"part-{i:05d}.parquet",
                       row_group_size=7)
    table = pa.table({"text": docs})
    with pa.OSFile(str(root / "all.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=9)
    large = pa.table({"text": pa.array(docs, pa.large_string())})
    with pa.OSFile(str(root / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, large.schema) as w:
        w.write_table(large, max_chunksize=11)
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs, "n": list(range(60))}).save_to_disk(str(root / "saved"), num_shards=3)
    return {"root": root, "docs": docs}


@pytest.mark.parametrize("spelling", ["shards/*.parquet", "[shards/part-00000.parquet,'shards/part-0000[12].parquet']",
                                      "all.arrow", "stream.arrow", "saved"])
def test_columnar_input_is_the_jsonl_reference(shards, spelling, monkeypatch):
    """Documents whole, in order, empty ones skipped, NUL removed, every 5th held out: the
    tokens, starts and digest of the .jsonl with the same documents."""
    monkeypatch.chdir(shards["root"])
    ref = prepared.build(data("data.train=ref.jsonl"))
    got = prepared.build(data(f"data.train={spelling}"))
    assert got.digest == ref.digest
    for a, b in ((got.train, ref.train), (got.eval, ref.eval)):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.starts, b.starts)
    kept = [d.replace("\0", "") for d in shards["docs"] if d.replace("\0", "")]
    assert got.manifest["train"]["documents"] + got.manifest["eval"]["documents"] == len(kept) == 58
    texts = [bytes(got.eval.tokens[a:e + 1]).decode() for a, e in zip(got.eval.starts, got.eval.ends, strict=True)]
    assert texts == [d + "\0" for i, d in enumerate(kept) if i % 5 == 4]


def test_dictionary_encoded_text_reads_as_its_strings(shards, tmp_path):
    """A dictionary-encoded column (pyarrow's dictionary_encode(), a pandas categorical; of string
    or large_string) in Parquet, an Arrow file and an Arrow stream: its strings, as the .jsonl."""
    pd = pytest.importorskip("pandas")
    docs = shards["docs"]
    ref = prepared.build(data(f"data.train={shards['root']}/ref.jsonl"))
    encoded = pa.table({"text": pa.array(docs).dictionary_encode()})
    assert pa.types.is_dictionary(encoded.schema.field("text").type)
    pq.write_table(encoded, tmp_path / "encoded.parquet", row_group_size=13)
    large = pa.table({"text": pa.array(docs, pa.large_string()).dictionary_encode()})
    pq.write_table(large, tmp_path / "large.parquet")
    pd.DataFrame({"text": pd.Categorical(docs)}).to_parquet(tmp_path / "categorical.parquet")
    assert pa.types.is_dictionary(pq.read_schema(tmp_path / "categorical.parquet").field("text").type)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, encoded.schema) as w:
        w.write_table(encoded, max_chunksize=9)
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, encoded.schema) as w:
        w.write_table(encoded, max_chunksize=11)
    pd.DataFrame({"text": docs}).to_feather(tmp_path / "frame.feather")  # Feather v2: Arrow's IPC file format
    for name in ("encoded.parquet", "large.parquet", "categorical.parquet", "file.arrow", "stream.arrow",
                 "frame.feather"):
        got = prepared.build(data(f"data.train={tmp_path / name}"))
        assert got.digest == ref.digest, name
        np.testing.assert_array_equal(got.train.tokens, ref.train.tokens)


def test_text_key_names_the_column_and_eval_files(shards, tmp_path):
    pq.write_table(pa.table({"content": shards["docs"][:30]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"content": shards["docs"][30:]}), tmp_path / "held.parquet")
    got = prepared.build(data(f"data.train={tmp_path}/c.parquet", f"data.eval={tmp_path}/held.parquet",
                              "data.text_key=content"))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in shards["docs"][:30]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in shards["docs"][30:]))
    ref = prepared.build(data(f"data.train={tmp_path}/a.jsonl", f"data.eval={tmp_path}/b.jsonl", "data.text_key=content"))
    assert got.digest == ref.digest and got.manifest["eval"]["documents"] == 30


def test_prepared_parquet_digest_is_the_same_however_the_paths_are_spelled(shards, tmp_path, monkeypatch, capsys):
    """prepare from a relative glob; a run naming the files absolute (or relative, from the same
    directory) with data.prepared reads them as the same data: the digest a resume compares."""
    monkeypatch.chdir(shards["root"])
    out = tmp_path / "prep"
    assert prepare_main(["data.train=shards/*.parquet", "data.eval_fraction=0.2", f"out={out}"]) == 0
    digest = json.loads((out / "manifest.json").read_text())["digest"]
    assert digest == prepared.build(data("data.train=ref.jsonl")).digest
    for spelling in (f"{shards['root']}/shards/*.parquet", "./shards/../shards/*.parquet"):
        assert prepared.corpus(data(f"data.train={spelling}", f"data.prepared={out}")).digest == digest
    again = tmp_path / "again"
    assert prepare_main([f"data.train={shards['root']}/shards/*.parquet", "data.eval_fraction=0.2", f"out={again}"]) == 0
    assert (again / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    assert json.loads((again / "manifest.json").read_text())["digest"] == digest


def _bad(root: Path) -> None:
    root.mkdir()
    pq.write_table(pa.table({"body": ["a", "b"]}), root / "nocol.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), root / "ints.parquet")
    pq.write_table(pa.table({"text": ["a", None]}), root / "null.parquet")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), root / "norows.parquet")
    (root / "empty.parquet").write_bytes(b"")
    good = root / "good.parquet"
    pq.write_table(pa.table({"text": ["some text"] * 100}), good)
    (root / "cut.parquet").write_bytes(good.read_bytes()[:-20])
    (root / "garbage.arrow").write_bytes(b"not arrow at all" * 10)
    table = pa.table({"text": ["some text"] * 100})
    with pa.OSFile(str(root / "whole.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table, max_chunksize=30)
    (root / "cut.arrow").write_bytes((root / "whole.arrow").read_bytes()[:-100])  # a copy stopped part-way
    with pa.OSFile(str(root / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=30)
    (root / "cutstream.arrow").write_bytes((root / "stream.arrow").read_bytes()[:-100])
    (root / "dict").mkdir()
    (root / "dict" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (root / "dict" / "train").mkdir()
    (root / "dict" / "train" / "state.json").write_text("{}")
    (root / "nothing").mkdir()  # what save_to_disk writes for a dataset of no rows
    (root / "nothing" / "state.json").write_text('{"_data_files": [], "_split": null}')
    (root / "nothing" / "dataset_info.json").write_text("{}")
    (root / "folder").mkdir()
    (root / "folder" / "a.parquet").write_bytes(good.read_bytes())
    # Latin-1 bytes in a string column (a writer that did not check): rows "ok", "fine", "été"
    latin = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(np.array([0, 2, 6, 9], np.int32).tobytes()),
                                                   pa.py_buffer(b"okfine\xe9t\xe9")])
    pq.write_table(pa.table({"text": latin}), root / "latin1.parquet")
    # Feather's first format: its magic, then its own metadata (pyarrow warns that it is deprecated)
    (root / "v1.feather").write_bytes(b"FEA1\0\0\0\0" + b"\0" * 64 + b"FEA1")


BAD = [
    ("R/nocol.parquet", "R/nocol.parquet: no column 'text' (data.text_key; its columns: body)"),
    ("R/ints.parquet", "R/ints.parquet: column 'text' holds int64, not text (data.text_key)"),
    ("R/null.parquet", "R/null.parquet: row 1: column 'text' is null (data.text_key)"),
    ("R/v1.feather", "R/v1.feather: a Feather v1 file (deprecated by pyarrow), not the Arrow format read here: "
                     "write it again as Feather v2"),
    ("R/latin1.parquet", "R/latin1.parquet: row 2: column 'text' holds bytes that are not UTF-8 (invalid "
                         "continuation byte)"),
    ("R/norows.parquet", "data.train: no text in 1 file(s) (every document empty)"),
    ("R/empty.parquet", "R/empty.parquet: not a readable Parquet file"),
    ("R/cut.parquet", "R/cut.parquet: not a readable Parquet file"),
    ("R/garbage.arrow", "R/garbage.arrow: not a readable Arrow file"),
    ("R/cut.arrow", "R/cut.arrow: not a readable Arrow file: cut short or damaged (its footer, which ends the file, "
                    "is missing or unreadable); write or copy it again"),
    ("R/cutstream.arrow", "R/cutstream.arrow: not a readable Arrow file: cut short or damaged (pyarrow: "),
    ("R/dict", "data.train: R/dict holds the splits of a DatasetDict (train): give one, such as R/dict/train"),
    ("R/nothing", "data.train: R/nothing is an empty dataset (its state.json lists no .arrow file)"),
    # a folder of part files (Spark, Dask): the glob of what it holds, not *.txt
    ("R/folder", "data.train: R/folder is a directory (give a glob such as R/folder/*.parquet, or a folder"),
]


@pytest.mark.parametrize("path, message", BAD, ids=[p.split("/")[-1] for p, _ in BAD])
def test_bad_columnar_files_are_one_line_and_write_nothing(tmp_path, capsys, path, message):
    root = tmp_path / "R"
    _bad(root)
    sub = lambda s: s.replace("R/", f"{root}/")
    out = tmp_path / "out"
    assert prepare_main([f"data.train={sub(path)}", f"out={out}"]) == 2
    assert one_line(capsys).startswith(f"nljax.prepare: error: {sub(message)}")
    assert not out.exists()
    run = tmp_path / "run"
    assert train_main(["--quiet", "data.source=files", f"data.train={sub(path)}", f"run.dir={run}"]) == 2
    assert one_line(capsys).startswith(f"nljax.train: error: {sub(message)}")
    assert not run.exists()


def test_without_pyarrow_a_parquet_is_one_line_with_the_pip_command(tmp_path, capsys, monkeypatch):
    pq.write_table(pa.table({"text": ["a"] * 30}), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    assert prepare_main([f"data.train={tmp_path}/a.parquet", f"out={tmp_path / 'out'}"]) == 2
    assert one_line(capsys) == (f"nljax.prepare: error: {tmp_path}/a.parquet: reading Parquet and Arrow files needs "
                                "pyarrow: pip install 'nljax[parquet]'")
    assert not (tmp_path / "out").exists()


def test_importing_nljax_does_not_import_pyarrow():
    code = ("import sys, nljax, nljax.prepare, nljax.train, nljax.data.prepared, nljax.data.documents; "
            "print('pyarrow' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


READ_IN_BOUNDED_MEMORY = """
import sys, tracemalloc
from pathlib import Path
import pyarrow as pa
from nljax import config
from nljax.data import documents, prepared
small, big, out = map(Path, sys.argv[1:])
for path in (small, big):  # what Arrow holds as each list of documents is handed on, at its most
    most = held = 0
    for docs, _, _ in documents.read([path], "text"):
        most, held = max(most, len(docs)), max(held, pa.default_memory_pool().bytes_allocated())
    print(most, held)
prepared.load = lambda path: None  # the prepare alone: its read-back check hashes 16 MB blocks
tracemalloc.start()
d = config.load(None, ["data.source=files", f"data.train={big}"]).data
prepared.build(d, out, workers=0, chunk_bytes=64 << 10)
print(tracemalloc.get_traced_memory()[1])
"""


def test_many_row_groups_are_read_in_the_memory_of_one(tmp_path):
    """Row groups of 50 documents of 2 KB (100 KB): a file of 200 (20 MB of text) is read holding
    what a file of 20 holds, one row group's rows at a time (its compressed pages and decoded text:
    a few row groups' worth, under a twentieth of the text); nljax.prepare on it (chunks of 64 KB, output streamed to disk)
    allocates under 1 MB of Python and numpy memory at its peak, a tenth of the text. (Opening a
    file reads its footer, which grows with the number of row groups, not with the text.)"""
    letters = np.random.default_rng(1).integers(97, 106, size=(10_000, 2000), dtype=np.uint8)
    docs = [row.tobytes().decode().replace("i", " ") for row in letters]
    pq.write_table(pa.table({"text": docs[:1000]}), tmp_path / "small.parquet", row_group_size=50)
    pq.write_table(pa.table({"text": docs}), tmp_path / "big.parquet", row_group_size=50)
    text = sum(map(len, docs))
    group = text // 200
    p = subprocess.run([sys.executable, "-c", READ_IN_BOUNDED_MEMORY, str(tmp_path / "small.parquet"),
                        str(tmp_path / "big.parquet"), str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    small_rows, small_held, big_rows, big_held, python_peak = map(int, p.stdout.split())
    assert small_rows == big_rows == 50  # one row group's documents at a time (BATCH is 1024)
    assert big_held < 1.2 * small_held + group and big_held < text // 20, (small_held, big_held, group)
    assert python_peak < 1 << 20 < text // 10, python_peak
    c = prepared.load(tmp_path / "out")
    assert c.manifest["train"]["documents"] + c.manifest["eval"]["documents"] == 10_000
    assert c.manifest["train"]["bytes"] + c.manifest["eval"]["bytes"] == text + 10_000


def test_a_save_to_disk_folder_lists_its_shards_in_order(shards, tmp_path):
    saved = shards["root"] / "saved"
    files = documents.expand([str(saved)], "data.train")
    state = json.loads((saved / "state.json").read_text())
    assert [p.name for p in files] == [f["filename"] for f in state["_data_files"]] and len(files) == 3
    # a glob that matches the folder reads it in its place among the matches (it was skipped without
    # a word: only files were taken); other folders a glob matches are skipped
    assert documents.expand([f"{shards['root']}/[ers]*"], "data.train") == [
        shards["root"] / "ref.jsonl", *files, shards["root"] / "stream.arrow"]
    # an empty one among the matches adds nothing, as a Parquet file of no rows; named, it is refused
    (tmp_path / "a.txt").write_text("text")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "state.json").write_text('{"_data_files": []}')
    (tmp_path / "b" / "dataset_info.json").write_text("{}")
    assert documents.expand([f"{tmp_path}/*"], "data.train") == [tmp_path / "a.txt"]
    with pytest.raises(config.ConfigError, match=f"data.train: {tmp_path / 'b'} is an empty dataset"):
        documents.expand([str(tmp_path / "b")], "data.train")
    # `**` matches the folder and its own files (state.json, dataset_info.json, its shards): the
    # folder is read once, its metadata files are not text files to refuse
    deep = documents.expand([f"{shards['root']}/sa*/**"], "data.train")
    assert deep == files
    assert documents.expand([f"{shards['root']}/**"], "data.train") == [
        shards["root"] / "all.arrow", shards["root"] / "ref.jsonl", *files, *sorted((shards["root"] / "shards").iterdir()),
        shards["root"] / "stream.arrow"]


def test_a_datasetdict_a_glob_matches_is_refused_as_when_named(tmp_path):
    """A DatasetDict's folder (one folder per split) matched by a glob was skipped without a word
    (`*`) or refused for its dataset_dict.json (`**`): both say which split to give."""
    for split in ("test", "train"):
        (tmp_path / "dd" / split).mkdir(parents=True)
        (tmp_path / "dd" / split / "state.json").write_text('{"_data_files": []}')
        (tmp_path / "dd" / split / "dataset_info.json").write_text("{}")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test", "train"]}')
    (tmp_path / "a.txt").write_text("text")
    for pattern in ("*", "**"):
        with pytest.raises(config.ConfigError, match=f"data.train: {tmp_path / 'dd'} holds the splits of a DatasetDict "
                                                     r"\(test, train\): give one"):
            documents.expand([f"{tmp_path}/{pattern}"], "data.train")


def test_a_glob_into_several_splits_of_a_datasetdict_is_refused(tmp_path):
    """A glob that matches the split folders (dd/*) or their shards (**/*.arrow) of a DatasetDict,
    not its folder, trained on its test split without a word; one split matched is read."""
    for split in ("test", "train"):
        (tmp_path / "dd" / split).mkdir(parents=True)
        (tmp_path / "dd" / split / "state.json").write_text('{"_data_files": [{"filename": "data.arrow"}]}')
        (tmp_path / "dd" / split / "dataset_info.json").write_text("{}")
        (tmp_path / "dd" / split / "data.arrow").write_bytes(b"")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test", "train"]}')
    for pattern in ("dd/*", "dd/*/*.arrow", "dd/**/*.arrow"):
        with pytest.raises(config.ConfigError) as e:
            documents.expand([f"{tmp_path}/{pattern}"], "data.train")
        assert str(e.value) == (f"data.train: '{tmp_path}/{pattern}' matches the splits test, train of the DatasetDict "
                                f"{tmp_path / 'dd'}: give one, such as {tmp_path / 'dd' / 'train'} (or name each)")
    with pytest.raises(config.ConfigError, match=rf"give one, such as {tmp_path / 'dd' / 'test'}$"):
        documents.expand([str(tmp_path / "dd")], "data.eval")  # a held-out split offered for data.eval
    assert documents.expand([f"{tmp_path}/dd/tr*"], "data.train") == [tmp_path / "dd" / "train" / "data.arrow"]
    both = documents.expand([str(tmp_path / "dd" / "train"), str(tmp_path / "dd" / "test")], "data.train")
    assert both == [tmp_path / "dd" / s / "data.arrow" for s in ("train", "test")]


def test_a_split_or_a_dataset_name_not_on_disk_says_what_there_is(tmp_path):
    """A split a DatasetDict folder lacks (`dd/validation`) names the splits it has, and a name
    with no file suffix that is not on disk (a Hugging Face dataset's, which nljax never
    downloads) says how to save one (both were "no file ...")."""
    for split in ("test", "train"):
        (tmp_path / "dd" / split).mkdir(parents=True)
        (tmp_path / "dd" / split / "state.json").write_text('{"_data_files": []}')
        (tmp_path / "dd" / split / "dataset_info.json").write_text("{}")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test", "train"]}')
    with pytest.raises(config.ConfigError, match=rf"^data.eval: {tmp_path / 'dd'} has no split 'validation' \(its "
                                                 r"splits: test, train\)$"):
        documents.expand([str(tmp_path / "dd" / "validation")], "data.eval")
    with pytest.raises(config.ConfigError, match=r"^data.train: no file or folder HuggingFaceFW/fineweb \(a Hugging "
                                                 r"Face dataset is not downloaded: save it once with datasets' "
                                                 r"load_dataset\(...\).save_to_disk\(DIR\) and give DIR"):
        documents.expand(["HuggingFaceFW/fineweb"], "data.train")
    with pytest.raises(config.ConfigError, match=r"^data.train: no file missing.txt$"):
        documents.expand(["missing.txt"], "data.train")


def test_chunks_of_a_parquet_file_end_after_the_row_that_reaches_them(tmp_path):
    """A chunk cut inside a Parquet record batch records the position after the row that reached
    prepare.chunk_bytes: a prepare resumed from any chunk's end reads the rows after it, each
    once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nljax.data import chunks, documents

    texts = [ch * 2048 for ch in "abcd"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")  # one row group, one batch
    files = documents.expand([str(tmp_path / "t.parquet")], "data.train")
    cut = list(chunks.read([files, []], "text", 2048))
    assert [(c.texts, c.end) for c in cut] == [([t], (0, 0, i + 1)) for i, t in enumerate(texts)]
    for i, c in enumerate(cut):
        assert [t for r in chunks.read([files, []], "text", 2048, start=c.end) for t in r.texts] == texts[i + 1:]


def test_an_arrow_record_batch_longer_than_a_list_is_read_row_by_row_once(tmp_path):
    """An Arrow record batch is handed out in lists of up to `batch` rows: each row once, in
    order, and the position after each list is the rows read; resumed from any of them, the
    rest."""
    import pyarrow as pa

    from nljax.data import documents

    texts = [f"row {i}" for i in range(7)]
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("text", pa.string())])) as w:
        w.write_batch(pa.record_batch([pa.array(texts)], names=["text"]))  # one batch of 7 rows
    files = documents.expand([str(tmp_path / "t.arrow")], "data.train")
    lists = list(documents.read(files, "text", batch=3))
    assert [(docs, done) for docs, _, done in lists] == [(texts[:3], 3), (texts[3:6], 6), (texts[6:], 7)]
    for skip in range(8):
        assert [t for docs, _, _ in documents.read(files, "text", (0, skip), batch=3) for t in docs] == texts[skip:]
