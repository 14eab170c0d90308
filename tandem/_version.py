"""The package version, in a module of its own: importing it loads nothing else of tandem."""
__version__ = "0.1.0"
