"""Process groups: joining the one ``torchrun`` describes, a local launcher for CPU runs, and the
collectives a training loop needs.

``torchrun --nproc_per_node N -m linattn train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`setup` joins that group (gloo on CPU,
nccl on CUDA). Without those variables the run is a single process and no group is made.
:func:`spawn_local` starts N CPU processes with :func:`torch.multiprocessing.spawn` on a free
local port and runs a given function in each (:func:`linattn.train.launch_local` runs
:func:`linattn.train.train` that way; the tests use it). :class:`World` is this process's place in
the group as :class:`linattn.train.TrainingLoop` sees it: mean and max over ranks, and the
``no_sync`` of the DistributedDataParallel wrapper for all but the last micro-batch.

Every group :func:`setup` and :func:`context_groups` make waits ``collective_timeout_s`` in a
collective for the other ranks, not torch's default 30 minutes: a rank that stopped (SIGSTOP, a
stuck data loader) then makes the others raise instead of stalling the run. gloo raises a
RuntimeError ("Timed out waiting 5000ms for recv operation to complete", torch 2.13) that names no
collective; :func:`timed_out` recognises it and :class:`CollectiveTimeout` says what the rank was
doing instead. nccl's watchdog aborts the process after the same timeout, so nothing is raised there.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CollectiveTimeout", "DistInfo", "World", "context_groups", "expected_world_size", "free_port",
           "is_main_process", "join_group", "setup", "spawn_local", "teardown", "timed_out"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands: ``rank`` of ``world_size``, its ``device``, whether
    :func:`setup` created the process group (and :func:`teardown` must destroy it), and
    ``collective_timeout_s``, how long the groups made for it wait for the other ranks (None:
    torch's default)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool
    collective_timeout_s: float | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


class World:
    """The collectives of a training loop over the ranks of ``info`` (identity in one process).

    ``model``: the DistributedDataParallel wrapper whose gradients the ranks average; its
    ``no_sync`` skips that averaging for every micro-batch but a step's last.

    ``context_parallel``: P, the consecutive ranks ``[g P, (g + 1) P)`` that share each sequence
    (context parallelism); ``context_group`` is this rank's group of them (None when P = 1). The
    batch is split over the ``world_size / P`` data-parallel groups (:attr:`data_rank`,
    :attr:`data_size`), and every rank of a group takes the same rows.
    """

    def __init__(self, info: DistInfo = SINGLE, model: torch.nn.Module | None = None, *,
                 context_parallel: int = 1, context_group=None) -> None:
        if info.world_size % context_parallel:
            raise ValueError(f"World: context_parallel = {context_parallel} must divide the world size "
                             f"{info.world_size}")
        self.info = info
        self.model = model
        self.context_parallel = context_parallel
        self.context_group = context_group

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel group: which rows of a batch it takes."""
        return self.info.rank // self.context_parallel

    @property
    def data_size(self) -> int:
        """How many data-parallel groups split a batch."""
        return self.info.world_size // self.context_parallel

    @property
    def context_rank(self) -> int:
        """This rank's place in its context-parallel group: which shard of the positions it holds."""
        return self.info.rank % self.context_parallel

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def is_main(self) -> bool:
        return self.info.is_main

    def mean(self, values: list[float]) -> list[float]:
        """Each value averaged over the ranks (float64)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return (t / self.world_size).tolist()

    def max(self, values: list[int]) -> list[int]:
        """Each integer's largest value over the ranks (how the ranks agree on stopping)."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def no_sync(self):
        if self.world_size == 1 or self.model is None:
            return contextlib.nullcontext()
        return self.model.no_sync()


class CollectiveTimeout(RuntimeError):
    """A collective that the other ranks did not join within the group's timeout: one of them
    stopped, is stuck, or is slower than ``timeout_s`` allows.

    ``rank``: the rank that gave up; ``during``: what it was doing ("step 7's forward and
    backward"); ``timeout_s``: how long it waited (None: unknown); ``setting``: the flag or field
    that sets it, named in the message; ``kept``: what survives, appended to the message ("the
    checkpoint of step 6 in out/checkpoints/step_00000006 is kept")."""

    def __init__(self, *, rank: int, during: str, timeout_s: float | None, setting: str | None = None,
                 kept: str | None = None) -> None:
        self.rank, self.during, self.timeout_s = rank, during, timeout_s
        waited = "past the group's timeout" if timeout_s is None else f"{timeout_s:g} s"
        message = f"rank {rank} waited {waited} for the other ranks in {during}"
        if setting is not None and timeout_s is not None:
            message += f" ({setting} {timeout_s:g})"
        message += ": a rank stopped or is stuck"
        if kept is not None:
            message += f"; {kept}"
        super().__init__(message)


def timed_out(error: BaseException) -> bool:
    """Whether ``error`` is a collective's (or the rendezvous store's) timeout: gloo's
    RuntimeError "Timed out waiting ...ms for recv operation to complete", the store's
    DistStoreError "Timed out after ... seconds", or a :class:`CollectiveTimeout`. torch gives
    them no type of their own, so the text decides."""
    return isinstance(error, CollectiveTimeout) or (isinstance(error, RuntimeError)
                                                   and "timed out" in str(error).lower())


# The longest collective timeout: ten years. torch.distributed's stores and process groups count a
# deadline in nanoseconds of a 64-bit clock (about 292 years) and a timedelta holds at most 1e9
# days; a timeout near either overflows, and the first wait then fails at once as "timed out".
MAX_COLLECTIVE_TIMEOUT_S = 10 * 365 * 86400.0


def collective_timeout(seconds: float) -> datetime.timedelta:
    """``seconds`` in (0, MAX_COLLECTIVE_TIMEOUT_S] or inf as the timedelta torch.distributed
    takes: inf (no limit) is the longest one, ten years."""
    if not 0 < seconds <= MAX_COLLECTIVE_TIMEOUT_S and seconds != float("inf"):
        raise ValueError(f"collective_timeout_s must be in (0, {MAX_COLLECTIVE_TIMEOUT_S:.0f}] or inf, got {seconds!r}")
    return datetime.timedelta(seconds=min(seconds, MAX_COLLECTIVE_TIMEOUT_S))


def _timeout(info: DistInfo) -> datetime.timedelta | None:
    return None if info.collective_timeout_s is None else collective_timeout(info.collective_timeout_s)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _unusable(device: torch.device) -> str | None:
    """Why torch cannot place tensors on ``device`` in this process, or None when it can: the
    backend's ``is_available()`` (``torch.cuda``, ``torch.mps``, ...), then a one-element tensor."""
    is_available = getattr(getattr(torch, device.type, None), "is_available", None)
    if callable(is_available) and not is_available():
        return f"torch.{device.type}.is_available() is False"
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:  # AssertionError: "Torch not compiled with CUDA enabled"
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


def is_main_process() -> bool:
    """Whether this process is rank 0 of the group the environment describes (True without one):
    the one that prints under torchrun."""
    return _env_int("RANK", 0) == 0


def expected_world_size() -> int:
    """The number of processes of this run: the joined group's, else ``WORLD_SIZE`` (torchrun's),
    else 1. Known before :func:`setup`, so that a config can be refused before any group is joined."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1)


def setup(device: str, *, collective_timeout_s: float) -> DistInfo:
    """Join the process group the environment describes (if any) and pick this rank's device.

    ``device``: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :class:`linattn.train.TrainConfig`).
    ``collective_timeout_s``: how long a collective of the group waits for the other ranks (the
    rendezvous too); a group that exists already keeps its own, and the groups
    :func:`context_groups` makes take this one.
    Raises ValueError, before any process group is joined, when torch cannot use that device, and
    :class:`CollectiveTimeout` when the other ranks do not join within the timeout.
    """
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        asked = f"'auto' (-> {device!r})"
    else:
        asked = repr(device)
    use_cuda = device == "cuda"
    dev = torch.device(device)
    if use_cuda and torch.cuda.is_available():
        dev = torch.device("cuda", local % torch.cuda.device_count())  # this rank's GPU, not GPU 0
    why = _unusable(dev)
    if why is not None:
        raise ValueError(f"TrainConfig.device (--device) = {asked}: torch cannot use it here ({why})")
    if use_cuda:
        torch.cuda.set_device(dev)
    owns = False
    timeout = collective_timeout(collective_timeout_s)
    if world > 1 and not dist.is_initialized():
        try:
            join_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world, timeout=timeout)
        except RuntimeError as e:
            if not timed_out(e):
                raise
            raise CollectiveTimeout(rank=rank, during="joining the process group",
                                    timeout_s=collective_timeout_s) from e
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local, dev, owns, collective_timeout_s)


def context_groups(info: DistInfo, context_parallel: int):
    """This rank's context-parallel process group: ranks ``[g P, (g + 1) P)`` with P =
    ``context_parallel`` (None when P = 1). Every rank creates every group, as
    ``torch.distributed.new_group`` requires, and keeps its own. The groups wait
    ``info.collective_timeout_s`` for the other ranks: ``new_group`` does not inherit the world
    group's timeout but takes torch's 30-minute default."""
    if context_parallel == 1:
        return None
    if info.world_size % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} must divide the number of processes {info.world_size}")
    mine = None
    for start in range(0, info.world_size, context_parallel):
        group = dist.new_group(list(range(start, start + context_parallel)), timeout=_timeout(info))
        if start <= info.rank < start + context_parallel:
            mine = group
    return mine


def join_group(backend: str, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, with ``torch.distributed.nn``
    imported first: every process group linattn makes is made here.

    Why (a torch internal, torch 2.13): ``torch.distributed.nn.functional`` gives about ten
    functions ``group=group.WORLD`` as a default, evaluated when that module is first imported.
    Imported after the default group exists, those defaults hold it for good: torch._dynamo imports
    the module, and torch.optim's first step and a ``torch.library.custom_op`` operator's first call
    import torch._dynamo (linattn's engine operators do not: ``functional.checks.EngineOp``). ``destroy_process_group`` then frees nothing, gloo's worker threads run on into
    interpreter shutdown, and one of them releasing a finished collective's state there (which
    needs the GIL) aborts the process: "terminate called without an active exception", SIGABRT,
    in 3-5 of 20-40 two-rank runs. Imported before, the defaults are None.
    ``tests/test_train.py::test_torch_distributed_nn_imported_after_a_group_still_holds_it`` fails
    the day torch stops doing this.
    """
    import torch.distributed.nn  # noqa: F401  (see above: before the group exists)

    dist.init_process_group(backend, **kwargs)


def teardown(info: DistInfo, *, barrier: bool = True) -> None:
    """Destroy the group :func:`setup` created, once every rank got here (``barrier``; False after a
    :class:`CollectiveTimeout`, when the other ranks are stuck or gone and waiting for them again
    would only double the wait).

    The DistributedDataParallel wrapper of the finished run may sit in a reference cycle that holds
    the group; collecting it here rather than during interpreter shutdown keeps gloo's threads from
    being torn down with the interpreter (:func:`join_group` has the abort that follows, and the
    other reference it avoids).
    """
    if info.owns_group and dist.is_initialized():
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, threads: int, fn: Callable[..., Any], args: tuple) -> None:
    from ..processes import die_with_parent

    # first: torch's own death signal (SIGINT) is set only after the child imported torch, and a
    # rank inside a long C++ op handles SIGINT late; a killed launcher must not leave ranks running
    die_with_parent()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    fn(*args)


def spawn_local(fn: Callable[..., Any], nprocs: int, args: tuple = (), *, threads_per_proc: int = 1) -> None:
    """Run ``fn(*args)`` in ``nprocs`` spawned CPU processes that see a torchrun-like environment
    (gloo, localhost, a free port). ``fn`` must be a module-level function (it is pickled by name).
    Raises if any process fails; when this process is stopped while they run (Ctrl-C, SIGTERM under
    :func:`linattn.processes.stop_on_sigterm`), the ranks are stopped before the exception goes on."""
    import torch.multiprocessing as mp

    from ..processes import stop_processes

    ranks = mp.start_processes(_worker, args=(nprocs, free_port(), threads_per_proc, fn, args), nprocs=nprocs,
                               join=False, start_method="spawn")
    try:
        while not ranks.join():
            pass
    finally:  # a rank that failed, or this process interrupted: no rank outlives the call
        stop_processes(ranks.processes)
