"""Data sources: text read as a ContextStream (`text`: the standard library's own source; `recall`:
the associative-recall probe), the user's own files (`documents` and `columnar` read them,
`tokenization` and `chunks` tokenize them, `prepared` and `workdir` write them to disk), and
image arrays (`images`), with the config sections `data` and `prepare` (settings.py) and `images`
(images.py)."""
