"""The generated references (docs/reference/config.md, commands.md) are current, their source
(the config dataclasses' field comments) is read right, and `nljax.train --print-config` prints
a config that reads back as the same config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nljax import config, configdoc, refdoc, train

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page", ["config", "commands"])
def test_the_generated_reference_is_current(page):
    path, text = next((p, t) for p, t in refdoc.pages(DOCS).items() if p.stem == page)
    current = path.read_text(encoding="utf-8") if path.is_file() else ""
    assert current == text, (f"{path} is stale (a config field, its comment or a command's options changed): "
                             f"regenerate it with `{configdoc.REGENERATE}`")


def test_a_changed_field_comment_makes_the_config_page_stale(tmp_path, monkeypatch):
    assert refdoc.main(["--docs", str(tmp_path)]) == 0
    assert refdoc.stale(tmp_path) == []
    comments = dict(configdoc.field_comments(config.Config().train.__class__))
    comments["steps"] = "optimizer steps, changed"
    real = configdoc.field_comments
    monkeypatch.setattr(configdoc, "field_comments",
                        lambda cls: comments if cls is config.Config().train.__class__ else real(cls))
    assert refdoc.stale(tmp_path) == [tmp_path / "reference" / "config.md"]
    assert refdoc.main(["--check", "--docs", str(tmp_path)]) == 1


def test_comments_are_read_from_the_class_body():
    source = '''class C:
    """Doc: # not a comment."""

    a: int = 1  # after a
    # above b,
    # two lines
    b: str = "x # in a string"
    # detached by the blank line

    c: float = 0.5
    d: tuple[int, ...] = (1,  # first
                          2)  # second

    def check(self) -> None:
        # a method's comment
        e: int = 2  # a local, not a field
    # above f, after the method
    f: bool = True
'''
    assert configdoc.comments_in_class_body(source) == {
        "a": "after a", "b": "above b, two lines", "c": "", "d": "first second", "f": "above f, after the method"}
    assert configdoc.comments_in_class_body("class D:\n    # first, before the body's indent\n    x: int = 0\n") == {
        "x": "first, before the body's indent"}


def test_every_config_key_is_a_heading_of_the_page():
    text = configdoc.config_markdown()
    names = [k.name for k in configdoc.keys()]
    assert len(names) > 80 and "train.steps" in names and "model.nl_lm.window" in names
    missing = [n for n in names if f"### `{n}`\n" not in text]
    assert not missing, f"keys without a heading: {missing}"


def test_types_and_values_are_written_as_yaml_reads_them():
    from typing import Literal
    assert configdoc.type_text(tuple[int, ...]) == "list of int"
    assert configdoc.type_text(Literal["a", "b"]) == "a | b"
    assert configdoc.type_text(int | None) == "int | None"
    assert configdoc._yaml((1, 8)) == "[1, 8]" and configdoc._yaml("007") == "'007'" and configdoc._yaml("") == "''"


def test_print_config_round_trips(tmp_path, capsys):
    overrides = ["train.steps=7", "cms.periods=[1,4]", "run.dir=007", "optim.lr=1e-9", "run.trackers=[]",
                 "train.sample_prompt='def '"]
    assert train.main(["--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "# global rows per optimizer step\n  batch_size: 16\n" in printed  # each key with its comment
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    expected = config.load(None, overrides)
    assert config.load(str(path)) == expected
    assert dataclasses.replace(expected, seed=1) != config.load(str(path))  # the comparison can fail
    assert train.main(["--print-config", "--config", str(path)]) == 0
    assert capsys.readouterr().out == printed
    assert not (tmp_path / "007").exists() and not Path("007").exists()  # nothing was run


def test_print_config_refuses_a_bad_key(capsys):
    assert train.main(["--print-config", "train.stepz=3"]) == 2
    assert "did you mean 'train.steps'" in capsys.readouterr().err


def test_print_config_prints_a_config_that_does_not_train_yet(capsys):
    """`--print-config data.source=files` before data.train is chosen: the config is printed (exit
    0), with one note on standard error saying what it lacks to train; it was refused before."""
    assert train.main(["--print-config", "data.source=files"]) == 0
    out, err = capsys.readouterr()
    assert "  source: files\n" in out and "nljax" not in out.splitlines()[-1]
    assert err.splitlines() == [
        "nljax.train: note: this config does not train as it is: data.source=files needs data.train (paths or globs "
        "of .txt, .jsonl, .txt.gz, .jsonl.gz, .parquet, .arrow or .feather files, or folders datasets' save_to_disk wrote) or "
        "data.prepared (a directory nljax.prepare wrote)"]
    assert train.main(["--print-config", "data.source=files", "train.steps=x"]) == 2  # a wrong value: refused
