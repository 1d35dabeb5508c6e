"""Models in the Hugging Face format, in and out, without `transformers`: a folder is JSON,
safetensors (or a weights-only pickle) and sentencepiece models.

- read.py: `nmt import` of a MarianMTModel folder (OPUS-MT) as an nmt package;
- write.py: `nmt export --format huggingface`, a folder transformers loads (Marian or M2M100);
- pieces.py: a folder's sentencepiece models and vocabularies renumbered with nmt's ids;
- names.py: transformers' names of nmt's tensors, and the ids both sides share.

The wing may import the ground (config, errors, files, models, vocab, export) and the engine's
checkpoint rules; nothing outside it imports it but the commands (cli/).
"""
