"""Data sources: text read as a ContextStream (`text`: the standard library's own source; `recall`:
the associative-recall probe; the user's own files: `documents` and `columnar` (Parquet, Arrow)
read them, `tokenization`, `chunks` (tokenized in worker processes), `prepared` and `workdir`
(written to disk, resumable)) and
image arrays (`images`), with the config sections `data` (settings.py) and `images` (images.py)."""
