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
  state before the pair. ``log2(Nc)`` rounds of four batched operations: launches grow with log N instead of N, every product
  is as large as the whole sequence's, and no host read. The price is arithmetic: full transitions
  cost one ``(D, D) x (D, D)`` product per chunk (about ``D / C`` times the sequential work of the
  delta rule's loop), diagonal ones an elementwise product.

Both compose products of transitions (factors in [0, 1], or matrices of norm <= 1 within the delta
rule's contract) and never a difference of cumulative log decays: no digit is lost to a large
decay earlier in the sequence.

Which strategy a call runs is chosen in one place, ``strategy.py``.

Dimension legend: Nc chunks, R rows (B*H), D state rows (query/key width), Dv state columns.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_recurrence", "chunk_recurrence_reference"]


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


def _compose(later: Tensor, earlier: Tensor, kind: str) -> Tensor:
    """The transition of two steps, ``later @ earlier`` (elementwise for numbers and diagonals)."""
    if kind == "full":
        return torch.bmm(later, earlier)
    return later * earlier


def _scan(A: Tensor, X: Tensor, seed: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """Exclusive affine scan along dim 1 of ``X (R, n, D, Dv)`` with transitions ``A (R, n, D, D | 1)``
    (row-major, contiguous; n a power of two): ``E (R, n, D, Dv)`` with ``E_0 = seed (R, D, Dv)``,
    ``E_{c+1} = A_c E_c + X_c``, and the total ``E_n (R, D, Dv)``.

    Neighbours (2i, 2i+1) are composed into one step, the half-length scan gives the state before
    every pair, and the state between the two members of a pair follows in one product: log2(n)
    levels of four batched operations. Rows first, pairs adjacent: every operand is a view with one
    batch stride (``(R*h, 2, ...)[:, 0]``), which a batched product reads as it is, with no copy."""
    R, n = X.shape[:2]
    if n == 1:
        return seed.unsqueeze(1).clone(), _apply(A[:, 0], kind, seed, X[:, 0])  # a copy: out may hold the seed
    h = n // 2
    Xp, Ap = X.view(R * h, 2, *X.shape[2:]), A.view(R * h, 2, *A.shape[2:])  # pairs of neighbours
    X2 = _apply(Ap[:, 1], kind, Xp[:, 0], Xp[:, 1])  # each pair as one step
    A2 = _compose(Ap[:, 1], Ap[:, 0], kind)
    E2, total = _scan(A2.view(R, h, *A.shape[2:]), X2.view(R, h, *X.shape[2:]), seed, kind)
    E2 = E2.reshape(R * h, *X.shape[2:])  # the state before each pair
    between = _apply(Ap[:, 0], kind, E2, Xp[:, 0])
    return torch.stack([E2, between], dim=1).view(X.shape), total


def _transposed(A: Tensor | None, kind: str) -> Tensor | None:
    return A.transpose(-1, -2) if kind == "full" else A


def _by_scan(A: Tensor | None, U: Tensor, seed: Tensor, kind: str, reverse: bool, out: Tensor | None) -> Tensor:
    """:func:`chunk_recurrence` for the accelerator. The chunks are laid out rows first and padded to
    a power of two with identity steps (no change to any state; at most as many again, none when
    the number of chunks is a power of two already, as it is for N a power of two); a reverse
    recurrence is the forward one over the chunks in reverse order, transitions transposed."""
    Nc, R, D, Dv = U.shape
    n = 1 << (Nc - 1).bit_length()
    steps = U.flip(0) if reverse else U
    if kind == "identity":  # prefix sums
        csum = steps.cumsum(0).add_(seed)
        states = torch.cat([seed.unsqueeze(0), csum])
    else:
        X = U.new_zeros(R, n, D, Dv)
        X[:, :Nc] = steps.transpose(0, 1)
        Ar = U.new_empty(R, n, *A.shape[2:])
        Ar[:, :Nc] = (_transposed(A, kind).flip(0) if reverse else A).transpose(0, 1)
        if n > Nc:  # identity steps
            pad = Ar[:, Nc:]
            if kind == "full":
                pad.zero_().diagonal(dim1=-2, dim2=-1).fill_(1)
            else:
                pad.fill_(1)
        E, total = _scan(Ar, X, seed, kind)
        states = U.new_empty(Nc + 1, R, D, Dv) if out is None else out
        if reverse:  # entry c is E_{Nc - c}: written in place, out may hold the seed
            states[1:] = E[:, :Nc].flip(1).transpose(0, 1)
            states[0] = total
        else:
            states[:Nc] = E[:, :Nc].transpose(0, 1)
            states[Nc] = total
        return states
    states = states.flip(0) if reverse else states
    return states if out is None else out.copy_(states)


def chunk_recurrence(A: Tensor | None, U: Tensor, seed: Tensor, *, strategy: str, reverse: bool = False,
                     out: Tensor | None = None) -> Tensor:
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

    Returns ``(Nc + 1, R, D, Dv)``: entry c is the state before chunk c (forward; entry Nc the
    final state) or the state after the steps c.. (reverse; entry Nc the seed).
    """
    Nc = U.shape[0]
    kind = _kind(A, U.shape[-2])
    if strategy == "accelerator":
        return _by_scan(A, U, seed, kind, reverse, out)
    if strategy != "cpu":
        raise ValueError(f"chunk_recurrence: strategy must be 'cpu' or 'accelerator', got {strategy!r}")
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
