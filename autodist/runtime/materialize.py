"""Materialising a model built on the meta device, one initialiser at a time (docs/design.md, "Lifecycle").

``with torch.device("meta"): model = Net()`` gives a model whose tensors have shapes and dtypes but
no storage. ``AutoDist`` places such a model first (the managed parameters allocate only what each
rank keeps: shards of sharded units, full tensors of replicated ones) and then runs the model's
initialisers in order. Before each initialiser call, the tensors it writes are allocated on the host;
once no later call writes a tensor, rank 0's values are broadcast and every rank keeps its part
(its dim-0 shard of a sharded parameter, the whole of a replicated parameter or a buffer) and drops
the host copy. A rank therefore holds its resident state plus the tensors of the calls in progress —
for ordinary modules, one module's tensors — never the whole model.

[Note: which initialiser, in which order] By default each module that registers meta tensors
directly is initialised by its ``reset_parameters()`` (torch's convention: a module's own
parameters and buffers; ``_reset_parameters()`` where only that exists, as in
``nn.MultiheadAttention``), children before their parent and children in registration order. With
``param_init_fn``, that function is called with every module, in the same order, instead. The
order is the one in which constructing the model on the CPU consumes the random generator when
every module initialises itself at the end of its constructor, after building its children (what
torch's own modules do: ``nn.MultiheadAttention`` builds ``out_proj``, then initialises
``in_proj_weight``). Every rank runs the initialisers on the host (never on an accelerator, whose
generator differs), so after ``torch.manual_seed(s)`` the values are bitwise those of building the
model on the CPU after the same seed, and every rank's CPU generator ends where building the model
on the CPU would have left it. Rank 0's values are the ones kept, as DDP keeps rank 0's parameters.

Exact equality with a CPU-built model cannot hold where the CPU constructor consumed the generator
in another order: children created in one order and registered in another; a parent that draws
its own tensors before building its children (a root ``nn.Parameter(torch.randn(...))`` assigned
first); a model that re-initialises itself after construction (GPT-2's ``self.apply(_init_weights)``,
torchtitan's ``init_weights``), whose CPU construction drew every module's default values first and
then drew again. For those, build on the meta device on both sides (the result is then the same on
any world size and under any plan), or initialise each module in ``param_init_fn`` with an explicit
``torch.Generator`` per module.

[Note: tied tensors, buffers, loose parameters] A tensor registered by several modules (tied
embeddings) keeps the values written by the initialiser of the module that registers it first (the
unit that owns it); the other modules' own initialisers run with a scratch tensor in its place, so
the random generator advances as it did when they were built, before the weights were tied. That
matches ``head.weight = wte.weight`` (Hugging Face's ``tie_weights``); a model tied the other way
(``wte.weight = head.weight``, nanoGPT) gets the embedding's initialisation, not the head's.
Buffers, persistent or not, are initialised like parameters (``BatchNorm.reset_parameters`` resets
its running statistics). A tensor that no initialiser writes — a root module's own parameters when
the root has no ``reset_parameters``, a buffer computed in ``__init__`` (rotary frequencies) — is
refused before anything is allocated, with its name: give its module a ``reset_parameters()`` or pass
a ``param_init_fn`` that writes it.

[Note: knowing what an initialiser writes] Before anything is allocated, every initialiser runs once
on fake tensors (``FakeTensorMode``: shapes without storage, reported as CPU tensors so that
``nn.init``'s meta shortcuts do not skip them, no random numbers drawn) under a dispatch mode that
records the storages each operation writes, so each call's footprint is known. A call that cannot
run on fake tensors (it reads values, e.g. a rejection loop) is assumed to write every tensor of its
module's subtree. The real calls are recorded too: a write to a tensor that is not allocated at that
point, or a tensor that ends up written by no call, is an error, never a silent uninitialised value.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._log import logger
from ..errors import InitError

InitFn = Callable[[nn.Module], None]

# Small finalised tensors (biases, norms) are broadcast together, in flat messages of at most this
# many bytes; larger ones alone. A flat message is a copy, so this bounds what coalescing adds to
# the peak; one message per tensor would cost a collective's latency per bias.
COALESCE_BYTES = 1024 * 1024


@dataclass
class _Entry:
    """One tensor on the meta device, registered at one or more sites."""

    name: str  # qualified name at its first registration (the parameter's name in ModelStructure)
    kind: str  # "param" | "buffer"
    original: torch.Tensor  # the meta tensor
    sites: list[tuple[nn.Module, str]]
    owner: nn.Module  # the module that registers it first
    first: int = -1  # the first call that writes it (from the dry run)
    last: int = -1
    live: torch.Tensor | None = None  # host copy while being initialised
    written: bool = False  # by the real calls
    aliased: bool = False  # ``live`` is the storage the rank keeps (a replicated parameter on the CPU)

    @property
    def nbytes(self) -> int:
        return self.original.numel() * self.original.element_size()

    def dict_of(self, module: nn.Module) -> dict[str, Any]:
        return module._parameters if self.kind == "param" else module._buffers

    def live_copy(self) -> torch.Tensor:
        """``live``, for an entry being initialised (between its first and its last call)."""
        if self.live is None:
            raise RuntimeError(f"materialize: {self.name} has no host copy outside its initialisation")
        return self.live

    def registered(self) -> torch.Tensor:
        """The tensor registered at its first site now."""
        module, attr = self.sites[0]
        return self.dict_of(module)[attr]

    def register(self, value: torch.Tensor) -> None:
        for module, attr in self.sites:
            self.dict_of(module)[attr] = value

    def blank(self, factory: Callable[..., torch.Tensor]) -> torch.Tensor:
        t = factory(tuple(self.original.shape), self.original.stride(), dtype=self.original.dtype, device="cpu")
        return nn.Parameter(t, requires_grad=self.original.requires_grad) if self.kind == "param" else t


@dataclass
class _Call:
    name: str  # module name ("" for the root)
    module: nn.Module
    fn: Callable[[], None]
    subtree: list[int] = field(default_factory=list)  # entries registered in the module's subtree
    foreign: list[tuple[int, str]] = field(default_factory=list)  # (entry, attr): registered here, owned elsewhere


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _dummy_scalar(t: torch.Tensor) -> Any:
    if t.dtype == torch.bool:
        return False
    if t.is_complex():
        return 0j
    return 0.0 if t.is_floating_point() else 0


class _WriteRecorder(TorchDispatchMode):
    """Records the storage of every tensor an operation writes (in place or ``out=``). In a dry run
    (fake tensors), a read of a value returns a placeholder instead of failing."""

    def __init__(self, *, dry: bool) -> None:
        super().__init__()
        self.dry = dry
        self.written: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.dry and func is torch.ops.aten._local_scalar_dense.default:
            return _dummy_scalar(args[0])
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor):
                    self.written.add(_storage_key(t))
        return func(*args, **kwargs)


def is_meta_model(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def _post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once (at its first registration), children before their parent."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", root)
    return out


@dataclass
class MaterializeReport:
    tensors: int
    calls: int
    total_bytes: int
    largest_live_bytes: int  # the most host bytes held at once by tensors being initialised
    largest_live_at: str  # the call where that happened


class Materializer:
    """Plans (at construction, changing nothing) and carries out (``run``) the materialisation of a
    model on the meta device; see the module docstring."""

    def __init__(self, module: nn.Module, param_init_fn: InitFn | None = None) -> None:
        self.module = module
        self.param_init_fn = param_init_fn
        self.entries = self._collect()
        self.calls = self._calls()
        self._dry_run()
        self._check_every_tensor_written()

    # ---- planning -------------------------------------------------------------------------------
    def _collect(self) -> list[_Entry]:
        entries: list[_Entry] = []
        index: dict[int, int] = {}
        for mname, m in self.module.named_modules(remove_duplicate=False):
            for kind, tensors in (("param", m._parameters), ("buffer", m._buffers)):
                for attr, t in tensors.items():
                    if t is None:
                        continue
                    if not t.is_meta:
                        raise InitError(
                            f"{kind} {mname + '.' if mname else ''}{attr} is on {t.device} while others are on the meta "
                            "device; build the whole model on the meta device (or none of it)"
                        )
                    i = index.get(id(t))
                    if i is None:
                        index[id(t)] = len(entries)
                        entries.append(_Entry(f"{mname}.{attr}" if mname else attr, kind, t, [(m, attr)], m))
                    elif (m, attr) not in entries[i].sites:
                        entries[i].sites.append((m, attr))
        return entries

    def _calls(self) -> list[_Call]:
        calls = []
        direct: dict[int, list[tuple[int, str]]] = {}
        for i, e in enumerate(self.entries):
            for m, attr in e.sites:
                direct.setdefault(id(m), []).append((i, attr))
        for name, m in _post_order(self.module):
            fn: Callable[[], None]
            if self.param_init_fn is not None:
                fn = functools.partial(self.param_init_fn, m)
            elif id(m) not in direct:
                continue
            elif callable(reset := getattr(m, "reset_parameters", None)):
                fn = reset
            elif callable(reset := getattr(m, "_reset_parameters", None)):
                fn = reset
            else:
                continue
            subtree = sorted({i for s in m.modules() for i, _ in direct.get(id(s), [])})
            foreign = [(i, attr) for i, attr in direct.get(id(m), []) if self.entries[i].owner is not m]
            calls.append(_Call(name, m, fn, subtree, foreign))
        return calls

    @contextlib.contextmanager
    def _scratch(self, call: _Call, factory: Callable[..., torch.Tensor]) -> Iterator[None]:
        """A module's own initialiser writes a scratch tensor in place of a tensor another module owns."""
        saved = []
        for i, attr in call.foreign:
            e = self.entries[i]
            d = e.dict_of(call.module)
            saved.append((d, attr, d[attr]))
            d[attr] = e.blank(factory)
        try:
            yield
        finally:
            for d, attr, t in saved:
                d[attr] = t

    def _replaced(self, call: _Call, expected: dict[int, torch.Tensor], keys: dict[int, int]) -> list[int]:
        """Entries of ``call``'s subtree whose registered tensor the call replaced: another object at a
        site, or the same object with other data (``module.to_empty(...)`` swaps ``.data``)."""
        out = []
        for i in call.subtree:
            e, want = self.entries[i], expected[i]
            for m, attr in e.sites:
                got = e.dict_of(m).get(attr)
                if got is not want or (got is not None and _storage_key(got) != keys[i]):
                    out.append(i)
                    break
        return out

    def _dry_run(self) -> list[set[int]]:
        """Each call's footprint: the entries it writes (see [Note: knowing what an initialiser writes])."""
        try:
            from torch._subclasses.fake_tensor import FakeTensorMode
        except ImportError:  # pragma: no cover - every call is assumed to write its subtree
            return [set(c.subtree) for c in self.calls]
        cpu_rng = torch.get_rng_state()
        fake_mode = FakeTensorMode()
        with fake_mode:
            fakes = [e.blank(torch.empty_strided) for e in self.entries]
        expected = dict(enumerate(fakes))
        footprints: list[set[int]] = []
        keys = {i: _storage_key(f) for i, f in enumerate(fakes)}
        by_key = {k: i for i, k in keys.items()}
        try:
            for e, f in zip(self.entries, fakes):
                e.register(f)
            for call in self.calls:
                recorder = _WriteRecorder(dry=True)
                try:
                    with fake_mode, recorder, torch.no_grad(), self._scratch(call, torch.empty_strided):
                        call.fn()
                    found = {by_key[k] for k in recorder.written if k in by_key}
                    found |= set(self._replaced(call, expected, keys))
                except Exception as exc:  # data-dependent initialisers cannot run on fake tensors
                    logger.debug("autodist: trial run of the initialiser of %r failed (%s); assuming it writes its subtree", call.name, exc)
                    found = set(call.subtree)
                for i in found:  # undo replacements: each call sees the fakes
                    self.entries[i].register(fakes[i])
                    if _storage_key(fakes[i]) != keys[i]:  # its data was swapped
                        del by_key[keys[i]]
                        keys[i] = _storage_key(fakes[i])
                        by_key[keys[i]] = i
                footprints.append(found)
        finally:
            for e in self.entries:
                e.register(e.original)
            torch.set_rng_state(cpu_rng)
        for ci, found in enumerate(footprints):
            for i in found:
                e = self.entries[i]
                e.first = ci if e.first < 0 else e.first
                e.last = ci
        return footprints

    def _check_every_tensor_written(self) -> None:
        missing = [e for e in self.entries if e.first < 0]
        if not missing:
            return
        def why(e: _Entry) -> str:
            if self.param_init_fn is not None:
                return "param_init_fn does not write it"
            owner = e.owner
            if callable(getattr(owner, "reset_parameters", None)) or callable(getattr(owner, "_reset_parameters", None)):
                return "its reset_parameters() does not write it"
            return "no reset_parameters()"

        names = ", ".join(f"{e.name} ({type(e.owner).__name__}: {why(e)})" for e in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise InitError(
            f"the model is on the meta device, but no initialiser writes {len(missing)} of its tensors: {names}{more}. "
            "By default each module that registers tensors is initialised by its reset_parameters(); give those "
            "modules one that initialises them, or pass param_init_fn=fn (called with every module, children "
            "first) that does. A buffer computed in __init__ (rotary frequencies) must be computed there again."
        )

    # ---- carrying out ---------------------------------------------------------------------------
    def held_bytes_profile(self) -> tuple[int, str]:
        """The most bytes of host copies held at once, and the call where that happens."""
        delta = [0] * (len(self.calls) + 1)
        for e in self.entries:
            delta[e.first] += e.nbytes
            delta[e.last + 1] -= e.nbytes
        best, at, live = 0, "", 0
        for ci, call in enumerate(self.calls):
            live += delta[ci]
            if live > best:
                best, at = live, call.name or "(root)"
        return best, at

    @torch.no_grad()
    def run(
        self,
        *,
        params: dict[str, Any],
        broadcast: Callable[[list[torch.Tensor]], None],
        device: torch.device,
    ) -> MaterializeReport:
        """Initialise every tensor; rank 0's values (``broadcast`` sends them in place) go into the
        managed parameters ``params`` (by name: their ``load_full_``) and into the modules' buffers.
        The caller registers the managed parameters' visible tensors afterwards."""
        for e in self.entries:
            e.register(e.original)
        meta_keys = {_storage_key(e.original): i for i, e in enumerate(self.entries)}
        starting: dict[int, list[int]] = {}
        ending: dict[int, list[int]] = {}
        for i, e in enumerate(self.entries):
            starting.setdefault(e.first, []).append(i)
            ending.setdefault(e.last, []).append(i)
        live: set[int] = set()
        # [Note: a failure on one rank] Every rank runs the initialisers, and the broadcasts that
        # follow are collectives: a rank whose initialiser fails (out of memory, say) keeps taking
        # part in them, with values nobody keeps, and raises once every broadcast is done. The
        # caller compares the ranks' outcomes, so every rank raises instead of the others waiting.
        failure: InitError | None = None
        for ci, call in enumerate(self.calls):
            for i in starting.get(ci, []):
                e = self.entries[i]
                kept = self._kept_storage(e, params, device)
                e.live = kept if kept is not None else e.blank(torch.empty_strided)
                e.aliased = kept is not None
                e.register(e.live)
                live.add(i)
            done = [self.entries[i] for i in ending.get(ci, [])]
            if failure is None:
                try:
                    self._call(call, live, meta_keys)
                    self._check_written(done)
                except InitError as exc:
                    failure = exc
            self._finish(done, params, broadcast, device)
            live.difference_update(ending.get(ci, []))
        if failure is not None:
            raise failure
        best, at = self.held_bytes_profile()
        return MaterializeReport(
            tensors=len(self.entries), calls=len(self.calls), total_bytes=sum(e.nbytes for e in self.entries),
            largest_live_bytes=best, largest_live_at=at,
        )

    def _call(self, call: _Call, live: set[int], meta_keys: dict[int, int]) -> None:
        """Run one initialiser call on the live tensors and take what it wrote."""
        expected: dict[int, torch.Tensor] = {}
        for i in call.subtree:
            e = self.entries[i]
            # not live: not begun (its meta tensor), or finished (a parameter is registered as its
            # meta tensor again, a buffer as its value, which a later call, an ancestor's under a
            # param_init_fn called with every module, must leave alone)
            expected[i] = e.live if e.live is not None else e.registered()
        keys = {i: _storage_key(t) for i, t in expected.items()}
        recorder = _WriteRecorder(dry=False)
        try:
            with recorder, self._scratch(call, torch.empty_strided):
                call.fn()
        except Exception as exc:
            raise InitError(f"initialising module {call.name or '(root)'!r} ({type(call.module).__name__}) failed: {exc}") from exc
        finished = {keys[i]: i for i in call.subtree if self.entries[i].live is None}
        stray = sorted({meta_keys[k] for k in recorder.written if k in meta_keys}
                       | {finished[k] for k in recorder.written if k in finished})
        replaced = self._replaced(call, expected, keys)
        stray += [i for i in replaced if self.entries[i].live is None]
        if stray:
            e = self.entries[stray[0]]
            raise InitError(
                f"the initialiser of module {call.name or '(root)'!r} wrote {e.name}, which its trial run on fake "
                "tensors did not write (its writes depend on values or on something outside the module). "
                "Pass a param_init_fn whose writes stay within the module it is called with."
            )
        for i in live:
            e = self.entries[i]
            if _storage_key(e.live_copy()) in recorder.written:
                e.written = True
        for i in replaced:
            self._adopt(self.entries[i])

    @staticmethod
    def _kept_storage(e: _Entry, params: dict[str, Any], device: torch.device) -> torch.Tensor | None:
        """A replicated parameter on the CPU is initialised where the rank keeps it (no host copy)."""
        mp = params.get(e.name) if e.kind == "param" else None
        if mp is None or mp.sharded or device.type != "cpu" or not mp.local.is_contiguous():
            return None
        if mp.local.dtype != e.original.dtype or tuple(mp.local.shape) != tuple(e.original.shape):
            return None
        return nn.Parameter(mp.local.detach(), requires_grad=e.original.requires_grad)

    def _adopt(self, e: _Entry) -> None:
        """The call registered a new tensor for ``e`` (or swapped its data): take its values."""
        live = e.live_copy()
        new = next(
            (e.dict_of(m)[attr] for m, attr in e.sites if e.dict_of(m).get(attr) is not live), live
        )
        if tuple(new.shape) != tuple(e.original.shape) or new.dtype != e.original.dtype:
            raise InitError(
                f"an initialiser replaced {e.name} (shape {tuple(e.original.shape)}, {e.original.dtype}) by a tensor of "
                f"shape {tuple(new.shape)}, {new.dtype}; initialise it in place instead"
            )
        if new is live:  # its data was swapped (``to_empty``): no longer the storage the rank keeps
            e.aliased = False
        else:
            live.detach().copy_(new.detach())
        e.register(live)
        e.written = True

    @staticmethod
    def _check_written(done: list[_Entry]) -> None:
        unwritten = [e.name for e in done if not e.written]
        if unwritten:
            raise InitError(
                f"the model is on the meta device, but no initialiser wrote {', '.join(unwritten[:6])}; give their "
                "modules a reset_parameters() that initialises them, or pass a param_init_fn that does"
            )

    def _finish(self, done: list[_Entry], params: dict[str, Any], broadcast: Callable[[list[torch.Tensor]], None],
                device: torch.device) -> None:
        """Broadcast rank 0's values of the tensors no later call writes and hand them over."""
        values = [e.live_copy().detach().to(device) for e in done]
        for e in done:  # on an accelerator the device copy is what is kept: the host copy goes now
            e.live = None
        batch: list[torch.Tensor] = []
        batch_bytes = 0
        for v in values:
            n = v.numel() * v.element_size()
            if n >= COALESCE_BYTES:
                broadcast([v])
                continue
            if batch_bytes + n > COALESCE_BYTES:
                broadcast(batch)
                batch, batch_bytes = [], 0
            batch.append(v)
            batch_bytes += n
        if batch:
            broadcast(batch)
        for e, v in zip(done, values):
            if e.kind == "param":
                e.register(e.original)
                if not e.aliased:
                    params[e.name].load_full_(v)
                    # the full copy goes now (not whenever the backend's thread drops the broadcast's reference)
                    v.untyped_storage().resize_(0)
            else:
                e.register(v)
            e.live = None
