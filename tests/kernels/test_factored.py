"""The factored temporal attention (the CPU path) against the fused reference.

``temporal_attention_factored`` moves the time and edge projections from the neighbour
slots onto the queries and the attention-weighted sums; it must be the same function
as ``temporal_attention_fused`` with ``kv_edge = edge_feat @ w_kv_edge.T``, forward and
backward, on every kind of row (fully masked, full, with gaps) and shape.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sven.kernels import reference
from tests.kernels.grid import make_mask

T_DIM, E_DIM = 20, 3
GRID = list(itertools.product((1, 7, 33), (1, 2), (8, 50), (1, 5, 16), (True, False)))


def _inputs(
    r: int,
    h: int,
    d: int,
    k: int,
    dtype: torch.dtype,
    seed: int = 0,
    dt_max: float = 1e4,
    e: int = E_DIM,
) -> list:
    gen = torch.Generator().manual_seed(seed)
    o, u = h * d, max(3, r // 2)
    mask = make_mask(r, k, gen)
    tensors = [
        torch.randn(r, h, d, generator=gen),  # q
        torch.randn(u, 2 * o, generator=gen),  # kv_node
        torch.randint(0, u, (r, k), generator=gen),  # nbr_pos (repeats: summed grads)
        torch.rand(r, k, generator=gen) * dt_max,  # dt, real-sized gaps by default
        mask,
        1.0 / 10 ** torch.linspace(0, 9, T_DIM),  # time_w
        torch.rand(T_DIM, generator=gen),  # time_b
        torch.randn(2 * o, T_DIM, generator=gen) / T_DIM**0.5,  # w_kv_time
        torch.randn(r, k, e, generator=gen),  # edge_feat
        torch.randn(2 * o, e, generator=gen) / e**0.5,  # w_kv_edge
    ]
    return [t if t.dtype in (torch.bool, torch.int64) else t.to(dtype) for t in tensors]


def _run(fn_name: str, inputs: list, edge: bool, dout: torch.Tensor) -> list[torch.Tensor]:
    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = [
        x.clone().requires_grad_(x.is_floating_point()) for x in inputs
    ]
    if fn_name == "fused":
        kv_edge = torch.nn.functional.linear(ef, we) if edge else None
        out = reference.temporal_attention_fused(q, kvn, pos, dt, mask, tw, tb, wt, kv_edge)
    else:
        out = reference.temporal_attention_factored(
            q, kvn, pos, dt, mask, tw, tb, wt, ef if edge else None, we if edge else None
        )
    out.backward(dout)
    grads = [x.grad for x in (q, kvn, dt, tw, tb, wt) + ((ef, we) if edge else ())]
    return [out] + [torch.zeros(()) if g is None else g for g in grads]


@pytest.mark.parametrize("r,h,d,k,edge", GRID)
def test_factored_equals_fused_float64(r: int, h: int, d: int, k: int, edge: bool) -> None:
    inputs = _inputs(r, h, d, k, torch.float64)
    dout = torch.randn(r, h * d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = _run("fused", inputs, edge, dout)
    got = _run("factored", inputs, edge, dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    out, mask = got[0], inputs[4]
    dead = ~mask.any(dim=1)
    assert not out.isnan().any() and (out[dead] == 0).all()
    if edge:
        # Masked slots contribute nothing, so their features get no gradient.
        assert (got[7][~mask] == 0).all()


def test_factored_float32_close_to_fused() -> None:
    # Against the fused form in float32 too. Small gaps keep cos(dt w + b) well
    # conditioned: the factored form rounds its argument once (addcmul), the fused one
    # twice, and for dt ~ 1e4 that alone moves dt's gradient by more than 1e-4.
    r, h, d, k = 33, 2, 50, 10
    inputs = _inputs(r, h, d, k, torch.float32, dt_max=10.0)
    dout = torch.randn(r, h * d, generator=torch.Generator().manual_seed(3))
    got = _run("factored", inputs, True, dout)
    want = _run("fused", inputs, True, dout)
    for g, w in zip(got, want):
        scale = float(w.abs().max()) or 1.0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


def test_factored_no_roots() -> None:
    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = _inputs(0, 2, 8, 3, torch.float32)
    kvn.requires_grad_()
    out = reference.temporal_attention_factored(q, kvn, pos, dt, mask, tw, tb, wt, ef, we)
    out.sum().backward()
    assert out.shape == (0, 16) and torch.equal(kvn.grad, torch.zeros_like(kvn))


@pytest.mark.parametrize("edge_dim", [0, E_DIM])
def test_layer_forms_agree(edge_dim: int) -> None:
    """``TemporalAttentionLayer(form=...)``: fused and factored give one function.

    Both layers share weights; outputs and every parameter's gradient agree in float64,
    so ``model.attention_form`` changes the order of computation, not the model.
    """
    from sven.models.base import TemporalAttentionLayer

    gen = torch.Generator().manual_seed(3)
    u, r, k = 6, 5, 4
    layers = {
        form: TemporalAttentionLayer(8, edge_dim, T_DIM, 8, 2, 0.0, form=form).double()
        for form in ("fused", "factored")
    }
    layers["factored"].load_state_dict(layers["fused"].state_dict())
    z = torch.randn(u, 8, generator=gen, dtype=torch.float64)
    root_pos = torch.randint(0, u, (r,), generator=gen)
    nbr_pos = torch.randint(0, u, (r, k), generator=gen)
    mask = make_mask(r, k, gen)
    dt = (torch.rand(r, k, generator=gen, dtype=torch.float64) * 1e4).masked_fill(~mask, 0.0)
    feat = torch.randn(r, k, edge_dim, generator=gen, dtype=torch.float64) if edge_dim else None
    out, grads = {}, {}
    for form, layer in layers.items():
        out[form] = layer(z, root_pos, nbr_pos, dt, mask, feat)
        out[form].square().sum().backward()
        grads[form] = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    torch.testing.assert_close(out["factored"], out["fused"], rtol=1e-9, atol=1e-11)
    assert grads["factored"].keys() == grads["fused"].keys()
    for name, g in grads["fused"].items():
        torch.testing.assert_close(grads["factored"][name], g, rtol=1e-8, atol=1e-10)


def test_layer_rejects_an_unknown_form() -> None:
    from sven.models.base import TemporalAttentionLayer

    with pytest.raises(ValueError, match="attention form"):
        TemporalAttentionLayer(8, 0, T_DIM, 8, 2, 0.0, form="tiled")


# The factored forward as one Triton kernel (evaluation on CUDA), against the reference;
# on CPU under Triton's interpreter (small shapes), on CUDA the whole grid.
# Three heads: a padded head in the programs' blocks.
TRITON_SMALL = [(7, 2, 8, 5, True), (7, 1, 50, 16, False), (1, 2, 8, 1, False), (5, 3, 8, 5, True)]
TRITON_GRID = list(itertools.product((1, 33, 517), (1, 2), (8, 50), (1, 10, 16), (True, False)))


def _triton_vs_reference(
    r: int, h: int, d: int, k: int, edge: bool, device: str, tol: float = 1e-5
) -> None:
    from sven.kernels import triton_factored

    inputs = [x.to(device) for x in _inputs(r, h, d, k, torch.float32, dt_max=10.0)]
    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = inputs
    args = (q, kvn, pos, dt, mask, tw, tb, wt, ef if edge else None, we if edge else None)
    want = reference.temporal_attention_factored(*[_f64(x) for x in args])
    with torch.no_grad():
        got = triton_factored.temporal_attention_factored(*args)
    assert got.dtype == torch.float32 and got.shape == (r, h * d)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # Roots without a valid slot give zero rows, not NaN.
    assert (got[~mask.any(dim=1)] == 0).all()


def _f64(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.double() if x is not None and x.is_floating_point() else x


# Both kernels: every head at once on 3-D tiles, or the sums as products on 2-D ones.
KERNEL = pytest.mark.parametrize("kernel", ["tiles", "dot", "split"])


@KERNEL
@pytest.mark.parametrize("r,h,d,k,edge", TRITON_SMALL)
def test_triton_factored_small(
    r: int, h: int, d: int, k: int, edge: bool, kernel: str, device, monkeypatch
) -> None:
    monkeypatch.setenv("SVEN_FACTORED_KERNEL", kernel)
    _triton_vs_reference(r, h, d, k, edge, device)


@pytest.mark.gpu
@KERNEL
@pytest.mark.parametrize("r,h,d,k,edge", TRITON_GRID)
def test_triton_factored_grid(
    r: int, h: int, d: int, k: int, edge: bool, kernel: str, cuda, monkeypatch
) -> None:
    monkeypatch.setenv("SVEN_FACTORED_KERNEL", kernel)
    _triton_vs_reference(r, h, d, k, edge, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("edge", [True, False])
def test_triton_factored_dot_on_tf32_is_close(edge: bool, cuda, monkeypatch) -> None:
    # Under train.matmul_precision=high (the default) the products run on TF32 tensor
    # cores: inputs keep 10 of float32's 23 mantissa bits, so the tolerance is TF32's.
    monkeypatch.setenv("SVEN_FACTORED_KERNEL", "dot")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    _triton_vs_reference(517, 2, 50, 10, edge, cuda, tol=1e-2)


@pytest.mark.parametrize("k", [1, 2, 3, 8, 10, 13, 17])
@pytest.mark.parametrize("eager", ["0", "1"])
def test_triton_factored_split_slots_any_count(k: int, eager: str, device, monkeypatch) -> None:
    """The split kernel's two slot tiles (a power of two at most K, the rest rounded
    up) cover any K: K a power of two (1, 2, 8: the second tile all masked), the second
    tile full (3, 10, 17) or padded (13: eight and eight); edges read in 16-column
    chunks, gaps read early or not."""
    monkeypatch.setenv("SVEN_FACTORED_KERNEL", "split")
    monkeypatch.setenv("SVEN_FACTORED_CHUNK", "16")
    monkeypatch.setenv("SVEN_FACTORED_EAGER", eager)
    _triton_vs_reference(6, 2, 8, k, True, device)


def test_triton_factored_with_a_gradient_is_the_reference(device) -> None:
    # Forward only: where a gradient is needed the call is the reference's, bit for bit.
    from sven.kernels import triton_factored

    inputs = [x.to(device) for x in _inputs(5, 2, 8, 3, torch.float32)]
    q = inputs[0].clone().requires_grad_()
    got = triton_factored.temporal_attention_factored(q, *inputs[1:])
    want = reference.temporal_attention_factored(q, *inputs[1:])
    assert torch.equal(got, want) and got.requires_grad


def test_triton_factored_no_roots(device) -> None:
    from sven.kernels import triton_factored

    q, kvn, pos, dt, mask, tw, tb, wt, _, _ = [
        x.to(device) for x in _inputs(0, 2, 8, 3, torch.float32)
    ]
    with torch.no_grad():
        out = triton_factored.temporal_attention_factored(q, kvn, pos, dt, mask, tw, tb, wt)
    assert out.shape == (0, 16)


def test_auto_form_is_factored_for_wide_batches_without_a_gradient(monkeypatch) -> None:
    """On CUDA ``auto`` runs the fused form, except for a batch of at least
    ``WIDE_ROOTS`` roots without a gradient (TGB's one-vs-many evaluation)."""
    from sven import kernels
    from sven.models import base

    calls: list[str] = []
    for name in ("temporal_attention_fused", "temporal_attention_factored"):
        monkeypatch.setattr(kernels, name, lambda *a, name=name, **_: calls.append(name) or _out(a))
    # The layer's choice as it is made for CUDA tensors, on the CPU.
    monkeypatch.setattr(kernels, "backend_for", lambda t, name=None: "triton")
    monkeypatch.setattr(base, "WIDE_ROOTS", 6)
    layer = base.TemporalAttentionLayer(8, 0, T_DIM, 8, 2, 0.0, form="auto")
    gen = torch.Generator().manual_seed(0)
    for r, grad in ((6, False), (5, False), (6, True)):
        z = torch.randn(4, 8, generator=gen)
        mask = torch.ones(r, 3, dtype=torch.bool)
        with torch.set_grad_enabled(grad):
            layer(z, torch.zeros(r, dtype=torch.int64), torch.zeros(r, 3, dtype=torch.int64),
                  torch.ones(r, 3), mask, None)  # fmt: skip
    assert calls == [
        "temporal_attention_factored",
        "temporal_attention_fused",
        "temporal_attention_fused",
    ]


def _out(args: tuple) -> torch.Tensor:
    q, roots = args[0], args[2].shape[0]
    return torch.zeros(roots, q.shape[1] * q.shape[2])


@KERNEL
@pytest.mark.parametrize("edge", [True, False])
def test_factored_reads_shared_query_rows(edge: bool, kernel: str, device, monkeypatch) -> None:
    """``q_rows``: roots read shared rows of the queries (one per node), the same
    function as each root given its own copy: the reference to the last bit, the
    Triton kernel within rounding of the float64 reference."""
    from sven.kernels import triton_factored

    monkeypatch.setenv("SVEN_FACTORED_KERNEL", kernel)
    gen = torch.Generator().manual_seed(11)
    inputs = [x.to(device) for x in _inputs(9, 2, 8, 5, torch.float32, dt_max=10.0)]
    shared = torch.randn(4, 2, 8, generator=gen).to(device)
    q_rows = torch.tensor([0, 3, 3, 1, 0, 2, 2, 3, 0], device=device)
    rest = inputs[1:] if edge else [*inputs[1:8], None, None]
    want = reference.temporal_attention_factored(shared[q_rows], *rest)
    got = reference.temporal_attention_factored(shared, *rest, None, q_rows)
    assert torch.equal(got, want)
    oracle = reference.temporal_attention_factored(
        _f64(shared[q_rows]), *[None if x is None else _f64(x) for x in rest]
    )
    with torch.no_grad():
        tri = triton_factored.temporal_attention_factored(shared, *rest, None, q_rows)
    torch.testing.assert_close(tri.double(), oracle, rtol=1e-5, atol=1e-5)


def test_wide_layer_computes_per_node_what_depends_on_the_node(monkeypatch) -> None:
    """A wide batch without a gradient whose node rows are fewer than its roots
    computes each node's query, its products and the output projection's node half once
    per node row: the same embeddings as the per-root computation, within rounding;
    exactly the per-root path while training or under a gradient."""
    from sven.models import base

    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    layer = base.TemporalAttentionLayer(8, E_DIM, T_DIM, 8, 2, 0.0, form="factored").eval()
    u, r, k = 5, 12, 4
    z = torch.randn(u, 8, generator=gen)
    root_pos = torch.randint(0, u, (r,), generator=gen)
    nbr_pos = torch.randint(0, u, (r, k), generator=gen)
    dt = torch.rand(r, k, generator=gen) * 100
    mask = make_mask(r, k, gen)
    feat = torch.randn(r, k, E_DIM, generator=gen)
    args = (z, root_pos, nbr_pos, dt, mask, feat)
    with torch.no_grad():
        per_root = layer(*args)
        monkeypatch.setattr(base, "WIDE_ROOTS", r)
        per_node = layer(*args)
        layer.train()
        training = layer(*args)
    torch.testing.assert_close(per_node, per_root, rtol=1e-5, atol=1e-5)
    assert not torch.equal(per_node, per_root)  # the other order of the sums
    assert torch.equal(training, per_root)


def _table_inputs(r: int, k: int, device: str) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Factored inputs whose edge features are rows of a table: (inputs with the
    materialised (R, K, d_e) features, the (E, d_e) table, the (R, K) rows)."""
    gen = torch.Generator().manual_seed(5)
    inputs = _inputs(r, 2, 8, k, torch.float32, dt_max=10.0)
    table = torch.randn(11, E_DIM, generator=gen)
    # Masked slots name any row (the sampler's padding: 0), read as zeros.
    rows = torch.randint(0, 11, (r, k), generator=gen).masked_fill(~inputs[4], 0)
    inputs[8] = table[rows] * inputs[4][..., None].float()
    return [x.to(device) for x in inputs], table.to(device), rows.to(device)


def test_factored_reads_edge_rows_of_a_table_exactly() -> None:
    """``edge_rows``: the reference reads the slots' rows of the table as the batch
    built them (zero where masked), to the last bit, forward and backward."""
    inputs, table, rows = _table_inputs(33, 5, "cpu")
    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = inputs
    want = reference.temporal_attention_factored(q, kvn, pos, dt, mask, tw, tb, wt, ef, we)
    got = reference.temporal_attention_factored(
        q, kvn, pos, dt, mask, tw, tb, wt, table, we, edge_rows=rows
    )
    assert torch.equal(got, want)


@KERNEL
@pytest.mark.parametrize("r,k", [(7, 5), (1, 1)])
def test_triton_factored_reads_edge_rows_in_place(
    r: int, k: int, kernel: str, device, monkeypatch
) -> None:
    """The Triton kernel with ``edge_rows`` reads each slot's row of the table in place,
    and gives what it gives on the materialised features, bit for bit (the same values
    loaded in the same order)."""
    from sven.kernels import triton_factored

    monkeypatch.setenv("SVEN_FACTORED_KERNEL", kernel)
    inputs, table, rows = _table_inputs(r, k, device)
    q, kvn, pos, dt, mask, tw, tb, wt, _, we = inputs
    with torch.no_grad():
        want = triton_factored.temporal_attention_factored(*inputs)
        got = triton_factored.temporal_attention_factored(
            q, kvn, pos, dt, mask, tw, tb, wt, table, we, edge_rows=rows
        )
    assert torch.equal(got, want)


def test_triton_factored_wider_than_a_program_holds_is_the_reference(device, monkeypatch) -> None:
    """A time encoding wider than ``FACTORED_MAX_WIDTH`` (a program holds a slot's time
    encoding in registers) takes the reference, bit for bit."""
    from sven.kernels import triton_factored

    monkeypatch.setattr(triton_factored, "FACTORED_MAX_WIDTH", T_DIM - 1)
    inputs = [x.to(device) for x in _inputs(5, 2, 8, 3, torch.float32)]
    with torch.no_grad():
        got = triton_factored.temporal_attention_factored(*inputs)
        want = reference.temporal_attention_factored(*inputs)
    assert torch.equal(got, want)


CHUNKED = [(40, 16, 4, False), (40, 16, 2, True), (172, 64, 8, True), (17, 64, 8, False)]


@pytest.mark.parametrize("e,chunk,warps,rows", CHUNKED)
def test_triton_factored_reads_wide_edge_rows_in_chunks(
    e: int, chunk: int, warps: int, rows: bool, device, monkeypatch
) -> None:
    """Edge rows wider than a chunk (``SVEN_FACTORED_CHUNK``) are read chunk by chunk,
    for the scores and again for the weighted sums, with any warp count: the
    reference's function, rows read in place or materialised."""
    from sven.kernels import triton_factored

    monkeypatch.setenv("SVEN_FACTORED_CHUNK", str(chunk))
    monkeypatch.setenv("SVEN_FACTORED_WARPS", str(warps))
    gen = torch.Generator().manual_seed(7)
    inputs = [x.to(device) for x in _inputs(9, 2, 8, 6, torch.float32, dt_max=10.0, e=e)]
    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = inputs
    if rows:
        table = torch.randn(13, e, generator=gen).to(device)
        slot_rows = torch.randint(0, 13, pos.shape, generator=gen).to(device)
        ef = table[slot_rows] * mask[..., None].float()
    want = reference.temporal_attention_factored(
        *[_f64(x) for x in (q, kvn, pos, dt, mask, tw, tb, wt, ef, we)]
    )
    with torch.no_grad():
        if rows:
            got = triton_factored.temporal_attention_factored(
                q, kvn, pos, dt, mask, tw, tb, wt, table, we, edge_rows=slot_rows
            )
        else:
            got = triton_factored.temporal_attention_factored(*inputs)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _with_edges(*inputs: torch.Tensor, edge_rows: bool) -> tuple:
    """The factored attention's arguments from :func:`_inputs`'s ten; with ``edge_rows``
    the edge features as rows of an (R K, d_e) table that each slot names."""
    pos, ef = inputs[2], inputs[8]
    if not edge_rows:
        return inputs
    table = ef.reshape(-1, ef.shape[-1])
    rows = torch.arange(table.shape[0], device=ef.device).view(pos.shape)
    return (*inputs[:8], table, inputs[9], rows)


# The interpreter computes the masked slots' NaN encodings in numpy, which warns.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("edge_rows", [False, True])
def test_triton_factored_eager_reads_change_nothing(edge_rows: bool, device, monkeypatch) -> None:
    """Reading the slots' rows and gaps without waiting for their flags
    (``SVEN_FACTORED_EAGER=1``) gives the same outputs bit for bit, also where a
    masked slot's gap is NaN or infinite (its encoding is zeroed, never summed)."""
    from sven.kernels import triton_factored

    q, kvn, pos, dt, mask, tw, tb, wt, ef, we = [
        x.to(device) for x in _inputs(33, 2, 8, 5, torch.float32, dt_max=10.0)
    ]
    dt = dt.masked_fill(~mask, float("nan"))
    dt[:, 0] = torch.where(mask[:, 0], dt[:, 0], float("inf"))
    args = _with_edges(q, kvn, pos, dt, mask, tw, tb, wt, ef, we, edge_rows=edge_rows)
    outs = []
    with torch.no_grad():
        for eager in ("0", "1"):
            monkeypatch.setenv("SVEN_FACTORED_EAGER", eager)
            outs.append(triton_factored.temporal_attention_factored(*args))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("h,d,f", [(1, 8, 20), (2, 50, 100), (3, 5, 7)])
def test_head_blocks_are_the_per_head_slices_on_a_diagonal(h: int, d: int, f: int) -> None:
    """The key block holds head j's (D, F) slice of the keys' rows at (j D, j F), the
    value block head j's slice of the values' rows, transposed, at (j F, j D); zeros
    elsewhere, exactly."""
    from sven.kernels import triton_factored

    w = torch.randn(2 * h * d, f, generator=torch.Generator().manual_seed(4))
    key, value = triton_factored._head_blocks(w, h, d)
    o = h * d
    assert torch.equal(key, torch.block_diag(*w[:o].view(h, d, f)))
    assert torch.equal(value, torch.block_diag(*w[o:].view(h, d, f).transpose(1, 2)))


@pytest.mark.parametrize("edge_rows", [False, True])
def test_triton_factored_products_by_blocks_equal_per_head(
    edge_rows: bool, device, monkeypatch
) -> None:
    """The queries' and the weighted sums' products over block-diagonal weights
    (``SVEN_FACTORED_PRODUCTS=blocks``) compute what the per-head products compute (their
    float64 operands to rounding), and close to the reference."""
    from sven.kernels import triton_factored

    args = _with_edges(
        *[x.to(device) for x in _inputs(33, 2, 8, 5, torch.float64, dt_max=10.0)],
        edge_rows=edge_rows,
    )
    outs = []
    with torch.no_grad():
        want = reference.temporal_attention_factored(*args)
        for mode in ("bmm", "blocks"):
            monkeypatch.setenv("SVEN_FACTORED_PRODUCTS", mode)
            outs.append(triton_factored.temporal_attention_factored(*args))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    # The kernel itself computes in float32.
    torch.testing.assert_close(outs[1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name,value",
    [
        ("SVEN_FACTORED_WARPS", "3"),
        ("SVEN_FACTORED_CHUNK", "48"),
        ("SVEN_FACTORED_EAGER", "2"),
        ("SVEN_FACTORED_PRODUCTS", "einsum"),
        ("SVEN_FACTORED_KERNEL", "heads"),
        ("SVEN_FACTORED_KERNEL", "rows"),
    ],
)
def test_triton_factored_refuses_a_bad_launch_setting(name: str, value: str, monkeypatch) -> None:
    from sven.kernels import triton_factored

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        triton_factored._factored_launch(172)
        triton_factored._by_blocks()
        triton_factored._factored_kernel(torch.zeros(1), torch.zeros(3, 200), 2, 100)


def test_row_vec_is_the_alignment_every_key_and_value_slice_shares() -> None:
    from sven.kernels.triton_factored import _row_vec

    # Rows of 200, slices at 0 and 100: every slice starts at a multiple of 4 elements.
    assert _row_vec(torch.zeros(4, 200), 100) == 4
    # Rows of 202 elements (slices at 0 and 101 of each): multiples of 2 only, and with
    # slices at 0 and 99 of rows of 202, none.
    assert _row_vec(torch.zeros(4, 202), 100) == 2
    assert _row_vec(torch.zeros(4, 202)[:, :198], 99) == 1
    # A view one element in: no slice is aligned.
    assert _row_vec(torch.zeros(4, 208)[:, 1:201], 100) == 1
    # Columns not contiguous: no vector loads.
    assert _row_vec(torch.zeros(200, 4).t(), 100) == 1
