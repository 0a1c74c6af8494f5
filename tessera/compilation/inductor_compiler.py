"""The ``inductor`` compiler: Inductor's standalone compile of each piece, stored as a piece file
(piece_file.py) that a warm process loads without Inductor's machinery, compiled here or in a
compile worker (``job`` / ``finish``)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import tempfile
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat, counters
from tessera.cache import liveness
from tessera.cache.entry import atomic_write, warn_write_failed
from tessera.cache.key import KeyRecord, machine_factors, machine_key
from tessera.compilation import piece_file
from tessera.compilation.compile_jobs import CACHE_ENV, JobDone, PieceJob, TensorSpec
from tessera.compilation.symbolic_inputs import describe
from tessera.config import CompileConfig, Shape, Size
from tessera.errors import ArtifactDamaged, CompilerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PieceNotes:
    """What debug dumps and piece records read about one compiled callable."""

    code: str  # the Python code that runs it (Inductor's output code)
    partitions: int  # functions Inductor's graph partition made of it (0: none)


class InductorCompiler:
    """Inductor's standalone compile; each artifact is one piece file (see piece_file.PieceFile)."""

    name = "inductor"
    loads_without_graph = True  # a piece file holds all its load needs (see warm.rebuild)

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self.machine_record: Path | None = None
        # Both maps hold the callables weakly: a piece's callable lives as long as the runners that
        # call it, and its notes (its source) go with it. Keyed by the object, never by id(): a
        # freed callable's id is reused by later objects, which must not find its notes.
        self._loaded: weakref.WeakValueDictionary[str, Callable[..., Any]] = weakref.WeakValueDictionary()
        self._notes: weakref.WeakKeyDictionary[Callable[..., Any], PieceNotes] = weakref.WeakKeyDictionary()

    def output_code(self, fn: Callable[..., Any]) -> str | None:
        """Inductor's output code behind ``fn`` (for debug dumps), when known."""
        notes = self._notes_of(fn)
        return notes.code if notes is not None else None

    def partitions_of(self, fn: Callable[..., Any]) -> int | None:
        """How many partitions Inductor's output code for ``fn`` has (graph_partition mode)."""
        notes = self._notes_of(fn)
        return notes.partitions if notes is not None else None

    def _notes_of(self, fn: Callable[..., Any]) -> PieceNotes | None:
        try:
            return self._notes.get(fn)
        except TypeError:  # not weakly referable: nothing was noted for it
            return None

    def _note(self, fn: Callable[..., Any], notes: PieceNotes) -> None:
        try:
            self._notes[fn] = notes
        except TypeError:  # not weakly referable (not one of ours): dumps show the FX code instead
            log.debug("no notes kept for %r: it cannot be weakly referenced", fn)

    def _base_factors(self) -> dict[str, Any]:
        return {
            "torch": torch.__version__,
            "torch_git": getattr(torch.version, "git_version", None),
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "python": platform.python_version(),
            "machine": machine_factors(),
            # What tessera writes into a graph before Inductor sees it (layout.keep_eager_layouts);
            # raise when that changes, so that artifacts compiled without it are not loaded.
            "graph_rewrites": 1,
            "piece_file": piece_file.FORMAT,
        }

    def key_record(self) -> KeyRecord:
        """Everything about this compiler that changes its output (imports Inductor's config)."""
        return KeyRecord.of(
            "compiler", {**self._base_factors(), "inductor_config": _compat.inductor_config_repr()}
        )

    def compute_hash(self) -> str:
        return self.key_record().digest

    def warm_hash(self) -> str:
        """For the model fingerprint: Inductor's overridden settings only, read without importing it."""
        overrides = _compat.inductor_config_overrides()
        return KeyRecord.of("compiler", {**self._base_factors(), "inductor_overrides": overrides}).digest

    def initialize_cache(self, cache_dir: Path | None) -> None:
        self.cache_dir = cache_dir

    def use_machine_record(self, root: Path) -> None:
        """Where the result of Inductor's per-process probes is kept for this machine."""
        self.machine_record = root / "machine" / f"{machine_key()}.json"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: Size,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        patches: dict[str, Any] = {}
        if isinstance(size, int | Shape):
            # A single size (or shape) is compiled with static shapes: worth Inductor's autotuning,
            # but not beside the user's code: its benchmarks draw their inputs from the global
            # random generator, which is the user's (_compat.rng_left_alone). The example
            # inputs are concrete: "from_graph" would keep the graph's symbols.
            patches["max_autotune"] = not _compat.rng_is_left_alone()
            dynamic_shapes = "from_example_inputs"
        else:
            dynamic_shapes = "from_graph"
        patches.update(config.inductor_config)
        if config.passes:
            from tessera.passes import pass_manager

            patches["post_grad_custom_post_pass"] = pass_manager(config.passes, size)
        if config.graph_partition:
            from tessera.compilation.split import default_splitting_ops, partition_op_names

            specs = config.splitting_ops if config.splitting_ops is not None else default_splitting_ops()
            patches["graph_partition"] = True
            patches["custom_should_partition_ops"] = list(partition_op_names(specs))
        from tessera.compilation.layout import keep_eager_layouts

        laid_out = keep_eager_layouts(graph)
        baseline = _compat.guard_baseline(example_inputs)
        with _compat.trusted_vec_isa(self._probe_recorded()):
            artifact = _compat.standalone_compile(laid_out, list(example_inputs), dynamic_shapes, patches)
        counters.bump("inductor_compiles")
        self._record_probe()
        try:
            guards = _compat.compile_assumptions(example_inputs, baseline) or ""
        except ValueError as e:
            # Code whose assumptions cannot be checked per call must never serve: an assumption
            # that never holds, so every call runs the piece as traced (correct, eager's speed).
            log.warning(
                "piece %s: what its compile assumed cannot be checked (%s); it runs as traced", key, e
            )
            guards = "False"
        standard = _standard_bytes(artifact) if self.cache_dir is not None else b""
        piece = piece_file.package(artifact, graph, example_inputs, standard, guards)
        # The cold process runs what a warm one will load: the direct code where there is one.
        fn = self._callable(piece, artifact, key)
        compiled = _compat.find_compiled_graph(artifact)
        self._note(fn, PieceNotes(compiled.source_code if compiled is not None else "", piece.partitions))
        handle = None
        if self.cache_dir is not None and (piece.standard or piece.direct is not None):
            try:
                atomic_write(self.cache_dir / key, piece.to_bytes())
            except OSError as e:  # disk full, read-only: this piece lives in memory only
                warn_write_failed(self.cache_dir, e)
                self.cache_dir = None
            else:
                handle = key
                counters.bump("artifacts_saved")
        return fn, handle

    def job(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: int | Shape | None,
        key: str,
    ) -> PieceJob | None:
        """``compile`` as a job for a worker process, which writes the piece file into the entry.
        None without a cache directory (a worker's result reaches this process through the file),
        for inputs on an accelerator (see below), and for a general size whose symbolic inputs
        cannot be described for another process (symbolic_inputs.describe)."""
        if self.cache_dir is None:
            return None
        if any(isinstance(x, torch.Tensor) and x.device.type != "cpu" for x in example_inputs):
            # A worker would make its own device context and allocate the example inputs there:
            # memory a serving process on the same accelerator may need. Until workers compile
            # from fake inputs, accelerator pieces compile in this process.
            return None
        inputs: Any
        if size is None:
            try:
                inputs = describe(example_inputs)
            except Exception as e:  # a shape env unlike the ones described: compiled here, as refused
                log.debug("general inputs not described for a worker (%s: %s)", type(e).__name__, e)
                return None
            if inputs is None:
                return None
        else:
            inputs = tuple(TensorSpec.of(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        return PieceJob(
            graph=graph,
            inputs=inputs,
            config=config,
            size=size,
            key=key,
            cache_dir=str(self.cache_dir),
            machine_record=str(self.machine_record) if self.machine_record is not None else None,
            roots=liveness.registered_roots(),
            env={name: os.environ[name] for name in CACHE_ENV if name in os.environ},
        )

    def finish(self, done: JobDone) -> tuple[Callable[..., Any], Any]:
        """The callable for a piece a worker compiled, loaded from the file it saved, as ``compile``
        would have returned it (its counts added to this process's)."""
        for name, count in done.counts.items():
            counters.bump(name, count)
        if done.handle is None or self.cache_dir is None:
            raise CompilerError("the compile worker saved no piece file")
        try:
            piece = piece_file.PieceFile.from_bytes((self.cache_dir / done.handle).read_bytes())
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CompilerError(f"the compile worker's piece file {done.handle} cannot be read: {e}") from e
        fn = self._callable(piece, None, done.handle)
        self._note(fn, PieceNotes(piece.direct.wrapper if piece.direct is not None else "", piece.partitions))
        return fn, done.handle

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        size: Size,
    ) -> Callable[..., Any]:
        assert self.cache_dir is not None, "load() needs initialize_cache(dir) first"
        if not isinstance(handle, str) or not handle:
            raise ArtifactDamaged(f"inductor artifact handle must be a file name, got {handle!r}")
        fn = self._loaded.get(handle)
        if fn is None:
            # Files are content-addressed: identical pieces (transformer layers) load once.
            try:
                piece = piece_file.PieceFile.from_bytes((self.cache_dir / handle).read_bytes())
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ArtifactDamaged(f"{handle} is not a tessera piece file: {e}") from e
            fn = self._callable(piece, None, handle)
            wrapper = piece.direct.wrapper if piece.direct is not None else ""
            self._note(fn, PieceNotes(wrapper, piece.partitions))
            with contextlib.suppress(TypeError):  # not weakly referable: identical pieces load again
                self._loaded[handle] = fn
            counters.bump("artifacts_loaded")
        return fn

    def _callable(self, piece: piece_file.PieceFile, artifact: Any, name: str) -> Callable[..., Any]:
        fn: Callable[..., Any] | None = None
        if piece.direct is not None:
            try:
                fn = piece_file.load_direct(piece.direct, Path(name).stem.lstrip("."))
            except Exception as e:  # a library that does not load here: Inductor's way still works
                log.warning(
                    "piece %s: direct load failed (%s: %s); loading through Inductor",
                    name,
                    type(e).__name__,
                    e,
                )
        if fn is None:
            if artifact is None:
                artifact = self._load_standard(piece.standard)
            fn = artifact
        if not piece.returns_tuple:
            # The piece graph returned a single value. Inductor's code returns a sequence; torch
            # 2.15's standalone-compile artifact returns the graph's own structure (the value).
            fn = functools.partial(_single_output, fn)
        if piece.guards:
            return GuardedCode(fn, _compat.guard_check(piece.guards))
        return fn

    def _load_standard(self, data: bytes) -> Any:
        if not data:
            raise CompilerError("the piece file holds no Inductor artifact to fall back to")
        with tempfile.TemporaryDirectory(prefix="tessera-piece-") as scratch:
            path = os.path.join(scratch, "artifact.bin")
            Path(path).write_bytes(data)
            with _compat.trusted_vec_isa(self._probe_recorded()):
                return _compat.load_compiled_artifact(path)

    def _probe_recorded(self) -> bool:
        """Whether an earlier process on this machine found the ISA the CPU flags promise."""
        if self.machine_record is None:
            return False
        try:
            recorded = json.loads(self.machine_record.read_text(encoding="utf-8")).get("vec_isa")
        except (OSError, ValueError, AttributeError):
            return False
        candidates = _compat.vec_isa_candidates()
        return bool(candidates) and recorded == candidates[0]

    def _record_probe(self) -> None:
        if self.machine_record is None or self.machine_record.exists():
            return
        record = {"vec_isa": _compat.picked_vec_isa(), "factors": machine_factors()}
        try:
            atomic_write(self.machine_record, json.dumps(record, sort_keys=True).encode())
        except OSError as e:
            log.debug("cannot record the ISA probe at %s: %s", self.machine_record, e)


class GuardedCode:
    """A piece's compiled code with what its compile assumed of the inputs' sizes (``holds``):
    the piece's runner checks it before each call, and runs the piece as traced where it fails."""

    __slots__ = ("__weakref__", "fn", "holds")  # weakly referable: the compiler keeps notes on it

    def __init__(self, fn: Callable[..., Any], holds: Callable[[tuple[Any, ...]], bool]) -> None:
        self.fn = fn
        self.holds = holds

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _single_output(fn: Callable[..., Any], *args: Any) -> Any:
    out = fn(*args)
    return out[0] if isinstance(out, (list, tuple)) else out


def _standard_bytes(artifact: Any) -> bytes:
    """Inductor's own serialization of ``artifact``; empty when Inductor cannot save it."""
    with tempfile.TemporaryDirectory(prefix="tessera-piece-") as scratch:
        path = os.path.join(scratch, "artifact.bin")
        try:
            artifact.save(path=path, format="binary")
        except RuntimeError as e:  # e.g. AOTAutograd's cache refused the graph
            log.debug("Inductor cannot save this piece (%s); keeping the direct code only", e)
            return b""
        return Path(path).read_bytes()
