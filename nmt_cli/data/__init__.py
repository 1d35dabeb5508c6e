"""What `nmt prep` is made of: recipes.py (each recipe's corpora and pinned files), fetch.py
(downloads and mirrors, checked and safely extracted), filters.py (what cleaning keeps).

The wing may import the ground and the configs; only the commands import it.
"""
