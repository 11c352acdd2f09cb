import atexit
import os
import shutil
import signal
import sys
import tempfile

# torch.compile's caches (FX graph, AOTAutograd) in a fresh folder for every test session: their
# keys do not see a custom op's schema or fake change (PyTorch issues 144344, 160472), so a cache
# left by an older linattn replays graphs that call our ops with old arguments. Set before torch
# is imported; a session's own entries still speed its later compiles.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="linattn-test-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
atexit.register(shutil.rmtree, _INDUCTOR_CACHE, True)

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

torch.set_num_threads(min(2, os.cpu_count() or 1))


def make_qkv(B, H, nq, nk, D, Dv, *, dtype=torch.float64, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, nq, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, nk, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, nk, Dv, generator=g, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def make_mask(B, nk, *, seed=0, all_padded_row=True):
    """Random bool (B, Nk) mask, True = real key; with B > 1 the last batch row is all padding."""
    g = torch.Generator().manual_seed(seed + 1000)
    mask = torch.rand(B, nk, generator=g) > 0.3
    if all_padded_row and B > 1:
        mask[-1] = False
    return mask


def grads(out, inputs, seed=0):
    """Gradients of <out, R> for a fixed random cotangent R (stronger than out.sum())."""
    g = torch.Generator().manual_seed(seed + 7)
    cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, cot, allow_unused=False)


def assert_close(a, b, *, atol=1e-10, rtol=1e-9, msg=""):
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{msg}: {m}")


def assert_decodes_as_teacher_forced(lm, ids, split: int, msg: str = ""):
    """A TransformerLM's logits for ``ids (B, N)``: step by step from the empty state, and a prefill
    of ``split`` positions then steps from its returned state, both equal to the teacher-forced
    forward. Returns the state after all N positions and the one after the prefill."""
    with torch.no_grad():
        full = lm(ids)
        steps, state = lm.forward_steps(ids)
        assert_close(steps, full, msg=f"{msg}: steps")
        head, state_split = lm(ids[:, :split], return_state=True)
        tail, _ = lm.forward_steps(ids[:, split:], state_split)
        assert_close(torch.cat([head, tail], 1), full, msg=f"{msg}: prefill + steps")
    return state, state_split


# A job that a non-interactive shell starts in the background (`make test &` in a script) ignores
# SIGINT, and an ignored signal stays ignored across exec, in every process the tests start. A test
# that sends SIGINT sets the disposition it means to test itself, so the suite passes however it
# is started.

def sigint_default() -> None:
    """``preexec_fn`` for a child process a test sends SIGINT to: SIGINT at its default disposition
    in the child (Python then raises KeyboardInterrupt there), whatever it is in this process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def default_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt) in this process for the test, as after an
    interactive start; the previous disposition back after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def qkv_factory():
    return make_qkv
