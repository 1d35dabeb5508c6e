"""nmt: Transformer neural machine translation from the command line."""

__version__ = "0.1.0"
