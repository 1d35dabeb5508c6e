"""Models in the Hugging Face format, in and out, without `transformers`: a folder is JSON,
safetensors (or a weights-only pickle) and sentencepiece models.

- read.py: `nmt import` of a MarianMTModel folder (OPUS-MT) as an nmt package;
- write.py: `nmt export --format huggingface`, a folder transformers loads (Marian or M2M100);
- pieces.py: a folder's sentencepiece models and vocabularies renumbered with nmt's ids;
- names.py: transformers' names of nmt's tensors, and the ids both sides share;
- imported.py: what `nmt import` read (read.py makes it, trim.py cuts its vocabulary);
- m2m100.py, weights.py, trim.py: M2M100's and NLLB's numbering, the tensors, the trimming.

The wing may import the ground, the configs, the engine's checkpoint rules and inference/ (the
model it reads or writes, the package writer); nothing outside it imports it but the commands.
"""
