"""What `nmt translate`, `nmt score`, `nmt serve` and the Python API run on.

- translator.py: the `Translator` (options in, lines out: the Python API, `nmt translate`'s
  output, what a server asks of it); searcher.py: the search under it, over one of two backends;
- backend.py: the protocol both backends keep and which engine `--engine auto` chooses (and
  what CTranslate2 cannot do); backend_nmt.py (nmt's own engine), backend_ct2.py (CTranslate2);
- models.py: a model found wherever it lies (run, checkpoint, package, export); checks.py: what
  its files must be before anything is built from them; description.py: a model described
  without torch;
- packages.py: the package and CTranslate2 folders nmt writes; ct2_spec.py: nmt's weights as
  CTranslate2's; ct2_cache.py: that conversion made once and kept;
- shortlist.py (lexical shortlists), mbr.py (minimum-Bayes-risk choice), languages.py (a
  multilingual model's language tokens), comet.py and comet_folder.py (COMET and CometKiwi),
  workers.py (decoding spread over processes).

The wing may import the ground, the configs and the engine; the commands, serve/ and hf/ import
it, never the other way.
"""
