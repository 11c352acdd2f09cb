"""Variable-length packed inputs (``cu_seqlens``) for the decayed recurrences.

Many documents packed back to back into one sequence, with flash-attention's varlen convention:
``cu_seqlens`` is an integer 1-D tensor (int32 as flash-attention and transformers' collator give it,
or int64) of document offsets ``[0, c_1, ..., c_n = T]`` (non-decreasing; an empty document, ``c_i == c_{i+1}``, is allowed and gets its state passed
through). Inputs are ``(1, H, T, ...)``; document i holds positions ``c_i <= t < c_{i+1}``, and no
information crosses a boundary. Per-document recurrent states have the number of documents n as
their batch dimension: ``(n, H, D, Dv)``.

How the engines run it, without a loop over documents (the cost grows with T, not with n times the
longest document). Every engine here (``gated_linear_attention``, ``delta_rule_attention``, and
``linear_attention`` through the first) already handles a reset: a log decay of -inf at a position
zeroes the state before that position's write, and the chunked forms hold the cumulative log
decays of a chunk as small decays plus a count of resets (``linattn.functional.log_decays``), so a
chunk that spans documents stays exact: every product across a boundary is exactly 0, and within
a document the decays keep their digits in the compute dtype, a reset earlier in the chunk costing
none of them. So:

- a document boundary is a log decay of -inf at the document's first position (the engine then
  sees one sequence, and its chunk loop, tiling and backward are unchanged);
- a document's initial state S0 (D x Dv) is WRITTEN by D positions inserted before it, right after
  the reset: keys e_1..e_D (unit basis vectors), values the rows of S0, no decay, and for the delta
  rule beta = 1 (``(I - e_i e_i^T) S + e_i v^T`` replaces row i); their outputs are discarded;
- a document's final state is READ by D positions inserted after it: queries e_i with readout
  scale 1 (the real queries are scaled beforehand), no write (zero key and value, beta = 0, no
  decay). Their outputs ARE the rows of the state, so gradients reach the state through the
  engine's own backward, with no engine change.

The inserted positions cost n*D extra positions, and only when states are asked for; without them
the inputs are used as they are (no copy), only the log decays get their -inf. The expanded layout
is built with index tensors and one gather (``index_select``) per input, never a loop over
documents. :func:`varlen_layout` describes it; ``VarlenLayout.total`` is the length the engine
runs on (T, plus n*D per kind of state asked for).

Why not reset and read states inside the engines' chunk loops instead: the state at a boundary in
the middle of a chunk is not one of the states the chunk loop carries, and reading it (and its
gradient) would need a second product per chunk in every engine's forward and backward. Inserted
positions reuse the tested engines as they are.

Kernel attention's normaliser (``linear_attention``) is a per-document running sum of key features
and needs no state insertion: :func:`segment_cumsum` and :func:`segment_sum` give it in the input's
dtype, adding only a document's own terms (blocks of masked sums and a carry from block to block,
never the difference of two prefix sums over the packed sequence, which in float32 would lose the
digits of a short document late in a long pack).

Where the isolation stops: everything above holds for finite inputs. A NaN or inf in a real
position's q, k or v can reach earlier outputs of its chunk (0 * inf is NaN in the blocked
products; SDPA's blocks do the same), and so the documents that share that chunk; the running
sums of the normaliser carry a non-finite key feature into its block and, through the carry from
block to block (0 * inf is NaN there too), into later documents. Guarding against it would cost
every call; the training loop stops at the first non-finite loss instead.

Dimension legend: H heads, T packed positions, n documents, Tx expanded positions (T plus the
inserted ones), D width of a state's rows (key or feature width), Dv value width, G gate width (1
per head, D per key channel), X any trailing width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .checks import check_values, shape_str

__all__ = [
    "VarlenLayout",
    "check_cu_seqlens",
    "document_lengths",
    "int64_offsets",
    "segment_cumsum",
    "segment_cumsum_reference",
    "segment_sum",
    "varlen_layout",
]


def check_cu_seqlens(fn: str, cu_seqlens, q: Tensor, *, name: str = "cu_seqlens", q_name: str = "q") -> Tensor:
    """Validate ``cu_seqlens`` for packed inputs ``q (1, H, T, D)`` and return it as int64.
    ``name`` and ``q_name``: what the caller calls the two (transformers' ``cu_seq_lens_q``).

    Any integer dtype is taken: flash-attention's convention, and so transformers'
    ``DataCollatorWithFlattening``, gives int32 offsets; the rest of linattn computes with int64
    (:func:`int64_offsets`, so an int32 tensor gives bitwise the results of its int64 copy).

    Raises:
        TypeError: not a tensor, or not of an integer dtype.
        ValueError: q's batch size is not 1; ``cu_seqlens`` is not 1-D with at least 2 entries, is
            on another device, does not start at 0, does not end at T, or decreases somewhere.
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{fn}: {name} must be an integer tensor (int32 or int64 document offsets "
                        f"[0, c_1, ..., T]) or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"{fn}: {name} must have an integer dtype (int32 or int64 document offsets "
                        f"[0, c_1, ..., T]), got {cu_seqlens.dtype}")
    if q.shape[0] != 1:
        raise ValueError(f"{fn}: with {name} the documents are packed along N and the batch size must be 1, "
                         f"got {q_name} {shape_str(q)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{fn}: {name} must be 1-D with n + 1 >= 2 entries [0, c_1, ..., T], "
                         f"got shape {shape_str(cu_seqlens)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"{fn}: {name} is on {cu_seqlens.device}, {q_name} on {q.device}")
    cu = int64_offsets(cu_seqlens)
    T = q.shape[2]
    # The values are checked on the device (check_values): a host read of cu_seqlens in every layer
    # and engine would stall a GPU each time; only a failed check reads the offending value.
    steps = cu[1:] - cu[:-1]
    check_values(cu[0] == 0, lambda: f"{fn}: {name} must start at 0, got {int(cu[0])}")
    check_values(cu[-1] == T, lambda: f"{fn}: {name} must end at T = {T} (the packed length of "
                                      f"{q_name} {shape_str(q)}), got {int(cu[-1])}")

    def decreasing() -> str:
        i = int(torch.nonzero(steps < 0)[0])
        return (f"{fn}: {name} must be non-decreasing, got {name}[{i}] = {int(cu[i])} > "
                f"{name}[{i + 1}] = {int(cu[i + 1])}")

    check_values(steps >= 0, decreasing)
    return cu


def int64_offsets(cu_seqlens: Tensor) -> Tensor:
    """Integer offsets ``cu_seqlens (n + 1,)`` as int64: the tensor itself when it is int64, else
    one int64 copy kept on the tensor object with its version counter (as :func:`document_lengths`
    keeps the lengths), so that the layers of one model forward, which share the offsets, share
    one copy too, and with it the lengths read once from it. Under torch.compile the copy is made
    every call (no attribute writes in a traced graph)."""
    if cu_seqlens.dtype == torch.int64:
        return cu_seqlens
    if torch.compiler.is_compiling():
        return cu_seqlens.to(torch.int64)
    kept = getattr(cu_seqlens, "_linattn_int64", None)
    if kept is not None and kept[0] == cu_seqlens._version:
        return kept[1]
    cu = cu_seqlens.to(torch.int64)
    cu_seqlens._linattn_int64 = (cu_seqlens._version, cu)
    return cu


def document_lengths(cu_seqlens: Tensor) -> list[int]:
    """The n documents' lengths on the host, for forms that must split the packed positions there
    (softmax's packed form: one SDPA call per document). Read once per ``cu_seqlens`` tensor: the
    lengths are kept on the tensor object with its version counter, so the layers of one model
    forward, which share the tensor, read the device once in all (a host read stalls a GPU), and an
    in-place change of the offsets reads them again. ``Tensor._version`` is a torch internal (the
    counter autograd uses to detect in-place changes); tests/test_probes.py fails the day it stops
    working. Under torch.compile the lengths are read every call (no attribute writes in a traced
    graph)."""
    if torch.compiler.is_compiling():
        return (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    kept = getattr(cu_seqlens, "_linattn_document_lengths", None)
    if kept is not None and kept[0] == cu_seqlens._version:
        return kept[1]
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    cu_seqlens._linattn_document_lengths = (cu_seqlens._version, lengths)
    return lengths


class VarlenLayout(NamedTuple):
    """Where the packed positions and the inserted state positions lie in the expanded sequence.

    Attributes:
        n: number of documents.
        T: packed length.
        width: D, rows written (``write``) and read (``read``) per document.
        total: Tx, the expanded length the engine runs on: T + n*D per kind of inserted position.
        starts: ``(n,)`` int64, the packed offset c_j of every document.
        doc: ``(T,)`` int64, the document of every packed position.
        real: ``(T,)`` int64, the expanded position of every packed position.
        write: ``(n*D,)`` int64, the positions writing the initial states (document-major, row i of
            document j at ``j*D + i``), or None.
        read: ``(n*D,)`` int64, the positions reading the final states (same order), or None.
        resets: ``(Tx, 1)`` bool, True at the first expanded position of every document that has
            one (where the log decay is -inf); a mask, not indices, so that building it reads
            nothing on the host.
        gather: ``(Tx,)`` int64 index into ``cat([packed, written, read], positions)``, or None when
            nothing is inserted (the expanded sequence is the packed one).
    """

    n: int
    T: int
    width: int
    total: int
    starts: Tensor
    doc: Tensor
    real: Tensor
    write: Tensor | None
    read: Tensor | None
    resets: Tensor
    gather: Tensor | None

    def expand(self, x: Tensor, write: Tensor | None = None, read: Tensor | None = None) -> Tensor:
        """``x (1, H, T, X)`` with ``write (1, H, n*D, X)`` and ``read (1, H, n*D, X)`` (where the
        layout has them) -> ``(1, H, Tx, X)``: one gather, differentiable in every part."""
        if self.gather is None:
            return x
        parts = [x] + [p for p, at in ((write, self.write), (read, self.read)) if at is not None]
        return torch.cat(parts, dim=2).index_select(2, self.gather)

    def packed(self, y: Tensor) -> Tensor:
        """The packed positions of an expanded ``y (1, H, Tx, X)``: ``(1, H, T, X)``."""
        return y if self.gather is None else y.index_select(2, self.real)

    def states(self, y: Tensor) -> Tensor:
        """The outputs of the reading positions of ``y (1, H, Tx, Dv)`` as per-document states
        ``(n, H, D, Dv)`` (row i of document j's state is the output of its i-th reading query)."""
        H, Dv = y.shape[1], y.shape[-1]
        rows = y.index_select(2, self.read)  # (1, H, n*D, Dv)
        return rows.view(H, self.n, self.width, Dv).transpose(0, 1)

    def state_rows(self, s: Tensor) -> Tensor:
        """Per-document states ``(n, H, D, Dv)`` as the values of the writing positions, ``(1, H, n*D, Dv)``."""
        return s.transpose(0, 1).reshape(1, s.shape[1], self.n * self.width, s.shape[-1])

    def basis(self, like: Tensor) -> Tensor:
        """The unit vectors e_1..e_D once per document, ``(1, H, n*D, D)`` (H, dtype and device
        of ``like (1, H, *, *)``): the keys of the writing and the queries of the reading positions."""
        eye = torch.eye(self.width, dtype=like.dtype, device=like.device)
        return eye.repeat(self.n, 1).expand(1, like.shape[1], self.n * self.width, self.width)

    def zeros(self, like: Tensor) -> Tensor:
        """``(1, H, n*D, X)`` zeros (H, X, dtype and device of ``like (1, H, *, X)``), for inserted
        positions."""
        return like.new_zeros(()).expand(1, like.shape[1], self.n * self.width, like.shape[-1])

    def ones(self, like: Tensor) -> Tensor:
        """``(1, H, n*D, 1)`` ones (beta = 1 of the writing positions)."""
        return like.new_ones(()).expand(1, like.shape[1], self.n * self.width, 1)

    def with_resets(self, g: Tensor) -> Tensor:
        """Expanded log decays ``g (1, H, Tx, G)`` with -inf at every document's first position
        (out of place; the gradient there is 0: the state it would decay is the previous
        document's, or the zeros a document without initial state starts from)."""
        return g.masked_fill(self.resets, float("-inf"))


def varlen_layout(cu_seqlens: Tensor, T: int, width: int, *, write_states: bool,
                  read_states: bool) -> VarlenLayout:
    """The :class:`VarlenLayout` of checked ``cu_seqlens`` (:func:`check_cu_seqlens`) over ``T``
    packed positions (the inputs' length, so that nothing is read from ``cu_seqlens`` on the host)
    with ``width`` (D) writing positions before each document when ``write_states``, and D reading
    positions after it when ``read_states``. Index arithmetic only, no loop over documents and no
    host read."""
    cu = int64_offsets(cu_seqlens)
    dev = cu.device
    n = cu.shape[0] - 1
    L = cu[1:] - cu[:-1]  # (n,) document lengths
    a = width if write_states else 0
    b = width if read_states else 0
    ecu = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    torch.cumsum(L + (a + b), 0, out=ecu[1:])  # expanded offsets of the documents
    doc = torch.repeat_interleave(torch.arange(n, device=dev), L, output_size=T)  # (T,)
    real = torch.arange(T, device=dev) - cu[doc] + ecu[doc] + a  # (T,)
    total = T + n * (a + b)
    write = read = gather = None
    if a:
        write = (ecu[:-1, None] + torch.arange(a, device=dev)).reshape(-1)  # (n*D,)
    if b:
        read = (ecu[:-1, None] + (L + a)[:, None] + torch.arange(b, device=dev)).reshape(-1)  # (n*D,)
    if a or b:
        gather = torch.empty(total, dtype=torch.int64, device=dev)
        at = torch.cat([p for p in (real, write, read) if p is not None])
        gather[at] = torch.arange(total, device=dev)
    # A document's first expanded position; an empty one without inserted positions shares it with
    # the next document (a reset there anyway) or, last, with the end (the spare entry, dropped).
    resets = torch.zeros(total + 1, dtype=torch.bool, device=dev)
    resets[ecu[:-1]] = True
    resets = resets[:total, None]  # (Tx, 1)
    return VarlenLayout(n, T, width, total, cu[:-1], doc, real, write, read, resets, gather)


def _doc_rows(initial: Tensor, layout: VarlenLayout) -> Tensor:
    """Per-document ``initial (n, H, X)`` at every packed position: ``(1, H, T, X)``."""
    return initial.transpose(0, 1).index_select(1, layout.doc).unsqueeze(0)


# Block length of segment_cumsum: each block's sums are one masked (C x C) product, so a running
# sum never subtracts one large prefix from another (rounding relative to the document's own sum).
_SEGMENT_BLOCK = 64


def segment_cumsum(x: Tensor, layout: VarlenLayout, *, initial: Tensor | None = None) -> Tensor:
    """Running sum within each document: ``y_t = initial_j + sum_{c_j <= s <= t} x_s`` for t in
    document j. ``x (1, H, T, X)``, ``initial (n, H, X)`` or None (zeros) -> ``(1, H, T, X)`` in
    x's dtype, differentiable in both (:func:`segment_cumsum_reference` written out).

    In x's dtype, and without the cancellation of one prefix sum minus another: the sequence is cut
    into blocks of C positions; within a block every running sum is one product with a mask of the
    same-document pairs s <= t (only a document's own terms are ever added), and what a document
    carries into the next block is the same running sum one level up, over the blocks' last
    sums (:func:`_running_sums`): log_C(T) levels of a few launches each, no loop over blocks and
    no host read. The rounding is then that of a sum of the document's own terms.
    """
    y = _running_sums(x[0], layout.doc).unsqueeze(0)
    if initial is not None:
        y = y + _doc_rows(initial.to(x.dtype), layout)
    return y


def _running_sums(x: Tensor, doc: Tensor) -> Tensor:
    """``x (H, T, X)``, ``doc (T,)`` document ids (non-decreasing; -1 for none) -> ``(H, T, X)``:
    each position's sum over its document's positions up to it."""
    H, T, X = x.shape
    C = max(1, min(_SEGMENT_BLOCK, T))
    Tb = -(-T // C)
    fill = Tb * C - T
    if fill:  # fill positions join no document (id -1): nothing adds to them or reads them
        x = torch.nn.functional.pad(x, (0, 0, 0, fill))
        doc = torch.cat([doc, doc.new_full((fill,), -1)])
    db = doc.view(Tb, C)  # (Tb, C)
    same = (db[:, :, None] == db[:, None, :]).tril_()  # (Tb, C_t, C_s): s <= t in t's document
    local = torch.matmul(same.to(x.dtype), x.view(H, Tb, C, X))  # (H, Tb, C, X): the sums since the block's start
    if Tb > 1:
        # A block's last sum is its last document's terms in it; over the blocks (whose last
        # documents are non-decreasing too) their running sums are each document's sum through the
        # end of every block it reaches: what block b's first document brings, if it began before b.
        first, last = db[:, 0], db[:, -1]  # (Tb,)
        through = _running_sums(local[:, :, -1], last)  # (H, Tb, X)
        carry = through[:, :-1] * (first[1:] == last[:-1]).to(x.dtype)[:, None]  # (H, Tb - 1, X): into blocks 1..
        in_first = (db[1:] == first[1:, None]).to(x.dtype)  # (Tb - 1, C): the position is in its block's first document
        local = torch.cat([local[:, :1], local[:, 1:] + carry[:, :, None, :] * in_first[None, :, :, None]], dim=1)
    return local.view(H, Tb * C, X)[:, :T]


def segment_cumsum_reference(x: Tensor, cu_seqlens: Tensor, *, initial: Tensor | None = None) -> Tensor:
    """:func:`segment_cumsum` written out, one document at a time (what the tests trust, in float64):
    ``x (1, H, T, X)``, offsets ``cu_seqlens (n + 1,)``, ``initial (n, H, X)`` or None."""
    out = torch.zeros_like(x)
    bounds = cu_seqlens.tolist()
    for j, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        out[:, :, a:b] = x[:, :, a:b].cumsum(2) + (0 if initial is None else initial[j][None, :, None, :])
    return out


def segment_sum(x: Tensor, layout: VarlenLayout, *, initial: Tensor | None = None) -> Tensor:
    """Sum over each document: ``x (1, H, T, X)``, ``initial (n, H, X)`` or None -> ``(n, H, X)``,
    ``initial_j + sum_{t in document j} x_t`` (an empty document gives its ``initial``, or zeros)."""
    H, X = x.shape[1], x.shape[-1]
    s = x.new_zeros(H, layout.n, X).index_add(1, layout.doc, x[0]).transpose(0, 1)  # (n, H, X)
    return s if initial is None else s + initial.to(x.dtype)
