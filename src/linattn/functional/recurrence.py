"""The recurrence across chunks: the one stage every chunked engine shares, written once with
its two strategies.

A chunked engine (``decayed.py``, ``delta.py``) forms everything inside a chunk in batched
products; what links the chunks is one affine recurrence on the state,

    S_{c+1} = A_c S_c + U_c        (S_0 = s0),

with a transition ``A_c`` that is the identity (no gate), a number per row (a gate per head), a
diagonal acting on the state's rows (a gate per key channel) or a full ``(D, D)`` matrix (the delta
rule: ``Diag(gamma_C) - Kd^T W``), and its backward, the same recurrence run backwards with the
transposed transitions. :func:`chunk_recurrence` is that stage, with two strategies:

- **cpu** (sequential): one multiply-add a chunk, the state read and written in place while it is
  in cache. The least arithmetic: right where launches are free (a CPU).
- **accelerator** (a log-depth scan): neighbouring chunks paired, each pair composed into one
  affine map (``A' = A_odd A_even``, ``U' = A_odd U_even + U_odd``), the half-length recurrence
  solved the same way, and the state between the two members of each pair filled in from the
  state before the pair: ``log2(Nc)`` rounds of three batched operations written in place,
  launches that grow with log N instead of N, every operation as large as the whole sequence's,
  and no host read. Elementwise transitions (a number or a diagonal) take the chunks in their own
  order, a round's pair members as strided views, which elementwise operations read as they are;
  full ones hold the chunks in bit-reversed order, so that the pairs of every round are two
  contiguous halves, each one batch for a matrix product (a gather in and one out). The price is
  arithmetic: full transitions
  cost one ``(D, D) x (D, D)`` product per chunk (about ``D / C`` times the sequential work of the
  delta rule's loop), diagonal ones an elementwise product.

Both compose products of transitions (factors in [0, 1], or matrices of norm <= 1 within the delta
rule's contract) and never a difference of cumulative log decays: no digit is lost to a large
decay earlier in the sequence.

Which strategy a call runs is chosen in one place, ``strategy.py``.

Prefix sums (the identity transition, and every cumulative sum of the engines: log decays, the
normaliser's key sums) go through :func:`prefix_sums` / :func:`prefix_sums_`: ``cumsum``, except
while deterministic algorithms are on (``torch.use_deterministic_algorithms``, which transformers'
``full_determinism`` sets), where CUDA refuses a floating cumsum (it has no deterministic kernel)
and a log-depth scan of adds, its rounding errors carried, takes its place on every device.

Dimension legend: Nc chunks, R rows (B*H), D state rows (query/key width), Dv state columns.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["chunk_recurrence", "chunk_recurrence_reference", "prefix_sums", "prefix_sums_"]


def _refused_cumsum(x: Tensor) -> bool:
    """Whether CUDA's cumsum would refuse ``x`` now: floating or complex values while deterministic
    algorithms are on (it raises there, or warns with ``warn_only``; integer sums are exact)."""
    return torch.are_deterministic_algorithms_enabled() and (x.is_floating_point() or x.is_complex())


def _two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a + b`` rounded, and its rounding error exactly (Knuth's TwoSum, for any magnitudes); an
    infinite sum (a log decay of -inf, a reset) has none: there the formula's inf - inf would be
    NaN, and it is set to 0."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)).add_(b - bb).nan_to_num_(0.0, 0.0, 0.0)


def _pair_sums_(hi: Tensor, lo: Tensor | None) -> None:
    """Inclusive prefix sums along dim 0, in place: each pair's sum into its second member, the
    pairs' prefix sums (the same, on every other position), then each later first member's own
    term added to the sum before it; log2(n) levels of halving size, two in-place adds each. With
    ``lo`` (zeros of hi's shape), each addition's rounding error is kept there exactly
    (:func:`_two_sum`): the sums are then ``hi + lo``."""
    n = hi.shape[0]
    if n < 2:
        return
    _add_into(hi, lo, slice(1, None, 2), slice(0, n - n % 2, 2))  # each pair's sum
    _pair_sums_(hi[1::2], None if lo is None else lo[1::2])  # the pairs' prefix sums
    _add_into(hi, lo, slice(2, None, 2), slice(1, n - 1, 2))  # each later first member's


def _add_into(hi: Tensor, lo: Tensor | None, into: slice, add: slice) -> None:
    """``hi[into] += hi[add]`` (disjoint positions), its rounding error into ``lo`` when given."""
    if lo is None:
        hi[into] += hi[add]
        return
    s, e = _two_sum(hi[into], hi[add])
    hi[into] = s
    lo[into] += e.add_(lo[add])


def _splits(x: Tensor, rounded_once: bool) -> bool:
    """Whether :func:`prefix_sums_` sums ``x`` by :func:`_split_sums_` (outside deterministic
    algorithms): float32 sums to be rounded once."""
    return rounded_once and x.dtype == torch.float32


def _split_sums_(x: Tensor, dim: int) -> Tensor:
    """``x`` (float32) replaced by its inclusive sums along ``dim``, each rounded once in whatever
    order and precision the device's cumsum adds: ``x`` split into ``hi``, x rounded to a grid of
    a power of two ``s`` per row (fine enough for the row's largest finite magnitude, coarse enough
    that every partial sum of up to ``L`` multiples of it is exact in float32: exact in any order),
    and ``lo = x - hi`` (exact, at most s/2; 0 where x is infinite), whose sums are so small that
    their rounding stays about 2^-30 of the row's largest term; then ``hi``'s sums plus ``lo``'s,
    one rounding. Returns ``x``. About fourteen launches, on small tensors only (log decays)."""
    L = x.shape[dim]
    top = x.abs().nan_to_num_(0.0, 0.0).amax(dim, keepdim=True)  # the largest finite magnitude of each row
    # s = 2^(e + 1 + ceil(log2 L) - 24) for top in [2^e, 2^(e + 1)): from the exponent bits, no frexp
    # (not every backend has one), and exact (an exp2 need not be)
    biased = top.view(torch.int32).bitwise_right_shift_(23).add_((L - 1).bit_length() - 23).clamp_(1, 254)
    s = biased.bitwise_left_shift_(23).view(torch.float32)
    hi = torch.div(x, s).round_().mul_(s)
    x.sub_(hi).nan_to_num_(0.0, 0.0, 0.0).cumsum_(dim)  # lo's sums, in x
    return x.add_(hi.cumsum_(dim))


def prefix_sums_(x: Tensor, dim: int, *, rounded_once: bool = False) -> Tensor:
    """``x`` replaced by its inclusive cumulative sums along ``dim``, in place; returns ``x``.

    ``Tensor.cumsum_``, or while CUDA would refuse that (:func:`_refused_cumsum`) a log-depth scan
    of adds on every device (:func:`_pair_sums_`), so that the code tested on a CPU is the code a
    deterministic GPU run takes.

    ``rounded_once``: for log decays, whose sums are exponentiated and differenced (a chunk's decays
    ``G_i - G_j``): each sum rounded once, on every device and in either mode. A plain cumsum rounds
    as its device adds: a CPU carries a float's running sum in double (each sum rounded once), CUDA
    adds in float, along the last dimension by a tree in blocks and along others in turn (aten's
    ScanUtils.cuh), so that a difference carries one rounding a step between its ends, or a tree's.
    Float32 GLA per head after decays of -39 at N = 65536 measured 2.6e-5 against float64 with
    CUDA's order emulated (tests/probes.py, ``cuda_scan_order``), 9.2e-6 with each sum rounded once.
    Float32 sums split in two exact parts (:func:`_split_sums_`) outside deterministic algorithms;
    the scan there carries its rounding errors (TwoSum), about ten launches for each one of the
    plain scan (small tensors only). Other dtypes: a plain cumsum."""
    if not _refused_cumsum(x):
        return _split_sums_(x, dim) if _splits(x, rounded_once) else x.cumsum_(dim)
    hi = x.movedim(dim, 0)
    lo = torch.zeros_like(hi) if rounded_once else None
    _pair_sums_(hi, lo)
    if lo is not None:
        hi += lo
    return x


def prefix_sums(x: Tensor, dim: int, *, rounded_once: bool = False) -> Tensor:
    """The inclusive cumulative sums of ``x`` along ``dim``, a new tensor: ``Tensor.cumsum``, or
    :func:`prefix_sums_` on a copy where that would not do (deterministic algorithms on, or
    ``rounded_once`` float32 sums)."""
    if _refused_cumsum(x) or _splits(x, rounded_once):
        return prefix_sums_(x.clone(), dim, rounded_once=rounded_once)
    return x.cumsum(dim)


def _kind(A: Tensor | None, D: int) -> str:
    """The transition's kind from its shape: None, ``(.., 1, 1)`` a number, ``(.., D, 1)`` a diagonal
    on the rows, ``(.., D, D)`` full."""
    if A is None:
        return "identity"
    if A.shape[-1] == 1:
        return "scalar" if A.shape[-2] == 1 else "diagonal"
    return "full"


def _apply(A: Tensor | None, kind: str, S: Tensor, U: Tensor, out: Tensor | None = None) -> Tensor:
    """``A S + U`` for a batch of transitions ``(M, D, D | 1)`` and states ``S, U (M, D, Dv)``, into
    ``out`` when given."""
    if kind == "identity":
        return torch.add(U, S, out=out)
    if kind == "full":
        return torch.baddbmm(U, A, S, out=out)
    return torch.addcmul(U, A, S, out=out)


def _add_applied(A: Tensor, kind: str, S: Tensor, U: Tensor) -> Tensor:
    """``U += A S`` in place (transitions ``(M, D, D | 1)``, not the identity): for a full product no
    copy of U into a new output first, which an out-of-place one launches on CUDA."""
    return U.baddbmm_(A, S) if kind == "full" else U.addcmul_(A, S)


def _compose(later: Tensor, earlier: Tensor, kind: str, out: Tensor | None = None) -> Tensor:
    """The transition of two steps, ``later @ earlier`` (elementwise for numbers and diagonals), into
    ``out`` when given."""
    if kind == "full":
        return torch.bmm(later, earlier, out=out)
    return torch.mul(later, earlier, out=out)


def _scan(M: Tensor, X: Tensor, seed: Tensor, kind: str, E: Tensor, reverse: bool, work: Tensor | None = None) -> Tensor:
    """Exclusive affine scan over ``n`` steps: ``X (n, R, D, Dv)`` what each step adds, ``M (n, R,
    D, D | 1)`` its transition (for ``reverse``, the transposed ones). Writes into ``E (n, R, D, Dv)``
    the state before each step in the order they run (forward: step 0 first from ``seed (R, D, Dv)``,
    ``E_{l+1} = M_l E_l + X_l``; ``reverse``: step n - 1 first), and returns the state after the last
    one. ``X`` is consumed (overwritten); ``M`` is read only. ``E`` may hold the seed itself (the
    slot of the step that runs first).

    Each level pairs neighbouring steps: the pair as one step (in place in the member that runs
    second: ``X_s <- M_s X_f + X_s``), its transition ``M_s M_f``, the half-length scan of the pairs
    into the slots of the members that run first (the state before a pair is its first member's),
    then the second's state ``M_f E_f + X_f``: log2(n) levels of three batched operations, no copy.

    Where the steps of a level sit (see :func:`_halves`): elementwise transitions (a number or a
    diagonal) in the steps' own order, a pair's members strided views (every other step); an
    elementwise operation reads those as they are, so there is no gather, no padding, and an odd
    count folds the step that runs first into the seed. Full transitions in bit-reversed order
    (step ``l`` at position ``bitrev(l)``, n a power of two): the pairs' members are the two
    contiguous halves, each one batch of ``(n/2) R`` matrices for one matrix product, which a
    strided batch would first have to copy.

    ``work``: None, or a flat buffer of at least ``(n - 1)`` transitions' size that the levels'
    composed transitions are written into, each level's after the one before (none is read after
    the level below it returns); None: each level allocates its own."""
    n = X.shape[0]
    if n == 1:
        E[0].copy_(seed)
        return _add_applied(M[0], kind, seed, X[0])
    if n % 2:  # the elementwise order only (the bit-reversed one has n a power of two)
        at, others = (n - 1, slice(0, n - 1)) if reverse else (0, slice(1, n))
        E[at].copy_(seed)  # before the seed is replaced: E may hold the seed itself
        seed = _add_applied(M[at], kind, seed, X[at])
        return _scan(M[others], X[others], seed, kind, E[others], reverse, work)
    first, second = _halves(n, kind, reverse)
    batch = (lambda t: t.flatten(0, 1)) if kind == "full" else (lambda t: t)  # (h R, D, D): one product
    Mf, Ms, Xf = batch(M[first]), batch(M[second]), batch(X[first])
    _add_applied(Ms, kind, Xf, batch(X[second]))  # each pair as one step
    size = Mf.numel()
    into, rest = (None, None) if work is None else (work[:size].view(Mf.shape), work[size:])
    total = _scan(_compose(Ms, Mf, kind, into).view(M[first].shape), X[second], seed, kind, E[first], reverse, rest)
    _apply(Mf, kind, batch(E[first]), Xf, out=batch(E[second]))
    return total


def _halves(n: int, kind: str, reverse: bool) -> tuple[slice, slice]:
    """The positions of the pairs' members (steps 2j, 2j + 1) that run first and second among ``n``
    (even) steps: every other step in the steps' own order (elementwise transitions), the two
    contiguous halves in bit-reversed order (full ones, :func:`_scan`)."""
    h = n // 2
    even, odd = (slice(0, h), slice(h, n)) if kind == "full" else (slice(0, n, 2), slice(1, n, 2))
    return (odd, even) if reverse else (even, odd)


@functools.lru_cache(maxsize=64)
def _bit_reversed(n: int, device: torch.device) -> Tensor:
    """``(n,)`` int64: ``bitrev(l)`` for l < n, n a power of two (the position of step l in
    :func:`_scan`'s order, and the step at position l: the permutation is its own inverse). Made on
    the device from an ``arange``, bit by bit (no host-to-device transfer, which would wait for the
    queue; not as a permute of a ``(2,) * log2(n)`` view, whose dimensions would pass MPS's limit of
    16 beyond 2**16 chunks), once per length and device: only read, never written, by the calls
    that share it."""
    bits = (n - 1).bit_length()
    steps = torch.arange(n, device=device)
    out = torch.zeros_like(steps)
    for b in range(bits):
        out.bitwise_or_(steps.bitwise_right_shift(b).bitwise_and_(1).bitwise_left_shift_(bits - 1 - b))
    return out


def _transposed(A: Tensor | None, kind: str) -> Tensor | None:
    return A.transpose(-1, -2) if kind == "full" else A


def _by_scan(A: Tensor | None, U: Tensor, seed: Tensor, kind: str, reverse: bool, out: Tensor | None,
             consume: bool = False) -> Tensor:
    """:func:`chunk_recurrence` for the accelerator, by :func:`_scan`. Elementwise transitions: the
    chunks as they are, the states written straight into the output (strided views, no gather); ``U``
    copied once, unless ``consume`` lets the scan work in it. Full ones: the chunks gathered into the
    bit-reversed order (one gather each for ``U`` and ``A``, the size of the copy any batched layout
    would cost) and padded to a power of two with identity steps (no change to any state; at most as
    many again, none when the number of chunks is a power of two already, as it is for N a power of
    two), the states gathered back in one more; with ``consume``, once gathered, ``U``'s memory holds
    the scan's states and ``A``'s the levels' composed transitions (where their layouts and sizes
    allow it: contiguous, no padding). A reverse recurrence runs the pairs the other way round on the
    transposed transitions (views): nothing is flipped."""
    Nc, R, D, Dv = U.shape
    states = U.new_empty(Nc + 1, R, D, Dv) if out is None else out
    if kind == "identity":  # prefix sums
        csum = prefix_sums(U.flip(0) if reverse else U, 0).add_(seed)
        if reverse:
            states[:Nc] = csum.flip(0)
            states[Nc] = seed
        else:
            states[1:] = csum
            states[0] = seed
        return states
    if kind != "full":
        # entry c of E: the state before step c runs: S_c forward, S_{c + 1} reverse
        E = states[1:] if reverse else states[:Nc]
        total = _scan(A, U if consume else U.clone(), seed, kind, E, reverse)
        states[0 if reverse else Nc] = total
        return states
    n = 1 << (Nc - 1).bit_length()
    order = _bit_reversed(n, U.device)
    chunks = order[:Nc]  # the position of every chunk
    if n == Nc:
        X, Ar = U.index_select(0, order), A.index_select(0, order)
    else:  # identity steps after the last chunk
        X = U.new_zeros(n, R, D, Dv).index_copy_(0, chunks, U)
        Ar = A.new_zeros(n, *A.shape[1:])
        Ar.diagonal(dim1=-2, dim2=-1).fill_(1)
        Ar.index_copy_(0, chunks, A)
    own = consume and n == Nc
    E = U if own and U.is_contiguous() else torch.empty_like(X)
    work = A.view(-1) if own and A.is_contiguous() else None  # n - 1 transitions' room in Nc's
    total = _scan(_transposed(Ar, kind) if reverse else Ar, X, seed, kind, E, reverse, work)
    if reverse:  # entry c is the state after the steps c..: E of step c is S_{c + 1}; out may hold the seed
        torch.index_select(E, 0, chunks, out=states[1:])
        states[0] = total
    else:
        torch.index_select(E, 0, chunks, out=states[:Nc])
        states[Nc] = total
    return states


def chunk_recurrence(A: Tensor | None, U: Tensor, seed: Tensor, *, strategy: str, reverse: bool = False,
                     out: Tensor | None = None, consume: bool = False) -> Tensor:
    """The states of ``S_{c+1} = A_c S_c + U_c``, or with ``reverse`` of
    ``S_c = A_c^T S_{c+1} + U_c`` (the backward's recurrence, run from the end).

    Args:
        A: None (identity), or ``(Nc, R, 1, 1)`` (a number per row), ``(Nc, R, D, 1)`` (a diagonal on
            the state's rows) or ``(Nc, R, D, D)`` (full) transitions.
        U: ``(Nc, R, D, Dv)`` what each chunk adds.
        seed: ``(R, D, Dv)``: ``S_0`` (forward) or ``S_Nc`` (reverse).
        strategy: ``"cpu"`` (sequential) or ``"accelerator"`` (log-depth scan); see the module
            docstring (resolve ``"auto"`` first: :func:`resolve_strategy`).
        out: ``(Nc + 1, R, D, Dv)`` to write the states into, or None for a new tensor.
        consume: ``A`` and ``U`` are the caller's temporaries, which the accelerator's scan may
            overwrite (their memory then holds its work instead of new buffers; unread after the call).

    Returns ``(Nc + 1, R, D, Dv)``: entry c is the state before chunk c (forward; entry Nc the
    final state) or the state after the steps c.. (reverse; entry Nc the seed).
    """
    Nc = U.shape[0]
    kind = _kind(A, U.shape[-2])
    if strategy not in ("cpu", "accelerator"):
        raise ValueError(f"chunk_recurrence: strategy must be 'cpu' or 'accelerator', got {strategy!r}")
    if Nc == 0:  # no step: the seed alone (the scan's halving needs a step)
        S = U.new_empty(1, *U.shape[1:]) if out is None else out
        S[0] = seed
        return S
    if strategy == "accelerator":
        return _by_scan(A, U, seed, kind, reverse, out, consume)
    S = U.new_empty(Nc + 1, *U.shape[1:]) if out is None else out
    At = _transposed(A, kind)
    if reverse:
        S[Nc] = seed
        for c in reversed(range(Nc)):
            _apply(None if At is None else At[c], kind, S[c + 1], U[c], out=S[c])
    else:
        S[0] = seed
        for c in range(Nc):
            _apply(None if A is None else A[c], kind, S[c], U[c], out=S[c + 1])
    return S


def chunk_recurrence_reference(A: Tensor | None, U: Tensor, seed: Tensor, *, reverse: bool = False) -> Tensor:
    """:func:`chunk_recurrence` written out, every transition as a full matrix (what the tests trust,
    in float64)."""
    Nc, R, D, Dv = U.shape
    if A is None:
        M = torch.eye(D, dtype=U.dtype).expand(Nc, R, D, D)
    elif A.shape[-1] == 1:
        M = torch.diag_embed(A.squeeze(-1).expand(Nc, R, D))
    else:
        M = A
    states = [seed]
    for c in (reversed(range(Nc)) if reverse else range(Nc)):
        states.append((M[c].transpose(-1, -2) if reverse else M[c]) @ states[-1] + U[c])
    return torch.stack(states[::-1] if reverse else states)
