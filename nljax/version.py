"""The package version (its own module: every other module may import it without importing the package)."""

__version__ = "0.1.0"
