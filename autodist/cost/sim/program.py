"""The simulator's data: a compiled step (:class:`Program`: instructions for the compute thread and
the background operations they issue), its timed result (:class:`SimResult`), and the memory
categories a byte is counted under."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from ...plan import Plan
from ...schedule import ActionLog

ORDER_CHECK_BYTES = 16 * 8  # the collective-order check's message (runtime/comm.py CollectiveSequence.digest)

# program opcodes: an instruction is ``(COMPUTE, seconds, name, transient bytes)``, ``(ISSUE, op)``,
# ``(WAIT, op)`` (``op``: an index into ``Program.ops``) or ``(MEM, bytes, category)``. A compute
# instruction may carry two more fields, ``(COMPUTE, seconds, name, transient bytes, host only,
# issue)``: of its ``seconds``, those the host thread spends on its own (the runtime's hooks, the
# bookkeeping and issuing of collectives), and the host's time to issue the rest, the device's work
# ([Note: two clocks on an asynchronous device] in execute.py; both 0 when absent)
COMPUTE, ISSUE, WAIT, MEM = 0, 1, 2, 3
Instruction = tuple  # one of the four shapes above

# memory categories (what a byte is for, in the peak's breakdown)
PARAMETERS, GATHERED, GRADIENTS, OPTIMIZER, ACTIVATIONS, COMM, LIBRARIES = range(7)
WAITED = -1  # in the compute thread's memory log: it waited here (no bytes, no category)
N_CATEGORIES = 7
CATEGORY_NAMES = (
    "parameters (shards, replicas, compute copies)",
    "gathered full parameters",
    "gradients (buckets, unreduced, accumulated)",
    "optimizer state",
    "activations (incl. the loss)",
    "communication buffers in flight",
    "math-library workspaces (cuBLAS, measured)",
)


@dataclass(slots=True)
class CommOp:
    kind: str  # "all_gather" | "all_reduce" | "reduce_scatter" | "copy_out" | "copy_back"
    label: str
    nbytes: int
    seconds: float
    staging_bytes: int  # allocated by the backend while the op runs
    end_bytes: int = 0  # memory released (negative) or taken when the op completes
    end_category: int = OPTIMIZER  # what ``end_bytes`` is for
    stream: int = 0  # 0: the communication queue, 1: the copy queue (offload)
    start: float = -1.0
    end: float = -1.0


@dataclass
class Event:
    stream: str  # "compute" | "comm"
    name: str
    start: float
    end: float


@dataclass
class SimResult:
    step_s: float
    peak_bytes: int
    static_bytes: int
    feasible: bool
    budget_bytes: int | None
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    events: list[Event] = field(default_factory=list)
    memory: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes) over the step
    gathers: int = 0
    reductions: int = 0
    copy_s: float = 0.0
    offload_log: list[tuple[str, int]] = field(default_factory=list)  # (sync point, managed state bytes)
    breakdown: dict[str, int] = field(default_factory=dict)  # bytes by category at the peak
    actions: ActionLog | None = None  # what the runtime will do, in its own vocabulary
    analytic_step_s: float | None = None  # with an estimator: the analytic model's step time before correction
    compile_s: float = 0.0  # the one-off cost of compiling the plan's compiled blocks (not in step_s)
    # on an asynchronous device: the host's own work and issuing, and the time the compute stream
    # stood idle waiting for the host to issue its next work (0 on a CPU)
    host_s: float = 0.0
    host_bound_s: float = 0.0

    def summary(self) -> str:
        host = f", host {self.host_s * 1e3:.1f}, waiting for the host {self.host_bound_s * 1e3:.1f}" if self.host_s else ""
        return (
            f"step {self.step_s * 1e3:.1f} ms (compute {self.compute_s * 1e3:.1f}, comm {self.comm_s * 1e3:.1f}, "
            f"exposed {self.exposed_comm_s * 1e3:.1f}{host}), peak {self.peak_bytes / 2**20:.1f} MiB"
            + ("" if self.feasible else " — over budget")
        )


@dataclass
class Program:
    """A plan compiled for one step (what :meth:`Simulator.compile` returns and
    :func:`~autodist.cost.sim.execute.execute` times): the compute thread's instructions, the
    background operations they issue, the static memory, the actions in the runtime's vocabulary,
    and ``sections``: ``(index into prog, name)`` where the compute thread reaches a hook position —
    ``"forward"``, ``"fwd <unit>"``, ``"loss"``, ``"loss backward"``, ``"bwd <unit>"``,
    ``"backward"`` (the end of backward: the flush), ``"optimizer"`` (with `` @m<k>`` for
    micro-batch k > 0). The instructions from one section's index to the next are what the runtime
    does at that position: the names a measured step is cut into (``autodist/lab/steptrace.py``)
    and the compute nodes of the learned estimator's graph. ``plan`` and ``param_bytes`` (each
    parameter's full size in its compute dtype) let the graph describe a section's unit."""

    prog: list[Instruction]
    ops: list[CommOp]
    static: list[int]
    actions: ActionLog
    offload_log: list[tuple[str, int]]
    sections: list[tuple[int, str]]
    plan: Plan | None = None
    param_bytes: dict[str, int] = field(default_factory=dict)


class DurationEstimator(Protocol):
    """Corrects a compiled step's durations (``autodist.lab.learned.Estimator``): given the program
    and its analytic timing (``record=True``), the new duration of compute instructions (by index
    into ``program.prog``; the others keep theirs) and of every operation (``program.ops`` order)."""

    def corrections(self, program: Program, analytic: SimResult) -> tuple[dict[int, float], list[float]]: ...


def scaled(program: Program, durations: dict[int, float], op_seconds: list[float]) -> tuple[list[Instruction], list[CommOp]]:
    """``program``'s instructions and operations with the given durations, ready to be timed again."""
    prog = list(program.prog)
    for i, d in durations.items():
        code, total, name, spike, *host = prog[i]
        if host and total > 0:  # the host's own part scales with the rest
            host = [host[0] * d / total, host[1]]
        prog[i] = (code, d, name, spike, *host)
    ops = [replace(op, seconds=sec, start=-1.0, end=-1.0) for op, sec in zip(program.ops, op_seconds)]
    return prog, ops


@dataclass
class ProgramBuilder:
    """What compiling a step appends to: the compute thread's instructions, the background
    operations, the actions in the runtime's vocabulary and the hook positions (see :class:`Program`)."""

    prog: list[Instruction] = field(default_factory=list)
    ops: list[CommOp] = field(default_factory=list)
    log: ActionLog = field(default_factory=ActionLog)  # autodist/schedule.py
    sections: list[tuple[int, str]] = field(default_factory=list)
    # ``emit(instruction)`` appends to ``prog`` (bound once: compiling a step calls it per instruction)
    emit: Callable[[Instruction], None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.emit = self.prog.append

    def add_op(self, op: CommOp) -> int:
        """Append a background operation; its index (what ``ISSUE`` and ``WAIT`` name)."""
        self.ops.append(op)
        return len(self.ops) - 1

    def section(self, name: str) -> None:
        """The compute thread reaches the hook position ``name`` here."""
        self.sections.append((len(self.prog), name))
