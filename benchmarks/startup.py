"""Process start to first output, each run in a fresh process; JSON out.

Per model: eager (the baseline, measured in the same run), tessera cold and warm, stock
``torch.compile`` cold and warm (Inductor's own caches) and PyTorch's mega-cache
(``save_cache_artifacts`` / ``load_cache_artifacts``). The figure that matters is the *warm-start
overhead*: (process start to first output) minus the same for eager, as the median of the
paired differences (the runs are interleaved, so drift on the machine cancels). tessera's warm
start is also broken into phases. ``--cold-scaling`` times tessera's cold compile for two layer
counts.

Two things would otherwise measure the machine rather than the implementations:

- Every measured process runs one ``gc.collect()`` after building the model. The heap ``import
  torch`` leaves is close to the point where CPython runs a full collection (~0.1 s here), so it
  falls on whichever process allocates a few thousand objects first: a lottery, not a cost of
  the path measured. Every implementation pays the collection alike, before its measured part.
- tessera's bytecode is compiled first (``compileall``), as ``pip install`` does for a wheel: an
  editable checkout run with ``PYTHONDONTWRITEBYTECODE`` would compile tessera's sources in every
  process, while torch's come precompiled.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import as_installed, child_env, header

TOY_WIDTH: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 8, "num_kv_heads": 4}
HF_SIZES: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
}
MODELS = ("toy4", "toy16", "toy32", "hf_llama_prefill", "hf_qwen2_decode")
IMPLS = ("eager", "tessera", "stock", "mega-save", "mega-load")
# How the measured process calls the model: a frozen model under no_grad, or the parameters as
# made (requiring grad) under inference_mode, as a server runs one.
STATES = ("frozen_no_grad", "trainable_inference_mode")
# A warm start from the whole-model artifact imports none of these (Dynamo's tracer, Inductor).
WATCHED_MODULES = (
    "torch._dynamo",
    "torch._dynamo.symbolic_convert",
    "torch._dynamo.convert_frame",
    "torch._inductor",
    "torch._inductor.compile_fx",
)


# -- the measured process ---------------------------------------------------------------------------
def child(impl: str, model_name: str, mega: str | None, state: str = STATES[0]) -> None:
    """Runs in the measured process: import, build, compile, first output, report times.

    Only the tessera runs import tessera's compile path; the eager baseline imports torch, the
    model and nothing else of ours.
    """
    import torch

    model, call_args, call_kwargs, dynamic = _build(model_name)
    if state == "trainable_inference_mode":
        model.requires_grad_(True)  # parameters as a model makes them, before anyone freezes them
    gc.collect()  # the full collection that is due anyway, outside the comparison (module docstring)
    marks = {"built": time.time()}
    compiled: Any = model
    report: dict[str, Any] = {}
    if impl == "tessera":
        import tessera
        from tessera import hf

        if model_name.startswith("hf_"):
            compiled = hf.compile_causal_lm(model, dynamic_sequence=dynamic, prefix=model_name)
        else:
            compiled = tessera.compile(model, prefix=model_name)
    elif impl != "eager":
        if impl == "mega-load" and mega:
            torch.compiler.load_cache_artifacts(Path(mega).read_bytes())
        if dynamic:
            for value in (*call_args, *call_kwargs.values()):
                if isinstance(value, torch.Tensor) and value.dim():
                    torch._dynamo.mark_dynamic(value, value.dim() - 1)
        compiled = torch.compile(model, dynamic=None if dynamic else False)
    marks["compile_object"] = time.time()
    with torch.inference_mode() if state == "trainable_inference_mode" else torch.no_grad():
        compiled(*call_args, **call_kwargs)
    marks["first_output"] = time.time()
    if impl == "mega-save" and mega:
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None, "mega-cache saved nothing"
        Path(mega).write_bytes(saved[0])
    if impl == "tessera":
        import tessera

        report["counters"] = tessera.counters.snapshot()
        imports = marks["compile_object"] - marks["built"]
        report["phases"] = {"import_tessera": imports, **compiled.startup_phases}
    report["marks"] = marks
    report["modules"] = {m: m in sys.modules for m in WATCHED_MODULES}
    print(json.dumps(report))


def child_load_paths(entry: str) -> None:
    """Runs in a fresh process: each piece file of ``entry`` loaded directly, then by Inductor.

    What ``CompiledArtifact.load`` costs beyond reading the file and mapping the kernel.
    """
    import tempfile

    from tessera import _compat
    from tessera.compilation import piece_file

    start = time.perf_counter()
    files = [p.read_bytes() for p in sorted(Path(entry, "artifacts").glob("*.bin"))]
    pieces = [piece_file.PieceFile.from_bytes(data) for data in files]
    read = time.perf_counter()
    for i, piece in enumerate(pieces):
        assert piece.direct is not None, piece.why_not_direct
        piece_file.load_direct(piece.direct, f"bench{i}")
    direct = time.perf_counter()
    _compat.inductor_config()  # imports Dynamo and Inductor
    imported = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for i, piece in enumerate(pieces):
            path = Path(scratch, f"{i}.bin")
            path.write_bytes(piece.standard)
            _compat.load_compiled_artifact(str(path))
    standard = time.perf_counter()
    print(
        json.dumps(
            {
                "pieces": len(pieces),
                "read_and_parse": read - start,
                "direct_load": direct - read,
                "inductor_import": imported - direct,
                "inductor_load": standard - imported,
            }
        )
    )


def _build(name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any], bool]:
    """The model, its first call's arguments, and whether its leading size is dynamic."""
    import torch

    if name.startswith("toy"):
        from tessera.models import toy_llama

        model = toy_llama.build(num_layers=int(name[3:]), **TOY_WIDTH)
        return model, toy_llama.example_inputs(16), {}, True
    import transformers

    from tessera import hf

    torch.manual_seed(0)
    family = "Qwen2" if "qwen2" in name else "Llama"
    config = getattr(transformers, f"{family}Config")(**HF_SIZES, attn_implementation="sdpa")
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    prompt = torch.randint(0, HF_SIZES["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    if name.endswith("prefill"):
        return model, (), {"input_ids": prompt, "use_cache": False}, True
    # decode: the prompt goes through eagerly; the measured call is the first decode step.
    cache = transformers.StaticCache(config=config, max_cache_len=64)
    positions = torch.arange(16)
    with torch.no_grad():  # the cache under the name this transformers' forward takes it by
        logits = model(**hf.step_inputs(model, prompt, positions, cache), use_cache=True).logits
    token = logits[:, -1:].argmax(-1)
    kwargs = {**hf.step_inputs(model, token, torch.tensor([16]), cache), "use_cache": True}
    return model, (), kwargs, False


# -- the driver -------------------------------------------------------------------------------------
def _run(
    impl: str, model: str, env_dirs: dict[str, str], mega: str | None, state: str = STATES[0]
) -> dict[str, Any]:
    env = child_env(**env_dirs)
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", impl, "--model", model, "--state", state]
    if mega:
        cmd += ["--mega", mega]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} {model} child failed:\n{proc.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["seconds"] = report.pop("marks")["first_output"] - start
    return report


def measure(model: str, repeats: int, state: str = STATES[0]) -> dict[str, Any]:
    """Medians over ``repeats`` fresh processes of each warm path, after one cold run of each."""
    seconds: dict[str, list[float]] = {}
    phases: list[dict[str, float]] = []
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        d = Path(scratch)

        def dirs(inductor: str, tess: str = "tessera") -> dict[str, str]:
            return {"TORCHINDUCTOR_CACHE_DIR": str(d / inductor), "TESSERA_CACHE_DIR": str(d / tess)}

        mega = str(d / "mega.bin")
        for name, impl, env in (
            ("tessera_cold", "tessera", dirs("ind-tessera")),
            ("stock_cold", "stock", dirs("ind-stock")),
            ("megacache_save_cold", "mega-save", dirs("ind-mega-save")),
        ):
            runs[name] = _run(impl, model, env, mega if impl == "mega-save" else None, state)
            seconds[name] = [runs[name]["seconds"]]
        for i in range(repeats):
            for name, impl, env in (
                ("eager", "eager", dirs(f"ind-eager-{i}", f"unused-{i}")),
                # A fresh machine for tessera: Inductor's cache directory is empty.
                ("tessera_warm", "tessera", dirs(f"ind-tessera-warm-{i}")),
                ("stock_warm", "stock", dirs("ind-stock")),
                ("megacache_warm", "mega-load", dirs(f"ind-mega-{i}")),
            ):
                runs[name] = _run(impl, model, env, mega if impl == "mega-load" else None, state)
                seconds.setdefault(name, []).append(runs[name]["seconds"])
                if name == "tessera_warm":
                    phases.append(runs[name]["phases"])
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    overhead = {
        impl: statistics.median(w - e for w, e in zip(seconds[f"{impl}_warm"], seconds["eager"], strict=True))
        for impl in ("tessera", "stock", "megacache")
    }
    return {
        "model": model,
        "state": state,
        "seconds_median": medians,
        "seconds_all": seconds,
        "warm_overhead_seconds": overhead,
        "tessera_over_stock_overhead": overhead["tessera"] / overhead["stock"]
        if overhead["stock"] > 0
        else None,
        "tessera_warm_phases_median": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "tessera_warm_counters": runs["tessera_warm"]["counters"],
        "tessera_warm_modules": runs["tessera_warm"]["modules"],
    }


def load_paths(repeats: int) -> dict[str, Any]:
    """Per fresh process: direct load vs Inductor's loader, with Inductor's cache warm and empty."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        env = {"TORCHINDUCTOR_CACHE_DIR": f"{scratch}/ind", "TESSERA_CACHE_DIR": f"{scratch}/t"}
        _run("tessera", "toy4", env, None)
        (entry,) = Path(scratch, "t").glob("*/rank_*/toy4")
        for case, inductor in (("inductor_cache_warm", f"{scratch}/ind"), ("inductor_cache_empty", None)):
            samples = []
            for i in range(repeats):
                run_env = child_env(TORCHINDUCTOR_CACHE_DIR=inductor or f"{scratch}/empty{i}")
                cmd = [sys.executable, "-m", "benchmarks.startup", "--child-load-paths", str(entry)]
                proc = subprocess.run(
                    cmd, env=run_env, capture_output=True, text=True, timeout=1800, check=True
                )
                samples.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            out[case] = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    return out


def cold_scaling(layer_counts: list[int], repeats: int) -> dict[str, Any]:
    """tessera's cold compile (empty tessera and Inductor caches) per layer count, medians."""
    out: dict[str, Any] = {}
    for layers in layer_counts:
        times = []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as scratch:
                env = {"TORCHINDUCTOR_CACHE_DIR": f"{scratch}/ind", "TESSERA_CACHE_DIR": f"{scratch}/t"}
                report = _run("tessera", f"toy{layers}", env, None)
                times.append(report["seconds"])
                inductor_compiles = report["counters"]["inductor_compiles"]
        out[str(layers)] = {
            "seconds_median": statistics.median(times),
            "seconds_all": times,
            "inductor_compiles": inductor_compiles,
        }
    first, last = (out[str(n)]["seconds_median"] for n in (layer_counts[0], layer_counts[-1]))
    out["ratio_last_over_first"] = last / first
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=IMPLS)
    parser.add_argument("--model", default="toy4")
    parser.add_argument("--mega")
    parser.add_argument("--child-load-paths", metavar="ENTRY")
    parser.add_argument("--load-paths", action="store_true", help="also compare direct and Inductor loads")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--state", choices=STATES, default=STATES[0], help="how the model is called")
    parser.add_argument(
        "--cold-scaling",
        type=int,
        nargs="*",
        default=None,
        metavar="LAYERS",
        help="also time tessera's cold compile for these layer counts (e.g. 2 8)",
    )
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.mega, args.state)
        return 0
    if args.child_load_paths:
        child_load_paths(args.child_load_paths)
        return 0
    as_installed()
    result: dict[str, Any] = {
        **header("startup"),
        "toy_width": TOY_WIDTH,
        "hf_sizes": HF_SIZES,
        "repeats": args.repeats,
        "state": args.state,
        "results": [measure(model, args.repeats, args.state) for model in args.models],
    }
    if args.cold_scaling:
        result["cold_scaling"] = cold_scaling(args.cold_scaling, args.repeats)
    if args.load_paths:
        result["load_paths"] = load_paths(args.repeats)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
