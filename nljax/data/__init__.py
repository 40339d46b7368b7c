"""Data sources: the byte-level ContextStream over a corpus that ships with Python."""
