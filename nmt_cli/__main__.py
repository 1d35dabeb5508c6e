"""`python -m nmt_cli` (and `torchrun -m nmt_cli train ...`)."""

from nmt_cli.cli import main

if __name__ == "__main__":
    main()
