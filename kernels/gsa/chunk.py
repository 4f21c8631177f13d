"""GSA (Gated Slot Attention), chunked: the public call, its settings, the launches and the custom ops around them
(math and design in README.md; the Triton kernels in fwd.py and bwd.py).

    o, final_state = chunk_gsa(q, k, v, s, g, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, backend=None, settings=None)

q, k: [B, T, H, K]; v: [B, T, H, V]; s (slot writes), g (log forget gate, <= 0; computed and used in fp32):
[B, T, H, M]. scale None means K^-0.5. States are a pair (Hk [N, H, K, M], Hv [N, H, M, V]), fp32. cu_seqlens [N+1]
packs N sequences into B = 1. CUDA tensors go to the Triton kernel, CPU tensors to the PyTorch chunked path;
backend='triton' | 'torch' forces one (tests run the Triton kernel on CPU tensors under TRITON_INTERPRET=1, the
sm_90 compile records its launches on meta tensors).

The Triton path is the operator flame::chunk_gsa (backward: flame::chunk_gsa_bwd), so that torch.compile traces a
whole block through it without a graph break. The PyTorch path stays outside: it is differentiable and traceable as
it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.gsa.torch_chunk import chunk_gsa_torch
from kernels.launch import launch, register_fake
from kernels.limits import GSA_MAX_SLOTS
from kernels.settings import check_choice, check_tiles_and_warps, from_text, to_text
from kernels.utils import (cdiv, check_head_sizes, chunk_count, chunk_tables, is_interpreting, next_pow2,
                           packed_rows, scan_tile)

try:
    import triton
except ImportError:  # the torch path needs no Triton
    triton = None


@dataclass(frozen=True)
class Settings:
    """Tiles, warps, register caps and the shape-chosen forward regime of the Triton kernel. Fixed values instead
    of autotuning: a first call compiles each kernel once (benchmarks/bench_kernels.py --set gsa.field=value times
    others)."""

    chunk: int | None = None
    """Tokens per chunk (16 or 32; the pairwise decays take log2(chunk) levels); None: 32 where M <= 64, else 16.
    The backward's per-chunk kernels need more shared memory than an H100 block has at 32 with M = 128."""
    prec: str = "tf32"
    """Operand precision of the fp32 products ("tf32" or "ieee"): the scans' always, the per-chunk kernels' where
    their operands are not bf16; the interpreter computes exact fp32 whatever this says."""
    bf16_products: bool = True
    """For bf16 inputs, the per-chunk kernels' products (_fwd_out, _bwd_dz, _bwd_pairs, _bwd_dkvsg: the logits,
    the pairwise levels, the output and every gradient product) take bf16 operands with fp32 accumulation, as FLA's
    kernels do. The scans' products stay as they are (fp32 at prec, or the bf16 halves of the split weights)."""
    scan_bd: int | None = None
    """D tile of the two-state scans; None: kernels.utils.scan_tile counting both states' tiles, about one program
    per SM."""
    key_scan_bd: int | None = None
    """D tile of the stateless forward's key-state scan; None: kernels.utils.scan_tile for one state."""
    out_scan_bd: int | None = None
    """D tile of the stateless forward's value-state scan (_out_scan); None: kernels.utils.scan_tile for one
    state."""
    scan_warps: int = 4
    """Warps of the scans: each step is a few small products, latency-bound."""
    chunk_warps: int = 8
    """Warps of the backward's per-chunk kernels _bwd_dz and _bwd_dkvsg: fewer register spills than with 4. Both
    have bf16 products (README, Why it is built this way)."""
    out_warps: int = 4
    """Warps of the forward's _fwd_out: two blocks per SM without a cap."""
    pairs_warps: int = 4
    """Warps of _bwd_pairs: uncapped, two blocks fit on an SM with few spills."""
    dkvsg_maxnreg: int | None = 128
    """Register cap of _bwd_dkvsg: at 128 two blocks of 8 warps fit on an SM instead of one, for a few spilled
    bytes."""
    pairs_maxnreg: int | None = None
    """Register cap of _bwd_pairs (None: ptxas decides)."""
    dz_maxnreg: int | None = None
    """Register cap of _bwd_dz (None: ptxas decides; a cap of 128 spills heavily)."""
    out_maxnreg: int | None = None
    """Register cap of _fwd_out (None: ptxas decides; a cap spills)."""
    fp16_states: bool = True
    """For bf16 data, the chunk states that pass between kernels (the stored-state forward's, the backward's
    rescan's and its state gradients) travel as fp16 with a power-of-two scale per slot row and D tile: half the
    bytes of fp32, the backward's largest traffic, at the 11 significant bits the tf32 products that read them keep
    (README, Numerics). Only where the scans' D tile spans whole tiles of the kernels that read the states (so each
    of those reads one scale per row): many sequence-heads, as in training. The scans carry the states in fp32; the
    final states stay fp32."""
    stateless_forward: bool | None = None
    """The forward stores no chunk state: the key-state scan alone forms the slot logits' inter-chunk parts and the
    value-state scan forms the output from the state it holds. The two scans then run one after the other, each
    with half the programs; None: where one state's scan alone still has a program per SM at 64-wide tiles
    (sequences x heads x V/64 >= 128)."""

    def __post_init__(self):
        check_choice(self, "chunk", (None, 16, 32))
        check_tiles_and_warps(self)

    def chunk_len(self, M: int) -> int:
        return self.chunk or (32 if _slots(M) <= 64 else 16)

    def bf16(self, q: torch.Tensor) -> bool:
        """Whether the per-chunk products take bf16 operands for inputs like q."""
        return self.bf16_products and q.dtype == torch.bfloat16

    def stateless(self, N: int, H: int, V: int) -> bool:
        """Whether the forward stores no chunk state for N sequences of H heads."""
        if self.stateless_forward is not None:
            return self.stateless_forward
        return N * H * cdiv(V, 64) >= 128


def _tile(D: int) -> int:
    return min(64, max(16, next_pow2(D)))


def _slots(M: int) -> int:
    """All M slots in one tile: the softmax runs over the whole row."""
    return max(16, next_pow2(M))


def _split(*xs) -> bool:
    """The scans' weights travel as bf16 halves when their data is bf16 (fp32 data takes tf32 products)."""
    return all(x.dtype == torch.bfloat16 for x in xs)


def _fed(g, split):
    """A scan's weights: fp32 [1, T, H, M], or bf16 [1, T, H, 2M] (hi | lo halves) when split."""
    if split:
        return torch.empty(*g.shape[:3], 2 * g.shape[3], device=g.device, dtype=torch.bfloat16)
    return torch.empty(g.shape, device=g.device, dtype=torch.float32)


def _chunk_consts(q, v, s, st: Settings) -> dict:
    """Compile-time values of the per-chunk kernels."""
    K, V, M = q.shape[-1], v.shape[-1], s.shape[-1]
    BT = st.chunk_len(M)
    return dict(H=q.shape[2], K=K, V=V, M=M, BT=BT, BK=_tile(K), BV=_tile(V), BM=_slots(M),
                LEVELS=BT.bit_length() - 1, BF16=st.bf16(q), PREC=st.prec)


def _scan(g, cu, tables, first, second, want_ht, reverse, egc, split, st: Settings):
    """The [M, D] state recursion of every chunk (fwd: states at chunk starts; reverse: gradients at chunk ends) of
    two states at once, each given as (w, x, h0) with w decayed (_gate_factors, _bwd_dz): returns (states, their
    scales or None, final state or None) for each, and the D tile, which is the scales' column group (the kernels
    that read the states take it as SC): fp16 states with scales where the data is bf16 (Settings.fp16_states),
    else fp32."""
    from kernels.gsa.fwd import _state_scan

    chunk_offsets, _, NT = tables
    H, M = g.shape[2], g.shape[3]
    N = cu.numel() - 1
    (w1, x1, h01), (w2, x2, h02) = first, second
    if (h01 is None) != (h02 is None):   # one final-state gradient unused: it is zero
        h01, h02 = (torch.zeros(N, H, M, x.shape[3], device=x.device) if h is None else h
                    for h, x in ((h01, x1), (h02, x2)))
    D1, D2 = x1.shape[3], x2.shape[3]
    # about one program per SM counting both states' tiles
    BD = st.scan_bd or scan_tile(max(D1, D2), 2 * N * H)
    f32 = dict(device=g.device, dtype=torch.float32)
    # fp16 where every tile of the kernels that read the states (_chunk_consts' BK, BV) lies within one scale group
    scaled = st.fp16_states and split and BD >= _tile(max(D1, D2))
    out = [(torch.empty(NT, H, M, D, device=g.device, dtype=torch.float16 if scaled else torch.float32),
            torch.empty(NT, H, M, cdiv(D, BD), **f32) if scaled else None,
            torch.empty(N, H, M, D, **f32) if want_ht else None) for D in (D1, D2)]
    grid = (N, H, cdiv(D1, BD) + cdiv(D2, BD))
    launch(_state_scan, grid, w1, x1, h01, *out[0], w2, x2, h02, *out[1], egc, cu, chunk_offsets, None, None,
           H=H, M=M, D1=D1, D2=D2, BT=st.chunk_len(M), BM=_slots(M), BD=BD, REVERSE=reverse,
           HAS_H0=h01 is not None, STORE_HT=want_ht, PREC=st.prec, SPLIT=split, EXACT=is_interpreting(),
           LOGITS=False, num_warps=st.scan_warps)
    return out, BD


def _key_scan(g, cu, tables, sE, k, hk0, q, want_ht, egc, split, st: Settings):
    """(stateless forward) The key-state scan alone, each D tile forming its part of the slot logits' inter-chunk
    term q Hk^T instead of storing the state: returns (the parts, fp32 [1, T, H, tiles x M]; final key state or
    None)."""
    from kernels.gsa.fwd import _state_scan

    chunk_offsets = tables[0]
    H, M, K = g.shape[2], g.shape[3], k.shape[3]
    N = cu.numel() - 1
    BD = st.key_scan_bd or scan_tile(K, N * H)
    f32 = dict(device=g.device, dtype=torch.float32)
    hkt = torch.empty(N, H, M, K, **f32) if want_ht else None
    zp = torch.empty(*g.shape[:3], cdiv(K, BD) * M, **f32)
    # the second state's arguments repeat the first's: D2 = 0 never reads them
    launch(_state_scan, (N, H, cdiv(K, BD)), sE, k, hk0, None, None, hkt, sE, k, hk0, None, None, None, egc,
           cu, chunk_offsets, q, zp, H=H, M=M, D1=K, D2=0, BT=st.chunk_len(M), BM=_slots(M), BD=BD, REVERSE=False,
           HAS_H0=hk0 is not None, STORE_HT=want_ht, PREC=st.prec, SPLIT=split, EXACT=is_interpreting(),
           LOGITS=True, num_warps=st.scan_warps)
    return zp, hkt


def _out_scan(sE, v, hv0, want_ht, pe, a2, cu, tables, egc, split, st: Settings):
    """(stateless forward) The value-state scan forming the output o (v's dtype) from p e^{G} and A2: returns
    (o, final value state or None)."""
    from kernels.gsa.fwd import _out_scan as kernel

    chunk_offsets = tables[0]
    N, H, M, V = cu.numel() - 1, v.shape[2], pe.shape[3], v.shape[3]
    o = torch.empty_like(v)
    hvt = torch.empty(N, H, M, V, device=v.device, dtype=torch.float32) if want_ht else None
    BD = st.out_scan_bd or scan_tile(V, N * H)
    launch(kernel, (N, H, cdiv(V, BD)), sE, v, hv0, hvt, egc, cu, chunk_offsets, pe, a2, o, H=H, M=M, D=V,
           BT=st.chunk_len(M), BM=_slots(M), BD=BD, HAS_H0=hv0 is not None, STORE_HT=want_ht, PREC=st.prec,
           SPLIT=split, EXACT=is_interpreting(), num_warps=st.scan_warps)
    return o, hvt


def _gate_factors(s, g, cu, tables, split, st: Settings):
    """(s e^{sum_{j>t} g_j} [1, T, H, M] fp32, or [1, T, H, 2M] bf16 halves when split; e^{G_C} [NT, H, M]; g
    slot-major by chunk [H, M, NT x BT]): the forward scans' weights and decays, and the per-chunk kernels' g."""
    from kernels.gsa.fwd import _gate_factors as kernel

    H, M = g.shape[2], g.shape[3]
    BT, NT = st.chunk_len(M), tables[2]
    sE = _fed(g, split)
    egc = torch.empty(NT, H, M, device=g.device, dtype=torch.float32)
    gf = torch.empty(H, M, NT * BT, device=g.device, dtype=torch.float32)
    launch(kernel, (NT, H), s, g, cu, tables[1], sE, egc, gf, NT * BT, H=H, M=M, BT=BT, BM=_slots(M), SPLIT=split)
    return sE, egc, gf


def _fwd(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, tables, st: Settings):
    from kernels.gsa.fwd import _fwd_out

    split = _split(k, v)
    sE, egc, gf = _gate_factors(s, g, cu, tables, split, st)
    stateless = st.stateless(cu.numel() - 1, q.shape[2], v.shape[3])
    f32 = dict(device=g.device, dtype=torch.float32)
    BT = st.chunk_len(g.shape[3])
    # the softmax p and the slot logits, kept for the backward (fp32 [T, H, M]); A1 = q k^T and A2 (p against s),
    # each [T, H, BT], for the backward's _bwd_pairs and _bwd_dkvsg (A2 also for _out_scan)
    p, z = (torch.empty(g.shape, **f32) for _ in range(2))
    a1, a2 = (torch.empty(*g.shape[:3], BT, **f32) for _ in range(2))
    if stateless:
        zp, hkt = _key_scan(g, cu, tables, sE, k, hk0, q, want_ht, egc, split, st)
        hk = hv = hk_sc = hv_sc = o = None
        SC = 1
        pe = torch.empty(g.shape, **f32)
        passes = ("softmax", "decayed")
    else:
        ((hk, hk_sc, hkt), (hv, hv_sc, hvt)), SC = _scan(g, cu, tables, (sE, k, hk0), (sE, v, hv0), want_ht, False,
                                                         egc, split, st)
        o = torch.empty_like(v)
        zp = pe = None
        passes = ("softmax", "output")
    for step in passes:
        launch(_fwd_out, (tables[2], q.shape[2]), q, k, v, s, gf, cu, tables[1], hk, hv, hk_sc, hv_sc, o, p, z, a1,
               a2, pe, zp, scale, tables[2] * BT, PASS=step, NZP=0 if zp is None else zp.shape[3] // g.shape[3], SC=SC,
               **_chunk_consts(q, v, s, st), num_warps=st.out_warps, maxnreg=st.out_maxnreg)
    if stateless:
        o, hvt = _out_scan(sE, v, hv0, want_ht, pe, a2, cu, tables, egc, split, st)
    return o, hkt, hvt, (sE, egc, p, z, gf, a1, a2)


def _bwd(q, k, v, s, g, scale, hk0, hv0, cu, tables, do, dhkt, dhvt, sE, egc, p, z, gf, a1, a2, y, inv_norm,
         st: Settings):
    from kernels.gsa.bwd import _bwd_dkvsg, _bwd_dz, _bwd_pairs

    # the chunk states again (cheap next to keeping them from the forward), with the forward's weights
    ((hk, hk_sc, _), (hv, hv_sc, _)), SC = _scan(g, cu, tables, (sE, k, hk0), (sE, v, hv0), False, False, egc,
                                                 sE.dtype == torch.bfloat16, st)
    grid = (tables[2], q.shape[2])
    f32 = dict(device=q.device, dtype=torch.float32)
    dz, dg = (torch.empty(g.shape, **f32) for _ in range(2))
    split = _split(q, do)
    pe, dze = (_fed(g, split) for _ in range(2))
    consts = _chunk_consts(q, v, s, st)
    TT = tables[2] * consts["BT"]
    d2 = torch.empty_like(a1)
    launch(_bwd_dz, grid, v, s, gf, do, cu, tables[1], hv, hv_sc, p, z, dz, dg, pe, dze, d2, scale, TT, SPLIT=split,
           SC=SC,
           **{n: x for n, x in consts.items() if n not in ("K", "BK")},   # it reads no key-side tensor
           num_warps=st.chunk_warps, maxnreg=st.dz_maxnreg)
    dsi, da1 = torch.empty(g.shape, **f32), torch.empty_like(a1)
    # _bwd_pairs on a second stream beside the reverse scan, which is independent of it and alone leaves most SMs
    # idle (None: the current stream, off CUDA)
    main = side = torch.cuda.current_stream() if q.is_cuda else None
    if main is not None:
        side = torch.cuda.Stream(device=q.device)
        side.wait_stream(main)
    with torch.cuda.stream(side):
        launch(_bwd_pairs, grid, s, g, p, dz, a1, d2, cu, tables[1], dsi, da1,
               **{n: consts[n] for n in ("H", "M", "BT", "BM", "LEVELS", "BF16", "PREC")}, num_warps=st.pairs_warps,
               maxnreg=st.pairs_maxnreg)
    ((dhk, dhk_sc, dhk0), (dhv, dhv_sc, dhv0)), dSC = _scan(g, cu, tables, (dze, q, dhkt), (pe, do, dhvt),
                                                            hk0 is not None, True, egc, split, st)
    assert dSC == SC   # the same D tile (one SC for both scans' scales)
    if main is not None:
        # every tensor it touched was allocated on the main stream and is freed after this wait
        main.wait_stream(side)
    if y is None:
        dq, dk, dv, ds, dy = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(s), None
    else:   # the gradient of the stacked projection y the features came from, in place of theirs
        dq = dk = dv = ds = None
        dy = torch.empty_like(y)
    launch(_bwd_dkvsg, grid, q, k, v, s, gf, do, cu, tables[1], hk, hv, dhk, dhv, hk_sc, hv_sc, dhk_sc, dhv_sc, dz,
           dq, dk, dv, ds, dg, dsi, a2, da1, TT, y, dy, inv_norm, **consts, SC=SC, W=0 if y is None else y.shape[-1],
           num_warps=st.chunk_warps, maxnreg=st.dkvsg_maxnreg)
    if y is not None:
        dg = None
    return dq, dk, dv, ds, dg, dhk0, dhv0, dy


def _tables(cu, total: int, seq_len: int, M: int, st: Settings):
    """chunk_tables for seq_len the common length of equal rows, or 0 for packed sequences of unknown lengths."""
    return chunk_tables(cu, st.chunk_len(M), total, seq_len or None)


# The Triton kernel as one operator torch.compile traces as a whole (no graph break), with the backward a second one.
# Packed inputs [1, T, H, *] (g fp32), cu int32 [N+1]; states in the kernels' layout Hk^T [N, H, M, K], Hv [N, H, M,
# V]. Besides o and the final states, the forward returns what the backward reads: only small [T, H, M] and
# [T, H, BT] factors (the backward rescans the chunk states instead of holding them). y [T, W], when given, is the
# stacked projection the features were made from (projection.py), inv_norm its gate's 1 / normalizer: the backward
# then returns y's gradient through the feature maps, and None for the features'.
def _forward_op(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, seq_len, settings, y, inv_norm):
    st = from_text("gsa", settings)
    tables = _tables(cu, q.shape[1], seq_len, s.shape[3], st)
    o, hkt, hvt, kept = _fwd(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, tables, st)
    return o, hkt, hvt, *kept


chunk_gsa_op = torch.library.custom_op(
    "flame::chunk_gsa", _forward_op, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, float scale, Tensor? hk0, Tensor? hv0, bool want_ht, "
           "Tensor cu, SymInt seq_len, str settings, Tensor? y, float inv_norm) -> (Tensor o, Tensor? hkt, "
           "Tensor? hvt, Tensor sE, Tensor egc, Tensor p, Tensor z, Tensor gf, Tensor a1, Tensor a2)")


def _fake_forward(q, k, v, s, g, scale, hk0, hv0, want_ht, cu, seq_len, settings, y, inv_norm):
    st = from_text("gsa", settings)
    _, T, H, K = q.shape
    V, M, N = v.shape[3], s.shape[3], cu.shape[0] - 1
    BT = st.chunk_len(M)
    NT = chunk_count(N, BT, T, seq_len or None)
    f32 = lambda *shape: q.new_empty(shape, dtype=torch.float32)  # noqa: E731
    hkt, hvt = (f32(N, H, M, K), f32(N, H, M, V)) if want_ht else (None, None)
    return (torch.empty_like(v), hkt, hvt, _fed(g, _split(k, v)), f32(NT, H, M), f32(1, T, H, M), f32(1, T, H, M),
            f32(H, M, NT * BT), f32(1, T, H, BT), f32(1, T, H, BT))


def _backward_op(q, k, v, s, g, scale, hk0, hv0, cu, seq_len, settings, sE, egc, p, z, gf, a1, a2, do, dhkt, dhvt,
                 y, inv_norm):
    st = from_text("gsa", settings)
    tables = _tables(cu, q.shape[1], seq_len, s.shape[3], st)
    return _bwd(q, k, v, s, g, scale, hk0, hv0, cu, tables, do, dhkt, dhvt, sE, egc, p, z, gf, a1, a2, y, inv_norm,
                st)


chunk_gsa_bwd_op = torch.library.custom_op(
    "flame::chunk_gsa_bwd", _backward_op, mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor s, Tensor g, float scale, Tensor? hk0, Tensor? hv0, Tensor cu, "
           "SymInt seq_len, str settings, Tensor sE, Tensor egc, Tensor p, Tensor z, Tensor gf, Tensor a1, "
           "Tensor a2, Tensor do, Tensor? dhkt, Tensor? dhvt, Tensor? y, float inv_norm) -> (Tensor? dq, Tensor? dk, "
           "Tensor? dv, Tensor? ds, Tensor? dg, Tensor? dhk0, Tensor? dhv0, Tensor? dy)")


def _fake_backward(q, k, v, s, g, scale, hk0, hv0, cu, seq_len, settings, sE, egc, p, z, gf, a1, a2, do, dhkt, dhvt,
                   y, inv_norm):
    features = (None,) * 5 if y is not None else tuple(torch.empty_like(x) for x in (q, k, v, s, g))
    return (*features, *(None if h is None else torch.empty_like(h) for h in (hk0, hv0)),
            None if y is None else torch.empty_like(y))


def _autograd_setup(ctx, inputs, output):
    q, k, v, s, g, scale, hk0, hv0, want_ht, cu, seq_len, settings, y, inv_norm = inputs
    kept = output[3:]
    ctx.mark_non_differentiable(*kept)
    # no zero gradients made for the kept factors; an unused o gets one below
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, s, g, hk0, hv0, cu, y, *kept)
    ctx.scale, ctx.seq_len, ctx.settings, ctx.inv_norm = scale, seq_len, settings, inv_norm


def _autograd_backward(ctx, do, dhkt, dhvt, *_):
    q, k, v, s, g, hk0, hv0, cu, y, *kept = ctx.saved_tensors
    c = lambda x: None if x is None else x.contiguous()  # noqa: E731
    do = torch.zeros_like(v) if do is None else do.contiguous()
    dq, dk, dv, ds, dg, dhk0, dhv0, dy = chunk_gsa_bwd_op(q, k, v, s, g, ctx.scale, hk0, hv0, cu, ctx.seq_len,
                                                          ctx.settings, *kept, do, c(dhkt), c(dhvt), y, ctx.inv_norm)
    # with y, the features' own gradients are None: dy already carries them (chunk_gsa_from_projection)
    return dq, dk, dv, ds, dg, None, dhk0, dhv0, None, None, None, None, dy, None


chunk_gsa_op.register_autograd(_autograd_backward, setup_context=_autograd_setup)
register_fake(chunk_gsa_op, _fake_forward, _forward_op)
register_fake(chunk_gsa_bwd_op, _fake_backward, _backward_op)


DEFAULT_SETTINGS = Settings()
"""Settings() built once: each construction checks every field (a few microseconds of the host's time a call)."""

MAX_SLOTS = GSA_MAX_SLOTS
"""Most slots of the Triton kernel (kernels/limits.py says why)."""


def _chunk_gsa_triton(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens, settings: Settings | None,
                      projection: tuple[torch.Tensor, float] | None = None):
    st = settings or DEFAULT_SETTINGS
    B, T, H, K = q.shape
    V, M = v.shape[-1], s.shape[-1]
    check_head_sizes("chunk_gsa", {"K": K, "V": V, "M": M}, {"M": MAX_SLOTS})
    BT = st.chunk_len(M)
    cu, flat = packed_rows(B, T, H, cu_seqlens, q.device)
    # The gate stays fp32 whatever the model's dtype (bf16 log gates near 0 lose the slow slots).
    q_, k_, v_, s_ = (flat(x) for x in (q, k, v, s))
    g_ = flat(g.float())
    hk0 = hv0 = None
    if initial_state is not None:
        hk0 = initial_state[0].float().transpose(-1, -2).contiguous()
        hv0 = initial_state[1].float().contiguous()
    y, inv_norm = (None, 1.0) if projection is None else (projection[0].reshape(B * T, -1).contiguous(),
                                                          float(projection[1]))
    o, hkt, hvt, *_ = chunk_gsa_op(q_, k_, v_, s_, g_, float(scale), hk0, hv0, bool(output_final_state), cu,
                                   T if cu_seqlens is None else 0, "" if settings is None else to_text(settings), y,
                                   inv_norm)
    final = (hkt.transpose(-1, -2), hvt) if output_final_state else None
    return o.reshape(B, T, H, V), final


def chunk_gsa(q, k, v, s, g, scale: float | None = None, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, backend: str | None = None, settings: Settings | None = None):
    """GSA over packed or batched sequences: returns (o [B, T, H, V] in v's dtype, (Hk, Hv) fp32 or None).
    settings: the Triton kernel's (None: Settings())."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if initial_state is not None and (len(initial_state) != 2 or any(x is None for x in initial_state)):
        raise ValueError("initial_state must be a pair (Hk [N, H, K, M], Hv [N, H, M, V])")
    if backend is None:
        backend = "triton" if q.is_cuda and triton is not None else "torch"
    if backend == "torch":
        return chunk_gsa_torch(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens)
    if backend != "triton":
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    return _chunk_gsa_triton(q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens, settings)
