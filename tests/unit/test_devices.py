"""Which GPU the engine's CUDA calls act on, checked on the CPU: every device handed out has its
index, every call that acts on "the current GPU" names one or runs inside torch.cuda.device, and
the threads and graphs that run on a GPU other than GPU 0 act on that GPU (tests/strict_cuda.py
stands in for torch.cuda)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from strict_cuda import Mistake, StrictCuda

import nmt_cli
from nmt_cli.config import resolve_device_name
from nmt_cli.engine import batches, graphed
from nmt_cli.engine.device import resolve_device
from nmt_cli.engine.figures import Figures
from nmt_cli.errors import NmtError


@pytest.fixture
def cuda(monkeypatch) -> StrictCuda:
    monkeypatch.setattr(graphed, "_failed", None)
    return StrictCuda(count=2).install(monkeypatch)


def test_every_gpu_is_handed_out_with_its_index(cuda):
    assert resolve_device_name("auto", True) == "cuda:0"
    assert resolve_device_name("cuda", True) == "cuda:0"
    assert resolve_device_name("cuda:1", True) == "cuda:1"
    assert resolve_device_name("auto", False) == "cpu"
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(NmtError, match="2 GPU"):
        resolve_device("cuda:2")
    with pytest.raises(NmtError, match="unknown --device"):
        resolve_device_name("cuda:x", True)


def test_a_graphed_step_on_another_gpu_records_and_replays_its_kernels(cuda):
    """The step's tensors on cuda:1 while the thread's current GPU is 0 (a --gpus worker, a
    server's thread): the graph is recorded on cuda:1's stream, holds the step's kernels and is
    replayed; the body runs twice (warm-up, recording), then only replays."""
    gpu = torch.device("cuda", 1)
    runs = []

    def body() -> torch.Tensor:
        cuda.launch(gpu)
        runs.append(cuda.current_stream(gpu))
        return torch.tensor([float(len(runs))])

    step = graphed.Replayed(body, gpu)
    outs = [step() for _ in range(5)]
    assert graphed._failed is None
    assert len(runs) == 2 and not runs[0].default and runs[0] is runs[1]  # both on the side stream
    (graph,) = cuda.graphs
    # a capture runs nothing: the step recorded is replayed too, as is every later one
    assert graph.device == 1 and graph.nodes == 1 and graph.replays == 4
    assert [o.item() for o in outs] == [1.0, 2.0, 2.0, 2.0, 2.0]
    assert cuda.current() == 0  # the caller's current GPU is left as it was
    assert all(launched == current == 1 for launched, current in cuda.kernels)


def test_beam_search_steps_replay_one_graph_per_tensor_of_the_cache(cuda):
    """Under beam search the cache's rows move from one of its tensors to the other at every
    step: a graph is recorded for each (the step's key), and each step replays its own."""
    gpu = torch.device("cuda", 0)
    step = graphed.Replayed(lambda: cuda.launch(gpu) or torch.zeros(1), gpu)
    for parity in (0, 1, 0, 1, 0, 1):
        step(parity)
    assert [g.replays for g in cuda.graphs] == [3, 2]  # parity 1 recorded first (step 2)


def test_each_search_records_into_a_pool_of_its_own_given_back_with_its_graphs(cuda):
    """Searches one after another on two GPUs: each records both parities into one pool of its
    own, freed with its graphs, and the next records into a new one (torch refuses a capture into
    a pool whose graphs are all gone: one pool per GPU for the process recorded the first search
    only, then every later one fell back to eager steps)."""
    pools = []

    def recorded(gpu: torch.device) -> None:
        step = graphed.Replayed(lambda: cuda.launch(gpu) or torch.zeros(1), gpu)
        for parity in (0, 1, 0, 1):
            step(parity)
        assert [g.replays for g in cuda.graphs] == [2, 1] and len({g.pool for g in cuda.graphs}) == 1
        pools.append((cuda.graphs[0].pool, cuda.graphs[0].device))

    for index in (1, 0, 1, 1):
        recorded(torch.device("cuda", index))
        assert not cuda.graphs  # freed with their search
    assert graphed._failed is None
    assert len({pool for pool, _ in pools}) == 4 and [device for _, device in pools] == [1, 0, 1, 1]
    assert set(cuda.released) == {pool for pool, _ in pools}


def test_the_graphs_of_an_ensemble_share_their_searchs_pool(cuda):
    gpu = torch.device("cuda", 0)
    pool = graphed.Pool()
    steps = [graphed.Replayed(lambda: cuda.launch(gpu) or torch.zeros(1), gpu, pool) for _ in range(2)]
    for parity in (0, 1, 0):
        for step in steps:
            step(parity)
    assert len(cuda.graphs) == 4 and {g.pool for g in cuda.graphs} == {pool.handles[0]}


def test_the_server_says_whether_its_steps_are_graphs_and_why_not(cuda):
    """/health's cuda_graphs (Translator.cuda_graphs): on a GPU "on", or "off:" and why (a
    recording that failed in this process, after which none is tried again); nothing elsewhere."""
    from types import SimpleNamespace

    from nmt_cli.inference.translator import Translator

    translator = Translator.__new__(Translator)  # its engine and backend are all this reads
    translator.engine = "nmt"
    translator.backend = SimpleNamespace(device=torch.device("cpu"), graphs=None)  # type: ignore[assignment]
    assert translator.cuda_graphs() is None  # a CPU
    translator.backend.device = torch.device("cuda", 0)
    assert translator.cuda_graphs() == "on"
    graphed._failed = "operation not permitted when stream is capturing"
    assert translator.cuda_graphs() == f"off: recording failed ({graphed._failed})"
    step = graphed.Replayed(lambda: torch.ones(1), torch.device("cuda", 0))
    assert [step().item() for _ in range(3)] == [1.0, 1.0, 1.0] and not cuda.graphs  # never recorded
    translator.backend.graphs = False
    graphed._failed = None
    assert translator.cuda_graphs() == "off: not asked for"


def test_a_shortlist_on_a_gpu_is_one_line_before_any_model_is_loaded(cuda):
    """--shortlist turns the graphed steps off (they score a batch's own ids): refused on a GPU
    until a GPU has measured it, before anything is loaded."""
    from types import SimpleNamespace

    from nmt_cli.config import TranslateConfig
    from nmt_cli.inference.backend_nmt import Backend

    nothing = SimpleNamespace(parts=())  # nothing of the model is read before the refusal
    with pytest.raises(NmtError, match="--shortlist is for decoding on a CPU"):
        Backend(nothing, TranslateConfig(device="cuda:1", shortlist=True))  # type: ignore[arg-type]


def test_a_cpu_step_is_never_recorded(cuda):
    step = graphed.Replayed(lambda: torch.ones(1), torch.device("cpu"))
    assert [step().item() for _ in range(3)] == [1.0, 1.0, 1.0] and not cuda.graphs


def test_the_collation_thread_copies_to_its_rank_gpu(cuda, monkeypatch):
    """The thread that collates a GPU run's batches acts on the run's GPU, for `--device cuda`
    (resolved to cuda:0) and for cuda:1 (a rank's GPU), not on GPU 0 or an unindexed one."""
    seen = []

    def copied(arrays, device, every_position=False):
        seen.append((cuda.current(), device))
        return arrays

    monkeypatch.setattr(batches, "collate", lambda src, tgt, planned: planned)
    monkeypatch.setattr(batches, "to_device", copied)
    for name, index in (("cuda", 0), ("cuda:1", 1)):
        seen.clear()
        device = resolve_device(name)
        groups = [[n, n + 1] for n in range(0, 12, 2)]
        split = SimpleNamespace(src=None, tgt=None)
        out = list(batches.on_device(split, groups, device, ahead=2))
        assert out == groups
        assert seen and all(current == index and d == torch.device("cuda", index) for current, d in seen)


def test_the_figures_copy_and_event_are_on_the_rows_gpu(cuda, monkeypatch):
    """The training figures' pinned copy is made and its event recorded with the rows' GPU
    current, whatever the thread's (rows stand in: a CPU tensor reporting cuda:1)."""

    class OnGpu:
        device = torch.device("cuda", 1)
        shape, dtype = (1, 5), torch.float64

    recorded = []
    monkeypatch.setattr(torch, "stack", lambda rows: OnGpu())
    monkeypatch.setattr(torch, "empty", lambda *a, **k: recorded.append(cuda.current()) or torch.zeros(1))
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: self)
    figures = Figures(late=True)
    figures.add(None)
    figures.close(1, 0, 0.1)
    (window,) = figures.closed
    assert recorded == [1] and window.arrived.stream.device_index == 1


# -- every call into torch.cuda that acts on "the current GPU" names its GPU ---------------------

# torch.cuda's functions that act on the current GPU unless given one (as their first argument,
# or `device`), and those that take none: these must run inside torch.cuda.device(...).
NAMES_A_DEVICE = {
    "Stream": 0,
    "current_stream": 0,
    "default_stream": 0,
    "set_device": 0,
    "synchronize": 0,
    "memory_allocated": 0,
    "max_memory_allocated": 0,
    "memory_reserved": 0,
    "max_memory_reserved": 0,
    "reset_peak_memory_stats": 0,
    "memory_stats": 0,
    "mem_get_info": 0,
    "get_rng_state": 0,
    "set_rng_state": 1,
    "get_device_properties": 0,
    "get_device_name": 0,
    "get_device_capability": 0,
    "stream": 0,
}
NAMES_NONE = {"CUDAGraph", "graph", "graph_pool_handle", "Event", "empty_cache", "manual_seed", "seed"}
METHODS = {"capture_begin", "capture_end", "replay"}  # a graph's: on the current GPU's stream


def _is_cuda_call(func: ast.expr, name: str | None = None) -> str | None:
    """`torch.cuda.X` (X, or only `name`)."""
    if (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "cuda"
        and isinstance(func.value.value, ast.Name)
        and func.value.value.id == "torch"
        and (name is None or func.attr == name)
    ):
        return func.attr
    return None


def device_mistakes(tree: ast.AST, where: str) -> list[str]:
    """Each call in `tree` that acts on whichever GPU is current: torch.cuda's without a device
    outside `with torch.cuda.device(...)`, a graph's capture or replay outside one, an
    unindexed `torch.device("cuda")` or `.cuda()`."""
    found: list[str] = []

    def visit(node: ast.AST, inside: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside = False  # a function body runs wherever it is called from
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
            isinstance(item.context_expr, ast.Call) and _is_cuda_call(item.context_expr.func, "device")
            for item in node.items
        ):
            for item in node.items:
                visit(item.context_expr, inside)
            for child in node.body:
                visit(child, True)
            return
        if isinstance(node, ast.Call):
            at = f"{where}:{node.lineno}"
            name = _is_cuda_call(node.func)
            named = any(k.arg == "device" for k in node.keywords)
            if name in NAMES_A_DEVICE and not inside and not named and len(node.args) <= NAMES_A_DEVICE[name]:
                found.append(f"{at}: torch.cuda.{name} without a device")
            if name in NAMES_NONE and not inside:
                found.append(f"{at}: torch.cuda.{name} outside torch.cuda.device(...)")
            method = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if method in METHODS and not inside:
                found.append(f"{at}: .{method}() outside torch.cuda.device(...)")
            if method == "cuda" and not node.args and not node.keywords:
                found.append(f"{at}: .cuda() without an index")
            is_device = isinstance(node.func, ast.Attribute) and node.func.attr == "device"
            if is_device and [getattr(a, "value", None) for a in node.args] == ["cuda"]:
                found.append(f'{at}: torch.device("cuda") without an index')
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def test_the_package_names_the_gpu_of_every_current_device_call():
    """The package, and the benchmarks that the GPU call runs."""
    root = Path(nmt_cli.__file__).parents[1]
    found = []
    for path in sorted([*(root / "nmt_cli").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        found += device_mistakes(ast.parse(path.read_text()), str(path.relative_to(root)))
    assert not found, "\n".join(found)


def test_the_walk_finds_each_kind_of_mistake():
    code = """
import torch
def a(x):
    s = torch.cuda.Stream()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    g.capture_begin()
    torch.cuda.set_rng_state(x)
    d = torch.device("cuda")
    return x.cuda()
def b(x, dev):
    with torch.cuda.device(dev):
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        g.replay()
        def later():
            torch.cuda.synchronize()
    torch.cuda.set_rng_state(x, dev)
    return torch.cuda.current_stream(dev), torch.cuda.Stream(device=dev)
"""
    found = device_mistakes(ast.parse(code), "x")
    assert [f.split(": ", 1)[1].split()[0] for f in found] == [
        "torch.cuda.Stream",
        "torch.cuda.current_stream",
        "torch.cuda.CUDAGraph",
        ".capture_begin()",
        "torch.cuda.set_rng_state",
        'torch.device("cuda")',
        ".cuda()",
        "torch.cuda.synchronize",
    ], found


def test_the_strict_recorders_refuse_what_torch_lets_through(cuda):
    with pytest.raises(Mistake, match="without its index"):
        cuda.set_device(torch.device("cuda"))
    graph = cuda.CUDAGraph()
    with cuda.stream(cuda.Stream(0)):
        graph.capture_begin()
        with pytest.raises(Mistake, match="capturing on cuda:0"):
            cuda.launch(torch.device("cuda", 1))
        with pytest.raises(Mistake, match="empty"):
            graph.capture_end()
    np.testing.assert_equal(cuda.current(), 0)


def test_bf16_arithmetic_is_what_the_kernels_may_use_not_only_what_the_cpu_has(monkeypatch):
    """CI's forced pass holds the kernels to AVX2 on a newer CPU: --precision auto must then
    choose as an AVX2-only machine does (fp32), though the CPU has bf16 arithmetic."""
    from nmt_cli.engine.device import cpu_has_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    assert cpu_has_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_has_bf16()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_has_bf16()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not cpu_has_bf16()


def test_tf32_is_on_while_a_tf32_search_runs_and_put_back_after(cuda):
    """--precision tf32: the process's TensorFloat-32 switch is on inside each search (every
    batch, in whichever thread) while any such search runs, and as it was once none does; fp32
    searches leave it alone. On the CPU it is one line."""
    from nmt_cli.config import TranslateConfig
    from nmt_cli.engine.device import matmuls
    from nmt_cli.inference.backend_nmt import Backend

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    backend = Backend.__new__(Backend)  # what _each reads
    backend.device, backend.threads, backend.caller_threads = torch.device("cuda", 1), 1, 0
    for precision, inside in (("tf32", "tf32"), ("fp32", before)):
        backend.precision = precision
        seen = list(backend._each(lambda _: matmul.fp32_precision, [1, 2]))
        assert seen == [inside, inside] and matmul.fp32_precision == before
    with matmuls("tf32"):  # two searches that overlap: on until the last one ends
        with matmuls("tf32"):
            assert matmul.fp32_precision == "tf32"
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == before
    nothing = SimpleNamespace(parts=())
    with pytest.raises(NmtError, match="--precision tf32 .* needs a GPU; on the CPU use fp32"):
        Backend(nothing, TranslateConfig(device="cpu", precision="tf32"))  # type: ignore[arg-type]
