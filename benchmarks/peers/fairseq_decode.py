"""fairseq 0.12.2's SequenceGenerator (beam 4), random weights of the given shape, every
sentence forced to exactly --length target tokens. Runs in the fairseq venv; prints JSON."""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES  # noqa: E402
from fairseq_train import build  # noqa: E402


def main():
    from fairseq.sequence_generator import SequenceGenerator

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--ids", required=True, help="JSON file: list of source id lists")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    shape = SHAPES[a.shape]
    model = build(shape).eval()
    dictionary = model.decoder.dictionary
    gen = SequenceGenerator(
        [model], dictionary, beam_size=4, max_len_a=0, max_len_b=a.length, min_len=a.length
    )
    sources = json.loads(Path(a.ids).read_text())
    tokens = 0
    with torch.no_grad():
        for i in [-1] + list(range(0, len(sources), a.batch)):  # -1: an untimed warm-up
            if i == 0:
                tokens, start = 0, time.perf_counter()
            chunk = sources[:2] if i < 0 else sources[i : i + a.batch]
            width = max(len(s) for s in chunk) + 1
            src = torch.full((len(chunk), width), dictionary.pad())
            for r, s in enumerate(chunk):  # fairseq pads on the left
                row = [x % (shape["vocab"] - 4) + 4 for x in s] + [dictionary.eos()]
                src[r, width - len(row) :] = torch.tensor(row)
            lengths = (src != dictionary.pad()).sum(1)
            out = gen.generate([model], {"net_input": {"src_tokens": src, "src_lengths": lengths}})
            tokens += sum(len(h[0]["tokens"]) - 1 for h in out)  # without the EOS
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "system": "fairseq SequenceGenerator",
                "seconds": seconds,
                "tokens": tokens,
                "sentences": len(sources),
            }
        )
    )


if __name__ == "__main__":
    main()
