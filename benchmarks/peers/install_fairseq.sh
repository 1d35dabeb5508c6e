#!/usr/bin/env bash
# fairseq 0.12.2 in its own venv (benchmark-only, never a dependency of nmt), with the four
# fixes ../shared/PEERS.md describes for Python 3.11 + torch 2.13.
#   bash benchmarks/peers/install_fairseq.sh [VENV]   (default: ../peers/fairseq)
set -euo pipefail
VENV=${1:-$(cd "$(dirname "$0")/../../.." && pwd)/peers/fairseq}
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q torch==2.13.0 numpy cython setuptools wheel
work=$(mktemp -d)
pip download -q fairseq==0.12.2 --no-deps --no-binary :all: --no-build-isolation -d "$work"
tar -xzf "$work"/fairseq-0.12.2.tar.gz -C "$work"
src="$work/fairseq-0.12.2"
# 1. The sdist lacks a C++ source: make the torch C++ extensions unavailable (Cython still builds).
python - "$src/setup.py" <<'PY'
import sys
p = open(sys.argv[1]).read()
p = p.replace("from torch.utils import cpp_extension", "raise ImportError('no torch extensions')", 1) \
    if "from torch.utils import cpp_extension" in p else p
open(sys.argv[1], "w").write(p)
PY
grep -n "cpp_extension" "$src/setup.py" | head -3 || true
pip install -q --no-build-isolation "$src"
# 3. hydra-core 1.0.7 fails on Python 3.11 dataclasses.
pip install -q hydra-core==1.3.2 omegaconf==2.3.0 sacrebleu sentencepiece
# (found without importing fairseq: the import is what fails until the fixes below)
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/fairseq
# 2 + 4. Mutable dataclass defaults -> default_factory; initialize.py reads field.default.
python - "$site" <<'PY'
import re, sys, pathlib
root = pathlib.Path(sys.argv[1])
pattern = re.compile(r"^(\s+\w+: [\w\[\], .]+ = )(\w+Config)\(\)$", re.M)
for path in root.rglob("*.py"):
    text = path.read_text()
    new = pattern.sub(lambda m: f"{m.group(1)}field(default_factory={m.group(2)})", text)
    new = re.sub(r"field\(default=(\w+Config)\(\)\)", r"field(default_factory=\1)", new)
    if new != text:
        if "from dataclasses import" in new and "field" not in new.split("from dataclasses import")[1].split("\n")[0]:
            new = new.replace("from dataclasses import ", "from dataclasses import field, ", 1)
        elif "from dataclasses import" not in new:
            new = "from dataclasses import field\n" + new
        path.write_text(new)
        print("patched", path.relative_to(root))
init = root / "dataclass" / "initialize.py"
t = init.read_text()
t = t.replace("v = FairseqConfig.__dataclass_fields__[k].default\n",
              "f = FairseqConfig.__dataclass_fields__[k]\n"
              "        v = f.default_factory() if f.default is dataclasses.MISSING else f.default\n")
if "import dataclasses" not in t:
    t = "import dataclasses\n" + t
open(init, "w").write(t)
PY
python -c "import fairseq; from fairseq.models.transformer import TransformerModel; from fairseq.sequence_generator import SequenceGenerator; print('fairseq', fairseq.__version__, 'ok')"
