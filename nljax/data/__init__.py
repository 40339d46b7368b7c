"""Data sources: the byte-level ContextStream over a corpus that ships with Python, the recall
probe, and the user's own text files (documents, tokenization, prepared token files)."""
