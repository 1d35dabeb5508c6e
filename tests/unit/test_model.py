import math

import pytest
import torch

from nmt_cli.config import PRESETS, DecodeOptions, ModelConfig
from nmt_cli.engine.cache import DecoderCache
from nmt_cli.engine.model import Transformer, dropout, sinusoids, undrawn
from nmt_cli.vocab import BOS, PAD


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    c = ModelConfig(
        vocab_size=50, num_encoder_layers=2, num_decoder_layers=2, d_model=16, ffn=32, heads=2, **kw
    )
    return Transformer(c).eval()


def test_presets_match_the_paper():
    assert PRESETS["base"] == dict(
        num_encoder_layers=6,
        num_decoder_layers=6,
        d_model=512,
        ffn=2048,
        heads=8,
        dropout=0.1,
        attention_dropout=0.1,
        relu_dropout=0.1,
    )
    big = PRESETS["big"]
    assert (big["d_model"], big["ffn"], big["heads"], big["dropout"]) == (1024, 4096, 16, 0.3)
    assert (PRESETS["tiny"]["num_encoder_layers"], PRESETS["tiny"]["d_model"]) == (3, 256)


def test_initialisation_and_tying():
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=8000, d_model=512, num_encoder_layers=1, num_decoder_layers=1))
    w = m.embed.weight
    assert torch.all(w[PAD] == 0)
    assert abs(w[1:].std().item() - 512**-0.5) < 0.002
    # Xavier uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)), so std a / sqrt(3). torch's
    # own default (a = 1 / sqrt(fan_in)) also stays inside a: the spread tells them apart.
    for lin, fan_in, fan_out in [
        (m.encoder[0].ffn.inner, 512, 2048),
        (m.decoder[0].cross_attn.kv, 512, 1024),
    ]:
        a = math.sqrt(6 / (fan_in + fan_out))
        assert a * 0.999 < lin.weight.abs().max().item() <= a
        assert lin.weight.std().item() == pytest.approx(a / math.sqrt(3), rel=0.01)
        assert torch.all(lin.bias == 0)
    assert all(n.norm.eps == 1e-6 for layer in m.encoder for n in (layer.res1, layer.res2))
    h = torch.randn(3, 512)
    assert torch.equal(m.logits(h), h @ w.T)  # output layer is the embedding
    names = [n for n, _ in m.named_parameters()]
    assert not any("out_proj" in n or "generator" in n for n in names)


def test_an_undrawn_model_draws_nothing_and_loads_whole():
    """What a package's shapes are checked with (on the meta device) and its weights loaded into:
    no weight drawn, a drawn model's shapes and positions, and once loaded its outputs."""
    drawn = tiny()
    before = torch.random.get_rng_state()
    empty = undrawn(drawn.config)
    assert torch.equal(torch.random.get_rng_state(), before)  # not one number drawn
    with torch.device("meta"):
        shapes = undrawn(drawn.config)
    assert {k: v.shape for k, v in shapes.state_dict().items()} == {
        k: v.shape for k, v in drawn.state_dict().items()
    }
    assert shapes.positions.is_meta and shapes.positions.shape == drawn.positions.shape
    empty.load_state_dict(drawn.state_dict())
    assert torch.equal(empty.positions, drawn.positions)
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[BOS, 8, 9]])
    assert torch.equal(empty.eval()(src, tgt), drawn(src, tgt))
    Transformer(drawn.config)  # outside undrawn, a model is drawn again
    assert not torch.equal(torch.random.get_rng_state(), before)


def test_packing_for_the_cpu_keeps_the_outputs(monkeypatch):
    from nmt_cli.engine import decoding
    from nmt_cli.engine.packing import PackedLinear, pack_for_cpu

    m = tiny()
    src = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    tgt = torch.tensor([[BOS, 11, 12], [BOS, 13, PAD]])
    with torch.no_grad():
        states = m(src, tgt)
        logits = m.logits(states)
    hyps = decoding.translate(m, src, DecodeOptions(beam=3, max_len_b=10, nbest=2))
    monkeypatch.setattr("nmt_cli.engine.packing.PACK_MIN", 0)  # pack even this model's weights
    packed = pack_for_cpu(m)
    assert packed is m and not any(p.requires_grad for p in m.parameters())
    assert not any(isinstance(x, torch.nn.Linear) for x in m.modules())
    # per encoder layer q, kv, out and the FFN's two; per decoder layer those and cross q, kv,
    # out; and the output projection
    assert sum(isinstance(x, PackedLinear) for x in m.modules()) == 2 * 5 + 2 * 8 + 1
    with torch.no_grad():
        torch.testing.assert_close(m(src, tgt), states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m.logits(states), logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(decoding.translate(m, src, DecodeOptions(beam=3, max_len_b=10, nbest=2)), hyps):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_packing_leaves_small_weights_to_f_linear():
    from nmt_cli.engine.packing import PACK_MIN, PackedLinear, pack_for_cpu

    torch.manual_seed(0)
    m = pack_for_cpu(
        Transformer(
            ModelConfig(
                vocab_size=1000, num_encoder_layers=1, num_decoder_layers=1, d_model=128, ffn=1024, heads=2
            )
        )
    )
    packed = {n for n, x in m.named_modules() if isinstance(x, PackedLinear)}
    assert packed == {
        "encoder.0.ffn.inner",
        "encoder.0.ffn.outer",
        "decoder.0.ffn.inner",
        "decoder.0.ffn.outer",
    }  # 128 x 1024 = PACK_MIN; q, k, v, out are 128 x 128
    assert 128 * 1024 == PACK_MIN and m.packed_output is None  # 1000 x 128 words: below it


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_drops_its_share_and_keeps_the_mean(p):
    torch.manual_seed(0)
    x = (torch.rand(1000, 1001) + 1.0).requires_grad_()  # an odd size: the last draw is cut
    torch.manual_seed(1)
    y = dropout(x, p, training=True)
    dropped = (y == 0).double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / x.numel())
    assert y.sum().item() == pytest.approx(x.sum().item(), rel=2e-3)  # unbiased
    kept = y != 0
    scale = (y[kept] / x[kept]).detach()
    assert torch.allclose(scale, torch.full_like(scale, 1 / (1 - p)), rtol=1e-4)
    y.sum().backward()
    assert torch.equal(x.grad != 0, kept) and torch.allclose(x.grad[kept], scale)
    # Each of the four 16-bit lanes of a draw is used: no lane always keeps or always drops.
    lanes = kept.flatten()[: 4 * (x.numel() // 4)].view(-1, 4).double().mean(0)
    assert torch.allclose(lanes, torch.full_like(lanes, 1 - p), atol=0.01)
    torch.manual_seed(1)
    assert torch.equal(dropout(x, p, training=True), y)  # from torch's generator: seeded
    assert dropout(x, p, training=False) is x


def test_sinusoids():
    # tensor2tensor's layout: sin on the first half of the channels, cos on the second, with
    # timescales 1 to 10000 in geometric steps: for d 8, 1, 10000^(1/3), 10000^(2/3), 10000.
    table = sinusoids(10, 8)
    assert torch.allclose(table[0], torch.tensor([0.0] * 4 + [1.0] * 4))
    by_hand = [
        math.sin(5.0),
        math.sin(5 / 21.544347),
        math.sin(5 / 464.15888),
        math.sin(5e-4),
        math.cos(5.0),
        math.cos(5 / 21.544347),
        math.cos(5 / 464.15888),
        math.cos(5e-4),
    ]
    assert torch.allclose(table[5], torch.tensor(by_hand), atol=1e-6)


@pytest.mark.parametrize("post_norm", [False, True])
def test_outputs_do_not_depend_on_the_batch(post_norm):
    m = tiny(post_norm=post_norm)
    src = torch.tensor([[5, 6, 7, 3]])
    tgt = torch.tensor([[BOS, 8, 9]])
    alone = m(src, tgt)
    long_src = torch.tensor([[5, 6, 7, 3, PAD, PAD, PAD], [9, 9, 9, 9, 9, 9, 3]])
    long_tgt = torch.tensor([[BOS, 8, 9, PAD, PAD], [BOS, 4, 4, 4, 4]])
    batched = m(long_src, long_tgt)
    assert torch.allclose(alone[0], batched[0, :3], atol=1e-5)


def test_decoder_is_causal():
    m = tiny()
    src = torch.tensor([[5, 6, 7, 3]])
    a = m(src, torch.tensor([[BOS, 8, 9, 10]]))
    b = m(src, torch.tensor([[BOS, 8, 9, 11]]))
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6)
    assert not torch.allclose(a[:, 3], b[:, 3])


def test_cached_decoding_equals_full_decoding():
    m = tiny()
    src = torch.tensor([[5, 6, 7, 3], [9, 8, 3, PAD]])
    tgt = torch.tensor([[BOS, 8, 9, 10, 11], [BOS, 4, 5, 6, 7]])
    with torch.no_grad():
        memory, mask = m.encode(src)
        kv = m.memory_keys_values(memory)
        full = m.decode(tgt, kv, mask)
        cache = DecoderCache(m.memory_keys_values(memory), mask, beam=1, max_len=8)
        steps = [m.decode(tgt[:, t : t + 1], cache.memory_kv, cache.src_mask, cache) for t in range(5)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert cache.length == 5


def test_cache_with_beams_reorders_rows_and_drops_sentences():
    m = tiny()
    src = torch.tensor([[5, 6, 3], [9, 8, 3]])
    tgt = torch.tensor([[BOS, 8, 9], [BOS, 4, 5]])
    with torch.no_grad():
        memory, mask = m.encode(src)
        cache = DecoderCache(m.memory_keys_values(memory), mask, beam=2, max_len=4)
        rows = tgt.repeat_interleave(2, 0)  # (2 sentences x 2 beams, T)
        rows[1, 1] = 7  # beam 1 of sentence 0 takes another second token
        for t in range(2):
            m.decode(rows[:, t : t + 1], cache.memory_kv, cache.src_mask, cache)
        # Sentence 0 finishes; sentence 1 keeps its beam 0 twice.
        cache.reorder(torch.tensor([2, 2]))
        step = m.decode(rows[[2, 2], 2:3], cache.memory_kv, cache.src_mask, cache)
        full = m.decode(tgt[[1]], m.memory_keys_values(memory[[1]]), mask[[1]])
        assert torch.allclose(step[0, 0], full[0, 2], atol=1e-5)
        assert torch.allclose(step[1, 0], full[0, 2], atol=1e-5)
        # And a beam that took another path keeps its own history.
        cache2 = DecoderCache(m.memory_keys_values(memory), mask, beam=2, max_len=4)
        for t in range(2):
            m.decode(rows[:, t : t + 1], cache2.memory_kv, cache2.src_mask, cache2)
        cache2.reorder(torch.tensor([1, 1, 2, 3]))
        step = m.decode(rows[[1, 1, 2, 3], 2:3], cache2.memory_kv, cache2.src_mask, cache2)
        alt = m.decode(rows[[1]], m.memory_keys_values(memory[[0]]), mask[[0]])
        assert torch.allclose(step[0, 0], alt[0, 2], atol=1e-5)


def test_too_long_input_is_a_clear_error():
    m = tiny(max_positions=4)
    with pytest.raises(ValueError, match="max_positions"):
        m(torch.tensor([[5, 6, 7, 8, 3]]), torch.tensor([[BOS]]))


# -- an independent implementation ---------------------------------------------------------------


def _layer_norm(x, ln):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-6) * ln.weight + ln.bias


def _attention(x, memory, attn, allowed, heads):
    """Section 3.2 written out: per head softmax(q k^T / sqrt(d_k)) v, heads concatenated."""
    d = x.shape[-1]
    q = x @ attn.q.weight.T + attn.q.bias
    kv = memory @ attn.kv.weight.T + attn.kv.bias
    k, v = kv[..., :d], kv[..., d:]
    outs = []
    for h in range(heads):
        cols = slice(h * d // heads, (h + 1) * d // heads)
        scores = q[..., cols] @ k[..., cols].transpose(-1, -2) / math.sqrt(d // heads)
        scores = scores.masked_fill(~allowed, -math.inf)
        outs.append(torch.softmax(scores, -1) @ v[..., cols])
    return torch.cat(outs, -1) @ attn.out.weight.T + attn.out.bias


def _ffn(x, ffn):
    return torch.relu(x @ ffn.inner.weight.T + ffn.inner.bias) @ ffn.outer.weight.T + ffn.outer.bias


def _reference(m, src, tgt):
    """The pre-norm Transformer with final LayerNorms, tied embeddings scaled by sqrt(d) and
    t2t's sinusoids, from the definitions (no code of model.py but its weights)."""
    c = m.config
    d, heads = c.d_model, c.heads

    def embed(ids):
        pos = torch.arange(ids.shape[1], dtype=torch.float32)[:, None]
        timescales = 10000 ** (torch.arange(d // 2) / (d // 2 - 1))
        pe = torch.cat([torch.sin(pos / timescales), torch.cos(pos / timescales)], 1)
        return m.embed.weight[ids] * math.sqrt(d) + pe

    src_ok = (src != PAD)[:, None, :]  # (B, 1, S)
    x = embed(src)
    for layer in m.encoder:
        h = _layer_norm(x, layer.res1.norm)
        x = x + _attention(h, h, layer.self_attn, src_ok, heads)
        x = x + _ffn(_layer_norm(x, layer.res2.norm), layer.ffn)
    memory = _layer_norm(x, m.encoder_norm)
    t = tgt.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None]  # (1, T, T)
    y = embed(tgt)
    for layer in m.decoder:
        h = _layer_norm(y, layer.res1.norm)
        y = y + _attention(h, h, layer.self_attn, causal, heads)
        y = y + _attention(_layer_norm(y, layer.res2.norm), memory, layer.cross_attn, src_ok, heads)
        y = y + _ffn(_layer_norm(y, layer.res3.norm), layer.ffn)
    return _layer_norm(y, m.decoder_norm) @ m.embed.weight.T


def test_the_model_computes_what_the_paper_and_t2t_define():
    m = tiny()
    with torch.no_grad():  # weights of every kind, so that no term hides behind a zero
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, PAD, PAD]])
    tgt = torch.tensor([[BOS, 11, 12, 13], [BOS, 14, PAD, PAD]])
    with torch.no_grad():
        ours = m.logits(m(src, tgt))
        theirs = _reference(m, src, tgt)
    assert torch.allclose(ours[0], theirs[0], atol=1e-4)
    assert torch.allclose(ours[1, :2], theirs[1, :2], atol=1e-4)  # where the target is real


@pytest.mark.parametrize("which", ["dropout", "attention_dropout", "relu_dropout"])
def test_each_dropout_acts_in_training_only(which):
    off = dict(dropout=0.0, attention_dropout=0.0, relu_dropout=0.0)
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[BOS, 8, 9]])
    m = tiny(**off).train()
    assert torch.allclose(m(src, tgt), m.eval()(src, tgt), atol=1e-6)  # all off: no noise
    m = tiny(**{**off, which: 0.5}).train()
    assert not torch.allclose(m(src, tgt), m.eval()(src, tgt), atol=1e-3)


@pytest.mark.parametrize("post_norm", [False, True])
def test_residual_dropout_is_on_the_sublayer_output(post_norm):
    from nmt_cli.engine.model import Residual

    torch.manual_seed(0)
    res = Residual(16, 0.5, post_norm).train()
    x = torch.randn(4, 16)
    double = lambda h: 2 * h  # noqa: E731
    expected = res.norm(x + double(x)) if post_norm else x + double(res.norm(x))
    assert not torch.allclose(res(x, double), expected, atol=1e-3)
    assert torch.allclose(res.eval()(x, double), expected, atol=1e-6)
    if not post_norm:  # what is dropped is the sub-layer's output: x itself always goes through
        dropped = res.train()(x, lambda h: torch.zeros_like(h) + 1.0) - x
        assert torch.all((dropped.abs() < 1e-5) | ((dropped - 2.0).abs() < 1e-5))


def test_a_gpu_keeps_attention_off_cudnn_and_flash_kernels():
    """The attention policy (flags only: no GPU needed); the CPU's own kernels are left alone."""
    from nmt_cli.engine.device import prefer_attention_kernels

    b = torch.backends.cuda
    before = b.flash_sdp_enabled(), b.cudnn_sdp_enabled(), b.mem_efficient_sdp_enabled()
    try:
        prefer_attention_kernels(torch.device("cpu"))
        assert (b.flash_sdp_enabled(), b.cudnn_sdp_enabled()) == before[:2]
        prefer_attention_kernels(torch.device("cuda"))
        assert not b.flash_sdp_enabled() and not b.cudnn_sdp_enabled() and b.mem_efficient_sdp_enabled()
    finally:
        b.enable_flash_sdp(before[0])
        b.enable_cudnn_sdp(before[1])
        b.enable_mem_efficient_sdp(before[2])


def _loss_and_gradient(post_norm: bool, bf16: bool, **kernels) -> tuple[float, torch.Tensor]:
    """A small model's label-smoothed loss on a fixed batch and its gradient (the key biases'
    left out: softmax ignores them, their gradient is rounding noise)."""
    from nmt_cli.engine.step import Objective

    torch.manual_seed(0)
    c = ModelConfig(
        vocab_size=300, num_encoder_layers=2, num_decoder_layers=2, d_model=32, ffn=64, heads=4,
        dropout=0.0, attention_dropout=0.0, relu_dropout=0.0, post_norm=post_norm,
    )  # fmt: skip
    model = Transformer(c)
    model.set_kernels(**kernels)
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(4, 300, (16, 13), generator=g), torch.randint(4, 300, (16, 11), generator=g)
    src[:4, -3:] = PAD
    tgt_in = torch.cat([torch.full((16, 1), BOS), tgt[:, :-1]], 1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _ = Objective(model, 0.1)(src, tgt_in, None, tgt.flatten())
    loss.backward()
    grads = [p.grad.flatten() for n, p in model.named_parameters() if not n.endswith("kv.bias")]
    return loss.item(), torch.cat(grads)


@pytest.mark.parametrize("post_norm", [False, True])
def test_one_qkv_product_is_the_same_model(post_norm):
    """--fused-qkv: self-attention's three projections as one product, the same loss and
    gradient (float32 to rounding; bf16 autocast far within what bf16 itself moves them)."""
    loss, grad = _loss_and_gradient(post_norm, False)
    fused_loss, fused = _loss_and_gradient(post_norm, False, fused_qkv=True)
    assert fused_loss == pytest.approx(loss, rel=1e-6) and torch.allclose(fused, grad, rtol=1e-4, atol=1e-6)
    bf16_loss, bf16 = _loss_and_gradient(post_norm, True)
    fused_loss, fused = _loss_and_gradient(post_norm, True, fused_qkv=True)
    assert fused_loss == pytest.approx(bf16_loss, rel=1e-3)
    assert (fused - bf16).norm() < 0.5 * (bf16 - grad).norm()


@pytest.mark.parametrize("post_norm", [False, True])
def test_a_narrow_residual_stream_moves_the_loss_no_more_than_bf16_does(post_norm):
    """--narrow-residual: without autocast nothing changes; under bf16 autocast the stream
    between sub-layers is bf16, and the loss and gradient stay as close to float32's as bf16
    autocast's own (a bound measured here, on this CPU, from plain autocast)."""
    loss, grad = _loss_and_gradient(post_norm, False)
    same_loss, same = _loss_and_gradient(post_norm, False, narrow_residual=True)
    assert same_loss == loss and torch.equal(same, grad)
    bf16_loss, bf16 = _loss_and_gradient(post_norm, True)
    narrow_loss, narrow = _loss_and_gradient(post_norm, True, narrow_residual=True)
    assert narrow_loss != bf16_loss  # the stream was narrowed
    assert abs(narrow_loss - loss) < 1e-3 * loss
    assert (narrow - grad).norm() < 1.5 * (bf16 - grad).norm() + 1e-3 * grad.norm()


def test_alignments_are_each_targets_most_attended_source_token_read_once_a_batch():
    """forced.aligned: each target token's source position of the highest averaged cross-attention
    among its own sentence's tokens (never a padding or the EOS), for every sentence, the whole
    batch read from the device once (not once a sentence)."""
    from conftest import host_reads
    from updates import small_model

    from nmt_cli.engine import forced
    from nmt_cli.engine.batches import pad_sources, pad_targets

    model = small_model().eval()
    sources = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], []]
    targets = [[4, 5, 6], [7, 8, 9, 10], [], [11]]
    src = torch.from_numpy(pad_sources(sources))
    with host_reads() as reads:
        found = forced.aligned(model, src, targets)
    assert reads["n"] == 1
    tgt_in = torch.from_numpy(pad_targets(targets)[0])
    with torch.no_grad():
        weights = model.cross_attention(src, tgt_in).float()
    expected = [
        [(int(weights[row, j, : len(x)].argmax()), j) for j in range(len(y))] if x and y else []
        for row, (x, y) in enumerate(zip(sources, targets))
    ]
    assert found == expected and [len(f) for f in found] == [3, 4, 0, 0]
