"""Generation over a file of prompts (`nljax.generate prompts=FILE out=RESULTS.jsonl`) and over a
list of prompts in Python (`lm.generate([...])`): each completion is the single-prompt decoding
of its prompt with its own generator, keyed by (seed, prompt index, sample index) — prompt 0's
sample 0 is what `prompt=` gives — whatever the other prompts, the batch and the device count;
the results file's records; where a completion ends (the document-end token, stop strings:
nljax/run/stopping.py), row by row, and why (`lm.generate(details=True)`); and the refusals,
one line each."""

import dataclasses
import json
import types

import jax
import numpy as np
import pytest
from helpers import TINY_NL, saved_run

import nljax
from nljax import generate
from nljax.errors import ConfigError
from nljax.run import sampling, trained
from nljax.run.scoring import StreamReader

# TINY_NL at train.seq_len 8: 20 new tokens cross windows of the memory
NL = TINY_NL
SETTINGS = dict(max_new_tokens=20, temperature=1.0, top_k=50, seed=7)
# an empty prompt (a document start: its end token, which resets the memory after the first
# window), one with a document end in its second window, a one-token one, one four windows long
PROMPTS = ["", "def f(x):\n\0  return", "x", "import numpy as np\nimport jax\n"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("batchgen") / "run"
    saved_run(run_dir, NL, 1, 1, steps=1)
    return run_dir


@pytest.fixture(scope="module")
def lm(run_dir):
    """The run loaded once for the module's Python-API tests: its decoders compile once (per row count)."""
    return nljax.load(run_dir)


def _args(run_dir, *more, **settings):
    return [f"run.dir={run_dir}", *more, *(f"{k}={v}" for k, v in {**SETTINGS, **settings}.items())]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cut(text, stops, eos=False):
    """(text, finish reason) of a completion whose whole text (no stops, sampled past the end
    token) is `text`, as `stop=` ends it, worked out character by character: before the earliest
    stop string of the first prefix that holds one; `eos`: or before its first NUL (bytes' end
    token), whichever comes first."""
    before, end, _ = text.partition("\0") if eos else (text, "", "")
    for k in range(len(before) + 1):
        found = [before[:k].find(stop) for stop in stops if stop in before[:k]]
        if found:
            return before[: min(found)], "stop"
    return before, "eos" if end else "length"


def _flat(completions):
    """`sampling.completions`' (i, j, Completion) as (i, j, text, finish reason)."""
    return [(i, j, c.text, c.finish_reason) for i, j, c in completions]


def _stops(text, at=0):
    """The two-character stop strings of `text` from character `at` on, in order, without U+FFFD
    (what a byte that is no UTF-8 reads as: the replacement a character cut short also reads as)
    or NUL."""
    return [text[k : k + 2] for k in range(at, len(text) - 1) if not {"\ufffd", "\0"} & set(text[k : k + 2])]


def _stop_in(text, at):
    """The first of `_stops(text, at)`."""
    return _stops(text, at)[0]


def test_seeded_keeps_the_single_prompts_generator():
    """(seed, 0, 0) draws what np.random.default_rng(seed) drew, over the whole seed range (the
    single-prompt path's generator is unchanged); other indices draw otherwise."""
    for seed in (0, 7, 2**32 - 1, 2**32, 2**40 + 3, 2**63 - 1):
        want = np.random.default_rng(seed).random(8)
        np.testing.assert_array_equal(sampling.seeded(seed).random(8), want)
        draws = {tuple(sampling.seeded(seed, i, j).random(4)) for i in range(3) for j in range(3)}
        assert len(draws) == 9


def test_each_completion_is_its_prompts_single_decoding_on_any_device_count(run_dir):
    """Batched over rows (prompts of different lengths, a batch padded at the end), each
    completion equals `TextSampler.tokens` of its prompt alone, drawn by seeded(seed, i, j), on 1
    and on 8 devices (rows split over them). The memory's output projection is made large so
    that what the memory holds decides the tokens: a row whose memory were written at another
    row's window end, or not reset after an empty prompt's end token, would differ. Sampled past
    the end token (stop_at_eos=false): the text as it always was; then as stop strings and the
    end token end it (its own row's, while the other rows go on)."""
    s = sampling.Settings(**SETTINGS, samples_per_prompt=2, batch_size=3, stop_at_eos=False)
    got, readers = {}, {}
    for n in (1, 8):
        t = trained.load(run_dir, devices=jax.devices()[:n])
        params = jax.tree.map(lambda x: x, t.params)
        out = params["mem0"]["out"]["kernel"]
        params["mem0"]["out"]["kernel"] = 3 * jax.random.normal(jax.random.key(0), out.shape, out.dtype)
        t = dataclasses.replace(t, params=params)
        codec = sampling.tokenization_of(t.cfg)
        ids = [sampling.prompt_ids(codec, p) for p in PROMPTS]
        readers[n] = StreamReader(t.model, t.params, t.run.mesh, t.cfg.train.seq_len, codec.end_id, s.batch_size,
                                  vocab=t.cfg.model.vocab_size)
        assert readers[n].rows == (3 if n == 1 else 8)
        got[n] = _flat(sampling.completions(readers[n], codec, ids, s))
    assert [(i, j) for i, j, _, _ in got[1]] == [(i, j) for i in range(4) for j in range(2)]
    assert got[1] == got[8]
    single = sampling.TextSampler(t.model, t.params, t.run.mesh, t.cfg.train.seq_len, codec.end_id,
                                  vocab=t.cfg.model.vocab_size)
    for i, j, text, why in got[1]:
        tokens = list(single.tokens(ids[i], s, sampling.seeded(s.seed, i, j)))
        assert text == "".join(codec.decode_stream(tokens, context=ids[i])) and why == "length", (i, j)
    assert len({text for _, _, text, _ in got[1]}) == 8  # each its own draw
    # stop strings, each from one completion's text: rows end at different tokens, each stops
    # being extended while the others go on, and each text is still its own whatever the batch
    # (3 rows with the other prompts of its batch, 8 rows over 8 devices)
    texts = [text for _, _, text, _ in got[1]]
    stops = (_stop_in(texts[1], 3), _stop_in(texts[4], 10), _stop_in(texts[6], 15))
    stopped = {n: _flat(sampling.completions(readers[n], codec, ids, dataclasses.replace(s, stop=stops,
                                                                                        stop_at_eos=True)))
               for n in (1, 8)}
    assert stopped[1] == stopped[8]
    assert [(text, why) for *_, text, why in stopped[1]] == [_cut(text, stops, eos=True) for text in texts]
    # rows ended by a stop string and rows run to the length; by the end token too where a text
    # holds one (jax 0.10.2's draws: prompt 0's sample 0; 0.11.2's: none, whose initial
    # parameters differ): test_the_document_end_token_ends_a_completion covers it whatever the draws
    assert {"stop", "length"} <= {why for *_, why in stopped[1]}


def test_the_results_file(run_dir, tmp_path, capsys):
    """A .jsonl file's records: prompt, completion, index, sample, then the input's other
    fields; prompt 0's sample 0 is `prompt=`'s text with the same seed; a prompt's completions do
    not depend on the other prompts or their number; a .txt file is a prompt a line (spaces
    kept, empty lines skipped); progress on standard error; an earlier result is replaced."""
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": p, "id": f"q{i}", "meta": {"n": i}} for i, p in enumerate(PROMPTS)])
    (tmp_path / "in.jsonl").write_text(src.read_text().replace("\n", "\n\n", 1))  # an empty line: skipped
    out = tmp_path / "out.jsonl"
    assert generate.main(_args(run_dir, f"prompts={src}", f"out={out}", samples_per_prompt=2, batch_size=3)) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[-3] == (f"nljax.generate: 4 prompts x 2 samples, 8 at a time (batch_size=3 rounded up to 8, a "
                       f"multiple of 8 devices) -> {out}")  # said why, once
    assert err[-2].startswith("nljax.generate: 8/8 completions, 160 tokens, ") and err[-2].endswith(
        " tokens/s (the first batch compiles too)")
    assert err[-1] == f"nljax.generate: wrote 8 completions to {out}"
    records = _records(out)
    assert [list(r) for r in records] == [["prompt", "completion", "index", "sample", "finish_reason", "new_tokens",
                                           "id", "meta"]] * 8
    assert {r["finish_reason"] for r in records} == {"length"}  # no document end sampled, no stop strings
    assert {r["new_tokens"] for r in records} == {SETTINGS["max_new_tokens"]}
    assert [(r["prompt"], r["index"], r["sample"], r["id"], r["meta"]) for r in records] == [
        (p, i, j, f"q{i}", {"n": i}) for i, p in enumerate(PROMPTS) for j in range(2)]
    assert all(r["completion"] for r in records)
    # prompt 0's sample 0: the single prompt's text with the same seed
    assert generate.main(_args(run_dir, "prompt=")) == 0
    assert capsys.readouterr().out == records[0]["completion"] + "\n"
    # other prompts around a prompt, one sample each, a .txt file: its completions stay
    txt = tmp_path / "in.txt"
    txt.write_bytes(b"other\n\nclass A:  \r\nx\nzzz\n")
    again = tmp_path / "again.jsonl"
    assert generate.main(_args(run_dir, f"prompts={txt}", f"out={again}")) == 0
    moved = _records(again)
    assert [(r["prompt"], r["index"], r["sample"]) for r in moved] == [("other", 0, 0), ("class A:  ", 1, 0),
                                                                         ("x", 2, 0), ("zzz", 3, 0)]
    assert moved[2]["completion"] == records[4]["completion"]  # "x" at index 2 in both files
    # an earlier result is replaced; stop= (a JSON list) cuts each completion before the first
    # stop string in it, and its finish_reason says so
    stops = [_stop_in(moved[1]["completion"], 4), _stop_in(moved[3]["completion"], 8)]
    assert generate.main(_args(run_dir, f"prompts={txt}", f"out={out}", f"stop={json.dumps(stops)}")) == 0
    stopped = _records(out)
    assert [r["prompt"] for r in stopped] == ["other", "class A:  ", "x", "zzz"]
    assert [(r["completion"], r["finish_reason"]) for r in stopped] == [_cut(r["completion"], stops) for r in moved]
    assert [r["finish_reason"] for r in stopped][1::2] == ["stop", "stop"]
    assert all(1 <= r["new_tokens"] <= SETTINGS["max_new_tokens"] for r in stopped)


def test_written_whole_or_not_at_all(run_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C halfway: exit 130, the earlier result whole, no partial file; a file that is not an
    earlier result (the prompts themselves, say) is never replaced."""
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in PROMPTS])
    out = tmp_path / "out.jsonl"
    assert generate.main(_args(run_dir, f"prompts={src}", f"out={out}", max_new_tokens=3)) == 0
    before = out.read_bytes()
    draw, calls = sampling.sample_token, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return draw(*a)

    monkeypatch.setattr(sampling, "sample_token", interrupted)
    assert generate.main(_args(run_dir, f"prompts={src}", f"out={out}")) == 130
    assert len(calls) == 30 and out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]
    capsys.readouterr()
    text = src.read_text()
    assert generate.main(_args(run_dir, f"prompts={src}", f"out={src}")) == 2
    assert capsys.readouterr().err.strip() == (f"nljax.generate: error: out={src} holds a file that is not an "
                                               "nljax.generate result: give a new file name, or move it")
    assert src.read_text() == text


def test_a_list_of_prompts_in_python(lm):
    """`lm.generate([...])`: one text per prompt, the first the prompt's own `generate`, each
    drawn as prompts= draws the prompt's sample 0 (not depending on the others); a str prompt
    still gives a str; a bad list is one line."""
    texts = lm.generate(PROMPTS, **SETTINGS)
    assert isinstance(texts, list) and len(texts) == 4 and all(isinstance(t, str) for t in texts)
    one = lm.generate(PROMPTS[0], **SETTINGS)
    assert isinstance(one, str) and texts[0] == one
    assert lm.generate(("other", *PROMPTS[1:]), **SETTINGS, batch_size=3)[1:] == texts[1:]  # a tuple too
    single, ids = lm.sampler(), [sampling.prompt_ids(lm.tokenizer, p) for p in PROMPTS]
    s = sampling.Settings(**SETTINGS)
    for i, text in enumerate(texts):
        tokens = list(single.tokens(ids[i], s, sampling.seeded(s.seed, i, 0)))
        assert text == lm.decode(tokens), i
    for prompt, line in ((["a", 3], "prompt[1] must be a str, got int 3"),
                         (["a", "\ud800"], "prompt[1] is not UTF-8 text (at character 0)"),
                         ({"a"}, "prompt must be a str or a list of str, got set {'a'}")):
        with pytest.raises(ConfigError) as e:
            lm.generate(prompt, max_new_tokens=2)
        assert str(e.value) == line
    with pytest.raises(ConfigError, match="stream= follows one prompt's text"):
        lm.generate(["a"], stream=print)
    with pytest.raises(ConfigError, match="batch_size must be >= 1, got 0"):
        lm.generate(["a"], batch_size=0)


def test_an_empty_list_and_samples_per_prompt_in_python(lm):
    """`lm.generate([])` is []; `samples_per_prompt=N` > 1 gives N texts per prompt, sample j of
    prompt i keyed as prompts= keys it (sample 0: the one-sample list's text); with one prompt
    (a str) it is refused."""
    assert lm.generate([]) == [] and lm.generate((), samples_per_prompt=3) == []
    texts = lm.generate(PROMPTS[:2], **SETTINGS)
    many = lm.generate(PROMPTS[:2], **SETTINGS, samples_per_prompt=3, batch_size=4)
    assert [len(m) for m in many] == [3, 3] and [m[0] for m in many] == texts
    single, s = lm.sampler(), sampling.Settings(**SETTINGS)
    for i, m in enumerate(many):
        ids = sampling.prompt_ids(lm.tokenizer, PROMPTS[i])
        for j, text in enumerate(m):
            assert text == lm.decode(list(single.tokens(ids, s, sampling.seeded(s.seed, i, j)))), (i, j)
    assert len(set(many[1])) > 1  # the samples differ
    with pytest.raises(ConfigError, match=r"samples_per_prompt=2 is for a list of prompts"):
        lm.generate("x", samples_per_prompt=2)
    with pytest.raises(ConfigError, match="samples_per_prompt must be >= 1, got 0"):
        lm.generate(["x"], samples_per_prompt=0)


def test_the_document_end_token_ends_a_completion(lm):
    """By default (as Hugging Face's eos_token_id) a completion ends at the document-end token (NUL
    for bytes), which is not part of its text: the text without it sampled past (stop_at_eos=False:
    as before, the NUL in it) cut before its first NUL, finish_reason "eos"; the rows that sample
    none are the same text (the same draws). Which rows draw it is read from each row's tokens
    drawn alone (the single prompt's decoder, seeded as the row): with seed 35, prompt 0's sample
    0 (at character 5), prompt 2's sample 1 (first: an empty completion) and prompt 3's sample 0
    on jax 0.10.2; prompt 2's sample 0 too on 0.11.2, whose initial parameters differ. A stop
    string and the end token: the first met ends it. The single prompt's text and stream
    (prompt= and lm.generate(str)) end alike. Each `Completion` counts the tokens drawn for it;
    `lm.generate(details=True)` gives those Completions."""
    s = sampling.Settings(max_new_tokens=40, temperature=1.0, seed=35, samples_per_prompt=2, batch_size=3)
    ids = [sampling.prompt_ids(lm.tokenizer, p) for p in PROMPTS]
    whole = _flat(sampling.completions(lm.stream_reader(3), lm.tokenizer, ids,
                                      dataclasses.replace(s, stop_at_eos=False)))
    drawn = []  # the tokens drawn, after each batch
    completed = list(sampling.completions(lm.stream_reader(3), lm.tokenizer, ids, s,
                                          lambda n, total, t: drawn.append(t)))
    ended = _flat(completed)
    # the reference: each row's 40 tokens drawn alone, sampled past the end token (its NUL in the text)
    single, end = lm.sampler(), lm.end_id
    tokens = [list(single.tokens(ids[k // 2], s, sampling.seeded(s.seed, k // 2, k % 2))) for k in range(8)]
    ends = [k for k, t in enumerate(tokens) if end in t]
    assert 0 < len(ends) < 8  # some rows end at the end token while the others go on
    assert [text for *_, text, _ in whole] == [lm.decode(t) for t in tokens]
    assert {why for *_, why in whole} == {"length"}
    assert [(text, why) for *_, text, why in ended] == [
        (lm.decode(t[: t.index(end)]), "eos") if end in t else (lm.decode(t), "length") for t in tokens]
    assert [(text, why) for *_, text, why in ended] == [
        (text.partition("\0")[0], "eos" if "\0" in text else "length") for *_, text, _ in whole]
    # a row that has ended is not extended: no token drawn after its end token; each completion
    # counts the tokens drawn for it (`new_tokens`): to its end token, which counts, or all 40
    new = [t.index(end) + 1 if end in t else 40 for t in tokens]
    assert drawn[-1] == sum(new)
    assert [c.new_tokens for *_, c in completed] == new
    # the single prompt: as prompt 0's sample 0, streamed in pieces that join to its text
    streamed = []
    assert lm.generate(PROMPTS[0], max_new_tokens=40, temperature=1.0, seed=35, stream=streamed.append) == ended[0][2]
    assert "".join(streamed) == ended[0][2]
    # details=True: those Completions (a list of prompts, samples_per_prompt; one prompt, streamed too)
    got = lm.generate(PROMPTS, max_new_tokens=40, temperature=1.0, seed=35, samples_per_prompt=2, batch_size=3,
                      details=True)
    assert [c for per in got for c in per] == [c for *_, c in completed]
    assert all(type(c) is nljax.Completion for per in got for c in per)
    streamed = []
    one = lm.generate(PROMPTS[0], max_new_tokens=40, temperature=1.0, seed=35, stream=streamed.append, details=True)
    assert one == completed[0][2] == nljax.Completion(ended[0][2], ended[0][3], new[0])
    assert "".join(streamed) == one.text
    assert lm.generate(PROMPTS[0], max_new_tokens=40, temperature=1.0, seed=35, stop_at_eos=False) == whole[0][2]
    # a stop string after the end token is never met; one before it is (in the last row that has
    # one on both sides of its end token)
    k = [k for k in ends if all(_stops(part) for part in whole[k][2].partition("\0")[::2])][-1]
    before, _, after = whole[k][2].partition("\0")
    late, early = next(p for p in _stops(after) if p not in before), _stops(before)[0]
    both = _flat(sampling.completions(lm.stream_reader(3), lm.tokenizer, ids, dataclasses.replace(s, stop=(late,))))
    assert both[k][2:] == ended[k][2:] == (before, "eos")
    both = _flat(sampling.completions(lm.stream_reader(3), lm.tokenizer, ids, dataclasses.replace(s, stop=(early,))))
    assert both[k][2:] == (_cut(whole[k][2], [early])[0], "stop")


def test_stop_strings_in_python(lm):
    """lm.generate(stop=...): a str or a list; each text cut before the first stop string in it,
    as the batch's rows are (a list of prompts) and as the single prompt's stream is (held back
    while its end may begin a stop string: the stream never shows what the text then drops)."""
    settings = dict(SETTINGS, stop_at_eos=False)
    texts = lm.generate(PROMPTS, **settings)
    stops = [_stop_in(texts[0], 6), _stop_in(texts[3], 2)]
    assert lm.generate(PROMPTS, **settings, stop=stops) == [_cut(text, stops)[0] for text in texts]
    assert lm.generate(PROMPTS, **settings, stop=stops[1]) == [_cut(text, stops[1:])[0] for text in texts]
    streamed = []
    one = lm.generate(PROMPTS[0], **settings, stop=stops, stream=streamed.append)
    assert one == _cut(texts[0], stops)[0] == "".join(streamed)
    # details=True: why it ended, and the tokens drawn: up to the one that completed a stop string
    tokens = list(lm.sampler().tokens(sampling.prompt_ids(lm.tokenizer, PROMPTS[0]), sampling.Settings(**settings)))
    n = next(k for k in range(1, len(tokens) + 1) if any(stop in lm.decode(tokens[:k]) for stop in stops))
    assert lm.generate(PROMPTS[0], **settings, stop=stops, details=True) == nljax.Completion(one, "stop", n)
    written = []  # prompt='s terminal text: the prompt, then the same
    sampling.write_text(lm.sampler(), lm.tokenizer, sampling.Settings(prompt=PROMPTS[0], **settings, stop=tuple(stops)),
                        written.append)
    assert "".join(written) == PROMPTS[0] + one
    assert lm.generate(PROMPTS[:2], **settings, stop=None) == texts[:2]  # None: no stop strings, as ()
    # held back: a stop string's first character is not shown until the next settles it
    first = lm.generate(PROMPTS[0], **settings, stop=[texts[0][6:9]], stream=(pieces := []).append)
    assert first == texts[0][:6] and "".join(pieces) == first
    for stop, line in (("", "stop is empty: a stop string ends a completion where it appears, and an empty one "
                            "appears before the first character"),
                       (["a", ""], "stop[1] is empty: "),
                       (["a", 3], "stop[1] must be a str, got int 3"),
                       ({"a"}, "stop must be a str or a list of str, got set {'a'}"),
                       ("\ud800", "stop is not UTF-8 text (at character 0)")):
        with pytest.raises(ConfigError) as e:
            lm.generate(["a"], max_new_tokens=2, stop=stop)
        assert str(e.value).startswith(line), (stop, str(e.value))
    with pytest.raises(ConfigError, match="stop_at_eos must be true or false, got 'false'"):
        lm.generate("a", stop_at_eos="false")
    with pytest.raises(ConfigError, match="^details must be True or False, got 'yes'$"):
        lm.generate("a", details="yes")


def _bad(tmp_path):
    """(files to write, arguments after run.dir=, the line) for each refusal."""
    t = tmp_path
    return [
        ({}, ["prompt=a", f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}"],
         "prompt= and prompts= together: give one prompt (prompt=) or a file of them (prompts=)"),
        ({}, [f"prompts={t / 'missing.txt'}", f"out={t / 'o.jsonl'}"], f"prompts={t / 'missing.txt'}: no such file"),
        ({"p.jsonl": '{"prompt": "a"}\n\n{"text": "b"}\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 3: each line is a JSON object with a string field \"prompt\", got no "
         "\"prompt\" field"),
        ({"p.jsonl": '{"prompt": 3}\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 1: each line is a JSON object with a string field \"prompt\", got "
         "\"prompt\": 3"),
        ({"p.jsonl": '["a"]\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 1: each line is a JSON object with a string field \"prompt\", got a list"),
        ({"p.jsonl": '{"prompt": "a"\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 1: not JSON ("),
        ({"p.jsonl": '{"prompt": "a", "completion": "b"}\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 1: the field \"completion\" is one nljax.generate writes (prompt, completion, "
         "index, sample, finish_reason, new_tokens): rename it in the file"),
        ({"p.jsonl": '{"prompt": "a", "finish_reason": "b"}\n'}, [f"prompts={t / 'p.jsonl'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.jsonl'} line 1: the field \"finish_reason\" is one nljax.generate writes"),
        ({"p.txt": "a\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}", 'stop=["a", ""]'],
         "stop[1] is empty: a stop string ends a completion where it appears"),
        ({"p.txt": ""}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}"], f"prompts={t / 'p.txt'} holds no prompt: "
                                                                            "the file is empty"),
        ({"p.txt": "\n\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.txt'} holds no prompt (empty lines are skipped)"),
        ({"p.txt": "a\n\xff\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.txt'} line 2: not UTF-8 text (at byte 0)"),
        ({"p.csv": "a\n"}, [f"prompts={t / 'p.csv'}", f"out={t / 'o.jsonl'}"],
         f"prompts={t / 'p.csv'}: give a .txt file (one prompt a line) or a .jsonl file (a \"prompt\" field a line)"),
        ({"p.txt": "a\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.json'}"],
         f"out={t / 'o.json'}: the result is JSON lines, give a file name ending in .jsonl"),
        ({"p.txt": "a\n"}, [f"prompts={t / 'p.txt'}"], "prompts= needs out=FILE.jsonl: the file the completions are "
                                                       "written to"),
        ({}, [f"out={t / 'o.jsonl'}"], f"out={t / 'o.jsonl'}: JSON lines are the results of prompts=FILE, which is "
                                       "not given"),
        ({}, [f"out={t / 'o.png'}"], "out= names the results of prompts=FILE (.jsonl) or a MeanFlow (model.name=dit) "
                                     "run's image grid; this run's model is nl_lm: the text of prompt= goes to the "
                                     "terminal"),
        ({}, ["samples_per_prompt=2"], "samples_per_prompt= is for prompts=FILE (many prompts); prompt= samples one "
                                       "completion"),
        ({"p.txt": "a\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}", "samples_per_prompt=0"],
         "samples_per_prompt must be >= 1, got 0"),
        ({"p.txt": "a\n"}, [f"prompts={t / 'p.txt'}", f"out={t / 'o.jsonl'}", "samples=2"],
         "samples= is for a MeanFlow (model.name=dit) run's image grid; this run's model is nl_lm: completions per "
         "prompt of prompts=FILE are samples_per_prompt="),
    ]


def test_a_records_settings_are_said_to_be_copied_not_read(tmp_path, capsys):
    """A .jsonl record's "stop" or "max_tokens" (vLLM's and OpenAI's request fields) was copied to
    the results in silence, the command line's settings applied: one warning line names them."""
    from nljax.data.tokenization import Bytes

    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a", "stop": ["x"], "id": 0}\n{"prompt": "b", "max_tokens": 5, "top_k": 2}\n')
    records, ids = generate._prompts(sampling.Settings(prompts=str(p)), Bytes())
    assert [r.fields for r in records] == [{"stop": ["x"], "id": 0}, {"max_tokens": 5, "top_k": 2}]
    assert capsys.readouterr().err == (
        f"nljax.generate: warning: prompts={p}: the records' fields max_tokens, top_k, stop are copied to the results, "
        "not read: the command line's settings (max_new_tokens=, top_k=, stop=) apply to every prompt\n")
    p.write_text('{"prompt": "a", "id": 0}\n')
    generate._prompts(sampling.Settings(prompts=str(p)), Bytes())
    assert capsys.readouterr().err == ""


def test_each_record_says_the_tokens_drawn(tmp_path, monkeypatch, capsys):
    """A results record's "new_tokens": the tokens drawn for its completion, as
    `lm.generate(details=True)`'s `Completion.new_tokens` gives them, after "finish_reason"; an
    input record holding the field is refused (the result would overwrite it). The completions
    are scripted: no model."""
    from nljax.run import prompts as prompts_lib
    from nljax.run.stopping import Completion

    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": "a", "id": "q0"}, {"prompt": "b"}])
    drawn = {0: Completion("xy", "eos", 3), 1: Completion("zzzz", "length", 4)}
    monkeypatch.setattr(generate, "completions", lambda reader, codec, ids, s, done: ((i, 0, drawn[i]) for i in (0, 1)))
    out = tmp_path / "out.jsonl"
    reader = types.SimpleNamespace(rows=8, devices=8)
    s = sampling.Settings(prompts=str(src), out=str(out), batch_size=8)
    assert generate._write_completions(reader, None, s, prompts_lib.read(str(src)), [[97], [98]]) == 0
    assert _records(out) == [
        {"prompt": "a", "completion": "xy", "index": 0, "sample": 0, "finish_reason": "eos", "new_tokens": 3,
         "id": "q0"},
        {"prompt": "b", "completion": "zzzz", "index": 1, "sample": 0, "finish_reason": "length", "new_tokens": 4}]
    assert [list(r)[4:6] for r in _records(out)] == [["finish_reason", "new_tokens"]] * 2
    capsys.readouterr()
    _jsonl(src, [{"prompt": "a", "new_tokens": 5}])
    with pytest.raises(ConfigError) as e:
        prompts_lib.read(str(src))
    assert str(e.value).startswith(f'prompts={src} line 1: the field "new_tokens" is one nljax.generate writes')


def test_bad_input_is_one_line(run_dir, tmp_path, capsys):
    for files, args, line in _bad(tmp_path):
        for name, text in files.items():
            (tmp_path / name).write_bytes(text.encode("latin-1" if "\xff" in text else "utf-8"))
        assert generate.main([f"run.dir={run_dir}", *args]) == 2, line
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"nljax.generate: error: {line}"), (line, err)
        assert not (tmp_path / "o.jsonl").exists()
        for name in files:
            (tmp_path / name).unlink()


def test_a_prompt_the_tokenizer_cannot_encode_names_its_line(tmp_path):
    """As prompt= is refused (test_generate.py), with the file and line: before anything loads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from nljax.data.tokenization import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainers.BpeTrainer(vocab_size=300,
                                                                                      special_tokens=["<eos>"]))
    tok.save(str(tmp_path / "words.json"))
    words = HFTokenizer(tmp_path / "words.json", "<eos>")
    (tmp_path / "p.txt").write_text("def f\ndef 日本 f\n")
    s = sampling.Settings(prompts=str(tmp_path / "p.txt"), out=str(tmp_path / "o.jsonl"))
    with pytest.raises(ConfigError) as e:
        generate._prompts(s, words)
    assert str(e.value) == (f"prompts={tmp_path / 'p.txt'} line 2: prompt 'def 日本 f': this run's tokenizer has no "
                            f"token for '日本' (the model would not see it): {tmp_path / 'words.json'}")


def test_an_export_gives_its_runs_results(run_dir, tmp_path, capsys):
    """prompts= through an export directory (read as nljax.load reads it, one device): the run's
    records; a bad file of prompts is refused as for a run."""
    from nljax import export

    export.export(trained.load(run_dir, devices=jax.devices()[:1]), tmp_path / "export")
    src = _jsonl(tmp_path / "in.jsonl", [{"prompt": p, "k": i} for i, p in enumerate(PROMPTS)])
    results = []
    for where in (run_dir, tmp_path / "export"):
        out = tmp_path / f"{where.name}.jsonl"
        assert generate.main(_args(where, f"prompts={src}", f"out={out}", samples_per_prompt=2)) == 0
        results.append(_records(out))
    assert results[0] == results[1] and len(results[0]) == 8
    capsys.readouterr()
    (tmp_path / "bad.txt").write_text("")
    bad = _args(tmp_path / "export", f"prompts={tmp_path / 'bad.txt'}", f"out={tmp_path / 'o.jsonl'}")
    assert generate.main(bad) == 2
    assert capsys.readouterr().err.strip().endswith("holds no prompt: the file is empty")
