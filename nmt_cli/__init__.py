"""nmt: Transformer neural machine translation from the command line, and from Python:

from nmt_cli import Translator
model = Translator.load("run")       # a run directory, a package, an export or a checkpoint
model.translate(["A dog runs."])     # ['Ein Hund läuft.']
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # imported on first use: `nmt --help` stays light
    if name == "Translator":
        from nmt_cli.inference.translator import Translator

        return Translator
    raise AttributeError(f"module 'nmt_cli' has no attribute {name!r}")
