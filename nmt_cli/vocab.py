"""The special pieces: the same ids in the sentencepiece model (bpe.py), the binarized data and
the model's embeddings."""

PAD, UNK, BOS, EOS = 0, 1, 2, 3
